// matmul_dot.tmpl.wgsl: the integer-dot prefill matmul for the formats with an int8 weight tile
// (kernels.DOT_SCALING: Q8_0, Q5_0, Q4_0, Q4_K, Q4_1, Q5_1, Q6_K), against activations
// matmul_dot_prep.wgsl quantized to int8 blocks of 32. kjarni/gpu/kernels.py renders it per format
// and tile (`kernels.template("matmul_dot", kernels.dot_variant(format, TI), {"idot", "i8tile"})`):
// {{BLOCK}} is the format's block decoder with flags `idot` and `i8tile` (block_<format>.wgsl: the
// weight bindings and fetch_i8(row, p) -> I8Raw / finish_i8(raw) -> I8, piece p = values 16 p ..
// 16 p + 15 of a row as 16 int8 quants, their scale d and min m: value = d q - m); the other fields
// are the thread's registers written out (kernels.dot_fields), and WSTORE how a piece's scale is
// kept: (d, m) per 32 values, or d per 16 values for Q6_K (then the two halves of an x block are
// summed apart, each times its scale).
//
// Math: y[t, row_offset + r] = sum_b dx[t, b] (sum_{c in b} qx[t, c] qw[r, c]) dw[r, b]
//   - mw[r, b] dx[t, b] sum_{c in b} qx[t, c]  (+ bias) (+ residual), over the 32-value blocks b,
//   the integer dots by dot4I8Packed, the rest in f32: x8 @ W^T for x8 = dx qx, the activations as
//   matmul_dot_prep rounded them (NumpyOps(quantize_activations=True) with quantized prefill).
// Bindings and Params: the linear family's (docs/gpu-kernels.md), with x (1) matmul_dot_prep's
// buffer (quants [tokens, cols / 16] vec4<u32>, then from vec4 tokens cols / 16 the (d, d sum q)
// pairs of two blocks a vec4, [tokens, cols / 64]); norm_weight (6) unread (the prep applied it).
// Tile: 256 threads own 64 rows x BM = 16 TI tokens (TI 4 or 8): thread (tx, ty) = (lid % 16,
// lid / 16) tokens ty + 16 i (i < TI) x rows tx + 16 j (j < 4), one vec4 of sums per token. K goes
// 64 values a step through workgroup memory (rows of 4 vec4<u32> quants padded to 5, and per row
// the (d, m) / (d, s) of its two blocks as a vec4<f32>); the next step's loads are issued into
// registers while the current step computes, and the weights' conversion to int8 (finish_i8) runs
// when they are stored at the next (two barriers a step).
// Split K over workgroups (grid z = S > 1): workgroup z takes the z-th of S runs of whole steps and
// writes its partial sums, without bias or residual (the host clears those flags), to y[z tokens +
// t] (y a [S, tokens, y_stride] scratch); matmul_reduce.wgsl adds them.
// Grid: (ceil(rows / 64), ceil(tokens / BM), S). Needs cols % 64 == 0.

// #include linear_structs.wgsl

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> a: array<vec4<u32>>;
@group(0) @binding(4) var<storage, read> bias: array<f32>;
@group(0) @binding(5) var<storage, read> residual: array<f32>;
@group(0) @binding(7) var<storage, read_write> y: array<f32>;

struct I8 {
    q: vec4<u32>,  // 16 int8 quants
    d: f32,
    m: f32,
}

// #include {{BLOCK}}.wgsl

const BN: u32 = 64u;
const BM: u32 = {{BM}}u;
const PAD: u32 = 5u;  // vec4 a tile row: 4, plus 1 against bank conflicts

var<workgroup> xs: array<vec4<u32>, BM * PAD>;
var<workgroup> ws: array<vec4<u32>, BN * PAD>;
var<workgroup> xds: array<vec4<f32>, BM>;  // per token: (d, d sum q) of the step's two blocks
var<workgroup> wds: array<vec4<f32>, BN>;  // per row: (d, m) of the step's two blocks, or d of its 4 pieces

fn idot4(a: vec4<u32>, b: vec4<u32>) -> i32 {
    return dot4I8Packed(a.x, b.x) + dot4I8Packed(a.y, b.y) + dot4I8Packed(a.z, b.z) + dot4I8Packed(a.w, b.w);
}

fn idot8(a0: vec4<u32>, a1: vec4<u32>, b0: vec4<u32>, b1: vec4<u32>) -> i32 {
    return idot4(a0, b0) + idot4(a1, b1);
}

struct Loads {
{{LOADS}}
    xd: vec4<u32>,
    w: I8Raw,
}

// Thread i's share of the step at k0: x quants vec4 i % 4 of tile token i / 4 (and i / 4 + 64
// with TI 8), the scales of tile token i (i < BM), piece i % 4 of tile row i / 4. Tokens and rows
// past the ends are clamped to the last (loaded, never stored).
fn fetch(k0: u32, m0: u32, n0: u32, i: u32) -> Loads {
    let c16 = params.cols / 16u;
    let last = params.tokens - 1u;
    var l = Loads();
{{FETCH}}
    if (i < BM) {
        l.xd = a[params.tokens * c16 + min(m0 + i, last) * (params.cols / 64u) + k0 / 64u];
    }
    l.w = fetch_i8(min(n0 + i / 4u, params.rows - 1u), k0 / 16u + i % 4u);
    return l;
}

fn store(l: Loads, i: u32) {
{{STORE}}
    if (i < BM) {
        xds[i] = bitcast<vec4<f32>>(l.xd);
    }
    let w = finish_i8(l.w);
    let r = i / 4u;
    let p = i % 4u;
    ws[r * PAD + p] = w.q;
{{WSTORE}}
}

// Token t, rows r0 + 16 j: acc[j] (+ bias) (+ residual), into split z's part of y.
fn put(z: u32, t: u32, r0: u32, acc: vec4<f32>) {
    if (t >= params.tokens) {
        return;
    }
    for (var j = 0u; j < 4u; j++) {
        let r = r0 + 16u * j;
        if (r < params.rows) {
            let col = params.row_offset + r;
            let i = (z * params.tokens + t) * params.y_stride + col;
            var o = acc[j];
            if ((params.flags & 1u) != 0u) {
                o += bias[col];
            }
            if ((params.flags & 2u) != 0u) {
                o += residual[i];
            }
            y[i] = o;
        }
    }
}

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let n0 = wid.x * BN;
    let m0 = wid.y * BM;
    let tx = lid % 16u;
    let ty = lid / 16u;
    let steps = params.cols / 64u;
    let per = (steps + nwg.z - 1u) / nwg.z;
    let first = min(wid.z * per, steps) * 64u;
    let end = min((wid.z + 1u) * per, steps) * 64u;
{{ACC}}
    var next = Loads();
    if (first < end) {  // an empty split (more splits than steps) loads nothing and writes zeros
        next = fetch(first, m0, n0, lid);
    }
    for (var k0 = first; k0 < end; k0 += 64u) {
        workgroupBarrier();
        store(next, lid);
        workgroupBarrier();
        if (k0 + 64u < end) {
            next = fetch(k0 + 64u, m0, n0, lid);
        }
        {
{{BODY}}
        }
    }
{{PUT}}
}
