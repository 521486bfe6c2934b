// argmax: the index of each row's largest value (lowest index on ties), in two passes, and
// whether the row is finite: NaN and inf rank above everything (rank_key), so the winner shows it.
// Bindings: params, x [tokens, cols], partial [tokens, chunks] (value bits, index),
// out [2 tokens]: the ids, then a status per row (0: finite, 1: a NaN or an inf somewhere; the id
// is then 0, a valid row for an embedding recorded before the status is read).
// chunks: grid (chunks, tokens), workgroup (c, t) reduces x[t, ITEMS WG c ..][:ITEMS WG] to partial.
// main:   grid (1, tokens), reduces partial[t, :] and writes out[t].

struct Params {
    cols: u32,
    tokens: u32,
    chunks: u32,
    k: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> partial: array<vec2<u32>>;
@group(0) @binding(3) var<storage, read_write> out: array<u32>;

override WG: u32 = 256u;
const ITEMS: u32 = 8u;

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
    var bv = NEG_BIG;
    var bi = NO_INDEX;
    for (var i = 0u; i < ITEMS; i++) {
        let c = (wid.x * ITEMS + i) * WG + lid;
        if (c < params.cols) {
            let v = rank_key(x[t * params.cols + c]);
            if (beats(v, c, bv, bi)) { bv = v; bi = c; }
        }
    }
    let best = workgroup_argmax(bv, bi, lid, sg);
    if (lid == 0u) {
        partial[t * params.chunks + wid.x] = best;
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
    var bv = NEG_BIG;
    var bi = NO_INDEX;
    for (var c = lid; c < params.chunks; c += WG) {
        let p = partial[t * params.chunks + c];
        if (beats(bitcast<f32>(p.x), p.y, bv, bi)) { bv = bitcast<f32>(p.x); bi = p.y; }
    }
    let best = workgroup_argmax(bv, bi, lid, sg);
    if (lid == 0u) {
        let bad = best.y == NO_INDEX || is_bad_logit(x[t * params.cols + min(best.y, params.cols - 1u)]);
        out[t] = select(best.y, 0u, bad);
        out[params.tokens + t] = select(0u, 1u, bad);
    }
}
