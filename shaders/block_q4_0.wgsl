// block_q4_0: the Q4_0 block decoder (layout: kjarni/gpu/quant.py), shared by the linear kernels
// (linear_q4_0.wgsl, matvec.tmpl.wgsl,
// matmul.tmpl.wgsl, embed.tmpl.wgsl): the weight bindings, UNIT, unit_values(row, u) (the
// UNIT dequantised values of unit u of a row as vec4s) and unit_col(u, k) (the column of the
// k-th vec4). Reads params.cols.

@group(0) @binding(2) var<storage, read> w_a: array<u32>;  // packed quants, [rows, words_a]
@group(0) @binding(3) var<storage, read> w_b: array<u32>;  // scales / mins, [rows, words_b]

// Q4_0: w_a = 4 words (16 qs bytes) per block, w_b = block scales d as f16 pairs (kjarni/gpu/quant.py).
// A unit is one qs word i of block b: values 4i .. 4i + 3 (low nibbles) and 16 + 4i .. (high), each d * (q - 8).
const UNIT: u32 = 8u;

fn unit_values(row: u32, u: u32) -> array<vec4<f32>, 2> {
    let nb = params.cols / 32u;
    let blk = u / 4u;
    let q = w_a[row * (nb * 4u) + u];
    let d = unpack2x16float(w_b[row * ((nb + 1u) / 2u) + blk / 2u])[blk & 1u];
    let lo = vec4<f32>(unpack4xU8(q & 0x0F0F0F0Fu)) - 8.0;
    let hi = vec4<f32>(unpack4xU8((q >> 4u) & 0x0F0F0F0Fu)) - 8.0;
    return array<vec4<f32>, 2>(d * lo, d * hi);
}

fn unit_col(u: u32, k: u32) -> u32 {
    return (u / 4u) * 32u + (u % 4u) * 4u + 16u * k;
}

// Values 8 c8 .. 8 c8 + 7 of a row (the prefill matmul's chunk): part p = c8 % 4 of a block is
// words 2 (p % 2) .. + 1, nibble p / 2.
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

// #if i8tile
// The prefill product's weight tile (matmul_dot.tmpl.wgsl, rendered with `idot` and `i8tile`):
// piece p of a row is values 16 p .. 16 p + 15, half h = p % 2 of block p / 2: nibble h of qs words
// 0 .. 3, q - 8 as int8 (bit 3 flipped, bits 4 .. 7 set where it is then set), scale d.
struct I8Raw {
    q: vec4<u32>,  // the block's qs words
    s: u32,        // the word holding the block's f16 scale
    h: u32,        // the half, plus 2 when the scale is the word's second half
}

fn fetch_i8(row: u32, p: u32) -> I8Raw {
    let nb = params.cols / 32u;
    let blk = p / 2u;
    let base = row * (nb * 4u) + blk * 4u;
    return I8Raw(vec4<u32>(w_a[base], w_a[base + 1u], w_a[base + 2u], w_a[base + 3u]),
                 w_b[row * ((nb + 1u) / 2u) + blk / 2u], (p & 1u) | ((blk & 1u) << 1u));
}

fn finish_i8(r: I8Raw) -> I8 {
    let w = ((r.q >> vec4<u32>(4u * (r.h & 1u))) & vec4<u32>(0x0F0F0F0Fu)) ^ vec4<u32>(0x08080808u);
    return I8(w | ((w & vec4<u32>(0x08080808u)) * 30u), unpack2x16float(r.s)[r.h >> 1u], 0.0);
}
// #endif
