// attention_tiled: causal grouped-query attention of a block of BQ = 32 query rows of one head
// (prefill), head_dim 64, FlashAttention style with register tiles: for each tile of BKT = 32
// keys, S = Q K^T and O += P V are small matrix products out of workgroup memory, and the online
// softmax (running max m and sum l per row) is updated once per tile, not once per key. No score
// matrix beyond one 32 x 32 tile.
// Bindings: params, step, q [tokens, H hd], k_cache, v_cache, out [tokens, H hd] (attention_kv.wgsl).
// Split over keys (override CHUNK > 0, a multiple of BKT; grid z = ceil((start + tokens) / CHUNK)):
//   workgroup z takes only keys [z CHUNK, (z + 1) CHUNK) and writes, for each of its rows, the
//   unnormalized output, max and sum to out = partial[((t H + h) max_splits + z) (hd + 2) ..]
//   (zeros and m = -3e38 where the row sees none of them), as attention_decode does;
//   attention_combine (with the same CHUNK) merges them. A workgroup whose keys all lie past its
//   block's last position writes nothing (attention_combine does not read that split). This cuts
//   the longest workgroup's walk over the keys from the whole prompt to CHUNK keys.
// Grid: (ceil(tokens / BQ), H, 1 or the splits); 128 threads, thread (ty, tx) = (lid / 16, lid % 16) owns query rows
// 4 ty .. 4 ty + 3 of the block: their scores against keys tx and tx + 16 of each tile, and their
// outputs in dims 4 tx .. 4 tx + 3.
// out[t, h] = softmax(q k^T * scale, keys 0 ..= start + t) v; with a sliding window only keys
// k > start + t - window. Keys a row does not see get weight exactly 0 (exp is not evaluated
// for them), so the result is the softmax over the visible keys alone.
// Workgroup memory: Q (scaled) [d4][row], K [d4][key], V [key][d4], P [key][row / 4], and the
// row maxima / sums of the 16 threads of each row: 30 KiB (lavapipe allows 32).

const HEAD_DIM: u32 = 64u;
const BQ: u32 = 32u;   // query rows per workgroup
const BKT: u32 = 32u;  // keys per tile
const D4: u32 = 16u;   // HEAD_DIM / 4
const NEG: f32 = -3.0e38;

override CHUNK: u32 = 0u;  // keys per split (0: no split, out is the attention output)

// #include attention_kv.wgsl

@group(0) @binding(2) var<storage, read> q: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read_write> out: array<f32>;

var<workgroup> q_sh: array<vec4<f32>, D4 * BQ>;
var<workgroup> k_sh: array<vec4<f32>, D4 * BKT>;
var<workgroup> v_sh: array<vec4<f32>, BKT * D4>;
var<workgroup> p_sh: array<vec4<f32>, BKT * BQ / 4u>;
var<workgroup> red: array<f32, BQ * 16u>;

// One K/V element of a tile as loaded (4 dims of one key), zeros past kmax.
struct KV {
    k: KVRaw,
    v: KVRaw,
}

// One thread's share of a K/V tile as loaded: element i = lid + 128 j of the tile (key i / D4,
// dims 4 (i % D4) ..), for j = 0 .. 3. Converted when stored, one tile later.
struct KVTile {
    e0: KV,
    e1: KV,
    e2: KV,
    e3: KV,
}

fn fetch_kv(kv_head: u32, k0: u32, kmax: u32, i: u32) -> KV {
    let key = k0 + i / D4;
    if (key > kmax) {
        return KV(KVRaw(), KVRaw());
    }
    return KV(raw_k4(kv_head, key, i % D4), raw_v4(kv_head, key, i % D4));
}

fn fetch_tile(kv_head: u32, k0: u32, kmax: u32, lid: u32) -> KVTile {
    return KVTile(fetch_kv(kv_head, k0, kmax, lid), fetch_kv(kv_head, k0, kmax, lid + 128u),
                  fetch_kv(kv_head, k0, kmax, lid + 256u), fetch_kv(kv_head, k0, kmax, lid + 384u));
}

fn store_kv(i: u32, e: KV) {
    k_sh[(i % D4) * BKT + i / D4] = kv_unpack(e.k);
    v_sh[i] = kv_unpack(e.v);
}

