// row_norm: the rms-norm scale of a token row whose sum of squares a workgroup holds in parts
// (one per thread): summed over each subgroup, then over the subgroups in order; and the f16
// activations at that scale. Pasted by matmul_tc_prep.wgsl and matmul_reduce_prep.wgsl, whose f16
// activations must agree bit for bit, and which declare norm_weight (array<vec4<f32>>).
// Call row_scale from uniform control flow (a barrier); needs at most 64 subgroups.

var<workgroup> part: array<f32, 64>;

fn row_scale(q: f32, sg: u32, nsg: u32, lane: u32, cols: u32, eps: f32) -> f32 {
    let sum = subgroupAdd(q);
    if (lane == 0u) {
        part[sg] = sum;
    }
    workgroupBarrier();
    var total = 0.0;
    for (var i = 0u; i < nsg; i++) {
        total += part[i];
    }
    return 1.0 / sqrt(total / f32(cols) + eps);
}

// The f16 activations of vec4 c of a row: f16(v s nw[c]) with the norm, else f16(v s).
fn normed_f16(v: vec4<f32>, s: f32, c: u32, norm: bool) -> vec4<f16> {
    var w = v * s;
    if (norm) {
        w *= norm_weight[c];
    }
    return vec4<f16>(w);
}
