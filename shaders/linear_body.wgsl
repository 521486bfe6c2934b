// The linear family's shared body: bindings, Params and the entry points. A format file declares
// w_a / w_b and `fn load_w8(row, c8) -> W8` (8 dequantised weights), then includes this.
//
// matvec (few tokens, decode, long rows): workgroup of WG threads computes R consecutive rows for
//   every token; threads stride over the 8-wide column chunks, a subgroup (or shared) reduction sums.
//   Grid: n = ceil(rows / R) workgroups folded as (min(n, 32768), ceil(n / 32768)).
// matvec_sg (few tokens, decode, rows up to a few thousand columns; subgroup devices only): each
//   subgroup owns R consecutive rows, its lanes stride over the chunks, subgroupAdd sums: no
//   workgroup memory, no barriers. Subgroups stride over the row groups, so any grid is correct;
//   the host sizes it as n = ceil(ceil(rows / R) / (WG / 32)) workgroups, folded as above.
// matvec_u (few tokens, decode, any row length; subgroup devices only): a workgroup of WG threads
//   computes R (1, 2 or 4) consecutive rows; threads take U (1, 2 or 4) 8-column chunks per step,
//   all loaded before any is used (loads in flight, not one load per loop trip), subgroupAdd then
//   one barrier sums the subgroups. WG = 32 is a subgroup per row group, WG = 256 splits K 8 ways.
//   Grid: n = ceil(rows / R) workgroups folded as (min(n, 32768), ceil(n / 32768)).
// matvec_t (several tokens: speculative verify; subgroup devices only): a workgroup of WG threads
//   (32..256) computes R (1, 2 or 4) consecutive rows for up to 4 Q tokens (Q = 1, 2 or 3 quads)
//   per pass, passes looping over the rest: a thread loads the R rows' weights of a chunk once and
//   applies them to every token of the pass, one token's x at a time (vec4 loads when cols % 4 == 0),
//   into hand-unrolled vec4 accumulators (per token: the R rows; per quad: the sums of squares).
//   Subgroup sums (Q = 1: subgroupAdd per vec4; else 16 slots halved over lane ^ 1 and lane ^ 2,
//   then xor-added: 24 vec4 shuffles on 32 lanes instead of 75), one barrier, then thread i sums
//   the subgroups for token i and finishes its R rows.
//   Grid: n = ceil(rows / R) workgroups folded as (min(n, 32768), ceil(n / 32768)).
// y[t, row_offset + r] = sum_c xn[t, c] W[r, c] (+ bias[row_offset + r]) (+ residual[t, row_offset + r]),
// xn = x, or x / sqrt(mean(x^2) + eps) * norm_weight when flags bit 2 is set; with flags bit 3, x is
// [tokens, 2 cols] = [gate | up] and the product reads silu(gate) * up (silu_mul fused in).

// #include linear_params.wgsl

override WG: u32 = 64u;
override R: u32 = 4u;
const R_MAX: u32 = 8u;

var<workgroup> red: array<f32, (R_MAX + 1u) * WG>;

fn finish(t: u32, r: u32, acc: f32, ss: f32) {
    var v = acc;
    if ((params.flags & 4u) != 0u) {
        v = v * inverseSqrt(ss / f32(params.cols) + params.eps);
    }
    let col = params.row_offset + r;
    if ((params.flags & 1u) != 0u) {
        v = v + bias[col];
    }
    let i = t * params.y_stride + col;
    if ((params.flags & 2u) != 0u) {
        v = v + residual[i];
    }
    y[i] = v;
}

