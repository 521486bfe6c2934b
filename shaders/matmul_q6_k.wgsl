// matmul_q6_k: prefill y = rms_norm?(x) @ W.T (+ bias) (+ residual) for many tokens, W a Q6_K weight kept
// quantized (layout: kjarni/gpu/quant.py); each 8-value chunk is dequantized to f32 while it is staged
// into workgroup memory (f32 math and accumulation). cols is a multiple of 256.
// Bindings and Params: the linear family (docs/gpu-kernels.md): w_a packed quants, w_b scales.
// Entry point `main`, overrides TM, TN, BK, KSPLIT; grid (ceil(rows / 8 TN), ceil(tokens / 8 TM)):
// matmul_body.wgsl.

@group(0) @binding(2) var<storage, read> w_a: array<u32>;
@group(0) @binding(3) var<storage, read> w_b: array<u32>;

// Q6_K: 48 words per 256-value block (ql 128 bytes, then qh 64 bytes, GGUF order); w_b 5 words per
// block: 16 int8 scales, then d. Value v = 128 h + 32 k + l (l < 32): ql byte 64 h + 32 (k % 2) + l,
// nibble k / 2; qh byte 32 h + l, bits 2 k; scale 8 h + 2 k + l / 16; value d scale (q - 32).
fn load_w8(row: u32, c8: u32) -> W8 {
    let nb = params.cols / 256u;
    let blk = c8 / 32u;
    let v = (c8 % 32u) * 8u;
    let h = v / 128u;
    let k = (v % 128u) / 32u;
    let l = v % 32u;
    let a = row * (nb * 48u) + blk * 48u;
    let ql = a + 16u * h + 8u * (k % 2u) + l / 4u;
    let qh = a + 32u + 8u * h + l / 4u;
    let s = row * (nb * 5u) + blk * 5u;
    let si = 8u * h + 2u * k + l / 16u;
    let d = unpack2x16float(w_b[s + 4u]).x * f32(extractBits(i32(w_b[s + si / 4u]), 8u * (si % 4u), 8u));
    let qs = 4u * (k / 2u);
    let q0 = ((w_a[ql] >> qs) & 0x0F0F0F0Fu) | (((w_a[qh] >> (2u * k)) & 0x03030303u) << 4u);
    let q1 = ((w_a[ql + 1u] >> qs) & 0x0F0F0F0Fu) | (((w_a[qh + 1u] >> (2u * k)) & 0x03030303u) << 4u);
    return W8(d * (vec4<f32>(unpack4xU8(q0)) - 32.0), d * (vec4<f32>(unpack4xU8(q1)) - 32.0));
}

// #include matmul_w_direct.wgsl
// #include matmul_body.wgsl
