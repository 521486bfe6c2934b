// matmul.tmpl.wgsl: the register-tiled prefill matmul for every weight format. kjarni/gpu/kernels.py
// renders it per format (`kernels.template("matmul", format)`): {{BLOCK}} is the format's block
// decoder (kernels.BLOCKS: block_<format>.wgsl, which declares w_a / w_b and defines
// `load_w8(row, c8)`, weights 8 c8 .. 8 c8 + 7 of a row dequantized to f32, and for
// kernels.SPLIT_LOAD_FORMATS (f16, Q8_0, Q4_K, Q5_0) its split into `fetch_w8(row, c8) -> WRaw` (the loads) and `finish_w8(raw) -> W8`); the other
// formats get the pair from load_w8 through matmul_w_direct.wgsl (the W8 field).
//
// Bindings and Params: the linear family (docs/gpu-kernels.md): params, x [tokens, cols], w_a, w_b,
// bias, residual, norm_weight, y [tokens, y_stride].
// Math: y[t, row_offset + r] = s_t sum_c x[t, c] nw[c] W[r, c] (+ bias) (+ residual), where
//   nw = norm_weight and s_t = 1 / sqrt(mean(x[t]^2) + eps) when flags bit 2, else nw = s_t = 1;
//   with flags bit 3, x[t, c] = silu(g[t, c]) up[t, c] of x = [gate | up] (silu_mul fused).
//   f32 products and f32 accumulation whatever the weight format.
// Tile: TM x TN threads (overrides, each 8 or 16) own a BM x BN = 8 TM tokens x 8 TN rows output
//   tile; each thread holds 8 tokens x 8 rows in 16 vec4 registers (tokens 4 ty .. and BM/2 + 4 ty ..,
//   rows 4 tx .. and BN/2 + 4 tx .., so a warp's vec4 reads of workgroup memory are contiguous).
//   K goes BK columns per step (override, TN / 2 or TN, at most min(TM, TN)) through workgroup
//   memory (x and W as f32, [k][token|row]). Every thread loads one column of 8 BK / TN rows of x
//   (consecutive threads, consecutive columns: see XRaw), the first BN BK / 8 threads one 8-column
//   chunk of a row of W each; the next step's loads are issued into registers while the current
//   step computes and converted (norm, silu, dequantization of f16 / Q8_0) only when stored at
//   the next step (two barriers per step). With NBUF = 2 (override) each group has two tiles:
//   step s computes from one while step s + 1, loaded during step s - 1, is stored into the other
//   and step s + 2's loads are issued: one barrier per step. Workgroup memory: NBUF KSPLIT 4 BK
//   (BM + 4 + BN) bytes: 16.5 KiB at TM = TN = BK = 16, KSPLIT = NBUF = 1 and 25 KiB at TM = 8,
//   TN = 16, BK = 8, KSPLIT = 4 (lavapipe allows 32 KiB, the H200 48). The fused norm's sums of
//   squares meet in xs / ws at the end.
// Split K (override KSPLIT, 1, 2 or 4, with KSPLIT BK NBUF >= 2 max(TM, TN)): KSPLIT groups of TM x TN
//   threads compute the same output tile over interleaved K steps (group g takes steps g,
//   g + KSPLIT, ..., each in its own part of workgroup memory) and group 0 adds the others' sums at
//   the end through workgroup memory. It multiplies the warps per workgroup for shapes with few
//   tiles (o_proj, down_proj of a small model at a 512-token prompt: 56 tiles of 64 x 128) without
//   a second pass or more bindings.
// Split K over workgroups (grid z = S > 1, shapes with few tiles and long rows): workgroup z
//   takes the z-th of S equal runs of whole steps of K and writes its partial sums, unscaled and
//   without bias or residual (the host clears those flags and bit 2), to y[z tokens + t] (y is a
//   [S, tokens, y_stride] scratch); matmul_reduce.wgsl adds the S partials.
// Grid: (ceil(rows / BN), ceil(tokens / BM), S); TM * TN * KSPLIT threads per workgroup.
//
// Loops over registers are written out by hand: naga emits `while`-shaped loops that drivers may
// not unroll, and a private array indexed by a loop counter then lives in (slow) local memory.

