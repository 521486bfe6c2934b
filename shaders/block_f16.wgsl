// block_f16: f16 weights as the linear kernels read them (linear_f16.wgsl, matvec.tmpl.wgsl,
// matmul.tmpl.wgsl, embed.tmpl.wgsl): rows
// of f16 pairs padded with zeros to a multiple of 8 values, one vec4<u32> = 8 weights. A unit is
// one such vec4: values 8u .. 8u + 7 of the row. Reads params.cols.

@group(0) @binding(2) var<storage, read> w_a: array<vec4<u32>>;
@group(0) @binding(3) var<storage, read> w_b: array<u32>;

const UNIT: u32 = 8u;

fn unit_values(row: u32, u: u32) -> array<vec4<f32>, 2> {
    let q = w_a[row * ((params.cols + 7u) / 8u) + u];
    return array<vec4<f32>, 2>(vec4<f32>(unpack2x16float(q.x), unpack2x16float(q.y)),
                               vec4<f32>(unpack2x16float(q.z), unpack2x16float(q.w)));
}

fn unit_col(u: u32, k: u32) -> u32 {
    return 8u * u + 4u * k;
}

// Values 8 c8 .. 8 c8 + 7 of a row: load_w8, split for the prefill matmul into fetch_w8 (the
// loads: 4 f16 pairs) and finish_w8 (the conversion), so that its loads stay in flight through a
// step and are converted only when stored at the next.
alias WRaw = vec4<u32>;

fn fetch_w8(row: u32, c8: u32) -> WRaw {
    return w_a[row * ((params.cols + 7u) / 8u) + c8];
}

fn finish_w8(q: WRaw) -> W8 {
    return W8(vec4<f32>(unpack2x16float(q.x), unpack2x16float(q.y)),
              vec4<f32>(unpack2x16float(q.z), unpack2x16float(q.w)));
}

fn load_w8(row: u32, c8: u32) -> W8 {
    return finish_w8(fetch_w8(row, c8));
}
