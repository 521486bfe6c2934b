// matmul_tc: prefill y = a @ W.T (+ bias) (+ residual) on tensor cores (Dawn's
// chromium_experimental_subgroup_matrix, f16 x f16 -> f32 16x16x16), a the f16 activations that
// matmul_tc_prep.wgsl wrote (norm, silu_mul and the f16 rounding done there), W in f16 or in a
// GGUF block format (the variants named .<format>, SHARED only): then each step's BN x BK weight
// tile is dequantized by the format's block decoder (the WEIGHT field pastes it: fetch_w8 / finish_w8,
// 8 values a chunk) and rounded to f16 as it is stored to workgroup memory, so the MMA is the f16
// one and no f16 copy of the weight exists outside the workgroup (NumpyOps(weight_format="f16",
// activations="f16") rounds the same way).
// Bindings and Params: the linear family (docs/gpu-kernels.md); x is a ([tokens, cols] f16), w_a
// the f16 weight ([rows, cols]) read as f16, or w_a / w_b the repacked blocks (kjarni/gpu/quant.py);
// norm_weight unused.
// Needs (the host checks): tokens >= 16, rows, row_offset and y_stride multiples of 16, cols of BK.
// Every 16 x 16 matrix then lies inside the product: the last ones along tokens start at
// tokens - 16 (overlapping their neighbours, which write the same values), so no load or store
// leaves its buffer and none needs a bounds check, and each is aligned to 16 elements.
// Tile: a workgroup of SM x SN subgroups; subgroup (sm, sn) owns TM x TN result matrices (tokens
// from (wy SM + sm) TM 16, rows from (wx SN + sn) TN 16). K runs BK = 16 KU columns a step.
// SHARED 0: each subgroup loads its TM left and TN right matrices straight from storage (L1/L2
// serve the neighbours' reuse). SHARED 1: the workgroup's BM x BK and BN x BK operand tiles are
// copied to workgroup memory by matrix loads and stores spread over the subgroups (prefetched one
// step ahead into registers), and every subgroup reads its operands from there. SHARED 2: the
// same tiles, copied by the threads in 16-byte chunks (x and an f16 w_a then read as vec4<u32>,
// stored to workgroup memory as 8 f16 values), as quantized weight tiles always are. SHARED 3:
// SHARED 2 with two tiles of each operand: step s's products read tile s % 2 while step s + 1's
// registers are stored into the other and step s + 2's loads are issued, one barrier a step
// (twice the workgroup memory). SHARED 5: SHARED 3 with xs / ws declared as vec4<u32> (a chunk is
// one 16-byte store), the matrix loads given offsets and strides in vec4<u32> elements, as Dawn
// reads them (kjarni/gpu/kernels.py, TC_TILES).
// Results start from the residual (loaded as a result matrix) or, with a bias, from bias +
// residual written to workgroup memory; they are stored straight to y.
// Split K (grid z = S > 1): workgroup z takes the z-th run of ceil(steps / S) K steps and stores
// its partial sums without bias or residual (the host clears those flags) to rows z tokens + t of
// a [S, tokens, y_stride] scratch, summed by matmul_reduce.wgsl.
// Grid: (ceil(rows / BN), ceil(tokens / BM), S), or with the flag tokens_first (ceil(tokens / BM),
// ceil(rows / BN), S); SM SN SG threads. Fields: TM, TN, SM, SN, KU,
// SG, X (the activations' binding) and the per-matrix code written out by kernels.tc_fields (DECL,
// INIT, PRE, STEP, STORE): no private arrays indexed in loops. Chunk copies (quantized weights,
// SHARED 2): thread i of the workgroup (sg SG + lane) copies chunks i, i + WG, .. of the tile (row
// chunk / (BK / 8), columns 8 (chunk % (BK / 8)) ..).

enable f16;
enable subgroups;
enable chromium_experimental_subgroup_matrix;

// #include linear_structs.wgsl

@group(0) @binding(0) var<uniform> params: Params;
{{X}}
{{WEIGHT}}
@group(0) @binding(4) var<storage, read> bias: array<f32>;
@group(0) @binding(5) var<storage, read> residual: array<f32>;
// #if silu
@group(0) @binding(7) var<storage, read_write> y: array<vec2<f16>>;
// #else
@group(0) @binding(7) var<storage, read_write> y: array<f32>;
// #endif

