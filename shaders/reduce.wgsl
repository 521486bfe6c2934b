// Workgroup reductions shared by several kernels (included; the includer defines `override WG`).
// `sg` is (subgroup_id, num_subgroups, subgroup_invocation_id) in the subgroup variant and
// unused otherwise. Call from uniform control flow: they contain barriers.

const NEG_BIG: f32 = -3.0e38;  // "minus infinity" for maxima (WGSL has no infinity literal)
const NO_INDEX: u32 = 0xffffffffu;
const F32_MAX: f32 = 0x1.fffffep+127f;  // the largest f32 (hex: Tint refuses the rounded decimal 3.40282347e38)

// Set false only to measure what the finite check costs (tools/bench_gpu.py).
override FINITE_CHECK: bool = true;

// NaN or an inf (kjarni/ops.py: a row holding one has no valid choice). Tested on the bits: a
// shader compiler may assume floats are never NaN or inf and fold a float comparison away.
fn is_bad_logit(v: f32) -> bool {
    return FINITE_CHECK && (bitcast<u32>(v) & 0x7f800000u) == 0x7f800000u;
}

// The value argmax and top_k rank by: a bad logit ranks above every finite one, so the row's
// winner is bad exactly when some logit is (the finite check costs no extra pass).
fn rank_key(v: f32) -> f32 {
    return select(v, F32_MAX, is_bad_logit(v));
}

var<workgroup> reduce_v: array<f32, WG>;
var<workgroup> reduce_i: array<u32, WG>;

fn workgroup_sum(v: f32, lid: u32, sg: vec3<u32>) -> f32 {
// #if subgroup
    let s = subgroupAdd(v);
    if (sg.z == 0u) { reduce_v[sg.x] = s; }
    let parts = sg.y;
// #else
    reduce_v[lid] = v;
    let parts = WG;
// #endif
    workgroupBarrier();
    var total = 0.0;
    for (var i = 0u; i < parts; i++) { total += reduce_v[i]; }
    workgroupBarrier();
    return total;
}

fn workgroup_max(v: f32, lid: u32, sg: vec3<u32>) -> f32 {
// #if subgroup
    let s = subgroupMax(v);
    if (sg.z == 0u) { reduce_v[sg.x] = s; }
    let parts = sg.y;
// #else
    reduce_v[lid] = v;
    let parts = WG;
// #endif
    workgroupBarrier();
    var best = NEG_BIG;
    for (var i = 0u; i < parts; i++) { best = max(best, reduce_v[i]); }
    workgroupBarrier();
    return best;
}

// (v, i) beats (w, j) when v > w, or v == w and i < j: the lowest index wins ties.
fn beats(v: f32, i: u32, w: f32, j: u32) -> bool {
    return v > w || (v == w && i < j);
}

// The winning (value, index) of the workgroup, returned to every thread.
fn workgroup_argmax(v: f32, idx: u32, lid: u32, sg: vec3<u32>) -> vec2<u32> {
// #if subgroup
    let m = subgroupMax(v);
    let mi = subgroupMin(select(NO_INDEX, idx, v == m));
    if (sg.z == 0u) { reduce_v[sg.x] = m; reduce_i[sg.x] = mi; }
    let parts = sg.y;
// #else
    reduce_v[lid] = v;
    reduce_i[lid] = idx;
    let parts = WG;
// #endif
    workgroupBarrier();
    var bv = NEG_BIG;
    var bi = NO_INDEX;
    for (var i = 0u; i < parts; i++) {
        if (beats(reduce_v[i], reduce_i[i], bv, bi)) { bv = reduce_v[i]; bi = reduce_i[i]; }
    }
    workgroupBarrier();
    return vec2<u32>(bitcast<u32>(bv), bi);
}
