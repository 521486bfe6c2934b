// matvec_f16.tmpl.wgsl: the decode matrix-vector product (one token) by f16 weights, written to
// read the weights at HBM speed. kjarni/gpu/kernels.py renders one variant per (R rows a group,
// UN units a trip): `kernels.template("matvec_f16", "r<R>u<UN>", flags)`, whose fields ROWS, FULL
// and TAIL are that many loads and sums written out (`matvec_f16_fields`), so every
// weight load of a trip is a register issued before any is used.
//
// y[row_offset + r] = s sum_c v[c] W[r, c] (+ bias[row_offset + r]) (+ residual[row_offset + r]),
// v = x, or silu(gate) * up with flags bit 3 ([gate | up], 2 cols), times norm_weight with flags
// bit 2; s = 1, or 1 / sqrt(mean(v_unweighted^2) + eps) with flags bit 2 (the fused RMSNorm).
// Bindings and Params: the linear family's (docs/gpu-kernels.md), x and norm_weight read as vec4;
// the weight is block_f16.wgsl's rows of 8-value vec4<u32> units.
//
// Phase 1 (every thread): v, vec4 i = lid, lid + WG, .., into workgroup memory (xs, XV >= cols / 4
// vec4s), the sum of squares through subgroupAdd and workgroup memory; one barrier. With flag
// `attn` (o_proj after a split attention_step.wgsl) x is that kernel's partials, SPLITS runs per
// head of HD4 vec4 outputs o_s then (m_s, l_s, 0, 0), and v[h, :] = sum_s e^(m_s - M) o_s /
// sum_s e^(m_s - M) l_s (M = max_s m_s), merged here once per workgroup.
// Phase 2: WG / LANES row groups of LANES lanes, a group owning R consecutive rows of a row set
// (rows past the end clamped to the last: loaded, not written); workgroups stride over the row
// sets (the grid may be capped below their count). Lanes stride over the row's units, UN a trip
// while UN whole units remain, then one a trip. Sums go over the group with subgroupShuffleXor,
// then through workgroup memory (double-buffered by row set) when a group spans subgroups.
// Flag `glu` (a one-token SwiGLU MLP's gate_up, kjarni/gpu/linear.py `Linear.record_swiglu`): the
// weight is [gate | up] stacked (rows = 2 I), a group's R rows are R / 2 rows of gate and the same
// rows of up (R even), and lane 0 writes y[row_offset + i] = silu(g_i) u_i for i < I (no bias or
// residual), so the down projection reads a plain x (no silu recomputed, half the bytes, in every
// one of its workgroups).
// Every index is in range by construction (rows clamped, units below cols / 8, xs below cols / 4),
// so kjarni compiles it without naga's runtime checks (GpuTuning.matvec_f16_unchecked).
// Grid: up to (min(n, 32768), ceil(n / 32768)) for n row sets; any smaller grid is correct.
// Needs the device feature "subgroup"; cols a multiple of 8; 4 cols + 2304 bytes of workgroup memory.

// #include linear_structs.wgsl

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read> bias: array<f32>;
@group(0) @binding(5) var<storage, read> residual: array<f32>;
@group(0) @binding(6) var<storage, read> norm_weight: array<vec4<f32>>;
@group(0) @binding(7) var<storage, read_write> y: array<f32>;

// #include block_f16.wgsl

override WG: u32 = 128u;
override LANES: u32 = 32u;
override XV: u32 = 256u;  // capacity of xs in vec4s: cols / 4 or more
// #if attn
override SPLITS: u32 = 8u;
override HD4: u32 = 16u;
// #endif
// (Every override is declared before the array sized by XV: naga 29 panics otherwise.)
const R: u32 = {{R}}u;
const UN: u32 = {{UN}}u;
// #if glu
const RG: u32 = R / 2u;  // output rows a group: of gate, then the same of up
// #else
const RG: u32 = R;
// #endif

var<workgroup> xs: array<vec4<f32>, XV>;
const MAX_SUBGROUPS: u32 = 64u;  // 256 threads in subgroups of 4, WebGPU's smallest
var<workgroup> part: array<vec4<f32>, 2u * MAX_SUBGROUPS>;  // double-buffered by row set
var<workgroup> part_ss: array<f32, MAX_SUBGROUPS>;

