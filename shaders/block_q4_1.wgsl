// block_q4_1: the Q4_1 block decoder (layout: kjarni/gpu/quant.py), shared by the linear kernels
// (linear_q4_1.wgsl, matvec.tmpl.wgsl,
// matmul.tmpl.wgsl, embed.tmpl.wgsl): the weight bindings, UNIT, unit_values(row, u) (the
// UNIT dequantised values of unit u of a row as vec4s) and unit_col(u, k) (the column of the
// k-th vec4). Reads params.cols.

@group(0) @binding(2) var<storage, read> w_a: array<u32>;  // packed quants, [rows, words_a]
@group(0) @binding(3) var<storage, read> w_b: array<u32>;  // scales / mins, [rows, words_b]

// Q4_1: w_a = 4 words (16 qs bytes) per block, w_b = one word per block: d (low f16), m (high f16)
// (kjarni/gpu/quant.py). A unit is one qs word i of block b: values 4i .. 4i + 3 (low nibbles) and
// 16 + 4i .. (high), each d * q + m.
const UNIT: u32 = 8u;

fn unit_values(row: u32, u: u32) -> array<vec4<f32>, 2> {
    let nb = params.cols / 32u;
    let q = w_a[row * (nb * 4u) + u];
    let dm = unpack2x16float(w_b[row * nb + u / 4u]);
    let lo = vec4<f32>(unpack4xU8(q & 0x0F0F0F0Fu));
    let hi = vec4<f32>(unpack4xU8((q >> 4u) & 0x0F0F0F0Fu));
    return array<vec4<f32>, 2>(dm.x * lo + dm.y, dm.x * hi + dm.y);
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
    let dm = unpack2x16float(w_b[row * nb + blk]);
    let q0 = vec4<f32>(unpack4xU8((w_a[a] >> shift) & 0x0F0F0F0Fu));
    let q1 = vec4<f32>(unpack4xU8((w_a[a + 1u] >> shift) & 0x0F0F0F0Fu));
    return W8(dm.x * q0 + dm.y, dm.x * q1 + dm.y);
}

// #if i8tile
// The prefill product's weight tile (matmul_dot.tmpl.wgsl, rendered with `idot` and `i8tile`):
// piece p of a row is values 16 p .. 16 p + 15, half h = p % 2 of block p / 2: nibble h of qs words
// 0 .. 3 (q 0 .. 15 as int8), scale d, min -m (value = d q + m).
struct I8Raw {
    q: vec4<u32>,  // the block's qs words
    s: u32,        // the block's (d, m) f16 pair
    h: u32,
}

fn fetch_i8(row: u32, p: u32) -> I8Raw {
    let nb = params.cols / 32u;
    let blk = p / 2u;
    let base = row * (nb * 4u) + blk * 4u;
    return I8Raw(vec4<u32>(w_a[base], w_a[base + 1u], w_a[base + 2u], w_a[base + 3u]), w_b[row * nb + blk], p & 1u);
}

fn finish_i8(r: I8Raw) -> I8 {
    let dm = unpack2x16float(r.s);
    return I8((r.q >> vec4<u32>(4u * r.h)) & vec4<u32>(0x0F0F0F0Fu), dm.x, -dm.y);
}
// #endif
