// attention_tc: causal grouped-query attention of a block of BQ query rows of one head (prefill)
// on tensor cores (Dawn's chromium_experimental_subgroup_matrix, f16 x f16 -> f32 matrices of
// MS x MS: 16 on NVIDIA, 8 on Mesa's lavapipe). Subgroup sg owns query rows sg MS .. sg MS + MS - 1
// of the block; for each tile of BKT keys S = Q K^T and O += P V are subgroup-matrix products out
// of workgroup memory, the softmax between them done by the lanes (LPR lanes a row, CPL keys each;
// lane l takes row l % MS and keys l / MS + LPR i of a tile, S and P held column-major so that
// the lanes of a step read and write distinct banks).
// Two passes over the keys: a result matrix cannot be rescaled per row in WGSL, so pass 1 finds
// each row's maximum score m (S only) and pass 2 accumulates P = exp(S - m) (rounded to f16 for
// the product) and O += P V with no rescaling; l sums the rounded P. What
// NumpyOps(activations="f16") rounds: q scale and P to f16, f32 sums.
// With the flag online, one pass: m is the first visible tile's row maximum, and is raised only
// when a later tile's exceeds it by more than GROW (so P <= e^GROW = 256, in f16's range). Then the
// rows' scale exp(m_old - m_new) goes to alpha_sh, every subgroup takes its O matrices through
// s_sh to scale their rows (a branch the whole workgroup takes: grow_sh, read uniform), and l is
// scaled with them. P is rounded to f16 against that m, not the row's last maximum, as a split's
// is against its own.
// One variant per (HEAD_DIM, MS, SG, NW, BKT) (kernels.attention_tc_fields writes out the matrix
// code). Bindings: attention_tiled's (attention_kv.wgsl): params, step, q [tokens, H hd] f32,
// k_cache, v_cache (f32 or f16), out [tokens, H hd] f32 (or, with CHUNK, its partials).
// Split over keys (override CHUNK > 0, a multiple of BKT; grid z = ceil((start + tokens) / CHUNK)):
// as attention_tiled, workgroup z takes keys [z CHUNK, (z + 1) CHUNK) only and writes each row's
// unnormalized output, maximum and sum to partial[((t H + h) max_splits + z) (hd + 2) ..] (zeros
// and m = -3e38 where a row sees none of them), for attention_combine; a workgroup whose keys all
// lie past its block's last position writes nothing.
// Grid: (ceil(tokens / BQ), H, 1 or the splits); NW SG threads.
// With the flag prefetch, each tile's K (and V) loads are issued before the previous tile's
// products, into registers (attention_tiled's way); without it, right before the tile's stores.
// Workgroup memory: kv (the K tile, then the V tile, BKT x LDS f16 each; first the block's scaled
// Q, BQ x LDS, which fits as BQ <= 2 BKT), s_sh (each subgroup's MS x BKT scores, column-major,
// then its output matrices), p_sh (its P in f16, column-major), ml_sh (its rows' m and l).

enable f16;
enable subgroups;
enable chromium_experimental_subgroup_matrix;

const HEAD_DIM: u32 = {{HEAD_DIM}}u;
const MS: u32 = {{MS}}u;    // matrix size (MS x MS x MS products)
const SG: u32 = {{SG}}u;    // subgroup size
const NW: u32 = {{NW}}u;    // subgroups a workgroup
const BKT: u32 = {{BKT}}u;  // keys a tile
const BQ: u32 = NW * MS;    // query rows a workgroup
const WG: u32 = NW * SG;
const NWF: u32 = max(NW, 4u);  // grow_sh's entries (NW used; 2 gave wrong results on an H100)
const D4: u32 = HEAD_DIM / 4u;
const LDS: u32 = HEAD_DIM + 8u;  // kv rows, padded by 8 halves
const LPR: u32 = SG / MS;        // lanes a query row
const CPL: u32 = BKT / LPR;      // keys a lane, a tile
const NEG: f32 = -3.0e38;

override CHUNK: u32 = 0u;  // keys per split (0: no split, out is the attention output)

// #include attention_kv.wgsl

@group(0) @binding(2) var<storage, read> q: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read_write> out: array<f32>;

