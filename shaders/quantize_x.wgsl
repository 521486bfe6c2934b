// quantize_x: x's int8 quantization in blocks of 32 values, as numpy_ops.quantize_blocks rounds
// it: q = round(v 127 / max |v|) (half to even), d = max |v| / 127. A block is 8 vec4s held by
// 8 consecutive lanes of one subgroup (lane i % 8 holding vec4 i % 8), which share its maximum
// through subgroupShuffleXor: call from uniform control flow, every lane of the subgroup taking
// part. Pasted by matvec_dot.tmpl.wgsl (x quantized in each workgroup) and matmul_dot_prep.wgsl.

struct XQ {
    q: vec4<i32>,  // this lane's 4 quants
    m: f32,        // the block's max |v|
}

fn quantize_x4(v: vec4<f32>) -> XQ {
    let a = abs(v);
    var m = max(max(a.x, a.y), max(a.z, a.w));
    m = max(m, subgroupShuffleXor(m, 1u));
    m = max(m, subgroupShuffleXor(m, 2u));
    m = max(m, subgroupShuffleXor(m, 4u));
    return XQ(vec4<i32>(round(v * select(0.0, 127.0 / m, m > 0.0))), m);
}