// #include linear_params.wgsl
// #include {{BLOCK}}.wgsl
{{W8}}

override TM: u32 = 16u;     // threads along tokens: tile BM = 8 TM tokens
override TN: u32 = 16u;     // threads along rows: tile BN = 8 TN rows
override BK: u32 = 16u;     // columns per K step (a multiple of 8, at most min(TM, TN))
override KSPLIT: u32 = 1u;  // thread groups splitting K (1, 2 or 4)
override NBUF: u32 = 1u;    // tiles per group: 1 (two barriers a step) or 2 (double-buffered, one)

// Per group g and buffer b: a [k][token / 4] tile (BK x BM, rows padded by one vec4 so that the
// loaders' column-wise stores spread over the banks) at vec4 (g NBUF + b) BK SX of xs, a
// [k][row / 4] tile (BK x BN) at (g NBUF + b) 2 BK TN of ws.
const SX_PAD: u32 = 1u;
var<workgroup> xs: array<vec4<f32>, BK * (2u * TM + SX_PAD) * KSPLIT * NBUF>;
var<workgroup> ws: array<vec4<f32>, 2u * BK * TN * KSPLIT * NBUF>;

// A thread's share of a step's x tile: one column c of NX = 8 BK / TN rows (tokens t0, t0 + TS,
// .., TS = TM TN / BK), as loaded, before any arithmetic, so that the loads stay in flight while
// the current step computes (fetch_x now, finish_x at the next step). Consecutive threads take
// consecutive columns of a row, so a warp's loads cover a few rows' contiguous spans. Slots
// a.x .. b.w are rows j = 0 .. 7; ua, ub the up values (flags bit 3), n the column's norm weight
// (bit 2); zeros where unused.
struct XRaw {
    a: vec4<f32>,
    b: vec4<f32>,
    ua: vec4<f32>,
    ub: vec4<f32>,
    n: f32,
}

fn x_rows4(base: u32, t: vec4<u32>, rs: u32) -> vec4<f32> {
    return vec4<f32>(x[base + t.x * rs], x[base + t.y * rs], x[base + t.z * rs], x[base + t.w * rs]);
}

// Column c (< cols) of rows t0 + TS j, j < NX (rows past the prompt read its last row). With
// flags bit 3, x is [tokens, 2 cols] = [gate | up].
fn fetch_x(t0: u32, ts: u32, c: u32) -> XRaw {
    let cols = params.cols;
    let silu = (params.flags & 8u) != 0u;
    let rs = cols * select(1u, 2u, silu);  // row stride
    let last = params.tokens - 1u;
    let ta = min(vec4<u32>(t0, t0 + ts, t0 + 2u * ts, t0 + 3u * ts), vec4<u32>(last));
    let tb = min(vec4<u32>(t0 + 4u * ts, t0 + 5u * ts, t0 + 6u * ts, t0 + 7u * ts), vec4<u32>(last));
    var r = XRaw();
    r.a = x_rows4(c, ta, rs);
    if (BK * 8u > TN * 4u) {  // NX = 8
        r.b = x_rows4(c, tb, rs);
    }
    if (silu) {
        r.ua = x_rows4(cols + c, ta, rs);
        if (BK * 8u > TN * 4u) {
            r.ub = x_rows4(cols + c, tb, rs);
        }
    }
    if ((params.flags & 4u) != 0u) {
        r.n = norm_weight[c];
    }
    return r;
}

