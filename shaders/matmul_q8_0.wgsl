// matmul_q8_0: prefill y = rms_norm?(x) @ W.T (+ bias) (+ residual) for many tokens, W a Q8_0 weight kept
// quantized (layout: kjarni/gpu/quant.py); each 8-value chunk is dequantized to f32 while it is staged
// into workgroup memory (f32 math and accumulation). cols is a multiple of 32.
// Bindings and Params: the linear family (docs/gpu-kernels.md): w_a packed quants, w_b scales.
// Entry point `main`, override TX (8 or 16); grid (ceil(rows / 8 TX), ceil(tokens / 8 TX)):
// matmul_body.wgsl.

@group(0) @binding(2) var<storage, read> w_a: array<u32>;
@group(0) @binding(3) var<storage, read> w_b: array<u32>;

// Q8_0: 8 words (32 int8) per block, d as f16 pairs in w_b; chunk c8 is words 2 c8, 2 c8 + 1.
fn load_w8(row: u32, c8: u32) -> W8 {
    let nb = params.cols / 32u;
    let a = row * (nb * 8u) + 2u * c8;
    let blk = c8 / 4u;
    let d = unpack2x16float(w_b[row * ((nb + 1u) / 2u) + blk / 2u])[blk & 1u];
    return W8(vec4<f32>(unpack4xI8(w_a[a])) * d, vec4<f32>(unpack4xI8(w_a[a + 1u])) * d);
}

// #include matmul_body.wgsl
