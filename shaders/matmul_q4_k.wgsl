// matmul_q4_k: prefill y = rms_norm?(x) @ W.T (+ bias) (+ residual) for many tokens, W a Q4_K weight kept
// quantized (layout: kjarni/gpu/quant.py); each 8-value chunk is dequantized to f32 while it is staged
// into workgroup memory (f32 math and accumulation). cols is a multiple of 256.
// Bindings and Params: the linear family (docs/gpu-kernels.md): w_a packed quants, w_b scales.
// Entry point `main`, overrides TM, TN, BK, KSPLIT; grid (ceil(rows / 8 TN), ceil(tokens / 8 TM)):
// matmul_body.wgsl.

@group(0) @binding(2) var<storage, read> w_a: array<u32>;
@group(0) @binding(3) var<storage, read> w_b: array<u32>;

fn scale_byte(s: u32, k: u32) -> u32 {
    return (w_b[s + 1u + k / 4u] >> (8u * (k % 4u))) & 0xFFu;
}

// (sc, m) of sub-block j from the block's side data at word s (GGUF get_scale_min_k4).
fn scale_min(s: u32, j: u32) -> vec2<f32> {
    if (j < 4u) {
        return vec2<f32>(f32(scale_byte(s, j) & 63u), f32(scale_byte(s, j + 4u) & 63u));
    }
    let packed = scale_byte(s, j + 4u);
    let sc = (packed & 15u) | ((scale_byte(s, j - 4u) >> 6u) << 4u);
    let m = (packed >> 4u) | ((scale_byte(s, j) >> 6u) << 4u);
    return vec2<f32>(f32(sc), f32(m));
}

// Q4_K: 32 words per 256-value block, byte 32 g + l holds value 64 g + l (low nibble) and
// 64 g + 32 + l (high); w_b 4 words per block: (d, dmin), then 12 scale bytes. Value
// (d sc) q - dmin m of the value's 32-wide sub-block.
fn load_w8(row: u32, c8: u32) -> W8 {
    let nb = params.cols / 256u;
    let blk = c8 / 32u;
    let v = (c8 % 32u) * 8u;  // first value of the chunk within the block
    let g = v / 64u;
    let hi = (v % 64u) / 32u;
    let a = row * (nb * 32u) + blk * 32u + 8u * g + (v % 32u) / 4u;
    let s = row * (nb * 4u) + blk * 4u;
    let dd = unpack2x16float(w_b[s]);
    let sm = scale_min(s, 2u * g + hi);
    let d = dd.x * sm.x;
    let m = dd.y * sm.y;
    let shift = 4u * hi;
    return W8(d * vec4<f32>(unpack4xU8((w_a[a] >> shift) & 0x0F0F0F0Fu)) - m,
              d * vec4<f32>(unpack4xU8((w_a[a + 1u] >> shift) & 0x0F0F0F0Fu)) - m);
}

// #include matmul_w_direct.wgsl
// #include matmul_body.wgsl
