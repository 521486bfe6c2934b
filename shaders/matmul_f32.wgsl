// matmul_f32: prefill y = rms_norm?(x) @ W.T (+ bias) (+ residual) for many tokens, W in f32.
// Bindings and Params: the linear family (docs/gpu-kernels.md); w_a as in linear_f32.wgsl (rows of
// f32 padded to a multiple of 8 values), w_b unused.
// Entry point `main`, overrides TM, TN, BK, KSPLIT; grid (ceil(rows / 8 TN), ceil(tokens / 8 TM)):
// matmul_body.wgsl.

@group(0) @binding(2) var<storage, read> w_a: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read> w_b: array<u32>;

alias WRaw = W8;

fn fetch_w8(row: u32, c8: u32) -> WRaw {
    let i = (row * ((params.cols + 7u) / 8u) + c8) * 2u;
    return W8(w_a[i], w_a[i + 1u]);
}

fn finish_w8(w: WRaw) -> W8 {
    return w;
}

// #include matmul_body.wgsl