var<workgroup> kv: array<f16, 2u * BKT * LDS>;
var<workgroup> s_sh: array<f32, NW * MS * BKT>;
var<workgroup> p_sh: array<f16, NW * MS * BKT>;
var<workgroup> ml_sh: array<vec2<f32>, BQ>;
var<workgroup> alpha_sh: array<f32, BQ>;  // online: each row's scale of this tile (1: none)
var<workgroup> grow_sh: array<u32, NWF>;  // online: 1 where a subgroup's rows need it this tile
const GROW: f32 = 5.5451774;              // online: 8 ln 2, so P <= 256

fn put4(i: u32, v: vec4<f32>) {
    let h = vec4<f16>(v);
    kv[i] = h.x;
    kv[i + 1u] = h.y;
    kv[i + 2u] = h.z;
    kv[i + 3u] = h.w;
}

// One thread's share of a K tile (and with v, of its V tile) as loaded: element i = lid + WG n of
// the tile (key i / D4, dims 4 (i % D4) ..), for n < BKT D4 / WG; converted when stored.
struct KVTile {
{{TILE_FIELDS}}
}

// Keys k0 .. k0 + BKT - 1 from the cache, zeros for keys past kmax (not this forward's, or not
// this split's).
fn fetch_tile(kv_head: u32, k0: u32, kmax: u32, v: bool, lid: u32) -> KVTile {
    var t = KVTile();
{{TILE_FETCH}}
    return t;
}

// A fetched tile into kv: K at 0, V (with v) at BKT LDS, as f16 rows of LDS.
fn store_tile(t: KVTile, v: bool, lid: u32) {
{{TILE_STORE}}
}

// The barrier after the previous tile's reads of kv, then tile k0 into kv (K; with v, V too) and a
// barrier. With prefetch the tile came into *tile a tile ago, and tile k0 + BKT's loads are
// issued into it now, in flight while this tile computes.
fn next_tile(tile: ptr<function, KVTile>, kv_head: u32, k0: u32, kmax: u32, v: bool, lid: u32) {
    workgroupBarrier();
// #if prefetch
    store_tile(*tile, v, lid);
    workgroupBarrier();
    if (k0 + BKT <= kmax) {
        *tile = fetch_tile(kv_head, k0 + BKT, kmax, v, lid);
    }
// #else
    store_tile(fetch_tile(kv_head, k0, kmax, v, lid), v, lid);
    workgroupBarrier();
// #endif
}

fn visible(key: u32, pos: u32, kmin: u32, kmax: u32) -> bool {
    return key >= kmin && key <= kmax && key <= pos && (params.window == 0u || key + params.window > pos);
}

// The larger of m and this lane's visible scores of tile k0 (row r, keys part + LPR i) in s_sh.
fn tile_max(k0: u32, pos: u32, kmin: u32, kmax: u32, sbase: u32, r: u32, part: u32, m: f32) -> f32 {
    var mx = m;
    for (var i = 0u; i < CPL; i++) {
        let c = i * LPR + part;
        if (visible(k0 + c, pos, kmin, kmax)) {
            mx = max(mx, s_sh[sbase + c * MS + r]);
        }
    }
    return mx;
}

// P = exp(S - m) of the same keys (0 where hidden), rounded to f16 into p_sh, each added to *l.
fn tile_weights(k0: u32, pos: u32, kmin: u32, kmax: u32, sbase: u32, r: u32, part: u32, m: f32, l: ptr<function, f32>) {
    for (var i = 0u; i < CPL; i++) {
        let c = i * LPR + part;
        var p = 0.0;
        if (visible(k0 + c, pos, kmin, kmax)) {
            p = exp(s_sh[sbase + c * MS + r] - m);
        }
        let p16 = f16(p);
        *l += f32(p16);
        p_sh[sbase + c * MS + r] = p16;
    }
}

// Row r of this subgroup (position pos)'s value at dims d .. of its output: o / l, or with CHUNK
// the partial (o, and at d 0 the row's m and l) of split z.
fn store(z: u32, t: u32, h: u32, d: u32, o: f32, ml: vec2<f32>) {
    if (CHUNK == 0u) {
        out[(t * params.num_heads + h) * HEAD_DIM + d] = o / ml.y;
        return;
    }
    let i = ((t * params.num_heads + h) * params.max_splits + z) * (HEAD_DIM + 2u);
    out[i + d] = o;
    if (d == 0u) {
        out[i + HEAD_DIM] = ml.x;
        out[i + HEAD_DIM + 1u] = ml.y;
    }
}

