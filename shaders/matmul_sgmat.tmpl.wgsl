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
// Grid: (ceil(rows / BN), ceil(tokens / BM), 1); SM SN SG threads. Fields: BM, BN, BK, SM, SN, SG.

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

    // This thread's loads of a step: x vec4 q = lid + j WG is token q / (BK / 4), vec4 q % (BK / 4);
    // W vec4<u32> q is row q / (BK / 8), chunk q % (BK / 8).
    var xr: array<vec4<f32>, NX>;
    var ur: array<vec4<f32>, NX>;
    var nr: array<vec4<f32>, NX>;
    var wr: array<vec4<u32>, NW>;
    for (var j = 0u; j < NX; j++) {
        let q = lid + j * WG;
        let t = t0 + q / (BK / 4u);
        let c = q % (BK / 4u);
        xr[j] = vec4<f32>(0.0);
        ur[j] = vec4<f32>(1.0);
        nr[j] = vec4<f32>(1.0);
        if (t < tokens) {
            xr[j] = x[t * xrs + c];
            if (silu) {
                ur[j] = x[t * xrs + up + c];
            }
        }
        if (norm) {
            nr[j] = norm_weight[c];
        }
    }
    for (var j = 0u; j < NW; j++) {
        let q = lid + j * WG;
        let r = r0 + q / (BK / 8u);
        wr[j] = vec4<u32>(0u);
        if (r < rows) {
            wr[j] = w_a[r * wrs + q % (BK / 8u)];
        }
    }

    var acc: array<subgroup_matrix_result<f32, 16, 16>, TMT * TNT>;
    for (var i = 0u; i < TMT * TNT; i++) {
        acc[i] = subgroup_matrix_result<f32, 16, 16>();
    }
    let sm = sg / SN;
    let sn = sg % SN;
    let xb = sm * TMT * 16u * LDS;
    let wb = sn * TNT * 16u * LDS;

    for (var k0 = 0u; k0 < cols; k0 += BK) {
        // Store the loaded step, converted to f16.
        for (var j = 0u; j < NX; j++) {
            let q = lid + j * WG;
            let t = q / (BK / 4u);
            var v = xr[j];
            if (silu) {
                v = silu_mul4(v, ur[j]);
            }
            let h = vec4<f16>(v * scale[t] * nr[j]);
            let o = t * LDS + 4u * (q % (BK / 4u));
            xs[o] = h.x;
            xs[o + 1u] = h.y;
            xs[o + 2u] = h.z;
            xs[o + 3u] = h.w;
        }
        for (var j = 0u; j < NW; j++) {
            let q = lid + j * WG;
            let o = (q / (BK / 8u)) * LDS + 8u * (q % (BK / 8u));
            let a = bitcast<vec2<f16>>(wr[j].x);
            let b = bitcast<vec2<f16>>(wr[j].y);
            let c = bitcast<vec2<f16>>(wr[j].z);
            let d = bitcast<vec2<f16>>(wr[j].w);
            ws[o] = a.x;
            ws[o + 1u] = a.y;
            ws[o + 2u] = b.x;
            ws[o + 3u] = b.y;
            ws[o + 4u] = c.x;
            ws[o + 5u] = c.y;
            ws[o + 6u] = d.x;
            ws[o + 7u] = d.y;
        }
        workgroupBarrier();
        // Issue the next step's loads before this step's products.
        let kn = k0 + BK;
        if (kn < cols) {
            for (var j = 0u; j < NX; j++) {
                let q = lid + j * WG;
                let t = t0 + q / (BK / 4u);
                let c = kn / 4u + q % (BK / 4u);
                if (t < tokens) {
                    xr[j] = x[t * xrs + c];
                    if (silu) {
                        ur[j] = x[t * xrs + up + c];
                    }
                }
                if (norm) {
                    nr[j] = norm_weight[c];
                }
            }
            for (var j = 0u; j < NW; j++) {
                let q = lid + j * WG;
                let r = r0 + q / (BK / 8u);
                if (r < rows) {
                    wr[j] = w_a[r * wrs + kn / 8u + q % (BK / 8u)];
                }
            }
        }
        for (var kk = 0u; kk < BK; kk += 16u) {
            var a: array<subgroup_matrix_left<f16, 16, 16>, TMT>;
            var b: array<subgroup_matrix_right<f16, 16, 16>, TNT>;
            for (var i = 0u; i < TMT; i++) {
                a[i] = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&xs, xb + i * 16u * LDS + kk, LDS);
            }
            for (var j = 0u; j < TNT; j++) {
                b[j] = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&ws, wb + j * 16u * LDS + kk, LDS);
            }
            for (var i = 0u; i < TMT; i++) {
                for (var j = 0u; j < TNT; j++) {
                    acc[i * TNT + j] = subgroupMatrixMultiplyAccumulate(a[i], b[j], acc[i * TNT + j]);
                }
            }
        }
        workgroupBarrier();
    }

    // Out through this subgroup's 16 x 16 tile of workgroup memory: bounds, bias, residual.
    let has_bias = (params.flags & 1u) != 0u;
    let has_residual = (params.flags & 2u) != 0u;
    for (var i = 0u; i < TMT; i++) {
        for (var j = 0u; j < TNT; j++) {
            subgroupMatrixStore<row_major>(&cs, sg * 256u, acc[i * TNT + j], 16u);
            workgroupBarrier();
            for (var e = lane; e < 256u; e += SG) {
                let t = t0 + (sm * TMT + i) * 16u + e / 16u;
                let r = r0 + (sn * TNT + j) * 16u + e % 16u;
                if (t < tokens && r < rows) {
                    let o = params.row_offset + r;
                    var v = cs[sg * 256u + e];
                    if (has_bias) {
                        v += bias[o];
                    }
                    if (has_residual) {
                        v += residual[t * params.y_stride + o];
                    }
                    y[t * params.y_stride + o] = v;
                }
            }
            workgroupBarrier();
        }
    }
}
