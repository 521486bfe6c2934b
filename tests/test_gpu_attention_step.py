"""attention_step.wgsl (decode: RoPE, the KV store and attention of one token in one dispatch)
against NumpyOps: head_dim 64 and 128, grouped-query heads, partial rotary, sliding windows, f16
and f32 caches, one workgroup per head or the keys split over several (flash-decoding: merged by
attention_combine when read, or by the o_proj matvec that loads them); and the pending rope_store
handle's rules (read q, drop it unread)."""

from __future__ import annotations

import numpy as np
import pytest

from kjarni.numpy_ops import NumpyKVCache, NumpyOps, quantize_activations
from tests.test_gpu_matvec import make_weight, record_pipelines

pytestmark = pytest.mark.gpu
ref = NumpyOps()


def _rope(head_dim: int, rotary_dim: int, positions: int) -> np.ndarray:
    from kjarni.model import rope_table

    class Cfg:  # the fields rope_table reads
        pass

    cfg = Cfg()
    cfg.head_dim, cfg.rope_theta, cfg.rope_scaling = rotary_dim, 10000.0, None
    table = rope_table(cfg, positions)
    assert table.shape[1] == rotary_dim
    return table


def _upload(ops, a):
    from kjarni.gpu import GpuTensor

    t = GpuTensor(ops.context.scratch(a.nbytes), a.shape)
    ops.context.queue.write_buffer(t.buffer, 0, np.ascontiguousarray(a, np.float32))
    return t


def _f16(a):
    return a.astype(np.float16).astype(np.float32)


def _read_cache(ops, buffer, kv_format, kv_heads, capacity, head_dim):
    """One layer's keys or values as the GPU stored them, [kv_heads, capacity, head_dim] float32."""
    data = np.frombuffer(ops.context.read(buffer, 0, buffer.size), np.float16 if kv_format == "f16" else np.float32)
    return data.reshape(kv_heads, capacity, head_dim).astype(np.float32)


@pytest.mark.parametrize("splits,lean,unchecked,q_regs,one", [
    (1, False, False, False, False), (8, False, False, False, False), (1, True, True, False, False),
    (8, True, True, False, False), (8, True, False, False, False), (1, True, False, True, False),
    (8, True, True, True, False), (8, False, False, True, False), (1, True, True, True, True),
    (8, True, True, True, True), (8, False, False, False, True)])
