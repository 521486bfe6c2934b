// prep_row: vec4 c of token t's row as the prep kernels read it (matmul_tc_prep.wgsl,
// matmul_dot_prep.wgsl, which declare x as array<vec4<f32>>, params and WG, and paste
// row_norm.wgsl first): x[t] (c4s vec4s a row), or with silu silu(gate) up of x[t] = [gate | up];
// and that row's rms-norm scale.

fn row_value(t: u32, c: u32, c4s: u32, silu: bool) -> vec4<f32> {
    if (silu) {
        let g = x[t * 2u * c4s + c];
        return g / (vec4<f32>(1.0) + exp(-g)) * x[t * 2u * c4s + c4s + c];
    }
    return x[t * c4s + c];
}

// The rms-norm scale of token t's row of values (row_value), or 1 without the norm; every thread
// of the workgroup calls it (row_scale's barrier; norm is uniform).
fn row_value_scale(t: u32, c4s: u32, silu: bool, norm: bool, lid: u32, sg: u32, nsg: u32, lane: u32) -> f32 {
    if (!norm) {
        return 1.0;
    }
    var q = 0.0;
    for (var c = lid; c < c4s; c += WG) {
        let v = row_value(t, c, c4s, silu);
        q += dot(v, v);
    }
    return row_scale(q, sg, nsg, lane, params.cols, params.eps);
}
