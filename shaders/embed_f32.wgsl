// embed_f32: out[t, :] = table[ids[t], :], table in f32 rows padded to 8 values (as linear_f32).
// Bindings: params, ids, w_a (table), w_b (unused), out. Grid: embed_body.wgsl.

@group(0) @binding(2) var<storage, read> w_a: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read> w_b: array<u32>;

fn load_w8(row: u32, c8: u32) -> W8 {
    let i = (row * ((params.cols + 7u) / 8u) + c8) * 2u;
    return W8(w_a[i], w_a[i + 1u]);
}

// #include embed_body.wgsl