@compute @workgroup_size(WG)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
    @builtin(subgroup_id) sg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
) {
    let h = wid.y;
    let kv_head = h / (params.num_heads / params.num_kv_heads);
    let block = query_block(wid, BQ, CHUNK);
    if (block.none) {
        return;  // no row of the block reaches this split (uniform: before any barrier)
    }
    let t0 = block.t0;  // the block's first row
    let first = block.first;  // position of the block's first row
    let kmin = block.kmin;
    let kmax = block.kmax;
    // Q times the scale, in f16, into kv: rows past the prompt read zeros (never stored).
    for (var i = lid; i < BQ * D4; i += WG) {
        let t = t0 + i / D4;
        var v = vec4<f32>();
        if (t < params.tokens) {
            v = q[(t * params.num_heads + h) * D4 + i % D4] * params.scale;
        }
        put4(i / D4 * LDS + 4u * (i % D4), v);
    }
    workgroupBarrier();
{{Q_LOAD}}
    let r = lane % MS;     // this lane's row of the subgroup's MS
    let part = lane / MS;  // and its keys of a tile: part + LPR i
    let pos = first + sg * MS + r;
    let sbase = sg * MS * BKT;  // this subgroup's scores (column c at sbase + c MS) and P
    let kfirst = kmin - kmin % BKT;

    var m = NEG;
// #if online
    // One pass: the tile's scores, m raised where they exceed it by more than GROW (O and l
    // rescaled), then P = exp(S - m) and O += P V.
    var l = 0.0;
{{O_DECL}}
    var tile = KVTile();
// #if prefetch
    tile = fetch_tile(kv_head, kfirst, kmax, true, lid);
// #endif
    for (var k0 = kfirst; k0 <= kmax; k0 += BKT) {
        next_tile(&tile, kv_head, k0, kmax, true, lid);
{{S_BODY}}
        workgroupBarrier();
        var tm = tile_max(k0, pos, kmin, kmax, sbase, r, part, NEG);
        for (var x = MS; x < SG; x *= 2u) {  // over the lanes of row r
            tm = max(tm, subgroupShuffleXor(tm, x));
        }
        var alpha = 1.0;
        if (tm > m + GROW) {
            if (m > NEG) {
                alpha = exp(m - tm);  // the row's O so far is rescaled below
            }
            m = tm;
        }
        l *= alpha;
        tile_weights(k0, pos, kmin, kmax, sbase, r, part, m, &l);
        if (part == 0u) {
            alpha_sh[sg * MS + r] = alpha;
        }
        let grow = subgroupAny(alpha != 1.0);
        if (lane == 0u) {
            grow_sh[sg] = select(0u, 1u, grow);
        }
        let grows = workgroupUniformLoad(&grow_sh);  // a barrier: P, alpha_sh visible, s_sh free
        var any = 0u;
        for (var i = 0u; i < NW; i++) {
            any |= grows[i];
        }
        if (any != 0u) {
{{RESCALE}}
        }
{{PV_BODY}}
    }
// #else
    // Pass 1: each row's maximum visible score.
    var tile = KVTile();  // with prefetch, the next tile's loads
// #if prefetch
    tile = fetch_tile(kv_head, kfirst, kmax, false, lid);
// #endif
    for (var k0 = kfirst; k0 <= kmax; k0 += BKT) {
        next_tile(&tile, kv_head, k0, kmax, false, lid);
{{S_BODY}}
        workgroupBarrier();
        m = tile_max(k0, pos, kmin, kmax, sbase, r, part, m);
    }
    for (var x = MS; x < SG; x *= 2u) {  // over the lanes of row r
        m = max(m, subgroupShuffleXor(m, x));
    }

    // Pass 2: P = exp(S - m) in f16, O += P V, l = the sum of the rounded P.
    var l = 0.0;
{{O_DECL}}
// #if prefetch
    tile = fetch_tile(kv_head, kfirst, kmax, true, lid);
// #endif
    for (var k0 = kfirst; k0 <= kmax; k0 += BKT) {
        next_tile(&tile, kv_head, k0, kmax, true, lid);
{{S_BODY}}
        workgroupBarrier();
        tile_weights(k0, pos, kmin, kmax, sbase, r, part, m, &l);
        workgroupBarrier();
{{PV_BODY}}
    }
// #endif
    for (var x = MS; x < SG; x *= 2u) {
        l += subgroupShuffleXor(l, x);
    }
    if (part == 0u) {
        ml_sh[sg * MS + r] = vec2<f32>(m, l);
    }
    // The output matrices through s_sh, MS x MS at a time.
{{STORE}}
}
