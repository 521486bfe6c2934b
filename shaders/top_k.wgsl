// top_k: the k largest values of each row and their indices, descending (lowest index first on
// ties), by repeated selection in two passes; only tokens * k pairs are read back.
// Bindings: params, x [tokens, cols], partial [tokens, chunks, k] candidates, out [tokens, k].
// Pairs are (value bits, index); an exhausted chunk yields (NEG_BIG, NO_INDEX). NaN and inf rank
// above every finite value (rank_key) and the first pair carries the logit's own bits, so a
// non-finite row shows in out[t, 0] (the finite check of sample.wgsl and of the CPU sampler).
// chunks: grid (chunks, tokens): each workgroup selects the k best of its ITEMS WG values.
// main:   grid (1, tokens): selects the k best of the row's chunks * k candidates.
// Sampling's variant (PER_CHUNK = m > 0, kjarni/gpu/sampling.py): chunk w holds the columns
// w, w + chunks, w + 2 chunks, .. (a row's best spread evenly over the chunks whatever the ids) and
// keeps only its m best, so the chunk pass runs m rounds instead of k. Main still selects k; when
// it takes some chunk's m-th candidate, that chunk may hold more of the k best, and it writes
// out[tokens * k + t] = (1, 0) ("incomplete": the sampler leaves the draw to the CPU), else (0, 0).

struct Params {
    cols: u32,
    tokens: u32,
    chunks: u32,
    k: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> partial: array<vec2<u32>>;
@group(0) @binding(3) var<storage, read_write> out: array<vec2<u32>>;

override WG: u32 = 256u;
override PER_CHUNK: u32 = 0u;
const ITEMS: u32 = 8u;

var<workgroup> took_last: u32;  // main, PER_CHUNK > 0: some chunk's m-th candidate was taken

fn per_chunk() -> u32 {
    return select(params.k, PER_CHUNK, PER_CHUNK > 0u);
}

// The column of item `slot` (= i WG + lid) of chunk `chunk`, and back.
fn column(chunk: u32, slot: u32) -> u32 {
    return select(chunk * ITEMS * WG + slot, slot * params.chunks + chunk, PER_CHUNK > 0u);
}

fn slot_of(c: u32) -> u32 {
    return select(c % (ITEMS * WG), c / params.chunks, PER_CHUNK > 0u);
}

// #include reduce.wgsl

@compute @workgroup_size(WG)
fn chunks(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
// #if subgroup
    @builtin(subgroup_id) sg_id: u32,
    @builtin(num_subgroups) sg_count: u32,
    @builtin(subgroup_invocation_id) sg_lane: u32,
// #endif
) {
// #if subgroup
    let sg = vec3<u32>(sg_id, sg_count, sg_lane);
// #else
    let sg = vec3<u32>(0u);
// #endif
    let t = wid.y;
    var vals: array<f32, ITEMS>;
    var live = 0u;  // bit i: item i not yet taken
    let m = per_chunk();
    for (var i = 0u; i < ITEMS; i++) {
        let c = column(wid.x, i * WG + lid);
        if (c < params.cols) {
            vals[i] = rank_key(x[t * params.cols + c]);
            live |= 1u << i;
        }
    }
    for (var n = 0u; n < m; n++) {
        var bv = NEG_BIG;
        var bi = NO_INDEX;
        for (var i = 0u; i < ITEMS; i++) {
            let c = column(wid.x, i * WG + lid);
            if ((live & (1u << i)) != 0u && beats(vals[i], c, bv, bi)) { bv = vals[i]; bi = c; }
        }
        let best = workgroup_argmax(bv, bi, lid, sg);
        if (best.y != NO_INDEX && slot_of(best.y) % WG == lid) {
            live &= ~(1u << (slot_of(best.y) / WG));
        }
        if (lid == 0u) {
            partial[(t * params.chunks + wid.x) * m + n] = best;
        }
    }
}

@compute @workgroup_size(WG)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
// #if subgroup
    @builtin(subgroup_id) sg_id: u32,
    @builtin(num_subgroups) sg_count: u32,
    @builtin(subgroup_invocation_id) sg_lane: u32,
// #endif
) {
// #if subgroup
    let sg = vec3<u32>(sg_id, sg_count, sg_lane);
// #else
    let sg = vec3<u32>(0u);
// #endif
    let t = wid.y;
    let m = per_chunk();
    let n_cand = params.chunks * m;
    let base = t * n_cand;
    if (lid == 0u) { took_last = 0u; }
    for (var n = 0u; n < params.k; n++) {
        var bv = NEG_BIG;
        var bi = NO_INDEX;
        var bj = 0u;
        for (var j = lid; j < n_cand; j += WG) {
            let p = partial[base + j];
            if (beats(bitcast<f32>(p.x), p.y, bv, bi)) { bv = bitcast<f32>(p.x); bi = p.y; bj = j; }
        }
        let best = workgroup_argmax(bv, bi, lid, sg);
        if (best.y != NO_INDEX && best.y == bi) {
            // This thread holds the winner (indices are unique): take it out of the running.
            partial[base + bj] = vec2<u32>(bitcast<u32>(NEG_BIG), NO_INDEX);
            if (PER_CHUNK > 0u && bj % m == m - 1u) { took_last = 1u; }
        }
        if (lid == 0u) {
            var pair = best;
            if (n == 0u && best.y != NO_INDEX) {
                pair.x = bitcast<u32>(x[t * params.cols + best.y]);  // NaN / inf as they are
            }
            out[t * params.k + n] = pair;
        }
    }
    if (PER_CHUNK > 0u) {
        workgroupBarrier();
        if (lid == 0u) {
            out[params.tokens * params.k + t] = vec2<u32>(took_last, 0u);
        }
    }
}
