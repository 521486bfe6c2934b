// matvec_dot.tmpl.wgsl: the decode matrix-vector product (one token) for the quantized formats
// with an integer-dot block decoder (Q8_0, Q5_0, Q4_K), against x quantized to 8 bits.
// kjarni/gpu/kernels.py renders it per format (`kernels.template("matvec_dot", format, {"idot"})`):
// {{BLOCK}} is the format's block decoder rendered with flag `idot` (block_<format>.wgsl), which
// declares w_a / w_b and defines CHUNK (32: values per chunk), struct XC, x_chunk(c) (chunk c of
// the quantized x, read from the workgroup arrays below), fetch_chunk(row, c) -> ChunkRaw (the
// loads of chunk c of the row) and dot_raw(raw, c, xc) (that chunk times it, with dot4I8Packed).
//
// y[row_offset + r] = s sum_c x8[c] W[r, c] (+ bias[row_offset + r]) (+ residual[row_offset + r]),
// v = x (silu(gate) * up with flags bit 3; times norm_weight with flags bit 2), x8 = v quantized
// in blocks of 32: d = max |v| / 127, q = round(v 127 / max |v|) (int8), x8 = d q; s = 1, or the
// rms scale 1 / sqrt(mean(v_unweighted^2) + eps) with flags bit 2. kjarni/numpy_ops.py's
// `quantize_activations` computes the same x8 (NumpyOps(quantize_activations=True)).
// Bindings and Params: the linear family's (docs/gpu-kernels.md), x and norm_weight read as vec4.
//
// Phase 1 (every thread): thread i quantizes vec4 i, i + WG, .. of x; the 8 threads of a 32-value
// block share its maximum and the 4 threads of a 16-value half its sum of quants through
// subgroupShuffleXor (subgroups of at least 8 lanes, WG a multiple of 8), into workgroup memory:
// xq (16 int8 values per vec4<u32>), xd (d per 32 values), xs (sum of q per 16 values). Then one
// barrier (and the sum of squares for the norm through workgroup memory).
// Phase 2: the workgroup is WG / LANES row groups of LANES lanes, a row group owns R (1, 2 or 4)
// consecutive rows of a row set; workgroups stride over the row sets (the grid may be capped:
// each workgroup quantizes x once for all its sets). Lanes stride over the row's chunks, UN (1 or
// 2) a trip, every weight load of the trip issued before any is used (a second chunk past the row
// is clamped, loaded and not added); each x chunk is read once for the R rows. Sums go over the
// group with subgroupShuffleXor, then through workgroup memory when a group spans subgroups.
// Flag `attn` (o_proj after a split attention_step.wgsl): x is that kernel's partials, SPLITS
// runs per head of HD4 vec4 outputs o_s then (m_s, l_s, 0, 0), and the product reads
// x[h, :] = sum_s e^(m_s - M) o_s / sum_s e^(m_s - M) l_s (M = max_s m_s), merged in phase 1.
// Flag `glu` (a one-token SwiGLU MLP's gate_up, `Linear.glu_fusable`, as matvec_f16.tmpl.wgsl's):
// the weight is [gate | up] stacked (rows = 2 I), a group's R rows are R / 2 rows of gate and the
// same rows of up (R even), and lane 0 writes y[row_offset + i] = silu(g_i) u_i for i < I (no bias
// or residual), so the down projection reads and quantizes a plain x.
// EARLY (override; the host sets it only with flag `attn`, GpuTuning.matvec_attn_early): a thread
// fetches its first row set's first trip of weights before phase 1, so their latency overlaps the
// merge and quantization of x (a load cannot move past phase 1's barrier); that trip is then
// summed from those registers, in the same order.
// Grid: up to (min(n, 32768), ceil(n / 32768)) for n row sets; any smaller grid is correct.
// Needs the device feature "subgroup"; cols a multiple of the format's block and at most 16 XV.

// #include linear_structs.wgsl

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read> bias: array<f32>;
@group(0) @binding(5) var<storage, read> residual: array<f32>;
@group(0) @binding(6) var<storage, read> norm_weight: array<vec4<f32>>;
@group(0) @binding(7) var<storage, read_write> y: array<f32>;