// 8 values of x (silu(gate) * up with flags bit 3; normalised by norm_weight, not yet by the rms)
// and their sum of squares.
fn load_x8(t: u32, c8: u32, ss: ptr<function, f32>) -> W8 {
    let silu = (params.flags & 8u) != 0u;
    let base = t * params.cols * select(1u, 2u, silu);
    let c = c8 * 8u;
    var v: array<f32, 8>;
    for (var i = 0u; i < 8u; i++) {
        v[i] = select(0.0, x[base + c + i], c + i < params.cols);
    }
    if (silu) {
        for (var i = 0u; i < 8u; i++) {
            let up = select(0.0, x[base + params.cols + c + i], c + i < params.cols);
            v[i] = v[i] / (1.0 + exp(-v[i])) * up;
        }
    }
    var a = vec4<f32>(v[0], v[1], v[2], v[3]);
    var b = vec4<f32>(v[4], v[5], v[6], v[7]);
    if ((params.flags & 4u) != 0u) {
        *ss += dot(a, a) + dot(b, b);
        for (var i = 0u; i < 8u; i++) {
            v[i] = select(0.0, norm_weight[c + i], c + i < params.cols);
        }
        a = a * vec4<f32>(v[0], v[1], v[2], v[3]);
        b = b * vec4<f32>(v[4], v[5], v[6], v[7]);
    }
    return W8(a, b);
}

@compute @workgroup_size(WG)
fn matvec(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
// #if subgroup
    @builtin(subgroup_id) sg_id: u32,
    @builtin(num_subgroups) sg_count: u32,
    @builtin(subgroup_invocation_id) sg_lane: u32,
// #endif
) {
    let row0 = (wid.x + wid.y * nwg.x) * R;
    if (row0 >= params.rows) {
        return;
    }
    let chunks = (params.cols + 7u) / 8u;
    for (var t = 0u; t < params.tokens; t++) {
        var acc: array<f32, R_MAX>;
        for (var r = 0u; r < R_MAX; r++) { acc[r] = 0.0; }  // explicit: lavapipe keeps the last token's sums
        var ss = 0.0;
        for (var c8 = lid; c8 < chunks; c8 += WG) {
            let xv = load_x8(t, c8, &ss);
            for (var r = 0u; r < R; r++) {
                let w = load_w8(min(row0 + r, params.rows - 1u), c8);
                acc[r] += dot(w.a, xv.a) + dot(w.b, xv.b);
            }
        }
// #if subgroup
        let parts = sg_count;
        for (var r = 0u; r < R; r++) {
            let s = subgroupAdd(acc[r]);
            if (sg_lane == 0u) { red[r * WG + sg_id] = s; }
        }
        let s = subgroupAdd(ss);
        if (sg_lane == 0u) { red[R * WG + sg_id] = s; }
// #else
        let parts = WG;
        for (var r = 0u; r < R; r++) {
            red[r * WG + lid] = acc[r];
        }
        red[R * WG + lid] = ss;
// #endif
        workgroupBarrier();
        if (lid < R && row0 + lid < params.rows) {
            var total = 0.0;
            var total_ss = 0.0;
            for (var i = 0u; i < parts; i++) {
                total += red[lid * WG + i];
                total_ss += red[R * WG + i];
            }
            finish(t, row0 + lid, total, total_ss);
        }
        workgroupBarrier();
    }
}

// #if subgroup
@compute @workgroup_size(WG)
fn matvec_sg(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(subgroup_id) sg_id: u32,
    @builtin(num_subgroups) sg_count: u32,
    @builtin(subgroup_invocation_id) sg_lane: u32,
    @builtin(subgroup_size) sg_size: u32,
) {
    let chunks = (params.cols + 7u) / 8u;
    let groups = (params.rows + R - 1u) / R;
    let stride = nwg.x * nwg.y * sg_count;
    for (var g = (wid.x + wid.y * nwg.x) * sg_count + sg_id; g < groups; g += stride) {
        let row0 = g * R;
        for (var t = 0u; t < params.tokens; t++) {
            var acc: array<f32, R_MAX>;
            for (var r = 0u; r < R_MAX; r++) { acc[r] = 0.0; }
            var ss = 0.0;
            for (var c8 = sg_lane; c8 < chunks; c8 += sg_size) {
                let xv = load_x8(t, c8, &ss);
                for (var r = 0u; r < R; r++) {
                    let w = load_w8(min(row0 + r, params.rows - 1u), c8);
                    acc[r] += dot(w.a, xv.a) + dot(w.b, xv.b);
                }
            }
            let total_ss = subgroupAdd(ss);
            for (var r = 0u; r < R; r++) {
                let total = subgroupAdd(acc[r]);
                if (sg_lane == r % sg_size && row0 + r < params.rows) {  // lane r writes row r
                    finish(t, row0 + r, total, total_ss);
                }
            }
        }
    }
}
// #endif

