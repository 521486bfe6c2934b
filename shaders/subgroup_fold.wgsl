// subgroup_fold: one step of the multi-token kernels' reductions (matvec_t in linear_body.wgsl,
// main_t in linear_quant_body.wgsl); subgroup devices only.

// Keeps slot a (lanes with bit m clear) or b (bit m set) and adds the partner lane's copy of it:
// one shuffle halves the slots a lane holds.
fn fold(a: vec4<f32>, b: vec4<f32>, lane: u32, m: u32) -> vec4<f32> {
    let upper = (lane & m) != 0u;
    return select(a, b, upper) + subgroupShuffleXor(select(b, a, upper), m);
}