override WG: u32 = 128u;
override LANES: u32 = 16u;
override R: u32 = 2u;
override UN: u32 = 1u;
override XV: u32 = 64u;  // capacity of xq in vec4s: cols / 16 or more
override EARLY: bool = false;
// (Every override is declared before the arrays sized by XV: naga 29 panics otherwise.)
// #if attn
override SPLITS: u32 = 8u;
override HD4: u32 = 16u;
// #endif

var<workgroup> xq: array<vec4<u32>, XV>;  // quantized x: vec4 i = values 16 i .. 16 i + 15
var<workgroup> xd: array<f32, XV / 2u>;   // scale of values 32 b .. 32 b + 31
var<workgroup> xs: array<i32, XV>;        // sum of the quants of values 16 i .. 16 i + 15

const MAX_SUBGROUPS: u32 = 64u;  // 256 threads in subgroups of 4, WebGPU's smallest
var<workgroup> part: array<vec4<f32>, 2u * MAX_SUBGROUPS>;  // double-buffered by row set
var<workgroup> part_ss: array<f32, MAX_SUBGROUPS>;

// #include {{BLOCK}}.wgsl
// #include quantize_x.wgsl

// x[c .. c + 3] as the product reads it: silu(gate) * up with flags bit 3; with flag `attn` the
// merged attention output (vec4 c / 4 of head c / 4 / HD4).
fn x4(c: u32) -> vec4<f32> {
// #if attn
    let i = c / 4u;
    let first = (i / HD4) * SPLITS;
    var m = -3.0e38;
    for (var s = 0u; s < SPLITS; s++) {
        m = max(m, x[(first + s) * (HD4 + 1u) + HD4].x);
    }
    var l = 0.0;
    var o = vec4<f32>(0.0);
    for (var s = 0u; s < SPLITS; s++) {
        let run = (first + s) * (HD4 + 1u);
        let ml = x[run + HD4];
        let e = exp(ml.x - m);
        l += e * ml.y;
        o += e * x[run + i % HD4];
    }
    return o / l;
// #else
    if ((params.flags & 8u) != 0u) {
        let g = x[c / 4u];
        return g / (1.0 + exp(-g)) * x[(params.cols + c) / 4u];
    }
    return x[c / 4u];
// #endif
}

// The weight row loaded as row i of a group whose first output row is row0 (clamped to the last
// row, of its half with glu; rg output rows a group).
fn weight_row(row0: u32, i: u32, rg: u32) -> u32 {
// #if glu
    let half = params.rows / 2u;
    return min(row0 + i % rg, half - 1u) + (i / rg) * half;
// #else
    return min(row0 + i, params.rows - 1u);
// #endif
}

// One chunk of rows r0 .. r3 as loaded (those past R left unloaded).
struct RowChunks {
    r0: ChunkRaw,
    r1: ChunkRaw,
    r2: ChunkRaw,
    r3: ChunkRaw,
}

fn fetch_rows(r: vec4<u32>, c: u32) -> RowChunks {
    var w: RowChunks;
    w.r0 = fetch_chunk(r.x, c);
    if (R > 1u) {
        w.r1 = fetch_chunk(r.y, c);
    }
    if (R > 2u) {
        w.r2 = fetch_chunk(r.z, c);
        w.r3 = fetch_chunk(r.w, c);
    }
    return w;
}

// Chunk c of the R rows times x chunk xc.
fn rows_dot(w: RowChunks, c: u32, xc: XC) -> vec4<f32> {
    var s = vec4<f32>(dot_raw(w.r0, c, xc), 0.0, 0.0, 0.0);
    if (R > 1u) {
        s.y = dot_raw(w.r1, c, xc);
    }
    if (R > 2u) {
        s.z = dot_raw(w.r2, c, xc);
        s.w = dot_raw(w.r3, c, xc);
    }
    return s;
}

// One trip's weights as loaded: chunk c (a) and the second chunk (b, left unloaded past UN).
struct Trip {
    a: RowChunks,
    b: RowChunks,
}

