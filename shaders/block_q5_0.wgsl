// block_q5_0: the Q5_0 block decoder (layout: kjarni/gpu/quant.py), shared by the linear kernels
// (linear_q5_0.wgsl, matvec.tmpl.wgsl,
// matmul.tmpl.wgsl, embed.tmpl.wgsl): the weight bindings, UNIT, unit_values(row, u) (the
// UNIT dequantised values of unit u of a row as vec4s) and unit_col(u, k) (the column of the
// k-th vec4). Reads params.cols.

@group(0) @binding(2) var<storage, read> w_a: array<u32>;  // packed quants, [rows, words_a]
@group(0) @binding(3) var<storage, read> w_b: array<u32>;  // scales / mins, [rows, words_b]

// Q5_0: w_a = 5 words per block (4 qs words, then qh: bit j is value j's fifth bit), w_b = block
// scales d as f16 pairs (kjarni/gpu/quant.py). A unit is one qs word i of block b: values
// 4i .. 4i + 3 (low nibbles) and 16 + 4i .. (high), each d * (q - 16).
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
    let d = unpack2x16float(w_b[row * ((nb + 1u) / 2u) + blk / 2u])[blk & 1u];
    let lo = vec4<f32>(unpack4xU8(q & 0x0F0F0F0Fu) | high4(qh >> (4u * i))) - 16.0;
    let hi = vec4<f32>(unpack4xU8((q >> 4u) & 0x0F0F0F0Fu) | high4(qh >> (16u + 4u * i))) - 16.0;
    return array<vec4<f32>, 2>(d * lo, d * hi);
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
    let d = unpack2x16float(w_b[row * ((nb + 1u) / 2u) + blk / 2u])[blk & 1u];
    let q0 = vec4<f32>(unpack4xU8((w_a[a] >> shift) & 0x0F0F0F0Fu) | high4(qh)) - 16.0;
    let q1 = vec4<f32>(unpack4xU8((w_a[a + 1u] >> shift) & 0x0F0F0F0Fu) | high4(qh >> 4u)) - 16.0;
    return W8(d * q0, d * q1);
}
