// block_q5_1: the Q5_1 block decoder (layout: kjarni/gpu/quant.py), shared by the linear kernels
// (linear_q5_1.wgsl, matvec.tmpl.wgsl,
// matmul.tmpl.wgsl, embed.tmpl.wgsl): the weight bindings, UNIT, unit_values(row, u) (the
// UNIT dequantised values of unit u of a row as vec4s) and unit_col(u, k) (the column of the
// k-th vec4). Reads params.cols.

@group(0) @binding(2) var<storage, read> w_a: array<u32>;  // packed quants, [rows, words_a]
@group(0) @binding(3) var<storage, read> w_b: array<u32>;  // scales / mins, [rows, words_b]

// Q5_1: w_a = 5 words per block (4 qs words, then qh: bit j is value j's fifth bit), w_b = one word
// per block: d (low f16), m (high f16) (kjarni/gpu/quant.py). A unit is one qs word i of block b:
// values 4i .. 4i + 3 (low nibbles) and 16 + 4i .. (high), each d * q + m.
const UNIT: u32 = 8u;

// Bits 0..3 of h as the fifth bit (16) of four values.
fn high4(h: u32) -> vec4<u32> {
    return (vec4<u32>(h, h >> 1u, h >> 2u, h >> 3u) & vec4<u32>(1u)) << vec4<u32>(4u);
}

fn unit_values(row: u32, u: u32) -> array<vec4<f32>, 2> {
    let nb = params.cols / 32u;
    let blk = u / 4u;
    let i = u % 4u;
    let base = row * (nb * 5u) + blk * 5u;
    let q = w_a[base + i];
    let qh = w_a[base + 4u];
    let dm = unpack2x16float(w_b[row * nb + blk]);
    let lo = vec4<f32>(unpack4xU8(q & 0x0F0F0F0Fu) | high4(qh >> (4u * i)));
    let hi = vec4<f32>(unpack4xU8((q >> 4u) & 0x0F0F0F0Fu) | high4(qh >> (16u + 4u * i)));
    return array<vec4<f32>, 2>(dm.x * lo + dm.y, dm.x * hi + dm.y);
}

fn unit_col(u: u32, k: u32) -> u32 {
    return (u / 4u) * 32u + (u % 4u) * 4u + 16u * k;
}

// Values 8 c8 .. 8 c8 + 7 of a row (the prefill matmul's chunk): part p = c8 % 4 of a block is
// qs words 2 (p % 2) .. + 1, nibble p / 2, fifth bits 8 p .. 8 p + 7 of qh.
fn load_w8(row: u32, c8: u32) -> W8 {
    let nb = params.cols / 32u;
    let blk = c8 / 4u;
    let part = c8 % 4u;
    let base = row * (nb * 5u) + blk * 5u;
    let a = base + (part % 2u) * 2u;
    let shift = (part / 2u) * 4u;
    let qh = w_a[base + 4u] >> (8u * part);
    let dm = unpack2x16float(w_b[row * nb + blk]);
    let q0 = vec4<f32>(unpack4xU8((w_a[a] >> shift) & 0x0F0F0F0Fu) | high4(qh));
    let q1 = vec4<f32>(unpack4xU8((w_a[a + 1u] >> shift) & 0x0F0F0F0Fu) | high4(qh >> 4u));
    return W8(dm.x * q0 + dm.y, dm.x * q1 + dm.y);
}

// #if i8tile
// The prefill product's weight tile (matmul_dot.tmpl.wgsl, rendered with `idot` and `i8tile`):
// piece p of a row is values 16 p .. 16 p + 15, half h = p % 2 of block p / 2: nibble h of qs words
// 0 .. 3 with qh bits 16 h .. 16 h + 15 as bit 4 (q 0 .. 31 as int8), scale d, min -m (value = d q + m).
struct I8Raw {
    q: vec4<u32>,  // the block's qs words
    qh: u32,
    s: u32,        // the block's (d, m) f16 pair
    h: u32,
}

fn fetch_i8(row: u32, p: u32) -> I8Raw {
    let nb = params.cols / 32u;
    let blk = p / 2u;
    let base = row * (nb * 5u) + blk * 5u;
    return I8Raw(vec4<u32>(w_a[base], w_a[base + 1u], w_a[base + 2u], w_a[base + 3u]), w_a[base + 4u],
                 w_b[row * nb + blk], p & 1u);
}

fn finish_i8(r: I8Raw) -> I8 {
    let qh = r.qh >> (16u * r.h);
    let fifth = vec4<u32>(pack4xU8(high4(qh)), pack4xU8(high4(qh >> 4u)), pack4xU8(high4(qh >> 8u)), pack4xU8(high4(qh >> 12u)));
    let dm = unpack2x16float(r.s);
    return I8(((r.q >> vec4<u32>(4u * r.h)) & vec4<u32>(0x0F0F0F0Fu)) | fifth, dm.x, -dm.y);
}
// #endif
