// attention_prefill: causal grouped-query attention for a block of query rows, FlashAttention
// style: keys and values stream through workgroup memory in tiles of BK positions and each query
// row keeps its running max, sum and output (online softmax, one key at a time); no score matrix.
// A row is shared by DT consecutive threads (a subgroup part: DT must not exceed the subgroup
// size), each owning HEAD_DIM / DT of its dims (vec4 c4 = part, part + DT, ...); the q.k dot is
// summed across them with subgroupShuffleXor. Without subgroups DT is 1 (a thread per row).
// Bindings: params, step, q [tokens, H hd], k_cache, v_cache, out [tokens, H hd].
// Grid: (ceil(tokens / BQ), H); workgroup of BQ * DT threads, thread lid works on query row
// BQ wid.x + lid / DT at position step.start + row.
// out[t, h] = softmax(q k^T * scale, keys 0 ..= start + t) v; with a sliding window only keys
// k > start + t - window.
// Split over keys (override CHUNK > 0, a multiple of BK; grid z = ceil((start + tokens) / CHUNK)),
// as attention_tiled.wgsl: workgroup z takes keys [z CHUNK, (z + 1) CHUNK) only and writes each
// row's unnormalised output, then (m, l), to out = partial[((t H + h) max_splits + z) (hd + 2) ..];
// attention_combine (same CHUNK) merges them. Without it the last query block walks the whole
// prompt alone (H200, Qwen2.5-1.5B shape, 512 tokens: 192 workgroups, 15.8 ms for 28 layers).

override HEAD_DIM: u32 = 64u;
override BQ: u32 = 32u;
const BK: u32 = 16u;
override CHUNK: u32 = 0u;  // keys per split (0: no split, out is the attention output)
const DT: u32 = 1u;       // replaced by the host (threads per query row; a power of two)
const MAX_D4: u32 = 64u;  // replaced by HEAD_DIM / 4 when the pipeline is made (private arrays need a const size)
const NP: u32 = MAX_D4 / DT;  // vec4s of the row per thread

// #include attention_kv.wgsl

fn visible(key: u32, pos: u32) -> bool {
    return key <= pos && (params.window == 0u || key + params.window > pos);
}

@group(0) @binding(2) var<storage, read> q: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read_write> out: array<f32>;

var<workgroup> k_sh: array<vec4<f32>, BK * HEAD_DIM / 4u>;
var<workgroup> v_sh: array<vec4<f32>, BK * HEAD_DIM / 4u>;

@compute @workgroup_size(BQ * DT)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let h = wid.y;
    let d4 = HEAD_DIM / 4u;
    let kv_head = h / (params.num_heads / params.num_kv_heads);
    let part = lid % DT;
    let t = wid.x * BQ + lid / DT;
    let valid = t < params.tokens;
    let pos = step.start + t;
    let row = (min(t, params.tokens - 1u) * params.num_heads + h) * d4;
    var qr: array<vec4<f32>, NP>;
    var acc: array<vec4<f32>, NP>;
    for (var i = 0u; i < NP; i++) {
        qr[i] = q[row + part + DT * i] * params.scale;
        acc[i] = vec4<f32>(0.0);
    }
    var m = -3.0e38;
    var l = 0.0;
    let last = step.start + min(wid.x * BQ + BQ, params.tokens) - 1u;  // last position of the block
    var kmax = last;
    var tile0 = 0u;
    if (CHUNK > 0u) {
        if (wid.z * CHUNK > last) {
            return;  // no row of the block reaches this split (uniform: before any barrier)
        }
        tile0 = wid.z * CHUNK / BK;
        kmax = min(last, wid.z * CHUNK + CHUNK - 1u);
    }
    let tiles = kmax / BK + 1u;
    for (var tile = tile0; tile < tiles; tile++) {
        workgroupBarrier();
        for (var i = lid; i < BK * d4; i += BQ * DT) {
            let key = tile * BK + i / d4;
            let c4 = i % d4;
            // Keys past the block are zero, not stale: every thread multiplies every key (p = 0).
            var kk = vec4<f32>(0.0);
            var vv = vec4<f32>(0.0);
            if (key <= kmax) {
                kk = load_k4(kv_head, key, c4);
                vv = load_v4(kv_head, key, c4);
            }
            k_sh[i] = kk;
            v_sh[i] = vv;
        }
        workgroupBarrier();
        // Every thread runs every key (uniform control flow for the shuffles); keys a row does
        // not see get no weight.
        for (var j = 0u; j < BK; j++) {
            var s = 0.0;
            for (var i = 0u; i < NP; i++) {
                s += dot(qr[i], k_sh[j * d4 + part + DT * i]);
            }
// #if subgroup
            for (var o = 1u; o < DT; o <<= 1u) {
                s += subgroupShuffleXor(s, o);
            }
// #endif
            let seen = valid && visible(tile * BK + j, pos);
            let m_new = select(m, max(m, s), seen);
            let correction = exp(m - m_new);
            let p = select(0.0, exp(s - m_new), seen);
            l = l * correction + p;
            for (var i = 0u; i < NP; i++) {
                acc[i] = acc[i] * correction + p * v_sh[j * d4 + part + DT * i];
            }
            m = m_new;
        }
    }
    if (!valid) {
        return;
    }
    if (CHUNK == 0u) {
        let inv = 1.0 / l;
        for (var i = 0u; i < NP; i++) {
            store4(4u * (row + part + DT * i), acc[i] * inv);
        }
        return;
    }
    let dst = ((t * params.num_heads + h) * params.max_splits + wid.z) * (HEAD_DIM + 2u);
    for (var i = 0u; i < NP; i++) {
        store4(dst + 4u * (part + DT * i), acc[i]);
    }
    if (part == 0u) {
        out[dst + HEAD_DIM] = m;
        out[dst + HEAD_DIM + 1u] = l;
    }
}

fn store4(i: u32, v: vec4<f32>) {
    out[i] = v.x;
    out[i + 1u] = v.y;
    out[i + 2u] = v.z;
    out[i + 3u] = v.w;
}