// The values: silu(gate) * up with flags bit 3; times the norm weight with flags bit 2, adding
// the (pre-norm) squares to the rows' sums ssa (rows 0 .. 3) and ssb (4 .. 7).
fn finish_x(r: XRaw, ssa: ptr<function, vec4<f32>>, ssb: ptr<function, vec4<f32>>) -> W8 {
    var a = r.a;
    var b = r.b;
    if ((params.flags & 8u) != 0u) {
        a = a / (1.0 + exp(-a)) * r.ua;
        b = b / (1.0 + exp(-b)) * r.ub;
    }
    if ((params.flags & 4u) != 0u) {
        *ssa += a * a;
        *ssb += b * b;
        a *= r.n;
        b *= r.n;
    }
    return W8(a, b);
}

// Stores a thread's x values (column k of the step, rows p0 + TS j) into the group's tile at t0.
fn store_x(t0: u32, k: u32, p0: u32, ts: u32, v: W8) {
    let s = 2u * TM + SX_PAD;
    let i = t0 + k * s;
    xs[i + p0 / 4u][p0 % 4u] = v.a.x;
    xs[i + (p0 + ts) / 4u][(p0 + ts) % 4u] = v.a.y;
    xs[i + (p0 + 2u * ts) / 4u][(p0 + 2u * ts) % 4u] = v.a.z;
    xs[i + (p0 + 3u * ts) / 4u][(p0 + 3u * ts) % 4u] = v.a.w;
    if (BK * 8u > TN * 4u) {
        xs[i + (p0 + 4u * ts) / 4u][(p0 + 4u * ts) % 4u] = v.b.x;
        xs[i + (p0 + 5u * ts) / 4u][(p0 + 5u * ts) % 4u] = v.b.y;
        xs[i + (p0 + 6u * ts) / 4u][(p0 + 6u * ts) % 4u] = v.b.z;
        xs[i + (p0 + 7u * ts) / 4u][(p0 + 7u * ts) % 4u] = v.b.w;
    }
}

// Stores 8 weights along k (k .. k + 7) of row p into the group's [k][row / 4] tile at t0.
fn store_w(t0: u32, k: u32, p: u32, v: W8) {
    let s = 2u * TN;
    let i = t0 + k * s + p / 4u;
    let l = p % 4u;
    ws[i][l] = v.a.x; ws[i + s][l] = v.a.y; ws[i + 2u * s][l] = v.a.z; ws[i + 3u * s][l] = v.a.w;
    ws[i + 4u * s][l] = v.b.x; ws[i + 5u * s][l] = v.b.y; ws[i + 6u * s][l] = v.b.z; ws[i + 7u * s][l] = v.b.w;
}

// A thread's loads of the step whose group columns start at kn (zeros past kend).
struct Loads {
    x: XRaw,
    w: WRaw,
}

fn fetch_step(kn: u32, kend: u32, m0: u32, ts: u32, lxk: u32, lxp: u32, load_w: bool, lwk: u32, lr: u32) -> Loads {
    var r = Loads(XRaw(), WRaw());
    if (kn + lxk < kend) {
        r.x = fetch_x(m0 + lxp, ts, kn + lxk);
    }
    if (load_w && kn + lwk < kend) {
        r.w = fetch_w8(lr, (kn + lwk) / 8u);
    }
    return r;
}

// Writes rows r .. r + 3 of token t (of split z): acc * scale (+ bias) (+ residual); skips
// rows/tokens outside.
fn store4(z: u32, t: u32, r: u32, acc: vec4<f32>, scale: f32) {
    if (t >= params.tokens) {
        return;
    }
    let v = acc * scale;
    for (var j = 0u; j < 4u; j++) {
        if (r + j < params.rows) {
            let col = params.row_offset + r + j;
            var o = v[j];
            if ((params.flags & 1u) != 0u) {
                o += bias[col];
            }
            let i = (z * params.tokens + t) * params.y_stride + col;
            if ((params.flags & 2u) != 0u) {
                o += residual[i];
            }
            y[i] = o;
        }
    }
}

