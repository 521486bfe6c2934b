// matmul_body: the register-tiled prefill matmul shared by every weight format (matmul_<format>.wgsl).
// A format file declares w_a / w_b and `fn load_w8(row, c8) -> W8` (weights 8 c8 .. 8 c8 + 7 of
// `row`, dequantized to f32), then includes this file.
//
// Bindings and Params: the linear family (docs/gpu-kernels.md): params, x [tokens, cols], w_a, w_b,
// bias, residual, norm_weight, y [tokens, y_stride].
// Math: y[t, row_offset + r] = s_t sum_c x[t, c] nw[c] W[r, c] (+ bias) (+ residual), where
//   nw = norm_weight and s_t = 1 / sqrt(mean(x[t]^2) + eps) when flags bit 2, else nw = s_t = 1;
//   with flags bit 3, x[t, c] = silu(g[t, c]) up[t, c] of x = [gate | up] (silu_mul fused).
//   f32 products and f32 accumulation whatever the weight format.
// Tile: TX x TX threads (override TX = 8 or 16) own a BM x BN = 8 TX tokens x 8 TX rows output
//   tile; each thread holds 8 tokens x 8 rows in 16 vec4 registers (tokens 4 ty .. and BM/2 + 4 ty ..,
//   rows 4 tx .. and BN/2 + 4 tx .., so a warp's vec4 reads of workgroup memory are contiguous).
//   K goes BK = TX columns per step through workgroup memory (x and W as f32, [k][token|row]);
//   each thread loads one 8-column chunk of x and one of W per step, and loads the next step's
//   chunks into registers while it computes the current one (two barriers per step).
//   Workgroup memory: KSPLIT (2 * 4 * BK * 8 TX + 4 TX^2) bytes: 17 KiB at TX = 16, KSPLIT = 1 and at
//   TX = 8, KSPLIT = 4 (fits lavapipe's 32 KiB).
// Split K (override KSPLIT, 1 or a multiple of 2): KSPLIT groups of TX x TX threads compute the same
//   output tile over interleaved K steps (group g takes steps g, g + KSPLIT, ..., each in its own
//   part of workgroup memory) and group 0 adds the others' sums at the end through workgroup
//   memory. It multiplies the warps per workgroup for shapes with few tiles (o_proj, down_proj of a
//   small model at a 512-token prompt: 112 tiles of 64x64) without a second pass or more bindings.
// Grid: (ceil(rows / BN), ceil(tokens / BM), 1); TX * TX * KSPLIT threads per workgroup.
//
// Loops over registers are written out by hand: naga emits `while`-shaped loops that drivers may
// not unroll, and a private array indexed by a loop counter then lives in (slow) local memory.

// #include linear_params.wgsl

override TX: u32 = 16u;     // threads per side; tile 8 TX x 8 TX, K step TX (a multiple of 8)
override KSPLIT: u32 = 1u;  // thread groups splitting K (1, or even)

// Per group g, vec4 g * 2 TX^2 ..: a [k][token / 4] (BK x BM) and a [k][row / 4] (BK x BN) tile.
var<workgroup> xs: array<vec4<f32>, 2u * TX * TX * KSPLIT>;
var<workgroup> ws: array<vec4<f32>, 2u * TX * TX * KSPLIT>;
var<workgroup> ss_sh: array<f32, TX * TX * KSPLIT>;  // per-loader sums of squares (fused norm)

