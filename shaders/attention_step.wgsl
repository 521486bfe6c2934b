// attention_step (decode: one token, short context): rope_store and attention_single in one
// dispatch. For head h at position p = step.start: q = rope(qkv's q head h) * scale; the kv head's
// k = rope(qkv's k head) and v are rounded as the cache stores them (f16 with kv_f16), written to
// the cache at p by the first q head of each kv group, and used from workgroup memory for key p
// by every head of the group (the others read keys lo .. p - 1 from the cache, which this
// dispatch does not write). out[h] = softmax(q k^T) v over positions [lo, p], lo = 0 or, with a
// sliding window, max(0, p + 1 - window). At most MAX_KEYS positions a workgroup (the host passes longer
// contexts to rope_store + attention_decode).
// Flash-decoding split (SPLITS > 1): grid (H, SPLITS, 1); workgroup (h, s) attends over the s-th
// run of C = ceil(n / SPLITS) of the n keys and writes, instead of out[h], its unnormalised
// o = sum_j exp(s_j - m) v_j and (m, l = sum_j exp(s_j - m)) to out as vec4s:
// [(h SPLITS + s) (hd / 4 + 1) ..] = o, then (m, l, 0, 0); a split past the last key writes
// o = 0, m = NEG_BIG, l = 0. The next matvec merges the splits while loading x
// (matvec.tmpl.wgsl with the attn flag), or attention_combine does (PAD 4).
// Bindings: params, step, qkv [1, (H + 2 KV) hd], rope [positions, rotary_dim] (cos | sin; unread
//   when rotary_dim = 0), k_cache / v_cache [KV, capacity, hd] (f32, or f16 pairs when kv_f16),
//   out [1, H hd] (SPLITS = 1). RoPE as rope_store.wgsl (rotate half over the first rotary_dim dims).
// Grid: (H, 1, 1), a workgroup of WG threads (a multiple of hd / 4). Scores: KL threads per key
// (KL divides hd / 4; summed with subgroupShuffleXor), two keys per trip with all their loads
// issued first, into workgroup memory; workgroup max and sum; then thread i accumulates dims
// 4 (i % (hd/4)) .. over the keys of subset i / (hd/4), four keys a trip (each trip's values
// loaded one trip ahead, the first before the scores), and the subsets' partial outputs are
// added by a tree through workgroup memory.
// LEAN (GpuTuning.attention_step_lean): fewer serial steps a workgroup: the new key is scored in
// the parallel score loop (from workgroup memory) instead of by one thread over all dims, the sum
// of the softmax takes one barrier (the last use of reduce_v), and the subsets' partial outputs
// are added by the first hd / 4 threads in one pass after one barrier instead of a tree.
// QREG (GpuTuning.attention_step_q_regs; the host sets it where a score lane holds at most QMAX
// vec4s of q, hd / 4 / KL): each score lane rotates its own vec4s of q into registers, so the
// cache keys are loaded and scored with no barrier before them (their loads overlap those of q
// and the RoPE table, as do those of the new key and value, made in registers before the loop,
// fresh_kv); the new key and value are stored (to workgroup memory and the cache, keep_kv) after
// that loop and the new key scored from workgroup memory behind the barrier that publishes it.
// The products and their order are the same.
// ONE_BARRIER (GpuTuning.attention_step_one_barrier): the softmax's max and sum in one barrier,
// the one that also publishes the new key and the scores: each thread's (max, sum of exp(s - max))
// over the scores it made, combined per subgroup, go to workgroup memory; after the barrier every
// thread scores the new key and combines the pairs (m = the largest max, l = sum of sum e^(max - m)),
// and p v takes exp(s - m) of the raw scores. Instead of a max (two barriers), a pass writing
// exp(s - m) and a sum (one barrier): the same weights, l summed in another order.

