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

// Where value v = 128 h + 32 k + l (l < 32, a multiple of 4) of block blk of a row lives: ql byte
// 64 h + 32 (k % 2) + l and qh byte 32 h + l (as words of w_a), the block's side words at s, its
// scale 8 h + 2 k + l / 16, and k (which nibble and which qh bit pair).
struct Q6At {
    ql: u32,
    qh: u32,
    s: u32,
    si: u32,
    k: u32,
}

fn q6_at(row: u32, blk: u32, v: u32) -> Q6At {
    let nb = params.cols / 256u;
    let h = v / 128u;
    let k = (v % 128u) / 32u;
    let l = v % 32u;
    let a = row * (nb * 48u) + blk * 48u;
    return Q6At(a + 16u * h + 8u * (k % 2u) + l / 4u, a + 32u + 8u * h + l / 4u, row * (nb * 5u) + blk * 5u,
                8u * h + 2u * k + l / 16u, k);
}

// Values 8 c8 .. 8 c8 + 7 of a row (the prefill matmul's chunk).
fn load_w8(row: u32, c8: u32) -> W8 {
    let at = q6_at(row, c8 / 32u, (c8 % 32u) * 8u);
    let d = unpack2x16float(w_b[at.s + 4u]).x * f32(extractBits(i32(w_b[at.s + at.si / 4u]), 8u * (at.si % 4u), 8u));
    return W8(d * q6(w_a[at.ql], w_a[at.qh], at.k), d * q6(w_a[at.ql + 1u], w_a[at.qh + 1u], at.k));
}

// #if i8tile
// The prefill product's weight tile (matmul_dot.tmpl.wgsl, rendered with `idot` and `i8tile`;
// kernels.DOT_SCALING "piece": a scale per 16 values): piece p of a row is values 16 (p % 16) ..
// + 15 of block p / 16 (q6_at: 4 ql words, nibble k / 2, and 4 qh words, bits 2 k, 2 k + 1), q - 32
// as int8 (bit 5 flipped, bits 6 and 7 set where it is then set), scale d scale[si].
struct I8Raw {
    ql: vec4<u32>,
    qh: vec4<u32>,
    s: u32,  // the word holding the piece's int8 scale
    d: u32,  // the word holding d (low half)
    k: u32,  // k, plus 4 times the scale's byte in s
}

fn fetch_i8(row: u32, p: u32) -> I8Raw {
    let at = q6_at(row, p / 16u, (p % 16u) * 16u);
    return I8Raw(vec4<u32>(w_a[at.ql], w_a[at.ql + 1u], w_a[at.ql + 2u], w_a[at.ql + 3u]),
                 vec4<u32>(w_a[at.qh], w_a[at.qh + 1u], w_a[at.qh + 2u], w_a[at.qh + 3u]),
                 w_b[at.s + at.si / 4u], w_b[at.s + 4u], at.k | ((at.si % 4u) << 2u));
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