@pytest.mark.parametrize("kv_format", ["f32", "f16"])
@pytest.mark.parametrize("heads,kv_heads,head_dim,rotary_dim,window,threads,prompt", [
    (14, 2, 64, 64, None, 1024, 19), (6, 2, 128, 128, None, 1024, 19), (3, 3, 64, 32, None, 1024, 19),
    (4, 1, 64, 64, 9, 1024, 19),
    # many keys a thread: both score keys of a trip, the four-key p v loop and its tail
    (14, 2, 64, 64, None, 1024, 700), (4, 2, 64, 64, None, 64, 83), (4, 2, 128, 128, 50, 64, 201),
    # fewer keys than splits: the splits past the last key are empty
    (4, 2, 64, 64, None, 64, 2),
    # past 1,024 keys: attention_step only when split (at most 1,024 keys a split)
    (4, 2, 64, 64, None, 256, 1030),
])
def test_attention_step_matches_numpy_over_several_decode_steps(wgpu_context, monkeypatch, kv_format, heads, kv_heads,
                                                                head_dim, rotary_dim, window, threads, prompt, splits,
                                                                lean, unchecked, q_regs, one):
    """``unchecked``: compiled without naga's index checks (`attention_step_unchecked`): every
    access must be in range by itself, the empty runs past the last key included. ``q_regs``: q
    in the score lanes' registers (`attention_step_q_regs`, the kernel's QREG, with subgroups).
    ``one``: the softmax in one barrier (`attention_step_one_barrier`)."""
    from kjarni.gpu import WgpuOps

    ops = WgpuOps(wgpu_context, weight_format="f32", kv_format=kv_format)
    ops.tuning.attention_step_threads = ops.tuning.attention_split_threads = threads
    ops.tuning.attention_step_splits = splits
    ops.tuning.attention_step_lean = lean
    ops.tuning.attention_step_unchecked = unchecked
    ops.tuning.attention_step_q_regs = q_regs
    ops.tuning.attention_step_one_barrier = one
    requested = record_pipelines(ops, monkeypatch)
    capacity = prompt + 8
    ops.tuning.attention_step_max = capacity
    rope = _rope(head_dim, rotary_dim, capacity)
    g_rope = ops.weight(rope, name="rope")
    gpu_cache = ops.new_kv_cache(2, kv_heads, head_dim, capacity)
    cpu_cache = NumpyKVCache(2, kv_heads, head_dim, capacity)
    rng = np.random.default_rng(heads * head_dim)
    width = (heads + 2 * kv_heads) * head_dim
    start = 0
    # An f16 cache value is the rounding of an f32 result; where the GPU's f32 rotation differs
    # from numpy's in its last bit (compilers contract different multiply-adds: Dawn's against
    # naga's, one lavapipe against another), a value next to a rounding boundary lands one f16 ulp
    # (2^-11 relative) away. So the cache is compared to numpy's to one ulp, and the attention is
    # checked against numpy's attention over the keys and values the GPU stored (f32 sums only).
    cache_rtol = 2.0**-10 if kv_format == "f16" else 1e-5
    for tokens in (prompt, 1, 1, 1, 1):  # a prefill (rope_store + the prefill kernels), then decode steps
        qkv = rng.standard_normal((tokens, width)).astype(np.float32)
        dispatches = ops.stats.dispatches
        out = ops.attention(ops.rope_store(_upload(ops, qkv), g_rope, gpu_cache, 1, start), gpu_cache, 1, start, window)
        if tokens == 1 and start + 1 <= 1024 * splits:
            assert ops.stats.dispatches - dispatches == 1, "one dispatch for rope, store and attention"
            steps = [(kw["unchecked"], kw["constants"]["QREG"], kw["constants"]["ONE_BARRIER"])
                     for kernel, kw in requested if kernel == "attention_step"]
            assert steps and set(steps) == {(unchecked, int(q_regs and ops.context.has_subgroups), int(one))}, steps
        q_ref = ref.rope_store(qkv, rope, cpu_cache, 1, start)
        if kv_format == "f16":  # the GPU keeps the cache in f16: numpy's own values, rounded alike
            cpu_cache.keys[:] = _f16(cpu_cache.keys)
            cpu_cache.values[:] = _f16(cpu_cache.values)
        stored = NumpyKVCache(2, kv_heads, head_dim, capacity)
        stored.keys[1], stored.values[1] = (_read_cache(ops, part[1], kv_format, kv_heads, capacity, head_dim)
                                            for part in (gpu_cache.keys, gpu_cache.values))
        np.testing.assert_allclose(ops.read(out), ref.attention(q_ref, stored, 1, start, window), atol=1e-4, rtol=1e-4)
        start += tokens
    # The cache holds what numpy's holds (the fused kernel stored every decode token's k and v).
    for got, want in ((gpu_cache.keys, cpu_cache.keys), (gpu_cache.values, cpu_cache.values)):
        got = _read_cache(ops, got[1], kv_format, kv_heads, capacity, head_dim)[:, :start]
        np.testing.assert_allclose(got, want[1][:, :start], atol=1e-5, rtol=cache_rtol)


def test_attention_step_doubles_its_splits_as_the_context_grows_and_matches_numpy(wgpu_context):
    """Past ``attention_step_split_keys`` keys a split the splits double (2 -> 4 -> 8 here, capped
    at ``attention_step_max_splits``); each decode step stays one dispatch and equals numpy."""
    from kjarni.gpu import WgpuOps
    from kjarni.gpu.step import AttentionPartials

    if not wgpu_context.has_subgroups:
        pytest.skip("a split attention_step needs subgroups (the o_proj merge); this adapter has none")
    ops = WgpuOps(wgpu_context, weight_format="f32", kv_format="f32")
    ops.tuning.attention_step_splits, ops.tuning.attention_step_split_keys, ops.tuning.attention_step_max_splits = 2, 8, 8
    heads, kv_heads, head_dim, prompt, steps = 4, 2, 64, 15, 60
    capacity = prompt + steps
    rope = _rope(head_dim, head_dim, capacity)
    g_rope = ops.weight(rope, name="rope")
    gpu_cache = ops.new_kv_cache(1, kv_heads, head_dim, capacity)
    cpu_cache = NumpyKVCache(1, kv_heads, head_dim, capacity)
    rng = np.random.default_rng(11)
    width = (heads + 2 * kv_heads) * head_dim
    start, seen = 0, []
    for tokens in (prompt,) + (1,) * steps:
        qkv = rng.standard_normal((tokens, width)).astype(np.float32)
        dispatches = ops.stats.dispatches
        out = ops.attention(ops.rope_store(_upload(ops, qkv), g_rope, gpu_cache, 0, start), gpu_cache, 0, start)
        if tokens == 1:
            assert ops.stats.dispatches - dispatches == 1, "one dispatch for rope, store and attention"
            assert type(out) is AttentionPartials
            # splits * 8 keys hold the start + 1 keys: 2 up to 16, 4 up to 32, then 8 (the cap).
            keys = start + 1
            assert out.splits == (2 if keys <= 16 else 4 if keys <= 32 else 8)
            seen.append(out.splits)
        q_ref = ref.rope_store(qkv, rope, cpu_cache, 0, start)
        np.testing.assert_allclose(ops.read(out), ref.attention(q_ref, cpu_cache, 0, start), atol=1e-4, rtol=1e-4)
        start += tokens
    assert sorted(set(seen)) == [2, 4, 8] and seen == sorted(seen)


