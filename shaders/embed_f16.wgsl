// embed_f16: out[t, :] = table[ids[t], :], table in f16 rows padded to 8 values (as linear_f16).
// Bindings: params, ids, w_a (table), w_b (unused), out. Grid: embed_body.wgsl.

@group(0) @binding(2) var<storage, read> w_a: array<vec4<u32>>;
@group(0) @binding(3) var<storage, read> w_b: array<u32>;

fn load_w8(row: u32, c8: u32) -> W8 {
    let q = w_a[row * ((params.cols + 7u) / 8u) + c8];
    return W8(vec4<f32>(unpack2x16float(q.x), unpack2x16float(q.y)),
              vec4<f32>(unpack2x16float(q.z), unpack2x16float(q.w)));
}

// #include embed_body.wgsl
