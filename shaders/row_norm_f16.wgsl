// row_norm_f16: the f16 activations of a token row at its rms scale (row_norm.wgsl's row_scale).
// Pasted by matmul_tc_prep.wgsl and matmul_reduce_prep.wgsl, whose f16 activations must agree bit
// for bit, and which declare norm_weight (array<vec4<f32>>) and enable f16.

// The f16 activations of vec4 c of a row: f16(v s nw[c]) with the norm, else f16(v s).
fn normed_f16(v: vec4<f32>, s: f32, c: u32, norm: bool) -> vec4<f16> {
    var w = v * s;
    if (norm) {
        w *= norm_weight[c];
    }
    return vec4<f16>(w);
}