def test_a_one_token_step_fuses_as_far_as_the_splits_reach_or_attention_single_max_unsplit(wgpu_context):
    """The default reach of attention_step: 32 splits of 1,024 keys on a subgroup device (16 splits
    up to 4,096 positions, then 32), ``attention_single_max`` (768) with one workgroup a head."""
    from kjarni.gpu import WgpuOps

    ops = WgpuOps(wgpu_context, weight_format="f32", kv_format="f32")
    attention = ops._attention
    if wgpu_context.has_subgroups:
        assert [attention.step_splits(n) for n in (1, 4096, 4097, 32768)] == [16, 16, 32, 32]
        assert attention.fuses_rope(1, 32767) and not attention.fuses_rope(1, 32768)
        assert not attention.fuses_rope(2, 0), "verifies of several rows never fuse"
    ops.tuning.attention_step_splits = 1
    assert attention.step_splits(32768) == 1
    assert attention.fuses_rope(1, 767) and not attention.fuses_rope(1, 768)
    ops.tuning.attention_step_max = 100
    assert attention.fuses_rope(1, 99) and not attention.fuses_rope(1, 100)


def test_a_pending_rope_store_is_recorded_when_q_is_read_or_the_handle_dropped(wgpu_context):
    from kjarni.gpu import WgpuOps

    ops = WgpuOps(wgpu_context, weight_format="f32", kv_format="f32")
    heads, kv_heads, hd, capacity = 4, 2, 64, 16
    rope = _rope(hd, hd, capacity)
    g_rope = ops.weight(rope, name="rope")
    gpu_cache = ops.new_kv_cache(1, kv_heads, hd, capacity)
    cpu_cache = NumpyKVCache(1, kv_heads, hd, capacity)
    rng = np.random.default_rng(5)
    qkv = rng.standard_normal((1, (heads + 2 * kv_heads) * hd)).astype(np.float32)
    q_ref = ref.rope_store(qkv, rope, cpu_cache, 0, 0)
    np.testing.assert_allclose(ops.read(ops.rope_store(_upload(ops, qkv), g_rope, gpu_cache, 0, 0)), q_ref, atol=1e-5)
    qkv2 = rng.standard_normal((1, (heads + 2 * kv_heads) * hd)).astype(np.float32)
    ref.rope_store(qkv2, rope, cpu_cache, 0, 1)
    ops.rope_store(_upload(ops, qkv2), g_rope, gpu_cache, 0, 1)  # dropped unread: still stored
    values = np.frombuffer(ops.context.read(gpu_cache.values[0], 0, gpu_cache.values[0].size), np.float32)
    np.testing.assert_allclose(values.reshape(kv_heads, capacity, hd)[:, :2], cpu_cache.values[0][:, :2], atol=1e-6)
    keys = np.frombuffer(ops.context.read(gpu_cache.keys[0], 0, gpu_cache.keys[0].size), np.float32)
    np.testing.assert_allclose(keys.reshape(kv_heads, capacity, hd)[:, :2], cpu_cache.keys[0][:, :2], atol=1e-5)


