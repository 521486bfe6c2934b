// matmul_q8_0: prefill y = rms_norm?(x) @ W.T (+ bias) (+ residual) for many tokens, W a Q8_0 weight kept
// quantized (layout: kjarni/gpu/quant.py); each 8-value chunk is dequantized to f32 while it is staged
// into workgroup memory (f32 math and accumulation). cols is a multiple of 32.
// Bindings and Params: the linear family (docs/gpu-kernels.md): w_a packed quants, w_b scales.
// Entry point `main`, overrides TM, TN, BK, KSPLIT; grid (ceil(rows / 8 TN), ceil(tokens / 8 TM)):
// matmul_body.wgsl.

@group(0) @binding(2) var<storage, read> w_a: array<u32>;
@group(0) @binding(3) var<storage, read> w_b: array<u32>;

// Q8_0: 8 words (32 int8) per block, d as f16 pairs in w_b; chunk c8 is words 2 c8, 2 c8 + 1.
// The chunk as loaded: two words of 4 int8 quants, the word holding the block's f16 scale pair,
// and which half of it is the scale; scaled at the next step (matmul_body.wgsl).
alias WRaw = vec4<u32>;

fn fetch_w8(row: u32, c8: u32) -> WRaw {
    let nb = params.cols / 32u;
    let a = row * (nb * 8u) + 2u * c8;
    let blk = c8 / 4u;
    return vec4<u32>(w_a[a], w_a[a + 1u], w_b[row * ((nb + 1u) / 2u) + blk / 2u], blk & 1u);
}

fn finish_w8(q: WRaw) -> W8 {
    let d = unpack2x16float(q.z)[q.w];
    return W8(vec4<f32>(unpack4xI8(q.x)) * d, vec4<f32>(unpack4xI8(q.y)) * d);
}

// #include matmul_body.wgsl
