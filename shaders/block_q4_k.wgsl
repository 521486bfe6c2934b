// block_q4_k: the Q4_K block decoder (layout: kjarni/gpu/quant.py), shared by the linear kernels
// (linear_q4_k.wgsl, matvec.tmpl.wgsl,
// matmul.tmpl.wgsl, embed.tmpl.wgsl): the weight bindings, UNIT, unit_values(row, u) (the
// UNIT dequantised values of unit u of a row as vec4s) and unit_col(u, k) (the column of the
// k-th vec4). Reads params.cols.

// The 6-bit (sc, m) of sub-block j from a block's side words s (s.x the (d, dmin) pair, s.y ..
// s.w the 12 scale bytes; GGUF get_scale_min_k4): scale bytes j % 4 of words 1, 2 and 3 are bytes
// j, j + 4 (j < 4) or j - 4, j, j + 4 (j >= 4) of the 12.
fn k4_scale_min(s: vec4<u32>, j: u32) -> vec2<u32> {
    let sh = 8u * (j % 4u);
    let b0 = (s.y >> sh) & 0xFFu;
    let b1 = (s.z >> sh) & 0xFFu;
    let b2 = (s.w >> sh) & 0xFFu;
    let low = j < 4u;
    return vec2<u32>(select((b2 & 15u) | ((b0 >> 6u) << 4u), b0 & 63u, low),
                     select((b2 >> 4u) | ((b1 >> 6u) << 4u), b1 & 63u, low));
}

// #if idot
// The integer-dot decoder (matvec_dot.tmpl.wgsl, which defines xq / xd / xs): a chunk is qs vec4
// c % 8 = 2 j + h of block c / 8, 32 values: the low nibbles are values 64 j + 16 h .. + 15 of
// sub-block 2 j (x vec4 4 j + h of the block), the high ones the same of sub-block 2 j + 1 (x vec4
// 4 j + h + 2). Its sum is d (sc_lo dx_lo ilo + sc_hi dx_hi ihi) - dmin (m_lo dx_lo slo + ...):
// ilo the integer dot of the low nibbles with the quantized x, slo the sum of those x quants.
@group(0) @binding(2) var<storage, read> w_a: array<vec4<u32>>;  // qs, 8 vec4 per block
@group(0) @binding(3) var<storage, read> w_b: array<vec4<u32>>;  // (d, dmin), 12 scale bytes

// #if i8tile
// The prefill product's weight tile (matmul_dot.tmpl.wgsl): piece p of a row is values 16 p ..
// 16 p + 15; within its block (p / 16), piece g = p % 4 of group j = (p % 16) / 4 (values 64 j ..
// 64 j + 63) is nibble g / 2 of qs vec4 2 j + g % 2, sub-block 2 j + g / 2: quants 0 .. 15 as
// int8, scale d sc, min dmin m (value = d sc q - dmin m).
struct I8Raw {
    q: vec4<u32>,  // the qs vec4
    s: vec4<u32>,  // the block's side words
    g: u32,        // (p % 16): group 4 j + piece g
}

fn fetch_i8(row: u32, p: u32) -> I8Raw {
    let nb = params.cols / 256u;
    let blk = p / 16u;
    let pp = p % 16u;
    return I8Raw(w_a[row * (nb * 8u) + blk * 8u + 2u * (pp / 4u) + pp % 2u], w_b[row * nb + blk], pp);
}

fn finish_i8(r: I8Raw) -> I8 {
    let nibble = (r.g % 4u) / 2u;
    let sm = k4_scale_min(r.s, 2u * (r.g / 4u) + nibble);
    let dd = unpack2x16float(r.s.x);
    return I8((r.q >> vec4<u32>(4u * nibble)) & vec4<u32>(0x0F0F0F0Fu), dd.x * f32(sm.x), dd.y * f32(sm.y));
}
// #else
const CHUNK: u32 = 32u;

struct XC {
    lo: vec4<u32>,
    hi: vec4<u32>,
    d_lo: f32,
    d_hi: f32,
    s_lo: f32,  // d_lo times the sum of the low half's x quants
    s_hi: f32,
}

fn x_chunk(c: u32) -> XC {
    let p = c % 8u;
    let v = (c / 8u) * 16u + 4u * (p / 2u) + p % 2u;
    let b = (c / 8u) * 8u + 2u * (p / 2u);
    let d_lo = xd[b];
    let d_hi = xd[b + 1u];
    return XC(xq[v], xq[v + 2u], d_lo, d_hi, d_lo * f32(xs[v]), d_hi * f32(xs[v + 2u]));
}

// Chunk c of a row as loaded (fetch_chunk), then times x (dot_raw): apart, so that matvec_dot
// issues a trip's loads before any is used (and with EARLY, the first trip's before phase 1).
struct ChunkRaw {
    q: vec4<u32>,
    sb: vec4<u32>,  // the super-block's d, dmin and packed scales
}

fn fetch_chunk(row: u32, c: u32) -> ChunkRaw {
    let nb = params.cols / 256u;
    return ChunkRaw(w_a[row * (nb * 8u) + c], w_b[row * nb + c / 8u]);
}