const TM: u32 = {{TM}}u;
const TN: u32 = {{TN}}u;
const SM: u32 = {{SM}}u;
const SN: u32 = {{SN}}u;
const KU: u32 = {{KU}}u;
const SG: u32 = {{SG}}u;
const NSG: u32 = SM * SN;
const WG: u32 = NSG * SG;
const BM: u32 = SM * TM * 16u;
const BN: u32 = SN * TN * 16u;
const BK: u32 = 16u * KU;
const LDS: u32 = BK + 8u;  // workgroup rows padded by 8 halves

// Bias (+ residual) of one result matrix, staged per subgroup.
var<workgroup> cs: array<f32, NSG * 256u>;
{{SHMEM}}

// The first token of result matrix i of subgroup row sm (clamped into the product).
fn tok(wy: u32, sm: u32, i: u32) -> u32 {
    return min((wy * SM + sm) * TM * 16u + i * 16u, params.tokens - 16u);
}

// The first weight row (within the segment) of result matrix j of subgroup column sn; j may run
// past TN into the next subgroup columns (the operand copies count the workgroup's matrices so).
fn row(wx: u32, sn: u32, j: u32) -> u32 {
// #if silu
    // Matrices 0 .. TN / 2 of a subgroup column are gate rows, the others the up rows of the same
    // outputs, params.rows / 2 further down [gate | up].
    let half = params.rows / 2u;
    let s = wx * SN + sn + j / TN;
    let jj = j % TN;
    return min(s * TN * 8u + jj % (TN / 2u) * 16u, half - 16u) + jj / (TN / 2u) * half;
// #else
    return min((wx * SN + sn) * TN * 16u + j * 16u, params.rows - 16u);
// #endif
}
// #if silu

const_assert TN % 2u == 0u;  // matrix j of a subgroup column pairs with j + TN / 2

// Values 2 p and 2 p + 1 of the result matrix this subgroup last stored to cs (row-major).
fn cs_pair(sg: u32, p: u32) -> vec2<f32> {
    return vec2<f32>(cs[sg * 256u + 2u * p], cs[sg * 256u + 2u * p + 1u]);
}

// silu(g) u rounded to f16 (as matmul_tc_prep.wgsl computes it), two outputs of a result matrix
// pair at a time: pair p of the 16 x 16 matrix at tokens t.., outputs c.. of y ([tokens,
// params.rows / 2] f16, read in pairs).
fn silu_out(t: u32, c: u32, p: u32, g: vec2<f32>, u: vec2<f32>) {
    let o = (t + p / 8u) * (params.rows / 2u) + c + 2u * (p % 8u);
    y[o / 2u] = vec2<f16>(g / (vec2<f32>(1.0) + exp(-g)) * u);
}
// #endif

// A result matrix holding bias (+ residual) at tokens t.., rows r..: through this subgroup's cs.
fn bias_tile(sg: u32, lane: u32, t: u32, r: u32) -> subgroup_matrix_result<f32, 16, 16> {
    let has_residual = (params.flags & 2u) != 0u;
    let o = params.row_offset + r;
    for (var e = lane; e < 256u; e += SG) {
        var v = bias[o + e % 16u];
        if (has_residual) {
            v += residual[(t + e / 16u) * params.y_stride + o + e % 16u];
        }
        cs[sg * 256u + e] = v;
    }
    workgroupBarrier();
    let m = subgroupMatrixLoad<subgroup_matrix_result<f32, 16, 16>, row_major>(&cs, sg * 256u, 16u);
    workgroupBarrier();
    return m;
}

@compute @workgroup_size(WG)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(subgroup_id) sg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
) {
    let cols = params.cols;
    let ys = params.y_stride;
    let sm = sg / SN;
    let sn = sg % SN;
    // The workgroup's row tile (wx) and token tile (wy). tokens_first: the grid is (token tiles,
    // row tiles), so the workgroups that share a weight tile run next to each other (meant to serve
    // its later reads from L2; on an H100 it was never faster: GpuTuning.tc_tokens_first).
// #if tokens_first
    let wx = wid.y;
    let wy = wid.x;
// #else
    let wx = wid.x;
    let wy = wid.y;
// #endif
    let steps = cols / BK;
    let per = (steps + nwg.z - 1u) / nwg.z;
    let k_begin = min(steps, wid.z * per) * BK;
    let k_end = min(steps, wid.z * per + per) * BK;
    let t_out = wid.z * params.tokens;  // the partial's first row of y when split
    let has_bias = (params.flags & 1u) != 0u;
    let has_residual = (params.flags & 2u) != 0u;
{{DECL}}
{{INIT}}
{{PRE}}
    for (var k0 = k_begin; k0 < k_end; k0 += BK) {
{{STEP}}
    }
// #if silu
{{STORE_SILU}}
// #else
{{STORE}}
// #endif
}
