// prep_row: vec4 c of token t's row as the prep kernels read it (matmul_tc_prep.wgsl,
// matmul_dot_prep.wgsl, which declare x as array<vec4<f32>>): x[t] (c4s vec4s a row), or with
// silu silu(gate) up of x[t] = [gate | up].

fn row_value(t: u32, c: u32, c4s: u32, silu: bool) -> vec4<f32> {
    if (silu) {
        let g = x[t * 2u * c4s + c];
        return g / (vec4<f32>(1.0) + exp(-g)) * x[t * 2u * c4s + c4s + c];
    }
    return x[t * c4s + c];
}