// v[4 i .. 4 i + 3] before the norm weight: x, silu(gate) * up, or the merged attention output.
fn load_v(i: u32) -> vec4<f32> {
// #if attn
    // One pass, the running max rescaling the sums: every split's loads are independent.
    let first = (i / HD4) * SPLITS;
    var m = -3.0e38;
    var l = 0.0;
    var o = vec4<f32>(0.0);
    for (var s = 0u; s < SPLITS; s++) {
        let run = (first + s) * (HD4 + 1u);
        let ml = x[run + HD4];
        let v = x[run + i % HD4];
        let m_new = max(m, ml.x);
        let c = exp(m - m_new);
        let e = exp(ml.x - m_new);
        l = l * c + e * ml.y;
        o = o * c + e * v;
        m = m_new;
    }
    return o / l;
// #else
    if ((params.flags & 8u) != 0u) {
        let g = x[i];
        return g / (1.0 + exp(-g)) * x[params.cols / 4u + i];
    }
    return x[i];
// #endif
}

// The weight row loaded as row i of a group whose first output row is row0 (clamped to the last
// row, of its half with glu).
fn weight_row(row0: u32, i: u32) -> u32 {
// #if glu
    let half = params.rows / 2u;
    return min(row0 + i % RG, half - 1u) + (i / RG) * half;
// #else
    return min(row0 + i, params.rows - 1u);
// #endif
}

// Unit u of a row (8 halves) times v[8 u .. 8 u + 7].
fn dot8(q: vec4<u32>, u: u32) -> f32 {
    return dot(vec4<f32>(unpack2x16float(q.x), unpack2x16float(q.y)), xs[2u * u])
         + dot(vec4<f32>(unpack2x16float(q.z), unpack2x16float(q.w)), xs[2u * u + 1u]);
}

@compute @workgroup_size(WG)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
    @builtin(subgroup_id) sg_id: u32,
    @builtin(subgroup_invocation_id) sg_lane: u32,
    @builtin(subgroup_size) sg_size: u32,
) {
    let norm = (params.flags & 4u) != 0u;
    // Phase 1: v into workgroup memory.
    let nv4 = params.cols / 4u;
    var ss = 0.0;
    for (var i = lid; i < nv4; i += WG) {
        var v = load_v(i);
        if (norm) {
            ss += dot(v, v);
            v *= norm_weight[i];
        }
        xs[i] = v;
    }
    ss = subgroupAdd(ss);
    if (sg_lane == 0u) {
        part_ss[sg_id] = ss;
    }
    workgroupBarrier();
    var scale = 1.0;
    if (norm) {
        var total = 0.0;
        for (var i = 0u; i < (WG + sg_size - 1u) / sg_size; i++) {
            total += part_ss[i];
        }
        scale = inverseSqrt(total / f32(params.cols) + params.eps);
    }

    // Phase 2: the rows.
    let groups = WG / LANES;
    let group = lid / LANES;
    let lane = lid % LANES;
    let units = params.cols / 8u;
    let stride = units;
// #if glu
    let out_rows = params.rows / 2u;
// #else
    let out_rows = params.rows;
// #endif
    let sets = (out_rows + RG * groups - 1u) / (RG * groups);
    let spans = LANES > sg_size;  // a row group spans LANES / sg_size subgroups
    let width = min(LANES, sg_size);
    var parity = 0u;
    for (var rs = wid.x + wid.y * nwg.x; rs < sets; rs += nwg.x * nwg.y) {
        let row0 = (rs * groups + group) * RG;
{{ROWS}}
        var s = vec4<f32>(0.0);
        var u = lane;
        for (; u + (UN - 1u) * LANES < units; u += UN * LANES) {
{{FULL}}
        }
        for (; u < units; u += LANES) {
{{TAIL}}
        }
        for (var m = 1u; m < width; m <<= 1u) {
            s += subgroupShuffleXor(s, m);
        }
        if (spans) {
            if (sg_lane == 0u) {
                part[parity * MAX_SUBGROUPS + sg_id] = s;
            }
            workgroupBarrier();
            if (lane == 0u) {
                let first = parity * MAX_SUBGROUPS + lid / sg_size;
                for (var i = 1u; i < LANES / sg_size; i++) {
                    s += part[first + i];
                }
            }
            parity ^= 1u;
        }
        if (lane == 0u) {
// #if glu
            for (var i = 0u; i < RG; i++) {
                if (row0 + i < out_rows) {
                    let g = s[i] * scale;
                    y[params.row_offset + row0 + i] = g / (1.0 + exp(-g)) * (s[i + RG] * scale);
                }
            }
// #else
            for (var i = 0u; i < R; i++) {
                let row = row0 + i;
                if (row < params.rows) {
                    let out = params.row_offset + row;
                    var v = s[i] * scale;
                    if ((params.flags & 1u) != 0u) {
                        v += bias[out];
                    }
                    if ((params.flags & 2u) != 0u) {
                        v += residual[out];
                    }
                    y[out] = v;
                }
            }
// #endif
        }
    }
}
