// rope_store: rotate the first rotary_dim dims of each q and k head of a fused qkv activation (HF
// rotate-half RoPE at positions step.start + t; rotary_dim = 0: no rotation), write k and v into
// this layer's KV cache, write q.
// Bindings: params, step, qkv [tokens, (H + 2 KV) hd], rope [positions, rotary_dim] (cos | sin;
//   unread when rotary_dim = 0), k_cache / v_cache [KV, capacity, hd] (f32, or f16 pairs when
//   kv_f16), q [tokens, H hd].
// One thread per (token, head slot, 2 adjacent dims); head slots: H q, KV k, KV v.
// Grid: n = ceil(tokens (H + 2 KV) hd / 2 / 64) folded as (min(n, 32768), ceil(n / 32768)).
// With r = rotary_dim / 2: y[e] = x[e] cos - x[e + r] sin (e < r), x[e] cos + x[e - r] sin
// (r <= e < 2r), x[e] (e >= 2r); cos and sin of column e % r at the position.

struct Params {
    num_heads: u32,
    num_kv_heads: u32,
    head_dim: u32,
    tokens: u32,
    capacity: u32,
    rotary_dim: u32,
    _pad1: u32,
    _pad2: u32,
}

struct Step {
    start: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<uniform> step: Step;
@group(0) @binding(2) var<storage, read> qkv: array<f32>;
@group(0) @binding(3) var<storage, read> rope: array<f32>;
// #if kv_f16
@group(0) @binding(4) var<storage, read_write> k_cache: array<u32>;
@group(0) @binding(5) var<storage, read_write> v_cache: array<u32>;
// #else
@group(0) @binding(4) var<storage, read_write> k_cache: array<f32>;
@group(0) @binding(5) var<storage, read_write> v_cache: array<f32>;
// #endif
@group(0) @binding(6) var<storage, read_write> q: array<f32>;

fn store_k(i: u32, v: vec2<f32>) {
// #if kv_f16
    k_cache[i / 2u] = pack2x16float(v);
// #else
    k_cache[i] = v.x;
    k_cache[i + 1u] = v.y;
// #endif
}

fn store_v(i: u32, v: vec2<f32>) {
// #if kv_f16
    v_cache[i / 2u] = pack2x16float(v);
// #else
    v_cache[i] = v.x;
    v_cache[i + 1u] = v.y;
// #endif
}

fn rotated(head: u32, e: u32, pos: u32) -> f32 {
    let r = params.rotary_dim / 2u;
    let x = qkv[head + e];
    if (e >= 2u * r) {
        return x;
    }
    let c = pos * params.rotary_dim + e % r;
    if (e < r) {
        return x * rope[c] - qkv[head + e + r] * rope[c + r];
    }
    return x * rope[c] + qkv[head + e - r] * rope[c + r];
}

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let hd = params.head_dim;
    let pairs = hd / 2u;
    let slots = params.num_heads + 2u * params.num_kv_heads;
    let i = (wid.x + wid.y * nwg.x) * 64u + lid;
    if (i >= params.tokens * slots * pairs) {
        return;
    }
    let d = 2u * (i % pairs);
    let s = (i / pairs) % slots;
    let t = i / (pairs * slots);
    let pos = step.start + t;
    let head = t * slots * hd + s * hd;
    let kv_slot = s - params.num_heads;
    if (s >= params.num_heads + params.num_kv_heads) {
        store_v(((kv_slot - params.num_kv_heads) * params.capacity + pos) * hd + d, vec2<f32>(qkv[head + d], qkv[head + d + 1u]));
        return;
    }
    let y = vec2<f32>(rotated(head, d, pos), rotated(head, d + 1u, pos));
    if (s < params.num_heads) {
        let dst = t * params.num_heads * hd + s * hd + d;
        q[dst] = y.x;
        q[dst + 1u] = y.y;
    } else {
        store_k((kv_slot * params.capacity + pos) * hd + d, y);
    }
}
