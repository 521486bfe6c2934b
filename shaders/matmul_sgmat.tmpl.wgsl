// matmul_sgmat: prefill y = rms_norm?(x) @ W.T (+ bias) (+ residual) for many tokens on tensor
// cores (Dawn's chromium_experimental_subgroup_matrix), W in f16, x rounded to f16, f32 sums.
// Bindings and Params: the linear family (docs/gpu-kernels.md); w_a as in matmul_f16.wgsl (rows of
// f16 pairs, one vec4<u32> = 8 weights), w_b unused. Needs cols % BK == 0 and subgroups of SG.
// Math: a[t, c] = f16(x[t, c] s_t nw[c]) (s_t, nw: the fused rms norm of flags bit 2, else 1; with
//   bit 3, x[t, c] = silu(gate) up of x = [gate | up]), y[t, row_offset + r] = sum_c a[t, c] W[r, c]
//   in f32 (+ bias) (+ residual): what NumpyOps(activations="f16") computes.
// Tile: a workgroup of SM x SN subgroups owns BM tokens x BN rows; subgroup (sm, sn) owns TMT x TNT
//   16 x 16 result matrices (tokens sm BM / SM .., rows sn BN / SN ..). K goes BK columns a step
//   through workgroup memory as f16 ([token][k] and [row][k], rows padded by 8 halves); each thread
//   loads NX vec4 of x and NW vec4<u32> of W a step, issued before the step's products and stored
//   (converted) at the next. The per-token rms scale is computed first (a subgroup per token row).
//   The results leave through a 16 x 16 f32 tile per subgroup in workgroup memory (bias, residual
//   and bounds applied there).
// Split K (grid z = S > 1): workgroup z takes the z-th run of ceil(steps / S) K steps and writes its
//   partial sums without bias or residual (the host clears those flags) to y[z tokens + t] (a
//   [S, tokens, y_stride] scratch) for matmul_reduce.wgsl; the norm's scale still covers whole rows.
// Grid: (ceil(rows / BN), ceil(tokens / BM), S); SM SN SG threads. Fields: BM, BN, BK, SM, SN, SG and
//   the register code written out per tile by kernels.sgmat_fields (XDECL, XLOADN, XSTORE,
//   WDECL, WLOADN, WSTORE, ACC, MMA, OUT): no private arrays indexed in loops, which the
//   driver may leave in local memory.

enable f16;
enable subgroups;
enable chromium_experimental_subgroup_matrix;

// #include linear_structs.wgsl

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> w_a: array<vec4<u32>>;
@group(0) @binding(4) var<storage, read> bias: array<f32>;
@group(0) @binding(5) var<storage, read> residual: array<f32>;
@group(0) @binding(6) var<storage, read> norm_weight: array<vec4<f32>>;
@group(0) @binding(7) var<storage, read_write> y: array<f32>;

const BM: u32 = {{BM}}u;
const BN: u32 = {{BN}}u;
const BK: u32 = {{BK}}u;
const SM: u32 = {{SM}}u;
const SN: u32 = {{SN}}u;
const SG: u32 = {{SG}}u;
const WG: u32 = SM * SN * SG;
const TMT: u32 = BM / (16u * SM);
const TNT: u32 = BN / (16u * SN);
const LDS: u32 = BK + 8u;
const NX: u32 = BM * BK / 4u / WG;
const NW: u32 = BN * BK / 8u / WG;

var<workgroup> xs: array<f16, BM * LDS>;
var<workgroup> ws: array<f16, BN * LDS>;
var<workgroup> cs: array<f32, SM * SN * 256u>;
var<workgroup> scale: array<f32, BM>;

fn silu_mul4(g: vec4<f32>, u: vec4<f32>) -> vec4<f32> {
    return g / (vec4<f32>(1.0) + exp(-g)) * u;
}