@pytest.mark.parametrize("fmt,early", [("f16", False), ("Q8_0", False), ("Q8_0", True), ("Q5_0", True)])
@pytest.mark.parametrize("heads,kv_heads,head_dim,rows,splits,prompt,lean", [
    (14, 2, 64, 896, 8, 40, False), (6, 2, 128, 75, 3, 19, False), (4, 1, 64, 203, 8, 2, False),
    (14, 2, 64, 896, 32, 40, True), (6, 2, 128, 75, 16, 19, True),
])
@pytest.mark.parametrize("key_lanes", [4, 8])
def test_the_o_proj_matvec_merges_split_attention_while_loading_x(wgpu_context, monkeypatch, fmt, early, heads,
                                                                   kv_heads, head_dim, rows, splits, prompt, lean,
                                                                   key_lanes):
    """attention_step over ``splits`` runs of the keys, then o_proj (+ residual) reading the runs'
    partials: two dispatches, the same result as numpy's attention then linear (odd row counts, head_dim
    64 and 128, fewer keys than splits). ``early``: a quantized o_proj fetches its first weights
    before it merges (`matvec_attn_early`, matvec_dot's EARLY)."""
    from kjarni.gpu import WgpuOps
    from kjarni.gpu.step import AttentionPartials

    ops = WgpuOps(wgpu_context, weight_format="f32", kv_format="f32")
    ops.tuning.attention_step_splits = splits
    ops.tuning.attention_step_lean = lean
    ops.tuning.attention_step_key_lanes = key_lanes
    ops.tuning.matvec_attn_early = early
    requested = record_pipelines(ops, monkeypatch)
    capacity = prompt + 4
    rope = _rope(head_dim, head_dim, capacity)
    g_rope = ops.weight(rope, name="rope")
    gpu_cache = ops.new_kv_cache(1, kv_heads, head_dim, capacity)
    cpu_cache = NumpyKVCache(1, kv_heads, head_dim, capacity)
    rng = np.random.default_rng(rows)
    width = (heads + 2 * kv_heads) * head_dim
    g_w, w = make_weight(ops, fmt, rows, heads * head_dim, seed=rows)
    qkv = rng.standard_normal((prompt, width)).astype(np.float32)
    ops.attention(ops.rope_store(_upload(ops, qkv), g_rope, gpu_cache, 0, 0), gpu_cache, 0, 0)
    ops.context.flush()  # the uploads below are written at once: the prefill must not see them in its freed buffers
    q_ref = ref.rope_store(qkv, rope, cpu_cache, 0, 0)
    ref.attention(q_ref, cpu_cache, 0, 0)
    qkv = rng.standard_normal((1, width)).astype(np.float32)
    residual = rng.standard_normal((1, rows)).astype(np.float32)
    g_residual = _upload(ops, residual)
    dispatches = ops.stats.dispatches
    attn = ops.attention(ops.rope_store(_upload(ops, qkv), g_rope, gpu_cache, 0, prompt), gpu_cache, 0, prompt)
    assert type(attn) is AttentionPartials
    y = ops.linear(attn, g_w, residual=g_residual)
    assert ops.stats.dispatches - dispatches == 2, "attention_step, then the matvec merging its partials"
    if fmt != "f16":
        constants = [(kernel, (kw.get("constants") or {}).get("EARLY")) for kernel, kw in requested]
        assert (f"matvec_dot.{fmt}", int(early)) in constants, constants
    merged = ref.attention(ref.rope_store(qkv, rope, cpu_cache, 0, prompt), cpu_cache, 0, prompt)
    if fmt != "f16":  # the integer-dot product reads x quantized to int8 blocks (matvec_dot.tmpl.wgsl)
        merged = quantize_activations(merged)
    expected = merged @ w.T + residual
    np.testing.assert_allclose(ops.read(y), expected, atol=2e-4, rtol=2e-4)


def test_the_hosts_key_limits_are_the_kernels():
    """attention.py's STEP_MAX_KEYS and STEP_Q_REGS are attention_step.wgsl's MAX_KEYS and QMAX."""
    import re

    from kjarni.gpu import kernels
    from kjarni.gpu.attention import STEP_MAX_KEYS, STEP_Q_REGS

    source = kernels.raw_source("attention_step.wgsl")
    consts = {name: int(value) for name, value in re.findall(r"^const (\w+): u32 = (\d+)u;", source, re.M)}
    assert (consts["MAX_KEYS"], consts["QMAX"]) == (STEP_MAX_KEYS, STEP_Q_REGS)
