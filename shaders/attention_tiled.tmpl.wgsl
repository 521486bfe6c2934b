// attention_tiled: causal grouped-query attention of a block of BQ query rows of one head
// (prefill), FlashAttention style with register tiles: for each tile of BKT keys, S = Q K^T and
// O += P V are small matrix products out of workgroup memory, and the online softmax (running max
// m and sum l per row) is updated once per tile, not once per key. No score matrix beyond one
// BQ x BKT tile. One variant per (HEAD_DIM, BQ, BKT) (kernels.attention_tiled_fields writes out
// each thread's registers): HEAD_DIM 64 or 128, BQ 16 or 32, BKT 16 or 32.
// Bindings: params, step, q [tokens, H hd], k_cache, v_cache, out [tokens, H hd] (attention_kv.wgsl).
// Split over keys (override CHUNK > 0, a multiple of BKT; grid z = ceil((start + tokens) / CHUNK)):
//   workgroup z takes only keys [z CHUNK, (z + 1) CHUNK) and writes, for each of its rows, the
//   unnormalized output, max and sum to out = partial[((t H + h) max_splits + z) (hd + 2) ..]
//   (zeros and m = -3e38 where the row sees none of them), as attention_decode does;
//   attention_combine (with the same CHUNK) merges them. A workgroup whose keys all lie past its
//   block's last position writes nothing (attention_combine does not read that split). This cuts
//   the longest workgroup's walk over the keys from the whole prompt to CHUNK keys.
// Grid: (ceil(tokens / BQ), H, 1 or the splits); 128 threads, thread (ty, tx) = (lid / 16, lid % 16)
// owns query rows RT ty .. RT ty + RT - 1 of the block (RT = BQ / 8): their scores against keys
// tx + 16 j of each tile (j < BKT / 16), and their outputs in the vec4s tx + 16 c of head_dim
// (c < HEAD_DIM / 64).
// out[t, h] = softmax(q k^T * scale, keys 0 ..= start + t) v; with a sliding window only keys
// k > start + t - window. Keys a row does not see get weight exactly 0 (exp is not evaluated
// for them), so the result is the softmax over the visible keys alone.
// Workgroup memory: Q (scaled) [d4][row], K [d4][key], V [key][d4], P [key][ty] (RT rows each),
// and the row maxima / sums of the 16 threads of each row (kernels.attention_tiled_bytes).

const HEAD_DIM: u32 = {{HEAD_DIM}}u;
const BQ: u32 = {{BQ}}u;   // query rows per workgroup
const BKT: u32 = {{BKT}}u; // keys per tile
const D4: u32 = HEAD_DIM / 4u;
const RT: u32 = BQ / 8u;   // query rows per thread
const NEG: f32 = -3.0e38;

alias RV = vec{{RT}}<f32>;  // one value per row of a thread
alias RB = vec{{RT}}<bool>;

override CHUNK: u32 = 0u;  // keys per split (0: no split, out is the attention output)

// #include attention_kv.wgsl

@group(0) @binding(2) var<storage, read> q: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read_write> out: array<f32>;

var<workgroup> q_sh: array<vec4<f32>, D4 * BQ>;
var<workgroup> k_sh: array<vec4<f32>, D4 * BKT>;
var<workgroup> v_sh: array<vec4<f32>, BKT * D4>;
var<workgroup> p_sh: array<RV, BKT * 8u>;
var<workgroup> red: array<f32, BQ * 16u>;

// One K/V element of a tile as loaded (4 dims of one key), zeros past kmax.
struct KV {
    k: KVRaw,
    v: KVRaw,
}

// One thread's share of a K/V tile as loaded: element i = lid + 128 e of the tile (key i / D4,
// dims 4 (i % D4) ..), for e < BKT D4 / 128. Converted when stored, one tile later.
struct KVTile {
{{TILE_FIELDS}}
}

