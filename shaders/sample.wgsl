// sample: the next token drawn from a row's n = top_k + 1 best logits (top_k.wgsl's output), the
// way kjarni.sampling.Sampler.sample_candidates draws it from the same candidates and draw:
//   scaled = logit / temperature, ranked by (scaled desc, id asc); a tie between ranks k - 1 and k
//   leaves the token undecided (top-k keeps every tied token, and some may be missing); keep the
//   first k; top-p keeps ranks whose probability mass ahead is below top_p; min-p keeps
//   probabilities >= min_p x the largest; the token is the first in id order whose cumulative
//   weight exceeds u x the total, u being the step's uniform draw in [0, 1).
// Bindings: params, draw (the step's u), candidates [n] (value bits, index; out[0] carries the
// logit's own bits; where params.flagged, then top_k's "incomplete" flag), out [2]: (token, status). Status 0: drawn; 1: the logits are not finite
// (a NaN or an inf somewhere, ranked first by top_k; token 0); 2: undecided, or incomplete (token: the best candidate, so the
// step it feeds stays valid). Grid (1, 1, 1): one thread per candidate, n <= WG.
// Float32 throughout (numpy uses float64): the token can differ only where u falls within rounding
// of a boundary between two tokens' cumulative probabilities, or the mass ahead within rounding of top_p.

struct Params {
    n: u32,
    top_k: u32,
    temperature: f32,
    top_p: f32,
    min_p: f32,
    flagged: u32,
    _pad1: u32,
    _pad2: u32,
}

struct Draw {
    u: f32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<uniform> draw: Draw;
@group(0) @binding(2) var<storage, read> candidates: array<vec2<u32>>;
@group(0) @binding(3) var<storage, read_write> out: array<u32>;

override WG: u32 = 256u;

// #include reduce.wgsl

var<workgroup> scaled: array<f32, WG>;  // by candidate
var<workgroup> ids: array<u32, WG>;
var<workgroup> valid: array<u32, WG>;
var<workgroup> ranked_v: array<f32, WG>;  // by rank
var<workgroup> ranked_id: array<u32, WG>;
var<workgroup> weight: array<f32, WG>;  // exp(scaled - best) by rank; 0 once filtered out
var<workgroup> valid_count: atomic<u32>;
var<workgroup> chosen: atomic<u32>;  // lowest id whose cumulative weight passes the draw
var<workgroup> last: atomic<u32>;  // highest id with weight > 0 (where rounding leaves none past it)

fn is_finite_value(v: f32) -> bool {
    return (bitcast<u32>(v) & 0x7f800000u) != 0x7f800000u;
}

fn sum_weights(count: u32) -> f32 {
    var s = 0.0;
    for (var j = 0u; j < count; j++) { s += weight[j]; }
    return s;
}

@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_index) lid: u32) {
    if (lid == 0u) {
        atomicStore(&valid_count, 0u);
        atomicStore(&chosen, NO_INDEX);
        atomicStore(&last, 0u);
    }
    // Scale; a missing candidate (NO_INDEX) or a non-finite scaled value drops out, as numpy's
    // np.isfinite filter drops it.
    var v = 0.0;
    var id = NO_INDEX;
    var ok = false;
    if (lid < params.n) {
        let c = candidates[lid];
        id = c.y;
        v = bitcast<f32>(c.x) / params.temperature;
        ok = id != NO_INDEX && is_finite_value(v);
    }
    scaled[lid] = v;
    ids[lid] = id;
    valid[lid] = select(0u, 1u, ok);
    workgroupBarrier();
    if (ok) {
        atomicAdd(&valid_count, 1u);
        var rank = 0u;
        for (var j = 0u; j < params.n; j++) {
            if (valid[j] != 0u && (scaled[j] > v || (scaled[j] == v && ids[j] < id))) { rank++; }
        }
        ranked_v[rank] = v;
        ranked_id[rank] = id;
    }
    let count = workgroupUniformLoad(&valid_count);
    let k = params.top_k;
    let undecided = count > k && ranked_v[k] == ranked_v[k - 1u];
    let m = min(count, k);

    // Top-k survivors' weights, then top-p over them (rank 0 always stays).
    var e = 0.0;
    if (lid < m) { e = exp(ranked_v[lid] - ranked_v[0]); }
    weight[lid] = e;
    workgroupBarrier();
    if (params.top_p < 1.0) {
        let total = sum_weights(m);
        var ahead = 0.0;
        for (var j = 0u; j < lid && j < m; j++) { ahead += weight[j] / total; }
        workgroupBarrier();
        if (lid > 0u && ahead >= params.top_p) { e = 0.0; }
        weight[lid] = e;
        workgroupBarrier();
    }
    // Min-p against the top token's probability (rank 0's weight is exp(0) = 1).
    if (params.min_p > 0.0) {
        let total = sum_weights(m);
        workgroupBarrier();
        if (e / total < params.min_p * (1.0 / total)) { e = 0.0; }
        weight[lid] = e;
        workgroupBarrier();
    }

    // The draw: cumulative weight in id order, as numpy's cumsum over ascending ids.
    let total = sum_weights(m);
    if (e > 0.0) {
        let mine = ranked_id[lid];
        var cumulative = 0.0;
        for (var j = 0u; j < m; j++) {
            if (ranked_id[j] <= mine) { cumulative += weight[j]; }
        }
        if (cumulative > draw.u * total) { atomicMin(&chosen, mine); }
        atomicMax(&last, mine);
    }
    workgroupBarrier();
    if (lid == 0u) {
        let first = candidates[0];
        var token = atomicLoad(&chosen);
        if (token == NO_INDEX) { token = atomicLoad(&last); }
        var status = 0u;
        if (first.y == NO_INDEX || is_bad_logit(bitcast<f32>(first.x))) {
            token = 0u;
            status = 1u;
        } else if (undecided || (params.flagged != 0u && candidates[params.n].x != 0u)) {
            token = ranked_id[0];
            status = 2u;
        }
        out[0] = token;
        out[1] = status;
    }
}