fn visible(key: u32, pos: u32) -> bool {
    return key <= pos && (params.window == 0u || key + params.window > pos);
}

// The block maximum of row r's 16 partial values in red (r 16 ..).
fn row_max(r: u32) -> f32 {
    var m = red[r * 16u];
    for (var i = 1u; i < 16u; i++) {
        m = max(m, red[r * 16u + i]);
    }
    return m;
}

fn row_sum(r: u32) -> f32 {
    var s = 0.0;
    for (var i = 0u; i < 16u; i++) {
        s += red[r * 16u + i];
    }
    return s;
}

@compute @workgroup_size(128)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let h = wid.y;
    let kv_head = h / (params.num_heads / params.num_kv_heads);
    let tx = lid % 16u;
    let ty = lid / 16u;
    let t0 = wid.x * BQ;  // the block's first row
    let rows = min(BQ, params.tokens - t0);
    let first = step.start + t0;             // position of the block's first row
    let last = step.start + t0 + rows - 1u;  // and of its last
    var kmin = 0u;
    if (params.window != 0u && first + 1u > params.window) {
        kmin = first + 1u - params.window;
    }
    var kmax = last;
    if (CHUNK > 0u) {
        if (wid.z * CHUNK > last) {
            return;  // no row of the block reaches this split (uniform: before any barrier)
        }
        kmin = max(kmin, wid.z * CHUNK);
        kmax = min(last, wid.z * CHUNK + CHUNK - 1u);
    }

    // Q (times the scale) into [d4][row]; rows past the prompt read the last row (never stored).
    for (var i = lid; i < D4 * BQ; i += 128u) {
        let r = i % BQ;
        let d4 = i / BQ;
        let t = t0 + min(r, rows - 1u);
        q_sh[i] = q[(t * params.num_heads + h) * D4 + d4] * params.scale;
    }

    var m = array<f32, 4>(NEG, NEG, NEG, NEG);  // running max of rows 4 ty + i
    var l = vec4<f32>(0.0);                     // this thread's share of the running sums
    var o0 = vec4<f32>(0.0);                    // rows 4 ty + i, dims 4 tx ..
    var o1 = vec4<f32>(0.0);
    var o2 = vec4<f32>(0.0);
    var o3 = vec4<f32>(0.0);
    let pos0 = first + 4u * ty;  // position of row 4 ty

    let kfirst = kmin - kmin % BKT;
    var tile = fetch_tile(kv_head, kfirst, kmax, lid);
    for (var k0 = kfirst; k0 <= kmax; k0 += BKT) {
        workgroupBarrier();  // the previous tile's reads of k_sh, v_sh and p_sh are done
        store_kv(lid, tile.e0);
        store_kv(lid + 128u, tile.e1);
        store_kv(lid + 256u, tile.e2);
        store_kv(lid + 384u, tile.e3);
        workgroupBarrier();
        if (k0 + BKT <= kmax) {
            tile = fetch_tile(kv_head, k0 + BKT, kmax, lid);  // in flight while this tile computes
        }

        // S for rows 4 ty + i, keys k0 + tx (a) and k0 + tx + 16 (b).
        var sa = vec4<f32>(0.0);
        var sb = vec4<f32>(0.0);
        for (var d4 = 0u; d4 < D4; d4++) {
            let ka = k_sh[d4 * BKT + tx];
            let kb = k_sh[d4 * BKT + tx + 16u];
            let q0 = q_sh[d4 * BQ + 4u * ty];
            let q1 = q_sh[d4 * BQ + 4u * ty + 1u];
            let q2 = q_sh[d4 * BQ + 4u * ty + 2u];
            let q3 = q_sh[d4 * BQ + 4u * ty + 3u];
            sa += vec4<f32>(dot(q0, ka), dot(q1, ka), dot(q2, ka), dot(q3, ka));
            sb += vec4<f32>(dot(q0, kb), dot(q1, kb), dot(q2, kb), dot(q3, kb));
        }
        let ka_pos = k0 + tx;
        let kb_pos = k0 + tx + 16u;
        let pos = vec4<u32>(pos0, pos0 + 1u, pos0 + 2u, pos0 + 3u);
        let see_a = vec4<bool>(visible(ka_pos, pos.x), visible(ka_pos, pos.y), visible(ka_pos, pos.z), visible(ka_pos, pos.w));
        let see_b = vec4<bool>(visible(kb_pos, pos.x), visible(kb_pos, pos.y), visible(kb_pos, pos.z), visible(kb_pos, pos.w));
        let ma = select(vec4<f32>(NEG), sa, see_a);
        let mb = select(vec4<f32>(NEG), sb, see_b);
        let part = max(ma, mb);
        red[(4u * ty) * 16u + tx] = part.x;
        red[(4u * ty + 1u) * 16u + tx] = part.y;
        red[(4u * ty + 2u) * 16u + tx] = part.z;
        red[(4u * ty + 3u) * 16u + tx] = part.w;
        workgroupBarrier();
        let m_new = vec4<f32>(max(m[0], row_max(4u * ty)), max(m[1], row_max(4u * ty + 1u)),
                              max(m[2], row_max(4u * ty + 2u)), max(m[3], row_max(4u * ty + 3u)));
        let corr = exp(vec4<f32>(m[0], m[1], m[2], m[3]) - m_new);
        let pa = select(vec4<f32>(0.0), exp(sa - m_new), see_a);
        let pb = select(vec4<f32>(0.0), exp(sb - m_new), see_b);
        l = l * corr + pa + pb;
        m[0] = m_new.x; m[1] = m_new.y; m[2] = m_new.z; m[3] = m_new.w;
        p_sh[tx * (BQ / 4u) + ty] = pa;          // P [key][row / 4]
        p_sh[(tx + 16u) * (BQ / 4u) + ty] = pb;
        workgroupBarrier();

        o0 *= corr.x; o1 *= corr.y; o2 *= corr.z; o3 *= corr.w;
        for (var j = 0u; j < BKT; j++) {
            let p = p_sh[j * (BQ / 4u) + ty];
            let v = v_sh[j * D4 + tx];
            o0 = fma(vec4<f32>(p.x), v, o0); o1 = fma(vec4<f32>(p.y), v, o1);
            o2 = fma(vec4<f32>(p.z), v, o2); o3 = fma(vec4<f32>(p.w), v, o3);
        }
    }

    // The row sums: each of the row's 16 threads holds the sum over its own keys.
    workgroupBarrier();
    red[(4u * ty) * 16u + tx] = l.x;
    red[(4u * ty + 1u) * 16u + tx] = l.y;
    red[(4u * ty + 2u) * 16u + tx] = l.z;
    red[(4u * ty + 3u) * 16u + tx] = l.w;
    workgroupBarrier();
    let r = 4u * ty;
    if (r < rows) { store_row(wid.z, t0 + r, h, tx, o0, m[0], row_sum(r)); }
    if (r + 1u < rows) { store_row(wid.z, t0 + r + 1u, h, tx, o1, m[1], row_sum(r + 1u)); }
    if (r + 2u < rows) { store_row(wid.z, t0 + r + 2u, h, tx, o2, m[2], row_sum(r + 2u)); }
    if (r + 3u < rows) { store_row(wid.z, t0 + r + 3u, h, tx, o3, m[3], row_sum(r + 3u)); }
}

// Dims 4 tx .. of row t, head h: o / l, or with CHUNK the partial (o, and m, l from tx 0) of split z.
fn store_row(z: u32, t: u32, h: u32, tx: u32, o: vec4<f32>, m: f32, l: f32) {
    var i = (t * params.num_heads + h) * HEAD_DIM + 4u * tx;
    var v = o / l;
    if (CHUNK > 0u) {
        i = ((t * params.num_heads + h) * params.max_splits + z) * (HEAD_DIM + 2u) + 4u * tx;
        v = o;
        if (tx == 0u) {
            out[i - 4u * tx + HEAD_DIM] = m;
            out[i - 4u * tx + HEAD_DIM + 1u] = l;
        }
    }
    out[i] = v.x;
    out[i + 1u] = v.y;
    out[i + 2u] = v.z;
    out[i + 3u] = v.w;
}
