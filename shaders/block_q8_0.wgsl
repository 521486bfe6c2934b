// block_q8_0: the Q8_0 block decoder (layout: kjarni/gpu/quant.py), shared by the linear kernels
// (linear_q8_0.wgsl, matvec.tmpl.wgsl,
// matmul.tmpl.wgsl, embed.tmpl.wgsl): the weight bindings, UNIT, unit_values(row, u) (the
// UNIT dequantised values of unit u of a row as vec4s) and unit_col(u, k) (the column of the
// k-th vec4). Reads params.cols.

// #if idot
// The integer-dot decoder (matvec_dot.tmpl.wgsl, which defines xq / xd / xs): a chunk is block c,
// two vec4 of int8 quants, times x vec4s 2 c and 2 c + 1: d dx (integer dot).
@group(0) @binding(2) var<storage, read> w_a: array<vec4<u32>>;  // 2 vec4 per block
@group(0) @binding(3) var<storage, read> w_b: array<u32>;        // d as f16 pairs

// #if i8tile
// The prefill product's weight tile (matmul_dot.tmpl.wgsl): piece p of a row is values 16 p ..
// 16 p + 15, half p % 2 of block p / 2: its vec4 of int8 quants as they are, scale d, no min.
struct I8Raw {
    q: vec4<u32>,
    s: u32,  // the word holding the block's f16 scale
    h: u32,  // which half of it
}

fn fetch_i8(row: u32, p: u32) -> I8Raw {
    let nb = params.cols / 32u;
    let blk = p / 2u;
    return I8Raw(w_a[row * (nb * 2u) + p], w_b[row * ((nb + 1u) / 2u) + blk / 2u], blk & 1u);
}

fn finish_i8(r: I8Raw) -> I8 {
    return I8(r.q, unpack2x16float(r.s)[r.h], 0.0);
}
// #else
const CHUNK: u32 = 32u;

struct XC {
    a: vec4<u32>,
    b: vec4<u32>,
    d: f32,
}

fn x_chunk(c: u32) -> XC {
    return XC(xq[2u * c], xq[2u * c + 1u], xd[c]);
}

// Chunk c of a row as loaded (fetch_chunk), then times x (dot_raw): apart, so that matvec_dot
// issues a trip's loads before any is used (and with EARLY, the first trip's before phase 1).
struct ChunkRaw {
    a: vec4<u32>,
    b: vec4<u32>,
    dw: u32,  // the word holding the block's f16 scale
}

fn fetch_chunk(row: u32, c: u32) -> ChunkRaw {
    let nb = params.cols / 32u;
    return ChunkRaw(w_a[row * (nb * 2u) + 2u * c], w_a[row * (nb * 2u) + 2u * c + 1u], w_b[row * ((nb + 1u) / 2u) + c / 2u]);
}

fn dot_raw(r: ChunkRaw, c: u32, xc: XC) -> f32 {
    let a = r.a;
    let b = r.b;
    let d = unpack2x16float(r.dw)[c & 1u];
    let i = dot4I8Packed(a.x, xc.a.x) + dot4I8Packed(a.y, xc.a.y) + dot4I8Packed(a.z, xc.a.z) + dot4I8Packed(a.w, xc.a.w)
          + dot4I8Packed(b.x, xc.b.x) + dot4I8Packed(b.y, xc.b.y) + dot4I8Packed(b.z, xc.b.z) + dot4I8Packed(b.w, xc.b.w);
    return d * xc.d * f32(i);
}
// #endif
// #else
@group(0) @binding(2) var<storage, read> w_a: array<u32>;  // packed quants, [rows, words_a]
@group(0) @binding(3) var<storage, read> w_b: array<u32>;  // scales / mins, [rows, words_b]

// Q8_0: w_a = 8 words (32 int8 values) per block, w_b = block scales d as f16 pairs (kjarni/gpu/quant.py).
// A unit is two words of the row: values 8u .. 8u + 7, each d * q.
const UNIT: u32 = 8u;

fn unit_values(row: u32, u: u32) -> array<vec4<f32>, 2> {
    let nb = params.cols / 32u;
    let a = row * (nb * 8u) + 2u * u;
    let blk = u / 4u;
    let d = unpack2x16float(w_b[row * ((nb + 1u) / 2u) + blk / 2u])[blk & 1u];
    return array<vec4<f32>, 2>(vec4<f32>(unpack4xI8(w_a[a])) * d, vec4<f32>(unpack4xI8(w_a[a + 1u])) * d);
}

fn unit_col(u: u32, k: u32) -> u32 {
    return 8u * u + 4u * k;
}

// Values 8 c8 .. 8 c8 + 7 of a row (unit c8): load_w8, split for the prefill matmul into
// fetch_w8 (the loads: two words of 4 int8 quants, the word holding the block's f16 scale pair,
// which half of it is the scale) and finish_w8 (the scaling), so that its loads stay in flight
// through a step and are converted only when stored at the next.
alias WRaw = vec4<u32>;

fn fetch_w8(row: u32, c8: u32) -> WRaw {
    let nb = params.cols / 32u;
    let a = row * (nb * 8u) + 2u * c8;
    let blk = c8 / 4u;
    return vec4<u32>(w_a[a], w_a[a + 1u], w_b[row * ((nb + 1u) / 2u) + blk / 2u], blk & 1u);
}

fn finish_w8(q: WRaw) -> W8 {
    let d = unpack2x16float(q.z)[q.w];
    return W8(vec4<f32>(unpack4xI8(q.x)) * d, vec4<f32>(unpack4xI8(q.y)) * d);
}

fn load_w8(row: u32, c8: u32) -> W8 {
    return finish_w8(fetch_w8(row, c8));
}
// #endif