// #if subgroup
override U: u32 = 4u;  // 8-column chunks per thread per step of matvec_u (1, 2 or 4)
var<workgroup> red_u: array<f32, 160>;  // [5][32 subgroups]: the R row sums and the sum of squares

fn dot8(w: W8, v: W8) -> f32 {
    return dot(w.a, v.a) + dot(w.b, v.b);
}

// Row `row`'s dot with chunks c0 .. c3 of x (chunk indices already clamped to the row; x is zero
// past the columns, so clamped duplicates add nothing). Unused chunks (U < 4) are skipped.
fn dot_u(row: u32, k0: u32, k1: u32, k2: u32, k3: u32, x0: W8, x1: W8, x2: W8, x3: W8) -> f32 {
    var s = dot8(load_w8(row, k0), x0);
    if (U > 1u) {
        s += dot8(load_w8(row, k1), x1);
    }
    if (U > 2u) {
        s += dot8(load_w8(row, k2), x2) + dot8(load_w8(row, k3), x3);
    }
    return s;
}

@compute @workgroup_size(WG)
fn matvec_u(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
    @builtin(subgroup_id) sg_id: u32,
    @builtin(num_subgroups) sg_count: u32,
    @builtin(subgroup_invocation_id) sg_lane: u32,
) {
    let row0 = (wid.x + wid.y * nwg.x) * R;
    if (row0 >= params.rows) {
        return;
    }
    let chunks = (params.cols + 7u) / 8u;
    let last = params.rows - 1u;
    let r1 = min(row0 + 1u, last);
    let r2 = min(row0 + 2u, last);
    let r3 = min(row0 + 3u, last);
    let zero = W8(vec4<f32>(0.0), vec4<f32>(0.0));
    for (var t = 0u; t < params.tokens; t++) {
        var a0 = 0.0;
        var a1 = 0.0;
        var a2 = 0.0;
        var a3 = 0.0;
        var ss = 0.0;
        for (var base = 0u; base < chunks; base += U * WG) {
            let c0 = base + lid;
            let c1 = c0 + WG;
            let c2 = c1 + WG;
            let c3 = c2 + WG;
            let k0 = min(c0, chunks - 1u);
            let k1 = min(c1, chunks - 1u);
            let k2 = min(c2, chunks - 1u);
            let k3 = min(c3, chunks - 1u);
            let x0 = load_x8(t, c0, &ss);
            var x1 = zero;
            var x2 = zero;
            var x3 = zero;
            if (U > 1u) {
                x1 = load_x8(t, c1, &ss);
            }
            if (U > 2u) {
                x2 = load_x8(t, c2, &ss);
                x3 = load_x8(t, c3, &ss);
            }
            a0 += dot_u(row0, k0, k1, k2, k3, x0, x1, x2, x3);
            if (R > 1u) {
                a1 += dot_u(r1, k0, k1, k2, k3, x0, x1, x2, x3);
            }
            if (R > 2u) {
                a2 += dot_u(r2, k0, k1, k2, k3, x0, x1, x2, x3);
                a3 += dot_u(r3, k0, k1, k2, k3, x0, x1, x2, x3);
            }
        }
        a0 = subgroupAdd(a0);
        a1 = subgroupAdd(a1);
        a2 = subgroupAdd(a2);
        a3 = subgroupAdd(a3);
        ss = subgroupAdd(ss);
        if (sg_lane == 0u) {
            red_u[sg_id] = a0;
            red_u[32u + sg_id] = a1;
            red_u[64u + sg_id] = a2;
            red_u[96u + sg_id] = a3;
            red_u[128u + sg_id] = ss;
        }
        workgroupBarrier();
        if (lid < R && row0 + lid < params.rows) {
            var total = 0.0;
            var total_ss = 0.0;
            for (var i = 0u; i < sg_count; i++) {
                total += red_u[lid * 32u + i];
                total_ss += red_u[128u + i];
            }
            finish(t, row0 + lid, total, total_ss);
        }
        workgroupBarrier();
    }
}
// #endif