override HEAD_DIM: u32 = 64u;
override WG: u32 = 256u;
override KL: u32 = 1u;  // threads per key in the scores (1 without subgroups)
override SPLITS: u32 = 1u;  // workgroups per head, each over a run of the keys
override LEAN: bool = false;
override QREG: bool = false;
override ONE_BARRIER: bool = false;
const MAX_KEYS: u32 = 1024u;
const QMAX: u32 = 4u;  // vec4s of q a score lane holds in registers (QREG)
struct Params {
    num_heads: u32,
    num_kv_heads: u32,
    head_dim: u32,
    capacity: u32,
    rotary_dim: u32,
    window: u32,      // sliding window (0: none)
    scale: f32,       // 1 / sqrt(head_dim)
    _pad: u32,
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
@group(0) @binding(4) var<storage, read_write> k_cache: array<vec2<u32>>;
@group(0) @binding(5) var<storage, read_write> v_cache: array<vec2<u32>>;

alias KVRaw = vec2<u32>;

fn kv_load(w: vec2<u32>) -> vec4<f32> {
    return vec4<f32>(unpack2x16float(w.x), unpack2x16float(w.y));
}

fn kv_pack(v: vec4<f32>) -> vec2<u32> {
    return vec2<u32>(pack2x16float(v.xy), pack2x16float(v.zw));
}
// #else
@group(0) @binding(4) var<storage, read_write> k_cache: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read_write> v_cache: array<vec4<f32>>;

alias KVRaw = vec4<f32>;

fn kv_load(w: vec4<f32>) -> vec4<f32> {
    return w;
}

fn kv_pack(v: vec4<f32>) -> vec4<f32> {
    return v;
}
// #endif
@group(0) @binding(6) var<storage, read_write> out: array<vec4<f32>>;

// #include reduce.wgsl

var<workgroup> q_sh: array<vec4<f32>, HEAD_DIM / 4u>;
// The new key and value as the cache stores them (packed with kv_f16), unpacked where read: an
// unpack of a pack in registers is not always honoured (Mesa 25's lavapipe drops the rounding of
// unpack2x16float(pack2x16float(x)).y), so the rounding goes through workgroup memory.
var<workgroup> k_sh: array<KVRaw, HEAD_DIM / 4u>;
var<workgroup> v_sh: array<KVRaw, HEAD_DIM / 4u>;
var<workgroup> p_sh: array<f32, MAX_KEYS>;
var<workgroup> o_sh: array<vec4<f32>, WG>;
var<workgroup> reduce_l: array<f32, WG>;  // ONE_BARRIER: the sums beside reduce_v's maxima

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

fn rotated4(head: u32, e: u32, pos: u32) -> vec4<f32> {
    return vec4<f32>(rotated(head, e, pos), rotated(head, e + 1u, pos), rotated(head, e + 2u, pos),
                     rotated(head, e + 3u, pos));
}

// This thread's share (dims kl, kl + KL, ..) of q . k for the cache row starting at vec4 `row`,
// or (fresh) for the new key in k_sh.
fn score_part(row: u32, kl: u32, fresh: bool) -> f32 {
    var acc = 0.0;
    for (var i = kl; i < HEAD_DIM / 4u; i += KL) {
        var k: vec4<f32>;
        if (fresh) {
            k = kv_load(k_sh[i]);
        } else {
            k = kv_load(k_cache[row + i]);
        }
        acc += dot(q_sh[i], k);
    }
    return acc;
}

alias QRegs = array<vec4<f32>, QMAX>;

// score_part with this lane's vec4s of q in registers (QREG: qr[t] = q's vec4 kl + t KL), for the
// cache row starting at vec4 `row`, or (fresh) for the new key in k_sh.
fn score_regs(qr: QRegs, row: u32, kl: u32, fresh: bool) -> f32 {
    var acc = 0.0;
    for (var t = 0u; t < QMAX; t++) {
        let i = kl + t * KL;
        if (t * KL < HEAD_DIM / 4u) {  // i < hd / 4: KL divides hd / 4
            var k: vec4<f32>;
            if (fresh) {
                k = kv_load(k_sh[i]);
            } else {
                k = kv_load(k_cache[row + i]);
            }
            acc += dot(qr[t], k);
        }
    }
    return acc;
}

// workgroup_sum without its closing barrier: reduce_v is not written again (LEAN). Its barrier
// also publishes p_sh.
fn workgroup_sum_once(v: f32, lid: u32, sg: vec3<u32>) -> f32 {
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
    return total;
}

// ONE_BARRIER: writes this thread's (max m, sum l of exp(s - m)) of its scores to reduce_v /
// reduce_l, combined per subgroup where there are subgroups; returns how many pairs they hold once
// the caller's barrier has run.
fn publish_pair(m: f32, l: f32, lid: u32, sg: vec3<u32>) -> u32 {
// #if subgroup
    let ms = subgroupMax(m);
    let ls = subgroupAdd(l * exp(m - ms));
    if (sg.z == 0u) {
        reduce_v[sg.x] = ms;
        reduce_l[sg.x] = ls;
    }
    return sg.y;
// #else
    reduce_v[lid] = m;
    reduce_l[lid] = l;
    return WG;
// #endif
}

// A p v weight: the score's exp(s - m) (ONE_BARRIER, whose p_sh holds the raw scores), or p_sh's
// value as it is (exp(s - m) already).
fn weight(p: f32, m: f32) -> f32 {
    if (ONE_BARRIER) {
        return exp(p - m);
    }
    return p;
}

fn key_sum(v: f32) -> f32 {
    var s = v;
// #if subgroup
    for (var m = 1u; m < KL; m <<= 1u) {
        s += subgroupShuffleXor(s, m);
    }
// #endif
    return s;
}

// The new key (rotated) and value of kv head `kv_head`, vec4 i of each, packed as the cache stores
// them.
struct Fresh {
    k: KVRaw,
    v: KVRaw,
}

fn fresh_kv(i: u32, kv_head: u32, pos: u32) -> Fresh {
    let e = 4u * i;
    let k = kv_pack(rotated4((params.num_heads + kv_head) * HEAD_DIM, e, pos));
    let vb = (params.num_heads + params.num_kv_heads + kv_head) * HEAD_DIM + e;
    return Fresh(k, kv_pack(vec4<f32>(qkv[vb], qkv[vb + 1u], qkv[vb + 2u], qkv[vb + 3u])));
}

// Vec4 i of the new key and value into k_sh / v_sh, and into the cache at vec4 `cache` where
// `stores`.
fn keep_kv(i: u32, f: Fresh, cache: u32, stores: bool) {
    k_sh[i] = f.k;
    v_sh[i] = f.v;
    if (stores) {
        k_cache[cache + i] = f.k;
        v_cache[cache + i] = f.v;
    }
}

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
    let heads = params.num_heads;
    let group = heads / params.num_kv_heads;
    let kv_head = h / group;
    let pos = step.start;
    let d4 = HEAD_DIM / 4u;
    let cache = (kv_head * params.capacity + pos) * d4;
    let length = pos + 1u;
    let lo = select(0u, length - min(length, params.window), params.window > 0u);
    let n = length - lo;   // keys lo .. pos; the host keeps ceil(n / SPLITS) <= MAX_KEYS
    let last = n - 1u;     // key pos, from workgroup memory; keys 0 .. last - 1 from the cache
    // This workgroup's keys: j0 .. j1 - 1 (of 0 .. last); the cache's up to `end`, then key last
    // from workgroup memory when it falls in the run. p_sh[j - j0] holds key j.
    let chunk = (n + SPLITS - 1u) / SPLITS;
    let j0 = min(split * chunk, n);
    let j1 = min(j0 + chunk, n);
    let end = min(j1, last);
    let has_last = last >= j0 && last < j1;
    let base = kv_head * params.capacity + lo;
    let count = end - min(end, j0);  // keys of this run in the cache
    // p v: thread lid owns dims 4 c4 .. of key subset lid / d4, four keys a trip. The first trip's
    // values are loaded now, so they arrive while the scores and the softmax are computed (a
    // clamped row where the run has fewer keys: never used; a run past the last key, j0 = n,
    // reads row `last`, so every load stays inside this kv head's rows: the kernel may run
    // without naga's index checks, GpuTuning.attention_step_unchecked).
    let c4 = lid % d4;
    let subset = lid / d4;
    let subsets = WG / d4;
    let vrow = (base + min(j0, last)) * d4 + c4;
    let vlast = max(count, 1u) - 1u;
    var v0 = v_cache[vrow + min(subset, vlast) * d4];
    var v1 = v_cache[vrow + min(subset + subsets, vlast) * d4];
    var v2 = v_cache[vrow + min(subset + 2u * subsets, vlast) * d4];
    var v3 = v_cache[vrow + min(subset + 3u * subsets, vlast) * d4];
    let kl = lid % KL;
    var qr: QRegs;
    if (QREG) {
        for (var t = 0u; t < QMAX; t++) {
            if (t * KL < d4) {
                qr[t] = rotated4(h * HEAD_DIM, 4u * (kl + t * KL), pos) * params.scale;
            }
        }
    }
    let stores = h % group == 0u && split == 0u;
    // Threads lid < hd / 4 (WG is a multiple of hd / 4) each make one vec4 of the new key and value.
    var fresh: Fresh;
    if (lid < d4) {
        fresh = fresh_kv(lid, kv_head, pos);
    }
    if (!QREG) {
        if (lid < d4) {
            q_sh[lid] = rotated4(h * HEAD_DIM, 4u * lid, pos) * params.scale;
            keep_kv(lid, fresh, cache, stores);
        }
        workgroupBarrier();
    }
    // Scores: KL threads per key, two keys a trip.
    let slots = WG / KL;
    var m_local = NEG_BIG;
    var j = j0 + lid / KL;
    // A uniform trip count (the shuffles of key_sum need subgroup-uniform control flow; Tint
    // checks it): threads past the run's last cache key in the final trip load a clamped row and
    // store nothing. LEAN: keys from `last` on (the new key, and any past the run) read k_sh, and
    // key `last` is scored here too (QREG: after the loop).
    let scored = select(end, j1, LEAN && !QREG && !ONE_BARRIER);
    let keys = scored - min(scored, j0);
    let trips = (keys + 2u * slots - 1u) / (2u * slots);
    let row_last = max(end, 1u) - 1u;
    for (var trip = 0u; trip < trips; trip++) {
        let jb = j + slots;
        var a0: f32;
        var a1: f32;
        if (QREG) {
            a0 = score_regs(qr, (base + min(j, row_last)) * d4, kl, false);
            a1 = score_regs(qr, (base + min(jb, row_last)) * d4, kl, false);
        } else {
            a0 = score_part((base + min(j, row_last)) * d4, kl, LEAN && j >= last);
            a1 = score_part((base + min(jb, row_last)) * d4, kl, LEAN && jb >= last);
        }
        let s0 = key_sum(a0);
        let s1 = key_sum(a1);
        if (kl == 0u && j < scored) {
            p_sh[j - j0] = s0;
            m_local = max(m_local, s0);
            if (jb < scored) {
                p_sh[jb - j0] = s1;
                m_local = max(m_local, s1);
            }
        }
        j += 2u * slots;
    }
    if (QREG && lid < d4) {
        // The new key and value (loaded with q, before the loop) kept after the cache keys'
        // loads: its stores to the cache would otherwise hold those loads back (a store and a
        // later load of one buffer stay in order).
        keep_kv(lid, fresh, cache, stores);
    }
    var m: f32;
    var l: f32;
    var p_new = 0.0;  // ONE_BARRIER: the new key's weight (0 where the run does not hold it)
    if (ONE_BARRIER) {
        var l_local = 0.0;
        if (kl == 0u) {  // this thread's scores: keys j0 + lid / KL, then every slots-th
            for (var jj = j0 + lid / KL; jj < scored; jj += slots) {
                l_local += exp(p_sh[jj - j0] - m_local);
            }
        }
        let parts = publish_pair(m_local, l_local, lid, sg);
        workgroupBarrier();  // publishes k_sh, v_sh, p_sh and the pairs
        var a: f32;
        if (QREG) {
            a = score_regs(qr, 0u, kl, true);
        } else {
            a = score_part(0u, kl, true);
        }
        let s = key_sum(a);  // the new key, by every lane group alike
        m = select(NEG_BIG, s, has_last);
        for (var i = 0u; i < parts; i++) {
            m = max(m, reduce_v[i]);
        }
        p_new = select(0.0, exp(s - m), has_last);
        l = p_new;
        for (var i = 0u; i < parts; i++) {
            l += reduce_l[i] * exp(reduce_v[i] - m);
        }
    } else if (QREG) {
        workgroupBarrier();  // publishes k_sh and v_sh
        // The new key, by every lane group alike (uniform shuffles); thread 0 keeps it.
        let s = key_sum(score_regs(qr, 0u, kl, true));
        if (lid == 0u && has_last) {
            p_sh[last - j0] = s;
            m_local = max(m_local, s);
        }
    } else if (!LEAN && lid == 0u && has_last) {
        var s = 0.0;
        for (var i = 0u; i < d4; i++) {
            s += dot(q_sh[i], kv_load(k_sh[i]));
        }
        p_sh[last - j0] = s;
        m_local = max(m_local, s);
    }
    if (!ONE_BARRIER) {
        m = workgroup_max(m_local, lid, sg);
        var l_local = 0.0;
        for (var i = lid; i < j1 - j0; i += WG) {
            let p = exp(p_sh[i] - m);
            p_sh[i] = p;
            l_local += p;
        }
        if (LEAN) {
            l = workgroup_sum_once(l_local, lid, sg);
        } else {
            l = workgroup_sum(l_local, lid, sg);  // its barriers also publish p_sh
        }
    }
    // p v: v0 .. v3 hold keys k, k + subsets, .. (loaded a trip ahead, clamped to the run).
    var o = vec4<f32>(0.0);
    var k = subset;  // relative to j0
    loop {
        if (k + 3u * subsets >= count) {
            break;
        }
        let w0 = kv_load(v0);
        let w1 = kv_load(v1);
        let w2 = kv_load(v2);
        let w3 = kv_load(v3);
        let kn = k + 4u * subsets;
        v0 = v_cache[vrow + min(kn, vlast) * d4];
        v1 = v_cache[vrow + min(kn + subsets, vlast) * d4];
        v2 = v_cache[vrow + min(kn + 2u * subsets, vlast) * d4];
        v3 = v_cache[vrow + min(kn + 3u * subsets, vlast) * d4];
        o += weight(p_sh[k], m) * w0 + weight(p_sh[k + subsets], m) * w1 + weight(p_sh[k + 2u * subsets], m) * w2
            + weight(p_sh[k + 3u * subsets], m) * w3;
        k = kn;
    }
    // At most three keys of the run remain: k, k + subsets, k + 2 subsets, in v0 .. v2.
    if (k < count) {
        o += weight(p_sh[k], m) * kv_load(v0);
    }
    if (k + subsets < count) {
        o += weight(p_sh[k + subsets], m) * kv_load(v1);
    }
    if (k + 2u * subsets < count) {
        o += weight(p_sh[k + 2u * subsets], m) * kv_load(v2);
    }
    if (has_last && (last - j0) % subsets == subset) {
        o += select(p_sh[last - j0], p_new, ONE_BARRIER) * kv_load(v_sh[c4]);
    }
    o_sh[lid] = o;
    workgroupBarrier();
    if (LEAN) {
        if (lid < d4) {
            for (var t = 1u; t < subsets; t++) {
                o += o_sh[lid + t * d4];
            }
            o_sh[lid] = o;  // read back below by the same thread only
        }
    } else {
        for (var stride = subsets / 2u; stride > 0u; stride >>= 1u) {  // subsets is a power of two
            if (subset < stride) {
                o_sh[lid] += o_sh[lid + stride * d4];
            }
            workgroupBarrier();
        }
    }
    if (SPLITS == 1u) {
        if (lid < d4) {
            out[h * d4 + lid] = o_sh[lid] / l;
        }
        return;
    }
    let dst = (h * SPLITS + split) * (d4 + 1u);
    if (lid < d4) {
        out[dst + lid] = o_sh[lid];
    }
    if (lid == 0u) {
        out[dst + d4] = vec4<f32>(m, l, 0.0, 0.0);
    }
}
