// Shared by the attention kernels: Params, Step, and reads of one layer's KV cache
// ([KV, capacity, hd], f32 or f16 pairs), 4 values at a time (head_dim is a multiple of 4).

struct Params {
    num_heads: u32,
    num_kv_heads: u32,
    head_dim: u32,
    tokens: u32,
    capacity: u32,
    max_splits: u32,  // stride of the decode partials (splits per query row and head)
    scale: f32,       // 1 / sqrt(head_dim)
    window: u32,      // sliding window (0: none): position p sees keys p - window < k <= p
}

struct Step {
    start: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<uniform> step: Step;

// raw_k4 / raw_v4 return the 4 values as stored (KVRaw), kv_unpack converts them: a kernel may
// keep raw loads in flight and convert them later.
// #if kv_f16
@group(0) @binding(3) var<storage, read> k_cache: array<vec2<u32>>;
@group(0) @binding(4) var<storage, read> v_cache: array<vec2<u32>>;

alias KVRaw = vec2<u32>;

fn kv_unpack(w: KVRaw) -> vec4<f32> {
    return vec4<f32>(unpack2x16float(w.x), unpack2x16float(w.y));
}
// #else
@group(0) @binding(3) var<storage, read> k_cache: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read> v_cache: array<vec4<f32>>;

alias KVRaw = vec4<f32>;

fn kv_unpack(w: KVRaw) -> vec4<f32> {
    return w;
}
// #endif

fn raw_k4(kv_head: u32, pos: u32, c4: u32) -> KVRaw {
    return k_cache[(kv_head * params.capacity + pos) * (HEAD_DIM / 4u) + c4];
}

fn raw_v4(kv_head: u32, pos: u32, c4: u32) -> KVRaw {
    return v_cache[(kv_head * params.capacity + pos) * (HEAD_DIM / 4u) + c4];
}

fn load_k4(kv_head: u32, pos: u32, c4: u32) -> vec4<f32> {
    return kv_unpack(raw_k4(kv_head, pos, c4));
}

fn load_v4(kv_head: u32, pos: u32, c4: u32) -> vec4<f32> {
    return kv_unpack(raw_v4(kv_head, pos, c4));
}