// #if subgroup
override Q: u32 = 2u;  // token quads per pass of matvec_t (1, 2 or 3): up to 4 Q tokens share each weight load
// [16 slots][WG / 4 subgroups] (4 is the smallest subgroup size WebGPU allows): slots 0 .. 11 one
// token's sums of the R rows (vec4 over rows), 12 .. 14 one quad's sums of squares (vec4 over
// tokens), 15 spare.
var<workgroup> red_t: array<vec4<f32>, 16u * (WG / 4u)>;

// x again as vec4s, for matvec_t's loads when cols is a multiple of 4 (a warp's scalar loads 32
// bytes apart cost 4 times the cache wavefronts of its vec4 loads). An entry point may use only
// one of x and x4 (naga rejects two statically used variables on one binding).
@group(0) @binding(1) var<storage, read> x4: array<vec4<f32>>;

// 8 values of x[t] as the product reads them (silu(gate) * up with flags bit 3), zero past cols:
// load_x8 without the norm weight.
fn x8(t: u32, c8: u32) -> W8 {
    let silu = (params.flags & 8u) != 0u;
    let base = t * params.cols * select(1u, 2u, silu);
    let c = c8 * 8u;
    if (params.cols % 4u == 0u) {  // c .. c + 3 is inside the row; c + 4 .. c + 7 unless cols % 8 == 4
        let i = (base + c) / 4u;
        let tail = c + 4u < params.cols;
        var a = x4[i];
        var b = select(vec4<f32>(0.0), x4[i + 1u], tail);
        if (silu) {
            let h = params.cols / 4u;
            a = a / (1.0 + exp(-a)) * x4[i + h];
            b = b / (1.0 + exp(-b)) * select(vec4<f32>(0.0), x4[i + h + 1u], tail);
        }
        return W8(a, b);
    }
    var v: array<f32, 8>;  // other widths: element by element, still through x4
    for (var i = 0u; i < 8u; i++) {
        let j = base + c + i;
        v[i] = select(0.0, x4[j / 4u][j % 4u], c + i < params.cols);
    }
    if (silu) {
        for (var i = 0u; i < 8u; i++) {
            let j = base + params.cols + c + i;
            let up = select(0.0, x4[j / 4u][j % 4u], c + i < params.cols);
            v[i] = v[i] / (1.0 + exp(-v[i])) * up;
        }
    }
    return W8(vec4<f32>(v[0], v[1], v[2], v[3]), vec4<f32>(v[4], v[5], v[6], v[7]));
}

// norm_weight[c8 * 8 ..][i] (zero past cols).
fn norm8(c8: u32) -> W8 {
    let c = c8 * 8u;
    var v: array<f32, 8>;
    for (var i = 0u; i < 8u; i++) {
        v[i] = select(0.0, norm_weight[c + i], c + i < params.cols);
    }
    return W8(vec4<f32>(v[0], v[1], v[2], v[3]), vec4<f32>(v[4], v[5], v[6], v[7]));
}

// Partial sums of four tokens: a .. d, each a vec4 over the R rows; ss, their sums of squares.
struct Quad {
    a: vec4<f32>,
    b: vec4<f32>,
    c: vec4<f32>,
    d: vec4<f32>,
    ss: vec4<f32>,
}

// Rows w0 .. w3 (R of them used) against 8 values of one token.
fn rows4(w0: W8, w1: W8, w2: W8, w3: W8, v: W8) -> vec4<f32> {
    return vec4<f32>(dot8(w0, v), select(0.0, dot8(w1, v), R > 1u), select(0.0, dot8(w2, v), R > 2u),
                     select(0.0, dot8(w3, v), R > 3u));
}

