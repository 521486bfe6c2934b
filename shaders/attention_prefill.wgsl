// attention_prefill: causal grouped-query attention for a block of query rows, FlashAttention
// style: keys and values stream through workgroup memory in tiles of BK positions and each
// thread keeps its query row's running max, sum and output (online softmax); no score matrix.
// Bindings: params, step, q [tokens, H hd], k_cache, v_cache, out [tokens, H hd].
// Grid: (ceil(tokens / BQ), H); thread lid owns query row BQ wid.x + lid at position step.start + row.
// out[t, h] = softmax(q k^T * scale, keys 0 ..= start + t) v; with a sliding window only keys
// k > start + t - window.

override HEAD_DIM: u32 = 64u;
override BQ: u32 = 32u;
const BK: u32 = 16u;
const MAX_D4: u32 = 64u;  // replaced by HEAD_DIM / 4 when the pipeline is made (private arrays need a const size)

// #include attention_kv.wgsl

fn visible(key: u32, pos: u32) -> bool {
    return key <= pos && (params.window == 0u || key + params.window > pos);
}

@group(0) @binding(2) var<storage, read> q: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read_write> out: array<vec4<f32>>;

var<workgroup> k_sh: array<vec4<f32>, BK * HEAD_DIM / 4u>;
var<workgroup> v_sh: array<vec4<f32>, BK * HEAD_DIM / 4u>;

@compute @workgroup_size(BQ)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let h = wid.y;
    let d4 = HEAD_DIM / 4u;
    let kv_head = h / (params.num_heads / params.num_kv_heads);
    let t = wid.x * BQ + lid;
    let valid = t < params.tokens;
    let pos = step.start + t;
    let row = (t * params.num_heads + h) * d4;
    var qr: array<vec4<f32>, MAX_D4>;
    var acc: array<vec4<f32>, MAX_D4>;
    if (valid) {
        for (var i = 0u; i < d4; i++) {
            qr[i] = q[row + i] * params.scale;
        }
    }
    var m = -3.0e38;
    var l = 0.0;
    let last = step.start + min(wid.x * BQ + BQ, params.tokens) - 1u;  // last position of the block
    let tiles = last / BK + 1u;
    for (var tile = 0u; tile < tiles; tile++) {
        workgroupBarrier();
        for (var i = lid; i < BK * d4; i += BQ) {
            let key = tile * BK + i / d4;
            let c4 = i % d4;
            if (key <= last) {
                k_sh[i] = load_k4(kv_head, key, c4);
                v_sh[i] = load_v4(kv_head, key, c4);
            }
        }
        workgroupBarrier();
        if (valid && tile * BK <= pos) {
            var s: array<f32, BK>;
            var tile_max = -3.0e38;
            for (var j = 0u; j < BK; j++) {
                s[j] = -3.0e38;
                if (visible(tile * BK + j, pos)) {
                    var dot_qk = 0.0;
                    for (var i = 0u; i < d4; i++) {
                        dot_qk += dot(qr[i], k_sh[j * d4 + i]);
                    }
                    s[j] = dot_qk;
                    tile_max = max(tile_max, dot_qk);
                }
            }
            let m_new = max(m, tile_max);
            let correction = exp(m - m_new);
            l *= correction;
            for (var i = 0u; i < d4; i++) {
                acc[i] *= correction;
            }
            for (var j = 0u; j < BK; j++) {
                if (visible(tile * BK + j, pos)) {
                    let p = exp(s[j] - m_new);
                    l += p;
                    for (var i = 0u; i < d4; i++) {
                        acc[i] += p * v_sh[j * d4 + i];
                    }
                }
            }
            m = m_new;
        }
    }
    if (valid) {
        let inv = 1.0 / l;
        for (var i = 0u; i < d4; i++) {
            out[row + i] = acc[i] * inv;
        }
    }
}