fn fetch_kv(kv_head: u32, k0: u32, kmax: u32, i: u32) -> KV {
    let key = k0 + i / D4;
    if (key > kmax) {
        return KV(KVRaw(), KVRaw());
    }
    return KV(raw_k4(kv_head, key, i % D4), raw_v4(kv_head, key, i % D4));
}

fn fetch_tile(kv_head: u32, k0: u32, kmax: u32, lid: u32) -> KVTile {
    return KVTile({{TILE_FETCH}});
}

fn store_kv(i: u32, e: KV) {
    k_sh[(i % D4) * BKT + i / D4] = kv_unpack(e.k);
    v_sh[i] = kv_unpack(e.v);
}

fn visible(key: u32, pos: u32) -> bool {
    return key <= pos && (params.window == 0u || key + params.window > pos);
}

// Which of a thread's rows (positions pos ..) see key `key`.
fn sees(key: u32, pos: u32) -> RB {
    return RB({{SEES}});
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
    let block = query_block(wid, BQ, CHUNK);
    if (block.none) {
        return;  // no row of the block reaches this split (uniform: before any barrier)
    }
    let t0 = block.t0;  // the block's first row
    let rows = block.rows;
    let first = block.first;  // position of the block's first row
    let kmin = block.kmin;
    let kmax = block.kmax;

    // Q (times the scale) into [d4][row]; rows past the prompt read the last row (never stored).
    for (var i = lid; i < D4 * BQ; i += 128u) {
        let r = i % BQ;
        let d4 = i / BQ;
        let t = t0 + min(r, rows - 1u);
        q_sh[i] = q[(t * params.num_heads + h) * D4 + d4] * params.scale;
    }

    var m = RV(NEG);  // running max of rows RT ty + i
    var l = RV(0.0);  // this thread's share of the running sums
{{O_DECL}}
    let pos0 = first + RT * ty;  // position of row RT ty

    let kfirst = kmin - kmin % BKT;
    var tile = fetch_tile(kv_head, kfirst, kmax, lid);
    for (var k0 = kfirst; k0 <= kmax; k0 += BKT) {
        workgroupBarrier();  // the previous tile's reads of k_sh, v_sh and p_sh are done
{{TILE_STORE}}
        workgroupBarrier();
        if (k0 + BKT <= kmax) {
            tile = fetch_tile(kv_head, k0 + BKT, kmax, lid);  // in flight while this tile computes
        }

        // S for rows RT ty + i, keys k0 + tx + 16 j.
{{S_DECL}}
        for (var d4 = 0u; d4 < D4; d4++) {
{{S_BODY}}
        }
{{S_MASK}}
{{RED_MAX}}
        workgroupBarrier();
        let m_new = max(m, RV({{ROW_MAXES}}));
        let corr = exp(m - m_new);
{{P_EXP}}
        m = m_new;
{{P_STORE}}
        workgroupBarrier();

{{O_SCALE}}
        for (var j = 0u; j < BKT; j++) {
            let p = p_sh[j * 8u + ty];
{{PV_BODY}}
        }
    }

    // The row sums: each of the row's 16 threads holds the sum over its own keys.
    workgroupBarrier();
{{RED_SUM}}
    workgroupBarrier();
    let r = RT * ty;
{{STORE_ROWS}}
}

// The vec4 c4 of head_dim of row t, head h: o / l, or with CHUNK the partial (o, and m, l from
// the thread of vec4 0) of split z.
fn store4(z: u32, t: u32, h: u32, c4: u32, o: vec4<f32>, m: f32, l: f32) {
    var i = (t * params.num_heads + h) * HEAD_DIM + 4u * c4;
    var v = o / l;
    if (CHUNK > 0u) {
        i = ((t * params.num_heads + h) * params.max_splits + z) * (HEAD_DIM + 2u) + 4u * c4;
        v = o;
        if (c4 == 0u) {
            out[i + HEAD_DIM] = m;
            out[i + HEAD_DIM + 1u] = l;
        }
    }
    out[i] = v.x;
    out[i + 1u] = v.y;
    out[i + 2u] = v.z;
    out[i + 3u] = v.w;
}