// 8 values of x's row t from column c (zeros past cols), times norm_weight when flags bit 2;
// adds the raw values' squares to ss. With flags bit 3, x is [tokens, 2 cols] = [gate | up] and
// the values are silu(gate) * up.
fn load_x8(t: u32, c: u32, ss: ptr<function, f32>) -> W8 {
    let cols = params.cols;
    let silu = (params.flags & 8u) != 0u;
    let base = t * cols * select(1u, 2u, silu);
    let last = cols - 1u;
    var a = vec4<f32>(
        select(0.0, x[base + min(c, last)], c < cols),
        select(0.0, x[base + min(c + 1u, last)], c + 1u < cols),
        select(0.0, x[base + min(c + 2u, last)], c + 2u < cols),
        select(0.0, x[base + min(c + 3u, last)], c + 3u < cols));
    var b = vec4<f32>(
        select(0.0, x[base + min(c + 4u, last)], c + 4u < cols),
        select(0.0, x[base + min(c + 5u, last)], c + 5u < cols),
        select(0.0, x[base + min(c + 6u, last)], c + 6u < cols),
        select(0.0, x[base + min(c + 7u, last)], c + 7u < cols));
    if (silu) {
        let u = base + cols;
        a = a / (1.0 + exp(-a)) * vec4<f32>(
            select(0.0, x[u + min(c, last)], c < cols),
            select(0.0, x[u + min(c + 1u, last)], c + 1u < cols),
            select(0.0, x[u + min(c + 2u, last)], c + 2u < cols),
            select(0.0, x[u + min(c + 3u, last)], c + 3u < cols));
        b = b / (1.0 + exp(-b)) * vec4<f32>(
            select(0.0, x[u + min(c + 4u, last)], c + 4u < cols),
            select(0.0, x[u + min(c + 5u, last)], c + 5u < cols),
            select(0.0, x[u + min(c + 6u, last)], c + 6u < cols),
            select(0.0, x[u + min(c + 7u, last)], c + 7u < cols));
    }
    if ((params.flags & 4u) != 0u) {
        *ss += dot(a, a) + dot(b, b);
        a *= vec4<f32>(norm_weight[min(c, last)], norm_weight[min(c + 1u, last)],
                       norm_weight[min(c + 2u, last)], norm_weight[min(c + 3u, last)]);
        b *= vec4<f32>(norm_weight[min(c + 4u, last)], norm_weight[min(c + 5u, last)],
                       norm_weight[min(c + 6u, last)], norm_weight[min(c + 7u, last)]);
    }
    return W8(a, b);
}

// Stores 8 values along k (k .. k + 7) at position p (token or row) of the [k][p / 4] tile at vec4 t0.
fn store_xs(t0: u32, k: u32, p: u32, v: W8) {
    let s = 2u * TX;  // vec4 per k row (BM / 4)
    let i = t0 + k * s + p / 4u;
    let l = p % 4u;
    xs[i][l] = v.a.x;
    xs[i + s][l] = v.a.y;
    xs[i + 2u * s][l] = v.a.z;
    xs[i + 3u * s][l] = v.a.w;
    xs[i + 4u * s][l] = v.b.x;
    xs[i + 5u * s][l] = v.b.y;
    xs[i + 6u * s][l] = v.b.z;
    xs[i + 7u * s][l] = v.b.w;
}

fn store_ws(t0: u32, k: u32, p: u32, v: W8) {
    let s = 2u * TX;
    let i = t0 + k * s + p / 4u;
    let l = p % 4u;
    ws[i][l] = v.a.x;
    ws[i + s][l] = v.a.y;
    ws[i + 2u * s][l] = v.a.z;
    ws[i + 3u * s][l] = v.a.w;
    ws[i + 4u * s][l] = v.b.x;
    ws[i + 5u * s][l] = v.b.y;
    ws[i + 6u * s][l] = v.b.z;
    ws[i + 7u * s][l] = v.b.w;
}

// Writes rows r .. r + 3 of token t: acc * scale (+ bias) (+ residual); skips rows/tokens outside.
fn store4(t: u32, r: u32, acc: vec4<f32>, scale: f32) {
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
            let i = t * params.y_stride + col;
            if ((params.flags & 2u) != 0u) {
                o += residual[i];
            }
            y[i] = o;
        }
    }
}

