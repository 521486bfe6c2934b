// matmul_f16: prefill y = rms_norm?(x) @ W.T (+ bias) (+ residual) for many tokens, W in f16
// (converted to f32 while staged into workgroup memory; f32 math and accumulation).
// Bindings and Params: the linear family (docs/gpu-kernels.md); w_a as in linear_f16.wgsl (rows of
// f16 pairs padded to a multiple of 8 values, one vec4<u32> = 8 weights), w_b unused.
// Entry point `main`, overrides TM, TN, BK, KSPLIT; grid (ceil(rows / 8 TN), ceil(tokens / 8 TM)):
// matmul_body.wgsl.

@group(0) @binding(2) var<storage, read> w_a: array<vec4<u32>>;
@group(0) @binding(3) var<storage, read> w_b: array<u32>;

// The 8 weights as loaded (4 f16 pairs), converted at the next step (matmul_body.wgsl).
alias WRaw = vec4<u32>;

fn fetch_w8(row: u32, c8: u32) -> WRaw {
    return w_a[row * ((params.cols + 7u) / 8u) + c8];
}

fn finish_w8(q: WRaw) -> W8 {
    return W8(vec4<f32>(unpack2x16float(q.x), unpack2x16float(q.y)),
              vec4<f32>(unpack2x16float(q.z), unpack2x16float(q.w)));
}

// #include matmul_body.wgsl
