// block_q6_k: the Q6_K block decoder (layout: kjarni/gpu/quant.py), shared by the linear kernels
// (linear_q6_k.wgsl, matvec.tmpl.wgsl,
// matmul.tmpl.wgsl, embed.tmpl.wgsl): the weight bindings, UNIT, unit_values(row, u) (the
// UNIT dequantised values of unit u of a row as vec4s) and unit_col(u, k) (the column of the
// k-th vec4). Reads params.cols.

@group(0) @binding(2) var<storage, read> w_a: array<u32>;  // packed quants, [rows, words_a]
@group(0) @binding(3) var<storage, read> w_b: array<u32>;  // scales / mins, [rows, words_b]

// Q6_K: 256-value blocks. w_a = 48 words per block: ql (32 words) then qh (16 words); w_b = 5 words
// per block: 16 int8 scales, then d (low f16) (kjarni/gpu/quant.py). Value 128h + 32k + l
// (h < 2, k < 4, l < 32) has low 4 bits in ql byte 64h + 32(k % 2) + l (nibble k / 2) and high 2
// bits in qh byte 32h + l (bits 2k, 2k + 1): (d * scale[v / 16]) * (q - 32).
// A unit is (h, i), i < 8: l = 4i .. 4i + 3 for all four k, 16 values from 3 words.
const UNIT: u32 = 16u;

fn q6(ql: u32, qh: u32, k: u32) -> vec4<f32> {
    let lo = (ql >> (4u * (k / 2u))) & 0x0F0F0F0Fu;
    let hi = ((qh >> (2u * k)) & 0x03030303u) << 4u;
    return vec4<f32>(unpack4xU8(lo | hi)) - 32.0;
}

fn unit_values(row: u32, u: u32) -> array<vec4<f32>, 4> {
    let nb = params.cols / 256u;
    let blk = u / 16u;
    let h = (u % 16u) / 8u;
    let i = u % 8u;
    let a = row * (nb * 48u) + blk * 48u;
    let ql0 = w_a[a + 16u * h + i];
    let ql1 = w_a[a + 16u * h + 8u + i];
    let qh = w_a[a + 32u + 8u * h + i];
    let s = row * (nb * 5u) + blk * 5u;
    let d = unpack2x16float(w_b[s + 4u]).x;
    // scale of k is byte 8h + 2k + i / 4: words 2h (k = 0, 1) and 2h + 1 (k = 2, 3)
    let sw0 = i32(w_b[s + 2u * h]);
    let sw1 = i32(w_b[s + 2u * h + 1u]);
    let b = 8u * (i / 4u);
    return array<vec4<f32>, 4>(
        (d * f32(extractBits(sw0, b, 8u))) * q6(ql0, qh, 0u),
        (d * f32(extractBits(sw0, b + 16u, 8u))) * q6(ql1, qh, 1u),
        (d * f32(extractBits(sw1, b, 8u))) * q6(ql0, qh, 2u),
        (d * f32(extractBits(sw1, b + 16u, 8u))) * q6(ql1, qh, 3u),
    );
}

fn unit_col(u: u32, k: u32) -> u32 {
    return (u / 16u) * 256u + ((u % 16u) / 8u) * 128u + 32u * k + 4u * (u % 8u);
}

// Values 8 c8 .. 8 c8 + 7 of a row (the prefill matmul's chunk): v = 128 h + 32 k + l, l < 32,
// in ql byte 64 h + 32 (k % 2) + l and qh byte 32 h + l; scale 8 h + 2 k + l / 16.
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
    return W8(d * q6(w_a[ql], w_a[qh], k), d * q6(w_a[ql + 1u], w_a[qh + 1u], k));
}

// #if i8tile
// The prefill product's weight tile (matmul_dot.tmpl.wgsl, rendered with `idot` and `i8tile`;
// kernels.DOT_SCALING "piece": a scale per 16 values): piece p of a row is values v = 16 p .. 16 p
// + 15 of block p / 16, i.e. 128 h + 32 k + l for l = l0 .. l0 + 15 (l0 0 or 16): ql words 16 h +
// 8 (k % 2) + l0 / 4 .. + 3 (nibble k / 2), qh words 32 + 8 h + l0 / 4 .. + 3 (bits 2 k, 2 k + 1),
// q - 32 as int8 (bit 5 flipped, bits 6 and 7 set where it is then set), scale d scale[8 h + 2 k +
// l0 / 16].
struct I8Raw {
    ql: vec4<u32>,
    qh: vec4<u32>,
    s: u32,  // the word holding the piece's int8 scale
    d: u32,  // the word holding d (low half)
    k: u32,  // k, plus 4 times the scale's byte in s
}

fn fetch_i8(row: u32, p: u32) -> I8Raw {
    let nb = params.cols / 256u;
    let blk = p / 16u;
    let v = (p % 16u) * 16u;
    let h = v / 128u;
    let k = (v % 128u) / 32u;
    let l0 = v % 32u;
    let a = row * (nb * 48u) + blk * 48u;
    let ql = a + 16u * h + 8u * (k % 2u) + l0 / 4u;
    let qh = a + 32u + 8u * h + l0 / 4u;
    let s = row * (nb * 5u) + blk * 5u;
    let si = 8u * h + 2u * k + l0 / 16u;
    return I8Raw(vec4<u32>(w_a[ql], w_a[ql + 1u], w_a[ql + 2u], w_a[ql + 3u]),
                 vec4<u32>(w_a[qh], w_a[qh + 1u], w_a[qh + 2u], w_a[qh + 3u]), w_b[s + si / 4u], w_b[s + 4u], k | ((si % 4u) << 2u));
}

fn finish_i8(r: I8Raw) -> I8 {
    let k = r.k & 3u;
    let lo = (r.ql >> vec4<u32>(4u * (k / 2u))) & vec4<u32>(0x0F0F0F0Fu);
    let hi = ((r.qh >> vec4<u32>(2u * k)) & vec4<u32>(0x03030303u)) << vec4<u32>(4u);
    let w = (lo | hi) ^ vec4<u32>(0x20202020u);
    let sc = f32(extractBits(i32(r.s), 8u * (r.k >> 2u), 8u));
    return I8(w | ((w & vec4<u32>(0x20202020u)) * 6u), unpack2x16float(r.d).x * sc, 0.0);
}
// #endif
