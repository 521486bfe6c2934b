"""Every WGSL kernel against NumpyOps (the spec) on random shapes, odd sizes included.

f32 weights must match to about 1e-4; f16 weights must match numpy run on the same weights
rounded to f16 (the only difference is where sums round). Shapes stay small: lavapipe is a CPU.
"""

from __future__ import annotations

import numpy as np
import pytest

from kjarni.errors import ContextOverflowError, GenerationFailedError, GpuUnavailableError
from kjarni.gpu import kernels
from kjarni.gpu.step import WithF16
from kjarni.numpy_ops import NumpyKVCache, NumpyOps

pytestmark = pytest.mark.gpu

ref = NumpyOps()


def rand(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def upload(ops, array):
    """An activation holding ``array`` (through the embedding gather of an f32 table)."""
    from kjarni.gpu import WgpuOps

    f32 = ops if ops.weight_format == "f32" else WgpuOps(ops.context, weight_format="f32")
    return f32.embed(f32.weight(array, name="activation"), np.arange(array.shape[0]))


def f16_round(a):
    return a.astype(np.float16).astype(np.float32)


@pytest.fixture(scope="module")
def f16_ops(wgpu_context):
    from kjarni.gpu import WgpuOps

    return WgpuOps(wgpu_context, weight_format="f16", kv_format="f16")


# ---------------------------------------------------------------- linear family


@pytest.mark.parametrize("fmt", ["f32", "f16"])
@pytest.mark.parametrize("tokens", [1, 3, 8, 70])
@pytest.mark.parametrize("rows,cols", [(29, 37), (131, 72), (9, 1100), (5, 4100)])
def test_linear_matches_numpy_with_bias_and_residual(gpu_ops, f16_ops, fmt, tokens, rows, cols):
    ops = gpu_ops if fmt == "f32" else f16_ops
    rng = np.random.default_rng(rows * tokens)
    x, w, b, r = rand(rng, tokens, cols), rand(rng, rows, cols), rand(rng, rows), rand(rng, tokens, rows)
    w_ref = w if fmt == "f32" else f16_round(w)
    gx, gr = upload(ops, x), upload(ops, r)
    got = ops.read(ops.linear(gx, ops.weight(w, name="w"), ops.weight(b, name="b"), residual=gr))
    np.testing.assert_allclose(got, ref.linear(x, w_ref, b, r), atol=1e-4, rtol=1e-4)
    plain = ops.read(ops.linear(gx, ops.weight(w, name="w")))
    np.testing.assert_allclose(plain, ref.linear(x, w_ref), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fmt", ["f32", "f16"])
@pytest.mark.parametrize("tokens", [1, 66])
def test_norm_linear_fuses_rms_norm_into_the_product(gpu_ops, f16_ops, fmt, tokens):
    ops = gpu_ops if fmt == "f32" else f16_ops
    rng = np.random.default_rng(tokens)
    x, nw, w, b = rand(rng, tokens, 45), rand(rng, 45), rand(rng, 50, 45), rand(rng, 50)
    w_ref = w if fmt == "f32" else f16_round(w)
    got = ops.read(ops.norm_linear(upload(ops, x), ops.weight(nw, name="n"), 1e-5, ops.weight(w, name="w"), ops.weight(b, name="b")))
    np.testing.assert_allclose(got, ref.norm_linear(x, nw, 1e-5, w_ref, b), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fmt", ["f32", "f16"])
@pytest.mark.parametrize("tokens", [1, 3, 8])
@pytest.mark.parametrize("rows,cols", [(37, 45), (2051, 40), (8195, 24), (19, 2100)])
def test_silu_mul_is_fused_into_the_next_linear_as_one_dispatch(gpu_ops, f16_ops, fmt, tokens, rows, cols):
    # Shapes reach matvec_sg with 1, 2 and 4 rows per subgroup and the workgroup matvec (> 2048 columns).
    ops = gpu_ops if fmt == "f32" else f16_ops
    rng = np.random.default_rng(rows + tokens)
    h, w, r = rand(rng, tokens, 2 * cols), rand(rng, rows, cols), rand(rng, tokens, rows)
    w_ref = w if fmt == "f32" else f16_round(w)
    gh, gr, gw = upload(ops, h), upload(ops, r), ops.weight(w, name="down")
    before = ops.stats.dispatches
    got = ops.linear(ops.silu_mul(gh), gw, residual=gr)
    assert ops.stats.dispatches - before == 1, "silu_mul rides along with the linear"
    np.testing.assert_allclose(ops.read(got), ref.linear(ref.silu_mul(h), w_ref, None, r), atol=1e-4, rtol=1e-4)


def test_a_pending_silu_mul_is_computed_when_something_else_reads_it(gpu_ops):
    rng = np.random.default_rng(12)
    h = rand(rng, 2, 2 * 33)
    pending = gpu_ops.silu_mul(upload(gpu_ops, h))
    np.testing.assert_allclose(gpu_ops.read(gpu_ops.rms_norm(pending, gpu_ops.weight(np.ones(33, np.float32), name="n"), 1e-6)),
                               ref.rms_norm(ref.silu_mul(h), np.ones(33, np.float32), 1e-6), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(gpu_ops.read(gpu_ops.rows(gpu_ops.silu_mul(upload(gpu_ops, h)), 1, 1)),
                               ref.silu_mul(h)[1:], atol=1e-6, rtol=1e-5)


def test_fused_weight_parts_are_stacked_along_rows(gpu_ops):
    rng = np.random.default_rng(1)
    parts = [rand(rng, 16, 24), rand(rng, 8, 24), rand(rng, 8, 24)]
    x = rand(rng, 2, 24)
    got = gpu_ops.read(gpu_ops.linear(upload(gpu_ops, x), gpu_ops.weight(parts, name="qkv")))
    np.testing.assert_allclose(got, x @ np.concatenate(parts).T, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------- elementwise and gathers


@pytest.mark.parametrize("fmt", ["f32", "f16"])
def test_embed_gathers_rows_in_the_weight_format(gpu_ops, f16_ops, fmt):
    ops = gpu_ops if fmt == "f32" else f16_ops
    table = rand(np.random.default_rng(2), 41, 13)
    ids = np.array([40, 0, 7, 7, 3], dtype=np.int32)
    got = ops.read(ops.embed(ops.weight(table, name="t"), ids))
    expected = table[ids] if fmt == "f32" else f16_round(table[ids])
    np.testing.assert_array_equal(got, expected)


def test_rms_norm_silu_mul_and_rows_match_numpy(gpu_ops):
    rng = np.random.default_rng(3)
    x, nw = rand(rng, 5, 77), rand(rng, 77)
    gx = upload(gpu_ops, x)
    np.testing.assert_allclose(gpu_ops.read(gpu_ops.rms_norm(gx, gpu_ops.weight(nw, name="n"), 1e-6)),
                               ref.rms_norm(x, nw, 1e-6), atol=1e-5, rtol=1e-5)
    h = rand(rng, 3, 2 * 39)
    np.testing.assert_allclose(gpu_ops.read(gpu_ops.silu_mul(upload(gpu_ops, h))), ref.silu_mul(h), atol=1e-6, rtol=1e-5)
    np.testing.assert_array_equal(gpu_ops.read(gpu_ops.rows(gx, 2, 3)), x[2:5])
    np.testing.assert_array_equal(gpu_ops.read(gpu_ops.rows(gx, 0, 1)), x[:1])


@pytest.mark.parametrize("tokens,features,first,count", [(3, 151_936, 2, 1), (70, 1100, 69, 1), (70, 1100, 5, 60), (2, 1, 1, 1)])
def test_rows_is_one_dispatch_giving_exactly_those_rows(gpu_ops, tokens, features, first, count):
    # rows.wgsl, not a buffer copy: a few-token forward's last row (a vocabulary-wide one too).
    x = rand(np.random.default_rng(tokens + first), tokens, features)
    gx = upload(gpu_ops, x)
    before = gpu_ops.context.stats.dispatches
    out = gpu_ops.rows(gx, first, count)
    assert gpu_ops.context.stats.dispatches == before + 1
    assert out.shape == (count, features)
    np.testing.assert_array_equal(gpu_ops.read(out), x[first:first + count])


# ---------------------------------------------------------------- rope_store + attention


def _attention_case(ops, kv_format, steps, heads=6, kv_heads=2, head_dim=16, capacity=200, seed=0, window=None,
                    reference=ref, tc=False, caches=None, key_growth=0.0, tensors=None):
    """Run rope_store + attention for token counts ``steps`` on GPU and ``reference``; yield both
    outputs (``caches``, a list: the reference's KV cache appended to it). The tensor-core prefill
    attention (attention_tc, on Dawn) runs only with ``tc``: it rounds q and the softmax weights
    to f16, which the f32 reference does not. ``key_growth``: the key at position p is scaled by
    1 + key_growth p, so later keys score higher. ``tensors``, a list: each GPU output appended."""
    from kjarni.model import rope_table

    ops.tuning.attention_tc = tc
    class Cfg:  # the fields rope_table reads
        pass

    cfg = Cfg()
    cfg.head_dim, cfg.rope_theta, cfg.rope_scaling = head_dim, 10000.0, None
    rope = rope_table(cfg, capacity)
    rng = np.random.default_rng(seed)
    gpu_cache = ops.new_kv_cache(2, kv_heads, head_dim, capacity)
    cpu_cache = NumpyKVCache(2, kv_heads, head_dim, capacity)
    if caches is not None:
        caches.append(cpu_cache)
    g_rope = ops.weight(rope, name="rope")
    start = 0
    for tokens in steps:
        qkv = rand(rng, tokens, (heads + 2 * kv_heads) * head_dim)
        qkv[:, heads * head_dim : (heads + kv_heads) * head_dim] *= (1 + key_growth * np.arange(start, start + tokens, dtype=np.float32))[:, None]
        q = ops.rope_store(upload(ops, qkv), g_rope, gpu_cache, 1, start)
        att = ops.attention(q, gpu_cache, 1, start, window)
        if tensors is not None:
            tensors.append(att)
        out = ops.read(att)
        q_ref = reference.rope_store(qkv, rope, cpu_cache, 1, start)
        if kv_format == "f16":  # the GPU stores the cache in f16: give numpy the same values
            cpu_cache.keys[:] = f16_round(cpu_cache.keys)
            cpu_cache.values[:] = f16_round(cpu_cache.values)
        yield ops.read(q), q_ref, out, reference.attention(q_ref, cpu_cache, 1, start, window)
        start += tokens


@pytest.mark.parametrize("kv_format", ["f32", "f16"])
@pytest.mark.parametrize("decode", ["single", "split"])
@pytest.mark.parametrize("window", [None, 50])
def test_rope_store_and_attention_match_numpy_for_prefill_then_decode(wgpu_context, kv_format, decode, window):
    from kjarni.gpu import WgpuOps

    ops = WgpuOps(wgpu_context, weight_format="f32", kv_format=kv_format)
    if decode == "split":  # flash-decoding (attention_decode + attention_combine), as past attention_step's reach
        ops.tuning.attention_single_max = 0
        ops.tuning.fuse_rope = False
    # 37-token prefill (tiled kernel), single-token decode, 3-token verify (decode kernels), then
    # a long jump over several 64-position splits.
    for q, q_ref, out, out_ref in _attention_case(ops, kv_format, [37, 1, 3, 70, 1], window=window):
        np.testing.assert_allclose(q, q_ref, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(out, out_ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("lanes", [1, 2, 8])
@pytest.mark.parametrize("window", [None, 23])
def test_attention_prefill_with_rows_shared_by_several_threads_matches_numpy(wgpu_context, lanes, window):
    """attention_prefill splits a query row's head_dim over `attention_prefill_lanes` threads
    (subgroupShuffleXor sums the q.k dots); head_dim 64 gives 2 vec4s per thread at 8 lanes, and
    70 tokens after 37 span several key tiles and query blocks."""
    from kjarni.gpu import WgpuOps

    ops = WgpuOps(wgpu_context, weight_format="f32", kv_format="f16")
    ops.tuning.attention_prefill_lanes = lanes
    ops.tuning.attention_prefill_chunk = 0
    ops.tuning.attention_tiled = False  # head_dim 64 would take attention_tiled
    for _, _, out, out_ref in _attention_case(ops, "f16", [37, 70], heads=4, kv_heads=2, head_dim=64, window=window):
        np.testing.assert_allclose(out, out_ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("head_dim, kv_format, chunk", [(128, "f16", 16), (128, "f32", 48), (64, "f16", 32), (128, "f16", 0)])
@pytest.mark.parametrize("window", [None, 23])
def test_attention_prefill_split_over_keys_matches_numpy(wgpu_context, head_dim, kv_format, chunk, window):
    """attention_prefill with its keys split over workgroups (grid z, `attention_prefill_chunk`
    keys each, merged by attention_combine): head_dim 128 (the Qwen2.5-1.5B shape) and 64, a
    37-token prompt then 70 and 12 more on top of the cache (blocks starting mid-split, splits a
    window hides, splits past a block's last row), 3 query heads per KV head."""
    from kjarni.gpu import WgpuOps

    ops = WgpuOps(wgpu_context, weight_format="f32", kv_format=kv_format)
    ops.tuning.attention_prefill_chunk = chunk
    ops.tuning.attention_tiled = False
    chunks = []
    real = ops.context.pipeline
    ops.context.pipeline = lambda kernel, kinds, **kw: chunks.append((kernel, (kw.get("constants") or {}).get("CHUNK"))) or real(kernel, kinds, **kw)
    try:
        for _, _, out, out_ref in _attention_case(ops, kv_format, [37, 70, 12], heads=6, kv_heads=2, head_dim=head_dim,
                                                  window=window):
            np.testing.assert_allclose(out, out_ref, atol=1e-4, rtol=1e-4)
    finally:
        del ops.context.pipeline
    assert ("attention_prefill", chunk) in chunks
    assert (("attention_combine", chunk) in chunks) == (chunk > 0)


def _tiled_calls(ops, kv_format, head_dim, window, heads=7, kv_heads=1):
    """Run _attention_case's 37 + 70 + 12 tokens through ops, checking each against numpy; the
    attention kernels it ran."""
    calls = []
    real = ops.context.pipeline
    ops.context.pipeline = lambda kernel, kinds, **kw: calls.append(kernel) or real(kernel, kinds, **kw)
    try:
        for _, _, out, out_ref in _attention_case(ops, kv_format, [37, 70, 12], heads=heads, kv_heads=kv_heads,
                                                  head_dim=head_dim, window=window):
            np.testing.assert_allclose(out, out_ref, atol=1e-4, rtol=1e-4)
    finally:
        del ops.context.pipeline
    return {c for c in calls if c.startswith("attention")}


@pytest.mark.parametrize("chunk", [0, 32, 64])
@pytest.mark.parametrize("kv_format", ["f32", "f16"])
@pytest.mark.parametrize("window", [None, 23, 50])
def test_attention_tiled_matches_numpy(wgpu_context, kv_format, window, chunk):
    """attention_tiled (head_dim 64's default tile: 32 query rows x 32-key tiles, online softmax
    per tile): a 37-token prompt, then 70 and 12 more tokens on top of the cache (blocks that start
    mid-tile, a partial last block, windows that begin inside a tile), 7 query heads on 1 KV head;
    whole (chunk 0) and with the keys split over workgroups in chunks of 32 or 64, merged by
    attention_combine (splits a window hides entirely, splits past a block)."""
    from kjarni.gpu import WgpuOps

    ops = WgpuOps(wgpu_context, weight_format="f32", kv_format=kv_format)
    ops.tuning.attention_tiled_chunk = chunk
    calls = _tiled_calls(ops, kv_format, 64, window)
    assert "attention_tiled.hd64_q32_k32" in calls and "attention_prefill" not in calls
    assert ("attention_combine" in calls) == (chunk > 0)


@pytest.mark.parametrize("head_dim, kv_format, chunk, window, keys", [
    (64, "f16", 0, None, 32), (128, "f16", 32, None, 32), (64, "f32", 64, 23, 32), (128, "f16", 0, 50, 32), (64, "f16", 64, None, 64)])
@pytest.mark.parametrize("warps, prefetch, online", [(4, False, False), (2, False, False), (4, True, False), (4, False, True),
                                                    (2, True, True), (2, False, True)])
def test_attention_tc_matches_numpy_with_f16_rounding(wgpu_context, head_dim, kv_format, chunk, window, keys, warps, prefetch,
                                                      online):
    """attention_tc (tensor cores: Dawn with a square f16 subgroup-matrix configuration, 16 x 16 on
    NVIDIA, 8 x 8 on Mesa 26's lavapipe) against NumpyOps(activations="f16"), which rounds the
    scaled q, keys, values and softmax weights to f16 as it does: a 37-token prompt, then 70 and
    12 more on top of the cache, 3 query heads per KV head, whole and split over the keys
    (attention_combine), with and without a window. Bound: one f16 rounding of the largest weight
    times the largest value (2^-11 max|v|), two where a split's weights are rounded against its
    own maximum, or (online) against a maximum raised only past 8 ln 2, not the row's as numpy's
    are; unsplit in two passes, the output is also closer to that reference than to the f32 one."""
    from kjarni.gpu import WgpuOps

    ops = WgpuOps(wgpu_context, weight_format="f32", kv_format=kv_format)
    ops.tuning.attention_tc_chunk, ops.tuning.attention_tc_keys, ops.tuning.attention_tc_warps = chunk, keys, warps
    ops.tuning.attention_tc_head_dims = (64, 128)
    ops.tuning.attention_tc_prefetch = prefetch  # the next tile's loads in flight during this one's products
    ops.tuning.attention_tc_online = online  # one pass, the rows' maxima raised as tiles exceed them
    shape = ops._attention.tc_shape(head_dim)
    if shape is None:
        pytest.skip(f"{wgpu_context.description} on {wgpu_context.runtime.description} has no square f16 subgroup-matrix "
                    "configuration for this variant (needs Dawn: KJARNI_WEBGPU_RUNTIME=dawn, on a driver that offers one)")
    ref16 = NumpyOps(activations="f16", f16_activation_min_tokens=ops.tuning.matvec_max_tokens + 1)
    calls, flags = [], []
    real = ops.context.pipeline
    ops.context.pipeline = lambda kernel, kinds, **kw: calls.append(kernel) or flags.append((kernel, kw.get("flags", ()))) or real(
        kernel, kinds, **kw)
    caches, tensors, start = [], [], 0
    try:
        for tokens, (_, q_ref, out, out_ref) in zip([37, 70, 12], _attention_case(
                ops, kv_format, [37, 70, 12], heads=6, kv_heads=2, head_dim=head_dim, window=window, reference=ref16, tc=True,
                caches=caches, tensors=tensors)):
            if type(tensors[-1]) is WithF16:  # split: attention_combine wrote the f16 rounding for o_proj too
                half = np.frombuffer(ops.context.read(tensors[-1].half.buffer, 0, out.size * 2)[: out.size * 2], np.float16)
                np.testing.assert_array_equal(half.reshape(out.shape), out.astype(np.float16))
            bound = (2.0 ** -10 if chunk or online else 2.0 ** -11) * np.abs(caches[0].values[1]).max()
            np.testing.assert_allclose(out, out_ref, atol=bound, rtol=0)
            if tokens > ops.tuning.matvec_max_tokens and not chunk and not online:  # and the roundings are the ones that happened
                exact = ref.attention(q_ref, caches[0], 1, start, window)
                assert np.abs(out - out_ref).max() < np.abs(out - exact).max()
            start += tokens
    finally:
        del ops.context.pipeline
    assert f"attention_tc.{kernels.attention_tc_variant(head_dim, *shape)}" in calls
    assert {"prefetch" in f for k, f in flags if k.startswith("attention_tc")} == {prefetch}
    assert {"online" in f for k, f in flags if k.startswith("attention_tc")} == {online}
    assert ("attention_combine" in calls) == (chunk > 0)
    assert any(type(t) is WithF16 for t in tensors) == (chunk > 0)  # the 70-token call splits whenever chunk > 0


@pytest.mark.parametrize("chunk", [0, 64])
def test_attention_tc_online_rescales_rows_whose_maximum_grows(wgpu_context, chunk):
    """attention_tc's one pass (flag online) keeps each row's maximum m from its first tile until a
    later tile's scores exceed it by more than 8 ln 2, then rescales that row's O and l. Keys that
    grow with position (scaled by 1 + p / 4) make later tiles exceed it: the case checks that it
    does so for some row, then that the output stays within attention_tc's bound of the f16
    reference (2^-10 max|v|: P rounded against m, not the row's maximum)."""
    from kjarni.gpu import WgpuOps

    ops = WgpuOps(wgpu_context, weight_format="f32", kv_format="f16")
    ops.tuning.attention_tc_chunk, ops.tuning.attention_tc_online = chunk, True
    ops.tuning.attention_tc_head_dims = (64,)
    shape = ops._attention.tc_shape(64)
    if shape is None:
        pytest.skip(f"{wgpu_context.description} on {wgpu_context.runtime.description} has no square f16 subgroup-matrix "
                    "configuration (needs Dawn: KJARNI_WEBGPU_RUNTIME=dawn, on a driver that offers one)")
    ref16 = NumpyOps(activations="f16", f16_activation_min_tokens=ops.tuning.matvec_max_tokens + 1)
    caches, grew = [], 0
    bkt = shape[3]
    for tokens, (_, q_ref, out, out_ref) in zip([37, 70], _attention_case(
            ops, "f16", [37, 70], heads=6, kv_heads=2, head_dim=64, reference=ref16, tc=True, caches=caches, key_growth=0.25)):
        np.testing.assert_allclose(out, out_ref, atol=2.0 ** -10 * np.abs(caches[0].values[1]).max(), rtol=0)
    # The rows of the second call (positions 37 .. 106) whose tile maxima (tiles of bkt keys,
    # restarted at each split) rise past the first visible tile's by more than 8 ln 2.
    keys = caches[0].keys[1].astype(np.float32)  # [kv_heads, capacity, hd]
    q = q_ref.reshape(70, 2, 3, 64).astype(np.float16).astype(np.float32) / np.float32(8.0)
    for t in range(70):
        pos = 37 + t
        scores = np.einsum("hgd,hkd->hgk", q[t], keys[:, : pos + 1])
        for begin in range(0, pos + 1, chunk or pos + 1):
            tiles = [scores[..., k : min(k + bkt, pos + 1, begin + (chunk or pos + 1))].max(-1)
                     for k in range(begin, min(pos + 1, begin + (chunk or pos + 1)), bkt)]
            grew += int((np.maximum.accumulate(tiles[1:], axis=0) > tiles[0] + 8 * np.log(2)).any()) if len(tiles) > 1 else 0
    assert grew > 0


@pytest.mark.parametrize("shape", kernels.ATTENTION_TILED_SHAPES, ids=lambda s: kernels.attention_tiled_variant(*s))
@pytest.mark.parametrize("kv_format, chunk, window", [("f32", 0, None), ("f16", 32, 23)])
def test_every_attention_tile_matches_numpy_where_it_fits(wgpu_context, shape, kv_format, chunk, window):
    """Every tile of attention_tiled.tmpl.wgsl (head_dim 64 and 128, 16 or 32 query rows, 16- or
    32-key tiles) asked for through GpuTuning.attention_tiled_rows / _keys, 3 query heads per KV
    head; a tile larger than this device's workgroup memory gives way to the first that fits (on
    lavapipe's 32 KiB head_dim 128 runs 16 x 16), and what runs is what tiled_shape says."""
    from kjarni.gpu import WgpuOps

    hd, rows, keys = shape
    ops = WgpuOps(wgpu_context, weight_format="f32", kv_format=kv_format)
    ops.tuning.attention_tiled_rows, ops.tuning.attention_tiled_keys = rows, keys
    ops.tuning.attention_tiled_chunk = chunk
    ran = ops._attention.tiled_shape(hd)
    fits = kernels.attention_tiled_bytes(hd, rows, keys) <= wgpu_context.max_workgroup_storage
    assert ran == (rows, keys) if fits else kernels.attention_tiled_bytes(hd, *ran) <= wgpu_context.max_workgroup_storage
    calls = _tiled_calls(ops, kv_format, hd, window, heads=6, kv_heads=2)
    assert f"attention_tiled.{kernels.attention_tiled_variant(hd, *ran)}" in calls and "attention_prefill" not in calls


@pytest.mark.parametrize("shape", kernels.ATTENTION_TC_SHAPES, ids=lambda s: kernels.attention_tc_variant(*s))
def test_attention_tc_workgroup_memory_is_what_the_host_checks(shape):
    """The host picks attention_tc's variant by kernels.attention_tc_bytes: the figure must be the
    shader's (its six workgroup arrays: kv and p_sh in f16, s_sh and alpha_sh in f32, ml_sh in
    vec2<f32>, grow_sh in u32), and the block's Q staging must fit in kv (BQ rows <= 2 BKT)."""
    import re

    src = kernels.template("attention_tc", kernels.attention_tc_variant(*shape))
    consts = {}
    for name, value in re.findall(r"const (\w+): u32 = ([^;]+);", src):
        consts[name] = eval(re.sub(r"(\d+)u", r"\1", value).replace("/", "//"), {}, consts)  # noqa: S307 (our own shader)
    sizes = {"f16": 2, "f32": 4, "u32": 4, "vec2<f32>": 8}
    arrays = re.findall(r"var<workgroup> \w+: array<(f16|f32|u32|vec2<f32>), ([^>]+)>;", src)
    assert len(arrays) == len(re.findall(r"var<workgroup>", src)) == 6
    total = sum(eval(re.sub(r"(\d+)u", r"\1", size), {}, consts) * sizes[kind] for kind, size in arrays)  # noqa: S307
    assert total == kernels.attention_tc_bytes(*shape)
    assert consts["BQ"] <= 2 * consts["BKT"] and consts["BKT"] % consts["LPR"] == 0


def test_attention_combine_and_reduce_prep_compile_with_tint(tint_compile):
    """attention_combine with the flag half (out16, the f16 rounding for o_proj) and without, and
    matmul_reduce_prep (the reduce and the next prep in one dispatch), as Dawn gets them."""
    for flags in (frozenset(), frozenset({"half"})):
        tint_compile(kernels.source("attention_combine", flags), "attention_combine")
    tint_compile(kernels.source("matmul_reduce_prep"), "matmul_reduce_prep")


def test_every_attention_tc_variant_compiles_with_tint(tint_compile):
    """Dawn's WGSL compiler accepts every attention_tc variant, with the f16 and the f32 KV cache,
    in two passes and in one (online), with and without prefetch (Null device: no GPU needed)."""
    for shape in kernels.ATTENTION_TC_SHAPES:
        name = kernels.attention_tc_variant(*shape)
        for flags in (frozenset(), frozenset({"kv_f16"}), frozenset({"kv_f16", "online"}), frozenset({"online", "prefetch"})):
            tint_compile(kernels.template("attention_tc", name, flags), name)


@pytest.mark.parametrize("shape", kernels.ATTENTION_TILED_SHAPES, ids=lambda s: kernels.attention_tiled_variant(*s))
def test_attention_tiled_workgroup_memory_is_what_the_host_checks(shape):
    """The host picks a tile by kernels.attention_tiled_bytes: the figure must be the shader's."""
    import re

    src = kernels.template("attention_tiled", kernels.attention_tiled_variant(*shape))
    consts = {k: int(v) for k, v in re.findall(r"const (\w+): u32 = (\d+)u;", src)}
    consts.update({k: eval(re.sub(r"(\d+)u", r"\1", v), {}, consts)  # noqa: S307 (our own shader)
                   for k, v in re.findall(r"const (\w+): u32 = ([^;]*[A-Z][^;]*);", src)})
    sizes = {"vec4<f32>": 16, "f32": 4, "RV": 4 * (shape[1] // 8)}
    total = 0
    for kind, size in re.findall(r"var<workgroup> \w+: array<(vec4<f32>|f32|RV), ([^>]+)>;", src):
        total += eval(re.sub(r"(\d+)u", r"\1", size), {}, consts) * sizes[kind]  # noqa: S307
    assert len(re.findall(r"var<workgroup>", src)) == 5
    assert total == kernels.attention_tiled_bytes(*shape)


def test_head_dim_without_a_tile_runs_attention_prefill(wgpu_context):
    """head_dim 96 has no attention_tiled tile: attention_prefill serves it."""
    from kjarni.gpu import WgpuOps

    ops = WgpuOps(wgpu_context, weight_format="f32", kv_format="f16")
    assert ops._attention.tiled_shape(96) is None
    calls = _tiled_calls(ops, "f16", 96, None, heads=2, kv_heads=1)
    assert "attention_prefill" in calls and not any(c.startswith("attention_tiled") for c in calls)


def test_attention_tiled_takes_longer_chunks_when_the_partials_would_be_too_large(wgpu_context):
    """The split partials hold tokens x heads x splits rows of head_dim + 2 floats; past
    attention_partial_max_bytes the chunk doubles until they fit (here 32 -> 64: 2 splits)."""
    from kjarni.gpu import WgpuOps

    ops = WgpuOps(wgpu_context, weight_format="f32", kv_format="f16")
    ops.tuning.attention_tiled_chunk = 32
    ops.tuning.attention_partial_max_bytes = 70 * 4 * 66 * 4 * 2  # two splits of 70 tokens x 4 heads
    chunks = []
    real = ops.context.pipeline
    ops.context.pipeline = lambda kernel, kinds, **kw: chunks.append((kw.get("constants") or {}).get("CHUNK")) or real(kernel, kinds, **kw)
    try:
        for _, _, out, out_ref in _attention_case(ops, "f16", [70], heads=4, kv_heads=2, head_dim=64):
            np.testing.assert_allclose(out, out_ref, atol=1e-4, rtol=1e-4)
    finally:
        del ops.context.pipeline
    assert 64 in chunks and 32 not in chunks  # 70 keys: 3 chunks of 32 do not fit, 2 of 64 do


def test_matvec_u_configurations_match_numpy(wgpu_context):
    """Every (threads, rows, chunks per step) of linear_body's matvec_u, with the fused norm, bias
    and residual, over rows not a multiple of R and columns not a multiple of 8 or of a step."""
    from kjarni.gpu import WgpuOps

    if not wgpu_context.has_subgroups:
        pytest.skip("matvec_u needs subgroups")
    rng = np.random.default_rng(11)
    for rows, cols in ((37, 300), (5, 2500)):
        x, w, nw, b, res = rand(rng, 2, cols), rand(rng, rows, cols), rand(rng, cols), rand(rng, rows), rand(rng, 2, rows)
        want = ref.norm_linear(x, nw, 1e-5, f16_round(w), b) + res  # the weights the GPU holds (module docstring)
        for cfg in ((32, 1, 1), (64, 2, 2), (128, 4, 4), (256, 4, 1), (32, 4, 4)):
            ops = WgpuOps(wgpu_context, weight_format="f16")
            ops.tuning.matvec_configs = {(rows, cols): cfg}
            ops.tuning.matvec_t_min_tokens = 3  # 2 tokens through matvec_u's token loop, not matvec_t
            gw = ops.weight(w, name="w")
            got = ops._linear(upload(ops, x), gw, ops.weight(b, name="b"), upload(ops, res), ops.weight(nw, name="n"), 1e-5)
            assert gw.plans and all(p[0][0][0].kjarni_name == "linear_f16:matvec_u" for p in gw.plans.values())
            np.testing.assert_allclose(ops.read(got), want, atol=1e-4, rtol=1e-4, err_msg=f"{rows}x{cols} {cfg}")


FLAG_COMBINATIONS = [(b, r, n, s) for b in (0, 1) for r in (0, 1) for n in (0, 1) for s in (0, 1)]


def _flagged_linear(ops, rng, weight, w_ref, tokens, bias, residual, norm, silu):
    """`ops._linear` with the given flags (silu: x is a pending silu_mul of ``[gate | up]``) and
    its numpy reference."""
    rows, cols = w_ref.shape
    h = rand(rng, tokens, 2 * cols if silu else cols)
    b, r, nw = rand(rng, rows), rand(rng, tokens, rows), rand(rng, cols)
    x = ref.silu_mul(h) if silu else h
    want = ref.norm_linear(x, nw, 1e-5, w_ref) if norm else ref.linear(x, w_ref)
    want = want + (b if bias else 0) + (r if residual else 0)
    gx = ops.silu_mul(upload(ops, h)) if silu else upload(ops, h)
    got = ops._linear(gx, weight, ops.weight(b, name="b") if bias else None, upload(ops, r) if residual else None,
                      ops.weight(nw, name="n") if norm else None, 1e-5)
    return ops.read(got), want


@pytest.mark.parametrize("fmt", ["f32", "f16"])
@pytest.mark.parametrize("tokens", [2, 3, 4, 5, 6, 7, 8, 9, 13])
def test_matvec_t_matches_numpy_for_several_tokens_with_every_flag(wgpu_context, fmt, tokens):
    """linear_body's matvec_t (each weight chunk applied to up to 12 tokens, speculative verify)
    for 2..9 tokens and 13 (two passes), every combination of bias, residual, fused norm and fused
    silu, on odd widths (element-wise x loads), widths of 4 mod 8 and 0 mod 8 (vec4 loads), rows
    not a multiple of R, and rows past 2048 columns (256 threads split K)."""
    from kjarni.gpu import WgpuOps

    if not wgpu_context.has_subgroups:
        pytest.skip("matvec_t needs subgroups")
    ops = WgpuOps(wgpu_context, weight_format=fmt)
    ops.tuning.matvec_max_tokens = 13
    rng = np.random.default_rng(tokens)
    for rows, cols in ((29, 37), (1030, 72), (9, 2100)):
        w = rand(rng, rows, cols)
        w_ref = w if fmt == "f32" else f16_round(w)
        gw = ops.weight(w, name="w")
        for flags in FLAG_COMBINATIONS:
            got, want = _flagged_linear(ops, rng, gw, w_ref, tokens, *flags)
            np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4, err_msg=f"{rows}x{cols} flags {flags}")
        assert {p[0][0][0].kjarni_name for p in gw.plans.values()} == {f"linear_{fmt}:matvec_t"}


def test_matvec_t_configurations_match_numpy(wgpu_context):
    """Every (threads, rows) of matvec_t through `matvec_t_configs`, with one to three token quads
    per pass (9 tokens in passes of 4 + 4 + 1, 8 + 1, or one pass), bias, residual and norm."""
    from kjarni.gpu import WgpuOps

    if not wgpu_context.has_subgroups:
        pytest.skip("matvec_t needs subgroups")
    rng = np.random.default_rng(13)
    rows, cols = 37, 300
    w = rand(rng, rows, cols)
    for cfg in ((32, 1), (64, 2), (128, 4), (256, 4), (32, 4)):
        for quads in (1, 2, 3):
            ops = WgpuOps(wgpu_context, weight_format="f16")
            ops.tuning.matvec_t_configs = {(rows, cols): cfg}
            ops.tuning.matvec_t_quads = quads
            gw = ops.weight(w, name="w")
            got, want = _flagged_linear(ops, rng, gw, f16_round(w), 9, 1, 1, 1, 0)
            np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4, err_msg=f"{cfg} quads {quads}")


def test_linear_plan_picks_matvec_t_for_2_to_max_tokens_and_keeps_one_token_kernels(wgpu_context):
    from kjarni.gpu import WgpuOps

    if not wgpu_context.has_subgroups:
        pytest.skip("matvec_t needs subgroups")
    rng = np.random.default_rng(14)

    def kernel(ops, weight, tokens):
        ops.linear(upload(ops, rand(rng, tokens, weight.shape[1])), weight)
        return next(p for key, p in weight.plans.items() if key[0] == tokens)[0][0][0].kjarni_name

    ops = WgpuOps(wgpu_context, weight_format="f16")
    ops.tuning.tensor_cores = False  # the SIMT prefill kernel past matvec_max_tokens (Dawn: tests/test_gpu_tensor_cores.py)
    assert ops.tuning.matvec_max_tokens >= 9, "a speculative verify of 8 drafts (9 tokens) takes the matrix-vector path"
    short, long = ops.weight(rand(rng, 40, 64), name="short"), ops.weight(rand(rng, 12, 2064), name="long")
    assert kernel(ops, short, 1).startswith("matvec_f16.") and kernel(ops, long, 1).startswith("matvec_f16.")  # f16 decode
    ops.tuning.matvec_template = False  # the older one-token kernels, still there to compare
    short, long = ops.weight(rand(rng, 40, 64), name="short2"), ops.weight(rand(rng, 12, 2064), name="long2")
    assert kernel(ops, short, 1) == "linear_f16:matvec_u" and kernel(ops, long, 1) == "linear_f16:matvec"
    for tokens in range(2, ops.tuning.matvec_max_tokens + 1):
        assert kernel(ops, short, tokens) == kernel(ops, long, tokens) == "linear_f16:matvec_t"
    assert kernel(ops, short, ops.tuning.matvec_max_tokens + 1) == "matmul.f16:main"
    ops.tuning.matvec_t_min_tokens = ops.tuning.matvec_max_tokens + 1  # the per-token kernels, to compare
    assert kernel(ops, ops.weight(rand(rng, 40, 64), name="w"), 5) == "linear_f16:matvec_u"
    q8 = WgpuOps(wgpu_context, weight_format="q8_0")
    wq = q8.weight(rand(rng, 40, 64), name="wq")
    assert wq.formats == ["Q8_0"] and kernel(q8, wq, 1) == "matvec_dot.Q8_0:main"  # integer dot
    q8.tuning.matvec_int_dot = False
    assert kernel(q8, q8.weight(rand(rng, 40, 64), name="wq1"), 1) == "matvec.Q8_0:main"
    assert {kernel(q8, wq, tokens) for tokens in range(2, q8.tuning.matvec_max_tokens + 1)} == {"linear_q8_0:main_t"}
    q8.tuning.quant_t_min_tokens = q8.tuning.matvec_max_tokens + 1
    assert kernel(q8, q8.weight(rand(rng, 40, 64), name="wq2"), 5) == "linear_q8_0:main"
    q8.tuning.matvec_template = False
    assert kernel(q8, q8.weight(rand(rng, 40, 64), name="wq3"), 1) == "linear_q8_0:main"


@pytest.mark.parametrize("qtype", ["Q8_0", "Q5_0"])
def test_quantized_split_k_decode_matches_numpy(wgpu_context, qtype):
    """quant_split_k_min_cols makes long quantized rows run `main` with SPLIT_K (a workgroup per
    row); the result matches the dequantized weight, 1 and 3 tokens, with norm and residual."""
    import gguf

    from kjarni.gpu import WgpuOps
    from kjarni.weights import QuantTensor

    if not wgpu_context.has_subgroups:
        pytest.skip("SPLIT_K needs subgroups")
    rng = np.random.default_rng(12)
    rows, cols = 19, 512
    t = gguf.GGMLQuantizationType[qtype]
    qt = QuantTensor(t, (rows, cols), gguf.quants.quantize(rand(rng, rows, cols), t))
    w = qt.dequantize().astype(np.float32)
    ops = WgpuOps(wgpu_context, weight_format="f32")
    ops.tuning.quant_split_k_min_cols = 256
    ops.tuning.matvec_template = False  # one token would take the decode template
    nw = rand(rng, cols)
    gw, gn = ops.weight(qt, name="wq"), ops.weight(nw, name="nq")
    for tokens in (1, 3):
        x, res = rand(rng, tokens, cols), rand(rng, tokens, rows)
        got = ops.read(ops._linear(upload(ops, x), gw, None, upload(ops, res), gn, 1e-5))
        np.testing.assert_allclose(got, ref.norm_linear(x, nw, 1e-5, w) + res, atol=1e-4, rtol=1e-4)
    assert any(("SPLIT_K", True) in key[3] for key in wgpu_context._pipelines)


def test_rope_store_refuses_positions_past_the_cache(gpu_ops):
    cache = gpu_ops.new_kv_cache(1, 1, 8, 4)
    rope = gpu_ops.weight(np.zeros((16, 8), np.float32), name="rope")
    qkv = upload(gpu_ops, np.zeros((3, 24), np.float32))
    with pytest.raises(ContextOverflowError):
        gpu_ops.rope_store(qkv, rope, cache, 0, 2)


def test_kv_cache_offset_trim_and_nbytes(gpu_ops, f16_ops):
    cache = gpu_ops.new_kv_cache(3, 2, 16, 10)
    assert cache.nbytes == 2 * 3 * 2 * 10 * 16 * 4
    assert f16_ops.new_kv_cache(3, 2, 16, 10).nbytes == cache.nbytes // 2
    cache.offset = 7
    assert cache.trim(3) == 4 and cache.trim(10) == 0 and cache.offset == 0


# ---------------------------------------------------------------- argmax / top_k


def test_argmax_and_top_k_on_the_gpu_break_ties_by_lowest_index(gpu_ops):
    rng = np.random.default_rng(5)
    logits = rand(rng, 3, 5003)
    logits[0, [17, 4000, 4999]] = 9.0  # a three-way tie across chunks
    logits[2, :] = 1.0  # all equal
    g = upload(gpu_ops, logits)
    np.testing.assert_array_equal(gpu_ops.argmax(g), ref.argmax(logits))
    for k in (1, 5, 40):
        values, ids = gpu_ops.top_k(g, k)
        ref_values, ref_ids = ref.top_k(logits[:2], k)
        np.testing.assert_array_equal(ids[:2], ref_ids)
        np.testing.assert_array_equal(values[:2], ref_values)
        # numpy's argpartition picks any of a tie larger than k; the GPU keeps the lowest indices
        np.testing.assert_array_equal(ids[2], np.arange(k))
    values, ids = gpu_ops.top_k(upload(gpu_ops, logits[:1, :9]), 20)  # k larger than the row
    np.testing.assert_array_equal(ids, ref.top_k(logits[:1, :9], 20)[1])


# ---------------------------------------------------------------- variants and limits


def test_shared_memory_variants_match_where_subgroups_are_not_used():
    from kjarni.gpu import WgpuContext, WgpuOps

    try:
        ops = WgpuOps(WgpuContext(use_subgroups=False), weight_format="f32")
    except GpuUnavailableError as exc:
        pytest.skip(str(exc))
    rng = np.random.default_rng(6)
    x, w, nw = rand(rng, 1, 45), rand(rng, 30, 45), rand(rng, 45)
    got = ops.read(ops.norm_linear(upload(ops, x), ops.weight(nw, name="n"), 1e-5, ops.weight(w, name="w")))
    np.testing.assert_allclose(got, ref.norm_linear(x, nw, 1e-5, w), atol=1e-4, rtol=1e-4)
    logits = rand(rng, 2, 3000)
    g = upload(ops, logits)
    np.testing.assert_array_equal(ops.argmax(g), ref.argmax(logits))
    np.testing.assert_array_equal(ops.top_k(g, 4)[1], ref.top_k(logits, 4)[1])
    for _, _, out, out_ref in _attention_case(ops, "f32", [5, 1]):
        np.testing.assert_allclose(out, out_ref, atol=1e-4, rtol=1e-4)


def test_weights_larger_than_the_binding_limit_are_split_into_row_chunks():
    from kjarni.gpu import WgpuContext, WgpuOps

    try:
        ops = WgpuOps(WgpuContext(max_binding_size=4096), weight_format="f32")
    except GpuUnavailableError as exc:
        pytest.skip(str(exc))
    rng = np.random.default_rng(7)
    w, b = rand(rng, 100, 30), rand(rng, 100)  # rows padded to 32 floats: 32 rows per 4 KiB binding
    weight = ops.weight(w, name="big")
    assert len(weight.segments) == 4
    for tokens in (1, 9):
        x = rand(rng, tokens, 30)
        got = ops.read(ops.linear(upload(ops, x), weight, ops.weight(b, name="b")))
        np.testing.assert_allclose(got, ref.linear(x, w, b), atol=1e-4, rtol=1e-4)
    ids = np.array([99, 0, 31, 32, 64, 70])
    np.testing.assert_array_equal(ops.read(ops.embed(weight, ids)), w[ids])


def test_no_matching_adapter_raises_gpu_unavailable_naming_what_was_found(wgpu_context):
    from kjarni.gpu import WgpuContext

    with pytest.raises(GpuUnavailableError, match="found: .*llvmpipe|found: "):
        WgpuContext(adapter_name="no-such-gpu-anywhere")


def test_a_shader_that_fails_to_compile_names_the_kernel(wgpu_context):
    with pytest.raises(GenerationFailedError, match="broken_kernel"):
        wgpu_context.pipeline("broken_kernel", ("uniform",), source="fn main( {")


# ---------------------------------------------------------------- Params layouts


def test_params_layouts_match_the_wgsl_structs():
    from kjarni.gpu import kernels
    from kjarni.gpu.params import KERNEL_PARAMS, LINEAR, STEP, STEP_KERNELS

    stems = dict(KERNEL_PARAMS)
    shaders = __import__("pathlib").Path(kernels.__file__).resolve().parents[2].joinpath("shaders")
    for path in shaders.glob("linear_q*.wgsl"):
        stems.setdefault(path.stem, LINEAR)  # quantized linear kernels share the linear Params
    for op in ("matvec", "matmul", "embed"):  # the templates, every format
        for fmt in kernels.BLOCKS:
            assert kernels.struct_fields(kernels.template(op, fmt, frozenset({"subgroup"}))) == list(LINEAR.fields), (op, fmt)
    for stem, layout in stems.items():
        fields = kernels.struct_fields(kernels.source(stem, frozenset({"subgroup"})))
        assert fields == list(layout.fields), f"{stem}.wgsl struct Params differs from params.{layout.name}"
        if stem in STEP_KERNELS:
            assert kernels.struct_fields(kernels.source(stem), "Step") == list(STEP.fields), stem


@pytest.mark.parametrize("splits, rows, tokens, bias", [(2, 96, 5, False), (3, 1536, 7, True), (4, 40, 3, True)])
def test_reduce_prep_writes_the_reduce_and_the_prep_bit_for_bit(wgpu_context, splits, rows, tokens, bias):
    """matmul_reduce_prep.wgsl (a product's K-split reduce and the next product's normed f16 prep
    in one dispatch, `ReducePending`) against matmul_reduce.wgsl then matmul_tc_prep.wgsl run on
    the same partials: the same y and the same f16 activations, bit for bit (same sums in the same
    order). Widths from a few vec4s to 1536 (6 per thread)."""
    from kjarni.gpu import WgpuOps
    from kjarni.gpu.linear import LINEAR_KINDS, REDUCE_PREP_KINDS
    from kjarni.gpu.params import LINEAR, LINEAR_BIAS, LINEAR_NORM, LINEAR_RESIDUAL

    if not (wgpu_context.has_f16 and wgpu_context.has_subgroups):
        pytest.skip(f"{wgpu_context.description} lacks shader-f16 or subgroups, which the prep kernels need")
    ops = WgpuOps(wgpu_context, weight_format="f32")
    ctx = wgpu_context
    rng = np.random.default_rng(splits)
    partials = upload(ops, rand(rng, splits * tokens, rows))
    residual = upload(ops, rand(rng, tokens, rows))
    b = ops.weight(rand(rng, rows), name="bias")
    nw = ops.weight(rand(rng, rows) + np.float32(1), name="norm")
    flags = LINEAR_RESIDUAL | (LINEAR_BIAS if bias else 0)
    eps = 1e-6
    y1, y2 = ctx.scratch(tokens * rows * 4), ctx.scratch(tokens * rows * 4)
    a1, a2 = ctx.scratch(tokens * rows * 2), ctx.scratch(tokens * rows * 2)
    d = ctx.dummy
    reduce = ctx.uniform(LINEAR.pack(rows=rows, cols=splits, tokens=tokens, flags=flags, row_offset=0, y_stride=rows, eps=0.0))
    ctx.dispatch(ctx.pipeline("matmul_reduce", LINEAR_KINDS), (reduce, partials.buffer, d, d, b.buffer, residual.buffer, d, y1.buffer),
                 (-(-rows // 256), tokens, 1))
    prep = ctx.uniform(LINEAR.pack(rows=rows, cols=rows, tokens=tokens, flags=LINEAR_NORM, row_offset=0, y_stride=rows, eps=eps))
    ctx.dispatch(ctx.pipeline("matmul_tc_prep", LINEAR_KINDS), (prep, y1.buffer, d, d, d, d, nw.buffer, a1.buffer), (tokens, 1, 1))
    fused = ctx.uniform(LINEAR.pack(rows=rows, cols=splits, tokens=tokens, flags=flags | LINEAR_NORM, row_offset=0, y_stride=rows,
                                    eps=eps))
    ctx.dispatch(ctx.pipeline("matmul_reduce_prep", REDUCE_PREP_KINDS),
                 (fused, partials.buffer, y2.buffer, d, b.buffer, residual.buffer, nw.buffer, a2.buffer), (tokens, 1, 1))
    want_y = np.frombuffer(ctx.read(y1.buffer, 0, tokens * rows * 4), np.float32)
    got_y = np.frombuffer(ctx.read(y2.buffer, 0, tokens * rows * 4), np.float32)
    np.testing.assert_array_equal(got_y, want_y)
    want_a = np.frombuffer(ctx.read(a1.buffer, 0, tokens * rows * 2), np.float16)
    got_a = np.frombuffer(ctx.read(a2.buffer, 0, tokens * rows * 2), np.float16)
    np.testing.assert_array_equal(got_a, want_a)
    # and they are the sums and the normed rounding they claim to be
    p = np.frombuffer(ctx.read(partials.buffer, 0, splits * tokens * rows * 4), np.float32).reshape(splits, tokens, rows)
    y = p.sum(0, dtype=np.float64) + ops.read(residual) + (np.frombuffer(ctx.read(b.buffer, 0, rows * 4), np.float32) if bias else 0)
    np.testing.assert_allclose(got_y.reshape(tokens, rows), y, rtol=1e-6, atol=1e-5)
    w = np.frombuffer(ctx.read(nw.buffer, 0, rows * 4), np.float32)
    normed = y / np.sqrt(np.mean(y * y, axis=-1, keepdims=True) + eps) * w
    np.testing.assert_allclose(got_a.reshape(tokens, rows).astype(np.float32), normed, rtol=2.0 ** -10, atol=1e-6)
