// matvec.tmpl.wgsl: the decode matrix-vector product (one token) for every weight format.
// kjarni/gpu/kernels.py renders it per format (`kernels.template("matvec", format)`): {{BLOCK}} is
// the format's block decoder (kernels.BLOCKS: block_<format>.wgsl, which declares w_a / w_b and
// defines UNIT, unit_values(row, u) and unit_col(u, k)).
//
// y[row_offset + r] = sum_c xn[c] W[r, c] (+ bias[row_offset + r]) (+ residual[row_offset + r]),
// xn = x, or x / sqrt(mean(x^2) + eps) * norm_weight with flags bit 2; with flags bit 3 x is
// [gate | up] (2 cols) and the product reads silu(gate) * up.
// Bindings and Params: the linear family's (docs/gpu-kernels.md), x and norm_weight read as vec4.
//
// A workgroup of WG threads is WG / LANES row groups of LANES lanes; a row group owns R (1, 2 or
// 4) consecutive rows. Lanes stride over the row's units (UNIT values), UN (1 or 2) units a trip,
// every weight load of the trip (R rows x UN units) issued before any is used; each x vec4 is
// loaded once for the R rows. Sums go over the row group's lanes with subgroupShuffleXor (lanes
// l ^ m for m < min(LANES, subgroup size)), then through workgroup memory when a row group spans
// several subgroups. Lane 0 of the group finishes its R rows.
// Grid: n = ceil(rows / (R WG / LANES)) workgroups folded as (min(n, 32768), ceil(n / 32768)).
// Needs the device feature "subgroup"; cols a multiple of 8 (and of the format's block).
//
// Flag `attn` (o_proj after a split attention_step.wgsl): x is that kernel's partials, SPLITS
// runs per head of HD4 vec4 outputs o_s then (m_s, l_s, 0, 0), and the product reads
// x[h, :] = sum_s e^(m_s - M) o_s / sum_s e^(m_s - M) l_s (M = max_s m_s), merged once per
// workgroup into workgroup memory before the loop (cols at most 4 MAX_XA).

// #include linear_structs.wgsl

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read> bias: array<f32>;
@group(0) @binding(5) var<storage, read> residual: array<f32>;
@group(0) @binding(6) var<storage, read> norm_weight: array<vec4<f32>>;
@group(0) @binding(7) var<storage, read_write> y: array<f32>;

// #include {{BLOCK}}.wgsl

override WG: u32 = 128u;
override LANES: u32 = 32u;
override R: u32 = 4u;
override UN: u32 = 2u;

const MAX_SUBGROUPS: u32 = 64u;  // 256 threads in subgroups of 4, WebGPU's smallest
var<workgroup> part: array<vec4<f32>, MAX_SUBGROUPS>;
var<workgroup> part_ss: array<f32, MAX_SUBGROUPS>;

alias Unit = array<vec4<f32>, UNIT / 4u>;

// #if attn
override SPLITS: u32 = 8u;
override HD4: u32 = 16u;
const MAX_XA: u32 = 1024u;
var<workgroup> xa: array<vec4<f32>, MAX_XA>;

// The merged attention output, vec4 i = 4i .. of head i / HD4, into xa (every thread calls it).
fn merge_attention(lid: u32) {
    for (var i = lid; i < params.cols / 4u; i += WG) {
        // One pass, the running max rescaling the sums: every split's loads are independent of
        // the others' values, so all are in flight at once (a max pass first cost a round trip).
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
        xa[i] = o / l;
    }
    workgroupBarrier();
}
// #endif

struct Acc {
    s: vec4<f32>,  // rows 0 .. 3 of the group
    ss: f32,       // sum of squares of x (fused norm)
}

// x[c .. c + 3] as the product reads it: silu(gate) * up with flags bit 3.
fn x4(c: u32) -> vec4<f32> {
// #if attn
    return xa[c / 4u];
// #else
    if ((params.flags & 8u) != 0u) {
        let g = x[c / 4u];
        return g / (1.0 + exp(-g)) * x[(params.cols + c) / 4u];
    }
    return x[c / 4u];
// #endif
}

// Adds unit u of the R rows (values w0 .. w3) times x to the sums.
fn add_unit(acc: ptr<function, Acc>, u: u32, w0: Unit, w1: Unit, w2: Unit, w3: Unit) {
    let norm = (params.flags & 4u) != 0u;
    for (var k = 0u; k < UNIT / 4u; k++) {
        let c = unit_col(u, k);
        var v = x4(c);
        if (norm) {
            (*acc).ss += dot(v, v);
            v *= norm_weight[c / 4u];
        }
        var s = vec4<f32>(dot(w0[k], v), 0.0, 0.0, 0.0);
        if (R > 1u) {
            s.y = dot(w1[k], v);
        }
        if (R > 2u) {
            s.z = dot(w2[k], v);
            s.w = dot(w3[k], v);
        }
        (*acc).s += s;
    }
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
    let group = lid / LANES;
    let lane = lid % LANES;
    let row0 = ((wid.x + wid.y * nwg.x) * (WG / LANES) + group) * R;
    let last = params.rows - 1u;
    let r0 = min(row0, last);
    let r1 = min(row0 + 1u, last);
    let r2 = min(row0 + 2u, last);
    let r3 = min(row0 + 3u, last);
    let units = params.cols / UNIT;
// #if attn
    merge_attention(lid);
// #endif
    var acc = Acc(vec4<f32>(0.0), 0.0);
    let zero = Unit();
    for (var u = lane; u < units; u += UN * LANES) {
        let ub = u + LANES;
        let second = UN > 1u && ub < units;
        let uc = select(u, ub, second);  // a clamped duplicate is loaded but not added
        let a0 = unit_values(r0, u);
        var a1 = zero;
        var a2 = zero;
        var a3 = zero;
        var b0 = zero;
        var b1 = zero;
        var b2 = zero;
        var b3 = zero;
        if (R > 1u) {
            a1 = unit_values(r1, u);
        }
        if (R > 2u) {
            a2 = unit_values(r2, u);
            a3 = unit_values(r3, u);
        }
        if (UN > 1u) {
            b0 = unit_values(r0, uc);
            if (R > 1u) {
                b1 = unit_values(r1, uc);
            }
            if (R > 2u) {
                b2 = unit_values(r2, uc);
                b3 = unit_values(r3, uc);
            }
        }
        add_unit(&acc, u, a0, a1, a2, a3);
        if (second) {
            add_unit(&acc, ub, b0, b1, b2, b3);
        }
    }
    var s = acc.s;
    var ss = acc.ss;
    let width = min(LANES, sg_size);
    for (var m = 1u; m < width; m <<= 1u) {
        s += subgroupShuffleXor(s, m);
        ss += subgroupShuffleXor(ss, m);
    }
    let spans = LANES > sg_size;  // the row group spans LANES / sg_size subgroups
    if (spans && sg_lane == 0u) {
        part[sg_id] = s;
        part_ss[sg_id] = ss;
    }
    workgroupBarrier();
    if (lane != 0u || row0 >= params.rows) {
        return;
    }
    if (spans) {
        let first = lid / sg_size;
        for (var i = 1u; i < LANES / sg_size; i++) {
            s += part[first + i];
            ss += part_ss[first + i];
        }
    }
    var scale = 1.0;
    if ((params.flags & 4u) != 0u) {
        scale = inverseSqrt(ss / f32(params.cols) + params.eps);
    }
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
}