// Chunk c8 of tokens t0 .. t0 + n - 1 (n = 1 .. 4) against the rows' weights (already times the
// norm weight), one token at a time so only one token's x is live.
fn add_quad(q: ptr<function, Quad>, t0: u32, n: u32, c8: u32, w0: W8, w1: W8, w2: W8, w3: W8) {
    let norm = (params.flags & 4u) != 0u;
    let va = x8(t0, c8);
    (*q).a += rows4(w0, w1, w2, w3, va);
    if (norm) { (*q).ss.x += dot8(va, va); }
    if (n > 1u) {
        let vb = x8(t0 + 1u, c8);
        (*q).b += rows4(w0, w1, w2, w3, vb);
        if (norm) { (*q).ss.y += dot8(vb, vb); }
    }
    if (n > 2u) {
        let vc = x8(t0 + 2u, c8);
        (*q).c += rows4(w0, w1, w2, w3, vc);
        if (norm) { (*q).ss.z += dot8(vc, vc); }
    }
    if (n > 3u) {
        let vd = x8(t0 + 3u, c8);
        (*q).d += rows4(w0, w1, w2, w3, vd);
        if (norm) { (*q).ss.w += dot8(vd, vd); }
    }
}

// Q = 1: sums the quad's n tokens (and the sums of squares with the fused norm) over the subgroup
// with one subgroupAdd each; lane 0 stores them (slots 0 .. n - 1 and 12) for the cross-subgroup sum.
fn reduce_quad(q: Quad, n: u32, sg_id: u32, sg_lane: u32) {
    let s = WG / 4u;
    let a = subgroupAdd(q.a);
    if (sg_lane == 0u) { red_t[sg_id] = a; }
    if (n > 1u) {
        let b = subgroupAdd(q.b);
        if (sg_lane == 0u) { red_t[s + sg_id] = b; }
    }
    if (n > 2u) {
        let c = subgroupAdd(q.c);
        if (sg_lane == 0u) { red_t[2u * s + sg_id] = c; }
    }
    if (n > 3u) {
        let d = subgroupAdd(q.d);
        if (sg_lane == 0u) { red_t[3u * s + sg_id] = d; }
    }
    if ((params.flags & 4u) != 0u) {
        let ss = subgroupAdd(q.ss);
        if (sg_lane == 0u) { red_t[12u * s + sg_id] = ss; }
    }
}

// #include subgroup_fold.wgsl

// Sums the 16 slots (qa, qb, qc's tokens, then their sums of squares, then a spare) over the
// subgroup in 24 vec4 shuffles on 32 lanes instead of 16 x 5: lanes halve them with lane ^ 1, then
// lane ^ 2 (8 + 4 shuffles), then add their 4 over lane ^ 4, ^ 8, ... Lane l < 4 then holds slots
// 8 (l & 1) + 4 (l >> 1) + 0 .. 3 and stores them for the cross-subgroup sum. Needs subgroups of at
// least 4 lanes, as WebGPU guarantees; a subgroup wider than the workgroup has only WG lanes.
fn reduce_slots(qa: Quad, qb: Quad, qc: Quad, sg_id: u32, sg_lane: u32, sg_size: u32) {
    let u0 = fold(qa.a, qc.a, sg_lane, 1u);
    let u1 = fold(qa.b, qc.b, sg_lane, 1u);
    let u2 = fold(qa.c, qc.c, sg_lane, 1u);
    let u3 = fold(qa.d, qc.d, sg_lane, 1u);
    let u4 = fold(qb.a, qa.ss, sg_lane, 1u);
    let u5 = fold(qb.b, qb.ss, sg_lane, 1u);
    let u6 = fold(qb.c, qc.ss, sg_lane, 1u);
    let u7 = fold(qb.d, vec4<f32>(0.0), sg_lane, 1u);
    var v0 = fold(u0, u4, sg_lane, 2u);
    var v1 = fold(u1, u5, sg_lane, 2u);
    var v2 = fold(u2, u6, sg_lane, 2u);
    var v3 = fold(u3, u7, sg_lane, 2u);
    for (var m = 4u; m < min(sg_size, WG); m <<= 1u) {
        v0 += subgroupShuffleXor(v0, m);
        v1 += subgroupShuffleXor(v1, m);
        v2 += subgroupShuffleXor(v2, m);
        v3 += subgroupShuffleXor(v3, m);
    }
    if (sg_lane < 4u) {
        let s = WG / 4u;
        let slot = 8u * (sg_lane & 1u) + 4u * (sg_lane >> 1u);
        red_t[slot * s + sg_id] = v0;
        red_t[(slot + 1u) * s + sg_id] = v1;
        red_t[(slot + 2u) * s + sg_id] = v2;
        red_t[(slot + 3u) * s + sg_id] = v3;
    }
}

