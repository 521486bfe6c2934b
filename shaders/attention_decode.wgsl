// attention_decode (flash-decoding, first pass): query row t (position p = step.start + t) and
// head h against cache positions [WG split, WG split + WG) ∩ [lo, p], lo = 0 or, with a sliding
// window, max(0, p + 1 - window). Writes the chunk's
// unnormalised output o = sum_j exp(s_j - m) v_j, its max score m and sum l = sum_j exp(s_j - m)
// to partial[((t H + h) max_splits + split) (hd + 2) ..]; attention_combine merges the chunks.
// Bindings: params, step, q [tokens, H hd], k_cache, v_cache, partial. Grid: (H, splits, tokens).
// One thread per key for the scores; for the output, thread lid sums dims 4 (lid % (hd/4)) ..
// over keys lid / (hd/4), + WG / (hd/4), ...

override HEAD_DIM: u32 = 64u;
override WG: u32 = 64u;  // keys per split

// #include attention_kv.wgsl
// #include reduce.wgsl

@group(0) @binding(2) var<storage, read> q: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read_write> partial: array<f32>;

var<workgroup> q_sh: array<vec4<f32>, HEAD_DIM / 4u>;
var<workgroup> p_sh: array<f32, WG>;
var<workgroup> o_sh: array<vec4<f32>, WG>;

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
    let h = wid.x;
    let split = wid.y;
    let t = wid.z;
    let kv_head = h / (params.num_heads / params.num_kv_heads);
    let length = step.start + t + 1u;
    let lo = select(0u, length - min(length, params.window), params.window > 0u);
    let d4 = HEAD_DIM / 4u;
    let q_base = (t * params.num_heads + h) * d4;
    for (var i = lid; i < d4; i += WG) {
        q_sh[i] = q[q_base + i] * params.scale;
    }
    workgroupBarrier();
    let key = split * WG + lid;
    var s = NEG_BIG;
    let seen = key >= lo && key < length;
    if (seen) {
        var acc = 0.0;
        for (var i = 0u; i < d4; i++) {
            acc += dot(q_sh[i], load_k4(kv_head, key, i));
        }
        s = acc;
    }
    let m = workgroup_max(s, lid, sg);
    let p = select(0.0, exp(s - m), seen);
    p_sh[lid] = p;
    let l = workgroup_sum(p, lid, sg);
    let c4 = lid % d4;
    let lanes = WG / d4;  // key subsets summed in parallel
    var o = vec4<f32>(0.0);
    if (lid < lanes * d4) {
        for (var j = lid / d4; j < WG; j += lanes) {
            let pos = split * WG + j;
            if (pos >= lo && pos < length) {
                o += p_sh[j] * load_v4(kv_head, pos, c4);
            }
        }
    }
    o_sh[lid] = o;
    workgroupBarrier();
    let out = ((t * params.num_heads + h) * params.max_splits + split) * (HEAD_DIM + 2u);
    if (lid < d4) {
        var total = vec4<f32>(0.0);
        for (var k = 0u; k < lanes; k++) {
            total += o_sh[k * d4 + lid];
        }
        partial[out + 4u * lid] = total.x;
        partial[out + 4u * lid + 1u] = total.y;
        partial[out + 4u * lid + 2u] = total.z;
        partial[out + 4u * lid + 3u] = total.w;
    }
    if (lid == 0u) {
        partial[out + HEAD_DIM] = m;
        partial[out + HEAD_DIM + 1u] = l;
    }
}
