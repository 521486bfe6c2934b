// rope_store: rotate q and k of a fused qkv activation (HF rotate-half RoPE at positions
// step.start + t), write k and v into this layer's KV cache, write the rotated q.
// Bindings: params, step, qkv [tokens, (H + 2 KV) hd], rope [positions, hd] (cos | sin),
//   k_cache / v_cache [KV, capacity, hd] (f32, or f16 pairs when kv_f16), q [tokens, H hd].
// One thread per (token, head slot, 2 adjacent rotation pairs); head slots: H q, KV k, KV v.
// Grid: n = ceil(tokens (H + 2 KV) hd / 4 / 64) folded as (min(n, 32768), ceil(n / 32768)).
// x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin for (x1, x2) = (x[d], x[d + hd / 2]).

struct Params {
    num_heads: u32,
    num_kv_heads: u32,
    head_dim: u32,
    tokens: u32,
    capacity: u32,
    _pad0: u32,
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

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let hd = params.head_dim;
    let half = hd / 2u;
    let quarter = hd / 4u;
    let slots = params.num_heads + 2u * params.num_kv_heads;
    let i = (wid.x + wid.y * nwg.x) * 64u + lid;
    if (i >= params.tokens * slots * quarter) {
        return;
    }
    let d = 2u * (i % quarter);
    let s = (i / quarter) % slots;
    let t = i / (quarter * slots);
    let pos = step.start + t;
    let src = t * slots * hd + s * hd + d;
    let x1 = vec2<f32>(qkv[src], qkv[src + 1u]);
    let x2 = vec2<f32>(qkv[src + half], qkv[src + half + 1u]);
    let kv_slot = s - params.num_heads;
    if (s >= params.num_heads + params.num_kv_heads) {
        let dst = ((kv_slot - params.num_kv_heads) * params.capacity + pos) * hd + d;
        store_v(dst, x1);
        store_v(dst + half, x2);
        return;
    }
    let r = pos * hd + d;
    let cos = vec2<f32>(rope[r], rope[r + 1u]);
    let sin = vec2<f32>(rope[r + half], rope[r + half + 1u]);
    let y1 = x1 * cos - x2 * sin;
    let y2 = x2 * cos + x1 * sin;
    if (s < params.num_heads) {
        let dst = t * params.num_heads * hd + s * hd + d;
        q[dst] = y1.x;
        q[dst + 1u] = y1.y;
        q[dst + half] = y2.x;
        q[dst + half + 1u] = y2.y;
    } else {
        let dst = (kv_slot * params.capacity + pos) * hd + d;
        store_k(dst, y1);
        store_k(dst + half, y2);
    }
}