@compute @workgroup_size(WG)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
    @builtin(subgroup_id) sg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
) {
    let r0 = wid.x * BN;
    let t0 = wid.y * BM;
    let cols = params.cols;
    let tokens = params.tokens;
    let rows = params.rows;
    let silu = (params.flags & 8u) != 0u;
    let norm = (params.flags & 4u) != 0u;
    let c4s = cols / 4u;
    let xrs = select(c4s, 2u * c4s, silu);  // x row stride in vec4
    let up = select(0u, c4s, silu);         // offset of up within a row
    let wrs = cols / 8u;                    // W row stride in vec4<u32>

    // The fused norm's scale per token row: a subgroup per row, lanes over its vec4s.
    if (norm) {
        for (var i = sg; i < BM; i += SM * SN) {
            let t = min(t0 + i, tokens - 1u);
            var s = 0.0;
            for (var c = lane; c < c4s; c += SG) {
                var v = x[t * xrs + c];
                if (silu) {
                    v = silu_mul4(v, x[t * xrs + up + c]);
                }
                s += dot(v, v);
            }
            s = subgroupAdd(s);
            if (lane == 0u) {
                scale[i] = 1.0 / sqrt(s / f32(cols) + params.eps);
            }
        }
    } else {
        for (var i = lid; i < BM; i += WG) {
            scale[i] = 1.0;
        }
    }
    workgroupBarrier();

    // K steps of this workgroup (all of them unless split over grid z).
    let steps = cols / BK;
    let per = (steps + nwg.z - 1u) / nwg.z;
    let k_begin = min(steps, wid.z * per) * BK;
    let k_end = min(steps, wid.z * per + per) * BK;
    let t_out = wid.z * tokens;  // the partial's first row of y when split

    // This thread's loads of a step: x vec4 q = lid + j WG is token q / (BK / 4), vec4 q % (BK / 4);
    // W vec4<u32> q is row q / (BK / 8), chunk q % (BK / 8). Loaded before the step's products,
    // converted and stored at the next step.
    let xq_t = lid / (BK / 4u);
    let xq_c = lid % (BK / 4u);
    let wq_r = lid / (BK / 8u);
    let wq_c = lid % (BK / 8u);
{{XDECL}}
{{WDECL}}
    var kn = k_begin;
    if (kn < k_end) {
{{XLOADN}}
{{WLOADN}}
    }
{{ACC}}
    let sm = sg / SN;
    let sn = sg % SN;
    let xb = sm * TMT * 16u * LDS;
    let wb = sn * TNT * 16u * LDS;

    for (var k0 = k_begin; k0 < k_end; k0 += BK) {
{{XSTORE}}
{{WSTORE}}
        workgroupBarrier();
        kn = k0 + BK;
        if (kn < k_end) {
{{XLOADN}}
{{WLOADN}}
        }
{{MMA}}
        workgroupBarrier();
    }

    // Out through this subgroup's 16 x 16 tile of workgroup memory: bounds, bias, residual.
{{OUT}}
}

// Writes result tile (i, j) of subgroup sg: rows t0 + ti .. of y (t_out more when split).
fn write_tile(m: subgroup_matrix_result<f32, 16, 16>, sg: u32, lane: u32, tb: u32, rb: u32, t_out: u32) {
    subgroupMatrixStore<row_major>(&cs, sg * 256u, m, 16u);
    workgroupBarrier();
    let tokens = params.tokens;
    let has_bias = (params.flags & 1u) != 0u;
    let has_residual = (params.flags & 2u) != 0u;
    for (var e = lane; e < 256u; e += SG) {
        let t = tb + e / 16u;
        let r = rb + e % 16u;
        if (t < tokens && r < params.rows) {
            let o = params.row_offset + r;
            var v = cs[sg * 256u + e];
            if (has_bias) {
                v += bias[o];
            }
            if (has_residual) {
                v += residual[t * params.y_stride + o];
            }
            y[(t_out + t) * params.y_stride + o] = v;
        }
    }
    workgroupBarrier();
}
