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

// The prefill kernels' block (attention_tiled, attention_tc): workgroup wid's BQ = bq query rows
// from wid.x bq (rows of them in the prompt) at positions first ..= last, and the keys kmin ..=
// kmax they read (the window's; with chunk > 0 also split wid.z's); none: no row of the block
// reaches that split, and the workgroup returns before any barrier.
struct QueryBlock {
    t0: u32,
    rows: u32,
    first: u32,
    last: u32,
    kmin: u32,
    kmax: u32,
    none: bool,
}

fn query_block(wid: vec3<u32>, bq: u32, chunk: u32) -> QueryBlock {
    var b: QueryBlock;
    b.t0 = wid.x * bq;
    b.rows = min(bq, params.tokens - b.t0);
    b.first = step.start + b.t0;
    b.last = step.start + b.t0 + b.rows - 1u;
    b.kmin = 0u;
    if (params.window != 0u && b.first + 1u > params.window) {
        b.kmin = b.first + 1u - params.window;
    }
    b.kmax = b.last;
    b.none = false;
    if (chunk > 0u) {
        b.none = wid.z * chunk > b.last;
        b.kmin = max(b.kmin, wid.z * chunk);
        b.kmax = min(b.last, wid.z * chunk + chunk - 1u);
    }
    return b;
}
