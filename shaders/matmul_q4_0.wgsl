// matmul_q4_0: prefill y = rms_norm?(x) @ W.T (+ bias) (+ residual) for many tokens, W a Q4_0 weight kept
// quantized (layout: kjarni/gpu/quant.py); each 8-value chunk is dequantized to f32 while it is staged
// into workgroup memory (f32 math and accumulation). cols is a multiple of 32.
// Bindings and Params: the linear family (docs/gpu-kernels.md): w_a packed quants, w_b scales.
// Entry point `main`, overrides TM, TN, BK, KSPLIT; grid (ceil(rows / 8 TN), ceil(tokens / 8 TM)):
// matmul_body.wgsl.

@group(0) @binding(2) var<storage, read> w_a: array<u32>;
@group(0) @binding(3) var<storage, read> w_b: array<u32>;

// Q4_0: 4 words per block, byte i holds value i (low nibble) and i + 16 (high); d as f16 pairs.
// Chunk part p = c8 % 4 of a block: words 2 (p % 2) .., nibble 4 (p / 2).
fn load_w8(row: u32, c8: u32) -> W8 {
    let nb = params.cols / 32u;
    let blk = c8 / 4u;
    let part = c8 % 4u;
    let a = row * (nb * 4u) + blk * 4u + (part % 2u) * 2u;
    let shift = (part / 2u) * 4u;
    let d = unpack2x16float(w_b[row * ((nb + 1u) / 2u) + blk / 2u])[blk & 1u];
    let q0 = vec4<f32>(unpack4xU8((w_a[a] >> shift) & 0x0F0F0F0Fu)) - 8.0;
    let q1 = vec4<f32>(unpack4xU8((w_a[a + 1u] >> shift) & 0x0F0F0F0Fu)) - 8.0;
    return W8(d * q0, d * q1);
}

// #include matmul_w_direct.wgsl
// #include matmul_body.wgsl