fn dot_raw(r: ChunkRaw, c: u32, xc: XC) -> f32 {
    let q = r.q;
    let sb = r.sb;
    // The 6-bit (sc, m) of sub-blocks 2 j and 2 j + 1, two bytes each (GGUF get_scale_min_k4).
    let j = (c % 8u) / 2u;
    let sh = 16u * (j & 1u);
    let b0 = sb.y >> sh;
    let b4 = sb.z >> sh;
    let b8 = sb.w >> sh;
    let high = j >= 2u;
    let sc = select(b0 & 0x3F3Fu, (b8 & 0x0F0Fu) | ((b0 >> 2u) & 0x3030u), high);
    let mn = select(b4 & 0x3F3Fu, ((b8 >> 4u) & 0x0F0Fu) | ((b4 >> 2u) & 0x3030u), high);
    let m4 = vec4<u32>(0x0F0F0F0Fu);
    let lo = q & m4;
    let hi = (q >> vec4<u32>(4u)) & m4;
    let ilo = dot4I8Packed(lo.x, xc.lo.x) + dot4I8Packed(lo.y, xc.lo.y) + dot4I8Packed(lo.z, xc.lo.z) + dot4I8Packed(lo.w, xc.lo.w);
    let ihi = dot4I8Packed(hi.x, xc.hi.x) + dot4I8Packed(hi.y, xc.hi.y) + dot4I8Packed(hi.z, xc.hi.z) + dot4I8Packed(hi.w, xc.hi.w);
    let dd = unpack2x16float(sb.x);
    let sums = f32(i32(sc & 0xFFu) * ilo) * xc.d_lo + f32(i32(sc >> 8u) * ihi) * xc.d_hi;
    let mins = f32(mn & 0xFFu) * xc.s_lo + f32(mn >> 8u) * xc.s_hi;
    return dd.x * sums - dd.y * mins;
}
// #endif
// #else
@group(0) @binding(2) var<storage, read> w_a: array<u32>;  // packed quants, [rows, words_a]
@group(0) @binding(3) var<storage, read> w_b: array<u32>;  // scales / mins, [rows, words_b]

// Q4_K: 256-value blocks. w_a = 32 words (128 qs bytes) per block: byte 32j + l holds value
// 64j + l (low nibble) and 64j + 32 + l (high); w_b = 4 words per block: (d, dmin) f16 pair, then
// the 12 GGUF bytes of eight 6-bit sub-block scales sc and mins m (kjarni/gpu/quant.py).
// Value v = (d * sc[v / 32]) * q - dmin * m[v / 32]. A unit is qs words 2v', 2v' + 1 of a block
// (v' = 0 .. 15): 16 values of sub-blocks 2j and 2j + 1, j = v' / 4.
const UNIT: u32 = 16u;

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

fn unit_values(row: u32, u: u32) -> array<vec4<f32>, 4> {
    let nb = params.cols / 256u;
    let blk = u / 16u;
    let v = u % 16u;
    let j = v / 4u;
    let a = row * (nb * 32u) + blk * 32u + 2u * v;
    let s = row * (nb * 4u) + blk * 4u;
    let dd = unpack2x16float(w_b[s]);
    let sm_lo = scale_min(s, 2u * j);
    let sm_hi = scale_min(s, 2u * j + 1u);
    let d_lo = dd.x * sm_lo.x;
    let m_lo = dd.y * sm_lo.y;
    let d_hi = dd.x * sm_hi.x;
    let m_hi = dd.y * sm_hi.y;
    let q0 = w_a[a];
    let q1 = w_a[a + 1u];
    return array<vec4<f32>, 4>(
        d_lo * vec4<f32>(unpack4xU8(q0 & 0x0F0F0F0Fu)) - m_lo,
        d_lo * vec4<f32>(unpack4xU8(q1 & 0x0F0F0F0Fu)) - m_lo,
        d_hi * vec4<f32>(unpack4xU8((q0 >> 4u) & 0x0F0F0F0Fu)) - m_hi,
        d_hi * vec4<f32>(unpack4xU8((q1 >> 4u) & 0x0F0F0F0Fu)) - m_hi,
    );
}

fn unit_col(u: u32, k: u32) -> u32 {
    let v = u % 16u;
    return (u / 16u) * 256u + (v / 4u) * 64u + (k / 2u) * 32u + (v % 4u) * 8u + (k % 2u) * 4u;
}

// Values 8 c8 .. 8 c8 + 7 of a row (the prefill matmul's chunk): value v of a block is qs byte
// 32 (v / 64) + v % 32, nibble (v % 64) / 32, of sub-block v / 32. load_w8, split for the prefill
// matmul into fetch_w8 (the loads: the chunk's two qs words, its sub-block, the block's four side
// words) and finish_w8 (the scale decoding and dequantization), so that its loads stay in flight
// through a step and are converted only when stored at the next.
struct WRaw {
    q: vec4<u32>,  // qs words a, a + 1, the sub-block j, unused
    s: vec4<u32>,  // (d, dmin), then the 12 scale bytes
}

fn fetch_w8(row: u32, c8: u32) -> WRaw {
    let nb = params.cols / 256u;
    let blk = c8 / 32u;
    let v = (c8 % 32u) * 8u;  // first value of the chunk within the block
    let g = v / 64u;
    let a = row * (nb * 32u) + blk * 32u + 8u * g + (v % 32u) / 4u;
    let s = row * (nb * 4u) + blk * 4u;
    return WRaw(vec4<u32>(w_a[a], w_a[a + 1u], v / 32u, 0u), vec4<u32>(w_b[s], w_b[s + 1u], w_b[s + 2u], w_b[s + 3u]));
}

fn finish_w8(r: WRaw) -> W8 {
    let j = r.q.z;
    let sm = k4_scale_min(r.s, j);
    let dd = unpack2x16float(r.s.x);
    let d = dd.x * f32(sm.x);
    let m = dd.y * f32(sm.y);
    let shift = 4u * (j % 2u);
    return W8(d * vec4<f32>(unpack4xU8((r.q.x >> shift) & 0x0F0F0F0Fu)) - m,
              d * vec4<f32>(unpack4xU8((r.q.y >> shift) & 0x0F0F0F0Fu)) - m);
}

fn load_w8(row: u32, c8: u32) -> W8 {
    return finish_w8(fetch_w8(row, c8));
}
// #endif