// Tile row p's sum of squares: slot j = p / ts of the loaders p % ts BK + c, c < BK, of each group.
fn row_squares(p: u32, ts: u32, nt: u32) -> f32 {
    let j = p / ts;
    var tot = 0.0;
    for (var g = 0u; g < KSPLIT; g++) {
        for (var c = 0u; c < BK; c++) {
            let i = g * nt + (p % ts) * BK + c;
            tot += select(xs[i][j % 4u], ws[i][j % 4u], j < 4u);
        }
    }
    return tot;
}

@compute @workgroup_size(TM * TN * KSPLIT)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let nt = TM * TN;  // threads per group
    let g = lid / nt;  // this thread's K group
    let tid = lid % nt;
    let bm = 8u * TM;  // tokens per tile
    let bn = 8u * TN;  // rows per tile
    let sx = 2u * TM + SX_PAD;  // vec4 per k row of the x tile; TM: offset of its second half
    let sw = 2u * TN;
    let tx0 = g * NBUF * BK * sx;  // the group's first tiles in xs / ws
    let tw0 = g * NBUF * BK * sw;
    let n0 = wid.x * bn;
    let m0 = wid.y * bm;
    let tx = tid % TN;
    let ty = tid / TN;
    // Loader roles: x column tid % BK of tile rows tid / BK + TS j (every thread); W chunk tid
    // (row tid % bn, columns 8 (tid / bn) .. + 8 of each step) for the first BN BK / 8 threads.
    let ts = nt / BK;
    let lxk = tid % BK;
    let lxp = tid / BK;
    let load_w = tid < TN * BK;
    let lwp = tid % bn;
    let lwk = (tid / bn) * 8u;
    let kstep = KSPLIT * BK;  // columns per step of the whole workgroup
    let lr = min(n0 + lwp, params.rows - 1u);
    let cols = params.cols;
    // This workgroup's columns [kbeg, kend): whole steps, split z of nwg.z.
    let per = (cols + nwg.z * kstep - 1u) / (nwg.z * kstep) * kstep;
    let kbeg = wid.z * per;
    let kend = min(cols, kbeg + per);

    var ssa = vec4<f32>(0.0);  // sums of squares of this thread's x rows (fused norm)
    var ssb = vec4<f32>(0.0);
    // This thread's shares of the coming step, as loaded (zeros: none).
    var next = fetch_step(kbeg + g * BK, kend, m0, ts, lxk, lxp, load_w, lwk, lr);
    let steps = select(0u, (kend - kbeg + kstep - 1u) / kstep, kend > kbeg);
    if (NBUF == 2u) {  // step 0 into buffer 0, step 1 in flight
        store_x(tx0, lxk, lxp, ts, finish_x(next.x, &ssa, &ssb));
        if (load_w) {
            store_w(tw0, lwk, lwp, finish_w8(next.w));
        }
        next = fetch_step(kbeg + kstep + g * BK, kend, m0, ts, lxk, lxp, load_w, lwk, lr);
        workgroupBarrier();
    }

    var c0 = vec4<f32>(0.0); var d0 = vec4<f32>(0.0);
    var c1 = vec4<f32>(0.0); var d1 = vec4<f32>(0.0);
    var c2 = vec4<f32>(0.0); var d2 = vec4<f32>(0.0);
    var c3 = vec4<f32>(0.0); var d3 = vec4<f32>(0.0);
    var c4 = vec4<f32>(0.0); var d4 = vec4<f32>(0.0);
    var c5 = vec4<f32>(0.0); var d5 = vec4<f32>(0.0);
    var c6 = vec4<f32>(0.0); var d6 = vec4<f32>(0.0);
    var c7 = vec4<f32>(0.0); var d7 = vec4<f32>(0.0);

    // Every group runs the same number of steps (barriers); a group past cols computes on zeros.
    for (var s = 0u; s < steps; s++) {
        let k0 = kbeg + s * kstep;
        let cx = tx0 + (s % NBUF) * BK * sx;  // this step's tiles
        let cw = tw0 + (s % NBUF) * BK * sw;
        if (NBUF == 1u) {
            workgroupBarrier();  // the previous step's reads are done
            store_x(tx0, lxk, lxp, ts, finish_x(next.x, &ssa, &ssb));
            if (load_w) {
                store_w(tw0, lwk, lwp, finish_w8(next.w));
            }
            workgroupBarrier();
            // Next step's chunks: in flight while this step computes (no arithmetic on x before
            // the next step, which would wait for the loads here).
            next = fetch_step(k0 + kstep + g * BK, kend, m0, ts, lxk, lxp, load_w, lwk, lr);
        } else {
            // Step s + 1 into the other buffer (last read at step s - 1, before the barrier that
            // ended it), then step s + 2's loads in flight while this step computes.
            let ox = tx0 + ((s + 1u) % 2u) * BK * sx;
            let ow = tw0 + ((s + 1u) % 2u) * BK * sw;
            store_x(ox, lxk, lxp, ts, finish_x(next.x, &ssa, &ssb));
            if (load_w) {
                store_w(ow, lwk, lwp, finish_w8(next.w));
            }
            next = fetch_step(k0 + 2u * kstep + g * BK, kend, m0, ts, lxk, lxp, load_w, lwk, lr);
        }
        for (var k = 0u; k < BK; k++) {
            let xa = xs[cx + k * sx + ty];       // tokens 4 ty .. 4 ty + 3
            let xb = xs[cx + k * sx + TM + ty];  // tokens BM/2 + 4 ty ..
            let wa = ws[cw + k * sw + tx];       // rows 4 tx .. 4 tx + 3
            let wb = ws[cw + k * sw + TN + tx];  // rows BN/2 + 4 tx ..
            // fma written out: the driver need not contract a separate multiply and add.
            c0 = fma(vec4<f32>(xa.x), wa, c0); d0 = fma(vec4<f32>(xa.x), wb, d0);
            c1 = fma(vec4<f32>(xa.y), wa, c1); d1 = fma(vec4<f32>(xa.y), wb, d1);
            c2 = fma(vec4<f32>(xa.z), wa, c2); d2 = fma(vec4<f32>(xa.z), wb, d2);
            c3 = fma(vec4<f32>(xa.w), wa, c3); d3 = fma(vec4<f32>(xa.w), wb, d3);
            c4 = fma(vec4<f32>(xb.x), wa, c4); d4 = fma(vec4<f32>(xb.x), wb, d4);
            c5 = fma(vec4<f32>(xb.y), wa, c5); d5 = fma(vec4<f32>(xb.y), wb, d5);
            c6 = fma(vec4<f32>(xb.z), wa, c6); d6 = fma(vec4<f32>(xb.z), wb, d6);
            c7 = fma(vec4<f32>(xb.w), wa, c7); d7 = fma(vec4<f32>(xb.w), wb, d7);
        }
        if (NBUF == 2u) {
            workgroupBarrier();  // step s + 1 stored, step s's reads done
        }
    }

    // Per-token rms scale: a tile row's sums of squares are spread over the BK threads of its
    // column loads in each group; they meet in workgroup memory (ws: rows 0 .. 3 of each thread's
    // slots, xs: 4 .. 7; 2 BK >= TM and 2 BK >= TN make room).
    var sc = array<f32, 8>(1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0);
    if ((params.flags & 4u) != 0u) {
        workgroupBarrier();
        ws[lid] = ssa;
        xs[lid] = ssb;
        workgroupBarrier();
        let inv_cols = 1.0 / f32(cols);
        sc[0] = inverseSqrt(row_squares(4u * ty, ts, nt) * inv_cols + params.eps);
        sc[1] = inverseSqrt(row_squares(4u * ty + 1u, ts, nt) * inv_cols + params.eps);
        sc[2] = inverseSqrt(row_squares(4u * ty + 2u, ts, nt) * inv_cols + params.eps);
        sc[3] = inverseSqrt(row_squares(4u * ty + 3u, ts, nt) * inv_cols + params.eps);
        sc[4] = inverseSqrt(row_squares(bm / 2u + 4u * ty, ts, nt) * inv_cols + params.eps);
        sc[5] = inverseSqrt(row_squares(bm / 2u + 4u * ty + 1u, ts, nt) * inv_cols + params.eps);
        sc[6] = inverseSqrt(row_squares(bm / 2u + 4u * ty + 2u, ts, nt) * inv_cols + params.eps);
        sc[7] = inverseSqrt(row_squares(bm / 2u + 4u * ty + 3u, ts, nt) * inv_cols + params.eps);
    }

    // Split K: group 0 adds the other groups' sums, 8 vec4 per thread at a time (xs and ws hold
    // 2 KSPLIT BK TM >= 4 TM TN and 2 KSPLIT BK TN >= 4 TM TN vec4).
    for (var src = 1u; src < KSPLIT; src++) {
        workgroupBarrier();
        if (g == src) {
            xs[tid] = c0; xs[nt + tid] = c1; xs[2u * nt + tid] = c2; xs[3u * nt + tid] = c3;
            ws[tid] = c4; ws[nt + tid] = c5; ws[2u * nt + tid] = c6; ws[3u * nt + tid] = c7;
        }
        workgroupBarrier();
        if (g == 0u) {
            c0 += xs[tid]; c1 += xs[nt + tid]; c2 += xs[2u * nt + tid]; c3 += xs[3u * nt + tid];
            c4 += ws[tid]; c5 += ws[nt + tid]; c6 += ws[2u * nt + tid]; c7 += ws[3u * nt + tid];
        }
        workgroupBarrier();
        if (g == src) {
            xs[tid] = d0; xs[nt + tid] = d1; xs[2u * nt + tid] = d2; xs[3u * nt + tid] = d3;
            ws[tid] = d4; ws[nt + tid] = d5; ws[2u * nt + tid] = d6; ws[3u * nt + tid] = d7;
        }
        workgroupBarrier();
        if (g == 0u) {
            d0 += xs[tid]; d1 += xs[nt + tid]; d2 += xs[2u * nt + tid]; d3 += xs[3u * nt + tid];
            d4 += ws[tid]; d5 += ws[nt + tid]; d6 += ws[2u * nt + tid]; d7 += ws[3u * nt + tid];
        }
    }
    if (g != 0u) {
        return;
    }

    let ta = m0 + 4u * ty;
    let tb = m0 + bm / 2u + 4u * ty;
    let ra = n0 + 4u * tx;
    let rb = n0 + bn / 2u + 4u * tx;
    store4(wid.z, ta, ra, c0, sc[0]); store4(wid.z, ta, rb, d0, sc[0]);
    store4(wid.z, ta + 1u, ra, c1, sc[1]); store4(wid.z, ta + 1u, rb, d1, sc[1]);
    store4(wid.z, ta + 2u, ra, c2, sc[2]); store4(wid.z, ta + 2u, rb, d2, sc[2]);
    store4(wid.z, ta + 3u, ra, c3, sc[3]); store4(wid.z, ta + 3u, rb, d3, sc[3]);
    store4(wid.z, tb, ra, c4, sc[4]); store4(wid.z, tb, rb, d4, sc[4]);
    store4(wid.z, tb + 1u, ra, c5, sc[5]); store4(wid.z, tb + 1u, rb, d5, sc[5]);
    store4(wid.z, tb + 2u, ra, c6, sc[6]); store4(wid.z, tb + 2u, rb, d6, sc[6]);
    store4(wid.z, tb + 3u, ra, c7, sc[7]); store4(wid.z, tb + 3u, rb, d7, sc[7]);
}