// The second chunk of the trip at c: c + LANES, or c itself past the row (a clamped duplicate,
// loaded and not added).
fn second_chunk(c: u32, chunks: u32) -> u32 {
    return select(c, c + LANES, c + LANES < chunks);
}

fn fetch_trip(c: u32, r: vec4<u32>, chunks: u32) -> Trip {
    var t: Trip;
    t.a = fetch_rows(r, c);
    if (UN > 1u) {
        t.b = fetch_rows(r, second_chunk(c, chunks));
    }
    return t;
}

// The trip's sums for the R rows.
fn trip_sum(c: u32, t: Trip, chunks: u32) -> vec4<f32> {
    var s = rows_dot(t.a, c, x_chunk(c));
    if (UN > 1u) {
        let cb = second_chunk(c, chunks);
        s += select(vec4<f32>(0.0), rows_dot(t.b, cb, x_chunk(cb)), c + LANES < chunks);
    }
    return s;
}

// Rows r0 .. r3 a group whose first output row is row0 loads (weight_row).
fn group_rows(row0: u32, rg: u32) -> vec4<u32> {
    return vec4<u32>(weight_row(row0, 0u, rg), weight_row(row0, 1u, rg), weight_row(row0, 2u, rg),
                     weight_row(row0, 3u, rg));
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
    let groups = WG / LANES;
    let group = lid / LANES;
    let lane = lid % LANES;
    let chunks = params.cols / CHUNK;
// #if glu
    let rg = R / 2u;  // output rows a group: of gate, then the same of up
    let out_rows = params.rows / 2u;
// #else
    let rg = R;
    let out_rows = params.rows;
// #endif
    let sets = (out_rows + rg * groups - 1u) / (rg * groups);
    // EARLY: the first row set's first trip (a clamped chunk where the lane has none: in range,
    // unused unless `peel`), fetched before x is quantized.
    let rs0 = wid.x + wid.y * nwg.x;
    let peel = EARLY && rs0 < sets && lane < chunks;
    var first: Trip;
    if (EARLY) {
        first = fetch_trip(min(lane, chunks - 1u), group_rows((rs0 * groups + group) * rg, rg), chunks);
    }
    // Phase 1: quantize x into workgroup memory.
    let nv4 = params.cols / 4u;
    var ss = 0.0;
    for (var base = 0u; base < nv4; base += WG) {
        let i = base + lid;
        var v = vec4<f32>(0.0);
        if (i < nv4) {
            v = x4(4u * i);
            if (norm) {
                ss += dot(v, v);
                v *= norm_weight[i];
            }
        }
        let xq4 = quantize_x4(v);
        let q = xq4.q;
        let m = xq4.m;
        var qs = q.x + q.y + q.z + q.w;
        qs += subgroupShuffleXor(qs, 1u);
        qs += subgroupShuffleXor(qs, 2u);
        if (i < nv4) {
            xq[i / 4u][i % 4u] = pack4xI8(q);
            if (i % 4u == 0u) {
                xs[i / 4u] = qs;
            }
            if (i % 8u == 0u) {
                xd[i / 8u] = m / 127.0;
            }
        }
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
    let spans = LANES > sg_size;  // a row group spans LANES / sg_size subgroups
    let width = min(LANES, sg_size);
    var parity = 0u;
    for (var rs = rs0; rs < sets; rs += nwg.x * nwg.y) {
        let row0 = (rs * groups + group) * rg;
        let rows = group_rows(row0, rg);
        var s = vec4<f32>(0.0);
        var c = lane;
        if (peel && rs == rs0) {  // the first trip, fetched before phase 1
            s += trip_sum(c, first, chunks);
            c += UN * LANES;
        }
        for (; c < chunks; c += UN * LANES) {
            s += trip_sum(c, fetch_trip(c, rows, chunks), chunks);
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
            for (var i = 0u; i < rg; i++) {
                if (row0 + i < out_rows) {
                    let g = s[i] * scale;
                    y[params.row_offset + row0 + i] = g / (1.0 + exp(-g)) * (s[i + rg] * scale);
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
