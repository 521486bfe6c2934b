// block_q5_0: the Q5_0 block decoder (layout: kjarni/gpu/quant.py), shared by the linear kernels
// (linear_q5_0.wgsl, matvec.tmpl.wgsl,
// matmul.tmpl.wgsl, embed.tmpl.wgsl): the weight bindings, UNIT, unit_values(row, u) (the
// UNIT dequantised values of unit u of a row as vec4s) and unit_col(u, k) (the column of the
// k-th vec4). Reads params.cols.

// #if idot
// The integer-dot decoder (matvec_dot.tmpl.wgsl, which defines xq / xd / xs): a chunk is block c.
// Its 5-bit quants q (0 .. 31) as bytes: the nibbles of qs word i with qh bits 4 i .. 4 i + 3
// (values 4 i ..) or 16 + 4 i .. (values 16 + 4 i ..) as bit 4; the sum is
// d (dx (integer dot of q with x vecs 2 c, 2 c + 1) - 16 dx (sum of the x quants)).
@group(0) @binding(2) var<storage, read> w_a: array<u32>;  // 5 words per block
@group(0) @binding(3) var<storage, read> w_b: array<u32>;  // d as f16 pairs

// Bits 0 .. 3 of h as bit 4 of bytes 0 .. 3.
fn fifth_bits(h: u32) -> u32 {
    return (((h & 15u) * 0x00204081u) & 0x01010101u) << 4u;
}

// #if i8tile
// The prefill product's weight tile (matmul_dot.tmpl.wgsl): piece p of a row is values 16 p ..
// 16 p + 15, half h = p % 2 of block p / 2: nibble h of qs words 0 .. 3 with qh bits 16 h .. 16 h
// + 15 as bit 4, q - 16 as int8 (bit 4 flipped, bits 5 .. 7 set where it is then set), scale d.
struct I8Raw {
    q: vec4<u32>,  // the block's qs words
    qh: u32,
    s: u32,        // the word holding the block's f16 scale
    h: u32,        // the half, plus 2 when the scale is the word's second half
}

fn fetch_i8(row: u32, p: u32) -> I8Raw {
    let nb = params.cols / 32u;
    let blk = p / 2u;
    let base = row * (nb * 5u) + blk * 5u;
    return I8Raw(vec4<u32>(w_a[base], w_a[base + 1u], w_a[base + 2u], w_a[base + 3u]), w_a[base + 4u],
                 w_b[row * ((nb + 1u) / 2u) + blk / 2u], (p & 1u) | ((blk & 1u) << 1u));
}

fn finish_i8(r: I8Raw) -> I8 {
    let h = r.h & 1u;
    let qh = r.qh >> (16u * h);
    let q5 = ((r.q >> vec4<u32>(4u * h)) & vec4<u32>(0x0F0F0F0Fu))
           | vec4<u32>(fifth_bits(qh), fifth_bits(qh >> 4u), fifth_bits(qh >> 8u), fifth_bits(qh >> 12u));
    let w = q5 ^ vec4<u32>(0x10101010u);
    return I8(w | ((w & vec4<u32>(0x10101010u)) * 14u), unpack2x16float(r.s)[r.h >> 1u], 0.0);
}
// #else
const CHUNK: u32 = 32u;

struct XC {
    a: vec4<u32>,
    b: vec4<u32>,
    d: f32,
    s: f32,  // d times the sum of the block's x quants
}

fn x_chunk(c: u32) -> XC {
    let d = xd[c];
    return XC(xq[2u * c], xq[2u * c + 1u], d, d * f32(xs[2u * c] + xs[2u * c + 1u]));
}

// Chunk c of a row as loaded (fetch_chunk), then times x (dot_raw): apart, so that matvec_dot
// issues a trip's loads before any is used (and with EARLY, the first trip's before phase 1).
struct ChunkRaw {
    q: vec4<u32>,
    qh: u32,
    dw: u32,  // the word holding the block's f16 scale
}

fn fetch_chunk(row: u32, c: u32) -> ChunkRaw {
    let nb = params.cols / 32u;
    let base = row * (nb * 5u) + c * 5u;
    return ChunkRaw(vec4<u32>(w_a[base], w_a[base + 1u], w_a[base + 2u], w_a[base + 3u]), w_a[base + 4u],
                    w_b[row * ((nb + 1u) / 2u) + c / 2u]);
}

fn dot_raw(r: ChunkRaw, c: u32, xc: XC) -> f32 {
    let q = r.q;
    let qh = r.qh;
    let d = unpack2x16float(r.dw)[c & 1u];
    let m4 = vec4<u32>(0x0F0F0F0Fu);
    let lo = (q & m4) | vec4<u32>(fifth_bits(qh), fifth_bits(qh >> 4u), fifth_bits(qh >> 8u), fifth_bits(qh >> 12u));
    let hi = ((q >> vec4<u32>(4u)) & m4)
           | vec4<u32>(fifth_bits(qh >> 16u), fifth_bits(qh >> 20u), fifth_bits(qh >> 24u), fifth_bits(qh >> 28u));
    let i = dot4I8Packed(lo.x, xc.a.x) + dot4I8Packed(lo.y, xc.a.y) + dot4I8Packed(lo.z, xc.a.z) + dot4I8Packed(lo.w, xc.a.w)
          + dot4I8Packed(hi.x, xc.b.x) + dot4I8Packed(hi.y, xc.b.y) + dot4I8Packed(hi.z, xc.b.z) + dot4I8Packed(hi.w, xc.b.w);
    return d * (xc.d * f32(i) - 16.0 * xc.s);
}
// #endif
// #else
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
// qs words 2 (p % 2) .. + 1, nibble p / 2, fifth bits 8 p .. 8 p + 7 of qh. load_w8, split for
// the prefill matmul into fetch_w8 (the loads: two qs words, qh, the word holding the block's f16
// scale pair, and the part and which half of the pair is the scale) and finish_w8 (the
// dequantization), so that its loads stay in flight through a step and are converted only when
// stored at the next.
struct WRaw {
    q: vec4<u32>,  // qs words a, a + 1, qh, the scale pair
    part: u32,     // p, plus 4 when the scale is the pair's second half
}

fn fetch_w8(row: u32, c8: u32) -> WRaw {
    let nb = params.cols / 32u;
    let blk = c8 / 4u;
    let part = c8 % 4u;
    let base = row * (nb * 5u) + blk * 5u;
    let a = base + (part % 2u) * 2u;
    return WRaw(vec4<u32>(w_a[a], w_a[a + 1u], w_a[base + 4u], w_b[row * ((nb + 1u) / 2u) + blk / 2u]),
                part | ((blk & 1u) << 2u));
}

fn finish_w8(r: WRaw) -> W8 {
    let part = r.part % 4u;
    let shift = (part / 2u) * 4u;
    let qh = r.q.z >> (8u * part);
    let d = unpack2x16float(r.q.w)[r.part / 4u];
    let q0 = vec4<f32>(unpack4xU8((r.q.x >> shift) & 0x0F0F0F0Fu) | high4(qh)) - 16.0;
    let q1 = vec4<f32>(unpack4xU8((r.q.y >> shift) & 0x0F0F0F0Fu) | high4(qh >> 4u)) - 16.0;
    return W8(d * q0, d * q1);
}

fn load_w8(row: u32, c8: u32) -> W8 {
    return finish_w8(fetch_w8(row, c8));
}
// #endif
