// attention_single (decode, short context, one pass): out[t, h] = softmax(q k^T * scale) v for
// query row t (position p = step.start + t) and head h over cache positions [lo, p], lo = 0 or,
// with a sliding window, max(0, p + 1 - window). At most MAX_KEYS positions (the caller uses
// attention_decode + attention_combine beyond that).
// Bindings: params, step, q [tokens, H hd], k_cache, v_cache, out [tokens, H hd].
// Grid: (H, tokens). One workgroup of WG threads per (head, query row): scores of keys lid,
// lid + WG, .. into workgroup memory, workgroup max and sum, then thread lid sums dims
// 4 (lid % (hd/4)) .. over keys lid / (hd/4), + WG / (hd/4), .. and the partial outputs are added.

override HEAD_DIM: u32 = 64u;
override WG: u32 = 256u;
const MAX_KEYS: u32 = 2048u;

// #include attention_kv.wgsl
// #include reduce.wgsl

@group(0) @binding(2) var<storage, read> q: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read_write> out: array<vec4<f32>>;

var<workgroup> q_sh: array<vec4<f32>, HEAD_DIM / 4u>;
var<workgroup> p_sh: array<f32, MAX_KEYS>;
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
    let t = wid.y;
    let kv_head = h / (params.num_heads / params.num_kv_heads);
    let length = step.start + t + 1u;
    let lo = select(0u, length - min(length, params.window), params.window > 0u);
    let n = min(length - lo, MAX_KEYS);
    let d4 = HEAD_DIM / 4u;
    let q_base = (t * params.num_heads + h) * d4;
    for (var i = lid; i < d4; i += WG) {
        q_sh[i] = q[q_base + i] * params.scale;
    }
    workgroupBarrier();
    var m_local = NEG_BIG;
    for (var j = lid; j < n; j += WG) {
        var acc = 0.0;
        for (var i = 0u; i < d4; i++) {
            acc += dot(q_sh[i], load_k4(kv_head, lo + j, i));
        }
        p_sh[j] = acc;
        m_local = max(m_local, acc);
    }
    let m = workgroup_max(m_local, lid, sg);
    var l_local = 0.0;
    for (var j = lid; j < n; j += WG) {
        let p = exp(p_sh[j] - m);
        p_sh[j] = p;
        l_local += p;
    }
    let l = workgroup_sum(l_local, lid, sg);  // its barriers also publish p_sh
    let c4 = lid % d4;
    let lanes = WG / d4;  // key subsets summed in parallel
    var o = vec4<f32>(0.0);
    if (lid < lanes * d4) {
        for (var j = lid / d4; j < n; j += lanes) {
            o += p_sh[j] * load_v4(kv_head, lo + j, c4);
        }
    }
    o_sh[lid] = o;
    workgroupBarrier();
    if (lid < d4) {
        var total = vec4<f32>(0.0);
        for (var k = 0u; k < lanes; k++) {
            total += o_sh[k * d4 + lid];
        }
        out[q_base + lid] = total / l;
    }
}
