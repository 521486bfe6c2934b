// attention_combine (flash-decoding, second pass): out[t, h] = sum_s e^(m_s - M) o_s / sum_s e^(m_s - M) l_s
// over the splits s covering positions [0, step.start + t], M = max_s m_s. A split is hd outputs
// then (m, l) and PAD - 2 floats unread.
// Bindings: params, step, partial (from attention_decode), out [tokens, H hd]; with the flag
// half also out16 (4), out rounded to f16 for a tensor-core product (what matmul_tc_prep.wgsl
// writes from out). Grid: (H, tokens).
// #if half

enable f16;
// #endif

override CHUNK: u32 = 64u;  // keys per split of attention_decode
override SPLITS: u32 = 0u;  // splits per row when fixed (attention_step's); 0: ceil(positions / CHUNK)
override PAD: u32 = 2u;     // floats after a split's hd outputs: (m, l), 4 for attention_step's vec4s

struct Params {
    num_heads: u32,
    num_kv_heads: u32,
    head_dim: u32,
    tokens: u32,
    capacity: u32,
    max_splits: u32,
    scale: f32,
    window: u32,
}

struct Step {
    start: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<uniform> step: Step;
@group(0) @binding(2) var<storage, read> partial: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
// #if half
@group(0) @binding(4) var<storage, read_write> out16: array<f16>;
// #endif

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let h = wid.x;
    let t = wid.y;
    let hd = params.head_dim;
    let splits = select((step.start + t + CHUNK) / CHUNK, SPLITS, SPLITS > 0u);  // ceil((start + t + 1) / CHUNK)
    let base = (t * params.num_heads + h) * params.max_splits;
    var m = -3.0e38;
    for (var s = 0u; s < splits; s++) {
        m = max(m, partial[(base + s) * (hd + PAD) + hd]);
    }
    var l = 0.0;
    for (var s = 0u; s < splits; s++) {
        let i = (base + s) * (hd + PAD) + hd;
        l += exp(partial[i] - m) * partial[i + 1u];
    }
    let dst = (t * params.num_heads + h) * hd;
    for (var d = lid; d < hd; d += 64u) {
        var o = 0.0;
        for (var s = 0u; s < splits; s++) {
            let i = (base + s) * (hd + PAD);
            o += exp(partial[i + hd] - m) * partial[i + d];
        }
        out[dst + d] = o / l;
// #if half
        out16[dst + d] = f16(o / l);
// #endif
    }
}
