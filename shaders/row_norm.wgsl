// row_norm: the rms-norm scale of a token row whose sum of squares a workgroup holds in parts
// (one per thread): summed over each subgroup, then over the subgroups in order. Pasted by the
// prep kernels (matmul_tc_prep.wgsl, matmul_reduce_prep.wgsl, matmul_dot_prep.wgsl).
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