@compute @workgroup_size(TX * TX * KSPLIT)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let nt = TX * TX;  // threads per group
    let g = lid / nt;  // this thread's K group
    let tid = lid % nt;
    let t0 = g * 2u * TX * TX;  // the group's tiles in xs / ws
    let bm = 8u * TX;  // tokens per tile
    let bn = 8u * TX;  // rows per tile
    let s = 2u * TX;   // vec4 per k row of xs / ws
    let h = TX;        // vec4 offset of the second half of a k row (BM / 8)
    let n0 = wid.x * bn;
    let m0 = wid.y * bm;
    let tx = tid % TX;
    let ty = tid / TX;
    // Loader role: position tid % bm of the tile (token and row), columns 8 (tid / bm) .. + 8 of each step.
    let lp = tid % bm;
    let lk = (tid / bm) * 8u;
    let kstep = KSPLIT * TX;  // columns per step of the whole workgroup
    let lt = min(m0 + lp, params.tokens - 1u);
    let lr = min(n0 + lp, params.rows - 1u);
    let cols = params.cols;

    var ss = 0.0;
    let k1 = g * TX + lk;  // this loader's first column
    var px = load_x8(lt, k1, &ss);
    var pw = W8(vec4<f32>(0.0), vec4<f32>(0.0));
    if (k1 < cols) {
        pw = load_w8(lr, k1 / 8u);
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
    for (var k0 = 0u; k0 < cols; k0 += kstep) {
        workgroupBarrier();  // the previous step's reads are done
        store_xs(t0, lk, lp, px);
        store_ws(t0, lk, lp, pw);
        workgroupBarrier();
        // Next step's chunks: in flight while this step computes.
        let kn = k0 + kstep + k1;
        if (k0 + kstep < cols) {
            px = load_x8(lt, kn, &ss);
            pw = W8(vec4<f32>(0.0), vec4<f32>(0.0));
            if (kn < cols) {
                pw = load_w8(lr, kn / 8u);
            }
        }
        for (var k = 0u; k < TX; k++) {
            let xa = xs[t0 + k * s + ty];      // tokens 4 ty .. 4 ty + 3
            let xb = xs[t0 + k * s + h + ty];  // tokens BM/2 + 4 ty ..
            let wa = ws[t0 + k * s + tx];      // rows 4 tx .. 4 tx + 3
            let wb = ws[t0 + k * s + h + tx];  // rows BN/2 + 4 tx ..
            c0 += xa.x * wa; d0 += xa.x * wb;
            c1 += xa.y * wa; d1 += xa.y * wb;
            c2 += xa.z * wa; d2 += xa.z * wb;
            c3 += xa.w * wa; d3 += xa.w * wb;
            c4 += xb.x * wa; d4 += xb.x * wb;
            c5 += xb.y * wa; d5 += xb.y * wb;
            c6 += xb.z * wa; d6 += xb.z * wb;
            c7 += xb.w * wa; d7 += xb.w * wb;
        }
    }

    // Per-token rms scale: the loaders of a token hold partial sums over disjoint columns.
    var sc = array<f32, 8>(1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0);
    if ((params.flags & 4u) != 0u) {
        ss_sh[lid] = ss;
        workgroupBarrier();
        let parts = KSPLIT * TX / 8u;  // loaders per token (ss_sh[p bm + token])
        let inv_cols = 1.0 / f32(cols);
        let ta = 4u * ty;
        let tb = bm / 2u + 4u * ty;
        var tot = array<f32, 8>(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0);
        for (var p = 0u; p < parts; p++) {
            tot[0] += ss_sh[p * bm + ta];
            tot[1] += ss_sh[p * bm + ta + 1u];
            tot[2] += ss_sh[p * bm + ta + 2u];
            tot[3] += ss_sh[p * bm + ta + 3u];
            tot[4] += ss_sh[p * bm + tb];
            tot[5] += ss_sh[p * bm + tb + 1u];
            tot[6] += ss_sh[p * bm + tb + 2u];
            tot[7] += ss_sh[p * bm + tb + 3u];
        }
        sc[0] = inverseSqrt(tot[0] * inv_cols + params.eps);
        sc[1] = inverseSqrt(tot[1] * inv_cols + params.eps);
        sc[2] = inverseSqrt(tot[2] * inv_cols + params.eps);
        sc[3] = inverseSqrt(tot[3] * inv_cols + params.eps);
        sc[4] = inverseSqrt(tot[4] * inv_cols + params.eps);
        sc[5] = inverseSqrt(tot[5] * inv_cols + params.eps);
        sc[6] = inverseSqrt(tot[6] * inv_cols + params.eps);
        sc[7] = inverseSqrt(tot[7] * inv_cols + params.eps);
    }

    // Split K: group 0 adds the other groups' sums, 8 vec4 per thread at a time (xs and ws hold
    // 4 KSPLIT TX^2 >= 8 TX^2 vec4).
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
    store4(ta, ra, c0, sc[0]); store4(ta, rb, d0, sc[0]);
    store4(ta + 1u, ra, c1, sc[1]); store4(ta + 1u, rb, d1, sc[1]);
    store4(ta + 2u, ra, c2, sc[2]); store4(ta + 2u, rb, d2, sc[2]);
    store4(ta + 3u, ra, c3, sc[3]); store4(ta + 3u, rb, d3, sc[3]);
    store4(tb, ra, c4, sc[4]); store4(tb, rb, d4, sc[4]);
    store4(tb + 1u, ra, c5, sc[5]); store4(tb + 1u, rb, d5, sc[5]);
    store4(tb + 2u, ra, c6, sc[6]); store4(tb + 2u, rb, d6, sc[6]);
    store4(tb + 3u, ra, c7, sc[7]); store4(tb + 3u, rb, d7, sc[7]);
}