@compute @workgroup_size(WG)
fn matvec_t(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
    @builtin(subgroup_id) sg_id: u32,
    @builtin(num_subgroups) sg_count: u32,
    @builtin(subgroup_invocation_id) sg_lane: u32,
    @builtin(subgroup_size) sg_size: u32,
) {
    let row0 = (wid.x + wid.y * nwg.x) * R;
    if (row0 >= params.rows) {
        return;
    }
    let chunks = (params.cols + 7u) / 8u;
    let last = params.rows - 1u;
    let r1 = min(row0 + 1u, last);
    let r2 = min(row0 + 2u, last);
    let r3 = min(row0 + 3u, last);
    let norm = (params.flags & 4u) != 0u;
    let zero = vec4<f32>(0.0);
    for (var t0 = 0u; t0 < params.tokens; t0 += 4u * Q) {
        // Tokens of each quad in this pass (0 .. 4): a quad computes only its own tokens.
        let left = params.tokens - t0;
        let na = min(left, 4u);
        let nb = select(0u, min(left - 4u, 4u), Q > 1u && left > 4u);
        let nc = select(0u, min(left - 8u, 4u), Q > 2u && left > 8u);
        var qa = Quad(zero, zero, zero, zero, zero);
        var qb = Quad(zero, zero, zero, zero, zero);
        var qc = Quad(zero, zero, zero, zero, zero);
        for (var c8 = lid; c8 < chunks; c8 += WG) {
            let z8 = W8(zero, zero);
            var w0 = load_w8(row0, c8);
            var w1 = z8;
            var w2 = z8;
            var w3 = z8;
            if (R > 1u) {
                w1 = load_w8(r1, c8);
            }
            if (R > 2u) {
                w2 = load_w8(r2, c8);
                w3 = load_w8(r3, c8);
            }
            if (norm) {  // the norm weight goes on the R weight chunks, not on every token
                let n = norm8(c8);
                w0 = W8(w0.a * n.a, w0.b * n.b);
                w1 = W8(w1.a * n.a, w1.b * n.b);
                w2 = W8(w2.a * n.a, w2.b * n.b);
                w3 = W8(w3.a * n.a, w3.b * n.b);
            }
            add_quad(&qa, t0, na, c8, w0, w1, w2, w3);
            if (nb > 0u) {
                add_quad(&qb, t0 + 4u, nb, c8, w0, w1, w2, w3);
            }
            if (nc > 0u) {
                add_quad(&qc, t0 + 8u, nc, c8, w0, w1, w2, w3);
            }
        }
        if (Q == 1u) {  // at most 5 vec4s: one subgroupAdd each
            reduce_quad(qa, na, sg_id, sg_lane);
        } else {
            reduce_slots(qa, qb, qc, sg_id, sg_lane, sg_size);
        }
        workgroupBarrier();
        // Thread i finishes token t0 + i: its R rows.
        let t = t0 + lid;
        if (lid < 4u * Q && t < params.tokens) {
            let s = WG / 4u;
            var total = zero;
            var total_ss = 0.0;
            for (var i = 0u; i < sg_count; i++) {
                total += red_t[lid * s + i];
                total_ss += red_t[(12u + lid / 4u) * s + i][lid % 4u];
            }
            for (var r = 0u; r < R; r++) {
                if (row0 + r < params.rows) {
                    finish(t, row0 + r, total[r], total_ss);
                }
            }
        }
        workgroupBarrier();
    }
}
// #endif
