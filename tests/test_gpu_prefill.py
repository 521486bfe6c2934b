"""The register-tiled prefill matmul (shaders/matmul.tmpl.wgsl) against numpy, in every tile variant.

`WgpuOps` routes linear ops of more than `matvec_max_tokens` tokens to ``matmul.<format>``; its
three variants (128x128 tiles, 64x64 tiles, 64x64 tiles with K split over 4 thread groups) are
forced through the selection thresholds. Shapes are odd on purpose: tokens, rows and cols that
are not multiples of any tile, cols not a multiple of 4 or 8 (zero padding, x tails).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from kjarni.numpy_ops import NumpyOps
from tests.test_gpu_quant import random_quant

pytestmark = pytest.mark.gpu

ref = NumpyOps()
T = gguf.GGMLQuantizationType

# (matmul_min_big_tiles, matmul_split_k_below, matmul_splits, matmul_nbuf) forcing each variant;
# the grid_split ones also split K over 3 workgroups (matmul_reduce adds the partials; not with a
# fused norm); the double-buffered ones (NBUF 2: one barrier a K step) keep what fits 32 KiB.
VARIANTS = {"tile128": (0, 0, 1, 1), "tile64x128": (10**9, 0, 1, 1), "tile64x128_split_k": (10**9, 10**9, 1, 1),
            "tile128_grid_split": (0, 0, 3, 1), "tile64x128_split_k_grid_split": (10**9, 10**9, 3, 1),
            "tile128_double": (0, 0, 1, 2), "tile64x128_split_k_double_grid_split": (10**9, 10**9, 3, 2)}


def rand(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def f16_round(a):
    return a.astype(np.float16).astype(np.float32)


@pytest.fixture(scope="module")
def make_ops(wgpu_context):
    from kjarni.gpu import WgpuOps

    def make(weight_format: str, variant: str) -> WgpuOps:
        ops = WgpuOps(wgpu_context, weight_format=weight_format)
        ops.tuning.tensor_cores = False  # these are the SIMT kernel's variants
        ops.tuning.matmul_int_dot = False  # and the SIMT kernel's for Q8_0 / Q5_0 / Q4_K too (float32 x)
        t = ops.tuning
        t.matmul_min_big_tiles, t.matmul_split_k_below, t.matmul_splits, t.matmul_nbuf = VARIANTS[variant]
        return ops

    return make


def upload(ops, array):
    """An activation holding ``array`` (gathered from an f32 table, exact)."""
    from kjarni.gpu import WgpuOps

    f32 = WgpuOps(ops.context, weight_format="f32")
    return f32.embed(f32.weight(array, name="activation"), np.arange(array.shape[0]))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("fmt", ["f32", "f16"])
@pytest.mark.parametrize("tokens,rows,cols", [(10, 29, 37), (70, 131, 72), (130, 200, 1100), (300, 9, 17), (67, 33, 513)])
def test_prefill_matmul_matches_numpy_with_bias_residual_and_fused_norm(make_ops, variant, fmt, tokens, rows, cols):
    ops = make_ops(fmt, variant)
    rng = np.random.default_rng(tokens * rows + cols)
    x, w, b, r, nw = rand(rng, tokens, cols), rand(rng, rows, cols), rand(rng, rows), rand(rng, tokens, rows), rand(rng, cols)
    w_ref = w if fmt == "f32" else f16_round(w)
    gx, gw = upload(ops, x), ops.weight(w, name="w")
    got = ops.read(ops.linear(gx, gw, ops.weight(b, name="b"), residual=upload(ops, r)))
    np.testing.assert_allclose(got, ref.linear(x, w_ref, b, r), atol=2e-4, rtol=1e-4)
    got = ops.read(ops.norm_linear(gx, ops.weight(nw, name="n"), 1e-5, gw, ops.weight(b, name="b")))
    np.testing.assert_allclose(got, ref.norm_linear(x, nw, 1e-5, w_ref, b), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("fmt", ["f32", "f16"])
def test_prefill_matmul_on_a_vocabulary_sized_lm_head(wgpu_context, fmt):
    """151,936 rows (Qwen2.5's vocabulary) at 17 tokens, the default tiles: the LM head of a
    forward asked for every token's logits (a speculative verification of 16 drafted tokens)."""
    from kjarni.gpu import WgpuOps

    ops = WgpuOps(wgpu_context, weight_format=fmt)
    ops.tuning.tensor_cores = False
    rng = np.random.default_rng(17)
    x, w = rand(rng, 17, 64), rand(rng, 151936, 64)
    gw = ops.weight(w, name="lm_head")
    assert ops.linear_kernels.plan((17, 64), gw, None, None, None, 0.0, False)[0][0][0].kjarni_name == f"matmul.{fmt}:main"
    got = ops.read(ops.linear(upload(ops, x), gw))
    np.testing.assert_allclose(got, ref.linear(x, w if fmt == "f32" else f16_round(w)), atol=2e-4, rtol=1e-4)


def _recorded_constants(monkeypatch, ctx) -> list[tuple[str, dict]]:
    """Every (kernel, constants) that `ctx.pipeline` is asked for from now on."""
    calls: list[tuple[str, dict]] = []
    real = ctx.pipeline

    def pipeline(kernel, kinds, **kwargs):
        calls.append((kernel, dict(kwargs.get("constants") or {})))
        return real(kernel, kinds, **kwargs)

    monkeypatch.setattr(ctx, "pipeline", pipeline)
    return calls


def _big(ctx, nbuf: int = 1) -> dict:
    """The 128x128 configuration: K over 2 thread groups where the device has the 32.5 KiB of
    workgroup memory that takes (the H200: 48 KiB), else over 1 (lavapipe: 32 KiB); asked for two
    buffers, one group keeps them where they fit (the H200), else one buffer."""
    from kjarni.gpu.linear import matmul_workgroup_bytes

    limit = ctx.max_workgroup_storage
    if nbuf == 2:
        return {"TM": 16, "TN": 16, "BK": 16, "KSPLIT": 1, "NBUF": 2 if matmul_workgroup_bytes(16, 16, 16, 1, 2) <= limit else 1}
    return {"TM": 16, "TN": 16, "BK": 16, "KSPLIT": 2 if matmul_workgroup_bytes(16, 16, 16, 2) <= limit else 1, "NBUF": 1}


def test_tile_configurations_fit_the_devices_workgroup_memory(wgpu_context, monkeypatch):
    from kjarni.gpu import WgpuOps
    from kjarni.gpu.linear import matmul_workgroup_bytes

    ops = WgpuOps(wgpu_context)
    assert ops.matmul_config(9728, 512, 896) == (8, 16, 8, 1, 1)  # a measured shape: its table entry
    ops.tuning.matmul_configs = {}  # the rules
    assert matmul_workgroup_bytes(16, 16, 16, 2) == 33280 and matmul_workgroup_bytes(8, 16, 8, 4) == 25088
    assert matmul_workgroup_bytes(8, 16, 8, 2, 2) == 25088
    monkeypatch.setattr(wgpu_context, "max_workgroup_storage", 48 << 10)
    assert ops.matmul_config(9728, 2048, 896) == (16, 16, 16, 2, 1)  # 1216 tiles of 128 x 128
    assert ops.matmul_config(896, 512, 4864) == (8, 16, 8, 4, 1)
    monkeypatch.setattr(wgpu_context, "max_workgroup_storage", 32 << 10)
    assert ops.matmul_config(9728, 2048, 896) == (16, 16, 16, 1, 1)
    monkeypatch.setattr(wgpu_context, "max_workgroup_storage", 16 << 10)
    assert ops.matmul_config(896, 512, 4864) == (8, 16, 8, 1, 1)


def test_each_variant_really_runs_its_tile_configuration(make_ops, monkeypatch):
    rng = np.random.default_rng(0)
    x, w = rand(rng, 10, 300), rand(rng, 20, 300)  # 10 tokens: past matvec_max_tokens (9)
    big, small, split = _big(make_ops("f32", "tile128").context), {"TM": 8, "TN": 16, "BK": 8, "KSPLIT": 1, "NBUF": 1}, {"TM": 8, "TN": 16, "BK": 8, "KSPLIT": 4, "NBUF": 1}
    reduce = [("matmul_reduce", {})]  # the grid-split variants add their partials in a second dispatch
    expected = {"tile128": [("matmul.f32", big)], "tile64x128": [("matmul.f32", small)], "tile64x128_split_k": [("matmul.f32", split)],
                "tile128_grid_split": [("matmul.f32", big), *reduce], "tile64x128_split_k_grid_split": [("matmul.f32", split), *reduce],
                "tile128_double": [("matmul.f32", _big(make_ops("f32", "tile128").context, nbuf=2))],
                "tile64x128_split_k_double_grid_split": [("matmul.f32", {**split, "KSPLIT": 2, "NBUF": 2}), *reduce]}
    for variant, want in expected.items():
        ops = make_ops("f32", variant)
        gx, gw = upload(ops, x), ops.weight(w, name="w")
        calls = _recorded_constants(monkeypatch, ops.context)
        ops.linear(gx, gw)
        assert calls == want, variant
        monkeypatch.undo()


def test_a_measured_configuration_overrides_the_rules_for_its_shape(make_ops, monkeypatch):
    ops = make_ops("f16", "tile128")
    rng = np.random.default_rng(3)
    x, w, r = rand(rng, 50, 296), rand(rng, 20, 296), rand(rng, 50, 20)
    ops.tuning.matmul_splits = None  # automatic: the measured split
    ops.tuning.matmul_configs = {(20, 296): (8, 8, 8, 2, 2, 3)}  # 64 x 64 tiles, 2 groups, 2 buffers, 3 splits
    gx, gw, gr = upload(ops, x), ops.weight(w, name="w"), upload(ops, r)
    calls = _recorded_constants(monkeypatch, ops.context)
    got = ops.read(ops.linear(gx, gw, residual=gr))
    assert calls == [("matmul.f16", {"TM": 8, "TN": 8, "BK": 8, "KSPLIT": 2, "NBUF": 2}), ("matmul_reduce", {})]
    np.testing.assert_allclose(got, ref.linear(x, f16_round(w), None, r), atol=2e-4, rtol=1e-4)
    calls.clear()
    ops.norm_linear(gx, ops.weight(rand(rng, 296), name="n"), 1e-5, gw)  # a fused norm: never split
    assert calls == [("matmul.f16", {"TM": 8, "TN": 8, "BK": 8, "KSPLIT": 2, "NBUF": 2})]


def test_default_selection_splits_k_for_few_tiles_and_uses_big_tiles_for_many(wgpu_context, monkeypatch):
    from kjarni.gpu import WgpuOps

    ops = WgpuOps(wgpu_context, weight_format="f16")
    ops.tuning.tensor_cores = False  # the SIMT kernels' selection (tests/test_gpu_tensor_cores.py: the other)
    rng = np.random.default_rng(1)
    x, small, short = upload(ops, rand(rng, 10, 256)), ops.weight(rand(rng, 24, 256), name="w"), upload(ops, rand(rng, 10, 8))
    calls = _recorded_constants(monkeypatch, wgpu_context)
    ops.linear(x, small)  # one 64x128 tile: K split over 4 groups and over 4 workgroups (256 / (2 x 32) columns)
    ops.norm_linear(x, ops.weight(rand(rng, 256), name="n"), 1e-5, small)  # a fused norm needs whole rows: no split
    ops.tuning.matmul_min_big_tiles = 1
    ops.linear(x, ops.weight(rand(rng, 24, 256), name="w2"))  # enough 128x128 tiles by the threshold
    ops.tuning.matmul_min_big_tiles = 10**9
    ops.linear(short, ops.weight(rand(rng, 24, 8), name="w8"))  # too few columns to split
    split, big, small = {"TM": 8, "TN": 16, "BK": 8, "KSPLIT": 4, "NBUF": 1}, _big(wgpu_context), {"TM": 8, "TN": 16, "BK": 8, "KSPLIT": 1, "NBUF": 1}
    reduce = ("matmul_reduce", {})
    assert calls == [("matmul.f16", split), reduce, ("matmul.f16", split), ("matmul.f16", big), reduce, ("matmul.f16", small)]
    assert ops.linear_kernels.matmul_splits(24, 10, 256, 0, 24) == 4


@pytest.mark.parametrize("qtype", sorted([T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q6_K], key=lambda t: t.name))
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_prefill_matmul_of_quantized_weights_matches_numpy_dequantized(make_ops, qtype, variant):
    ops = make_ops("f16", variant)
    cols = 768 if qtype in (T.Q4_K, T.Q6_K) else 288  # 3 K-quant blocks, 9 small blocks (odd f16 pairs)
    qt = random_quant(qtype, 37, cols, seed=int(qtype))
    w = gguf.quants.dequantize(qt.data, qtype)
    rng = np.random.default_rng(int(qtype))
    tokens = 21
    x, b, r, nw = rand(rng, tokens, cols), rand(rng, 37), rand(rng, tokens, 37), rand(rng, cols)
    gw = ops.weight(qt, name="wq")
    assert gw.formats == [qtype.name]
    gx = upload(ops, x)
    got = ops.read(ops.linear(gx, gw, ops.weight(b, name="b"), residual=upload(ops, r)))
    expected = ref.linear(x, w, b, r)
    scale = np.abs(expected).max()
    np.testing.assert_allclose(got, expected, atol=2e-5 * scale, rtol=1e-4)
    got = ops.read(ops.norm_linear(gx, ops.weight(nw, name="n"), 1e-5, gw))
    expected = ref.norm_linear(x, nw, 1e-5, w)
    np.testing.assert_allclose(got, expected, atol=2e-5 * np.abs(expected).max(), rtol=1e-4)
    assert any(k[0] == "matmul." + qtype.name for k in ops.context._pipelines)


@pytest.mark.parametrize("splits", [1, None])
@pytest.mark.parametrize("fmt", ["f32", "f16", "q8_0"])
def test_prefill_matmul_applies_a_pending_silu_mul_while_loading(wgpu_context, fmt, splits):
    # silu_mul(gate_up) followed by the down projection: no silu_mul dispatch, same values; with
    # the automatic split over K (6 workgroups here), one matmul_reduce more.
    from kjarni.gpu import WgpuOps

    ops = WgpuOps(wgpu_context, weight_format=fmt)
    ops.tuning.tensor_cores = False  # f32 activations (the tensor-core path: tests/test_gpu_tensor_cores.py)
    ops.tuning.matmul_splits = splits
    rng = np.random.default_rng(7)
    tokens, cols, rows = 70, 96, 45
    gate_up, w, r = rand(rng, tokens, 2 * cols), rand(rng, rows, cols), rand(rng, tokens, rows)
    gw = ops.weight(w, name="w")
    w_ref = {"f32": w, "f16": f16_round(w)}.get(fmt)
    if w_ref is None:
        w_ref = gguf.quants.dequantize(gguf.quants.quantize(w, T.Q8_0), T.Q8_0).reshape(w.shape)
    before = ops.stats.dispatches
    got = ops.read(ops.linear(ops.silu_mul(upload(ops, gate_up)), gw, residual=upload(ops, r)))
    expected = ref.linear(ref.silu_mul(gate_up), w_ref, None, r)
    np.testing.assert_allclose(got, expected, atol=2e-4 * max(1.0, np.abs(expected).max()), rtol=1e-4)
    kernels_run = ops.stats.dispatches - before
    assert kernels_run == (3 if splits == 1 else 4), "the two uploads (an embed each) and one matmul (+ reduce): no silu_mul dispatch"


@pytest.mark.parametrize("unchecked", [True, False])
@pytest.mark.parametrize("qtype", [None, T.Q8_0, T.Q4_K], ids=["f16", "Q8_0", "Q4_K"])
def test_matmul_unchecked_tuning_decides_how_the_prefill_matmul_is_compiled(make_ops, qtype, unchecked, monkeypatch):
    """GpuTuning.matmul_unchecked (on by default) reaches the matmul's pipeline, whose result is
    numpy's either way (rows past the tile's last, a fused norm, tokens past the last whole tile)."""
    ops = make_ops("f16", "tile64x128_split_k")
    ops.tuning.matmul_unchecked = unchecked
    asked = []
    real = ops.context.pipeline
    monkeypatch.setattr(ops.context, "pipeline", lambda kernel, kinds, **kw: asked.append((kernel, kw.get("unchecked", False)))
                        or real(kernel, kinds, **kw))
    rng = np.random.default_rng(6)
    cols, rows, tokens = 768, 37, 21
    if qtype is None:
        w = rand(rng, rows, cols)
        gw, w_ref, name = ops.weight(w, name="w"), f16_round(w), "matmul.f16"
    else:
        qt = random_quant(qtype, rows, cols, seed=int(qtype))
        gw, w_ref, name = ops.weight(qt, name="wq"), gguf.quants.dequantize(qt.data, qtype), "matmul." + qtype.name
    x, nw = rand(rng, tokens, cols), rand(rng, cols)
    got = ops.read(ops.norm_linear(upload(ops, x), ops.weight(nw, name="n"), 1e-5, gw))
    expected = ref.norm_linear(x, nw, 1e-5, w_ref)
    np.testing.assert_allclose(got, expected, atol=2e-5 * np.abs(expected).max(), rtol=1e-4)
    assert (name, unchecked) in asked and (name, not unchecked) not in asked


def test_a_kernel_compiled_without_runtime_checks_gives_the_same_result(make_ops, monkeypatch):
    """WgpuContext.pipeline(unchecked=True) (wgpu-native's trusted shader module, measured by
    tools/sweep_matmul.py --unchecked) builds a working pipeline; distinct from the checked one."""
    ops = make_ops("f32", "tile64x128_split_k")
    ctx = ops.context
    rng = np.random.default_rng(5)
    x, w = rand(rng, 40, 300), rand(rng, 50, 300)
    real = ctx.pipeline
    monkeypatch.setattr(ctx, "pipeline", lambda kernel, kinds, **kw: real(kernel, kinds, **{**kw, "unchecked": True}))
    got = ops.read(ops.linear(upload(ops, x), ops.weight(w, name="w")))
    np.testing.assert_allclose(got, ref.linear(x, w, None, None), atol=2e-4, rtol=1e-4)
    constants = {"TM": 8, "TN": 16, "BK": 8, "KSPLIT": 4, "NBUF": 1}
    from kjarni.gpu import kernels
    from kjarni.gpu.linear import LINEAR_KINDS

    source = kernels.template("matmul", "f32")
    assert real("matmul.f32", LINEAR_KINDS, constants=constants, source=source, unchecked=True) is not real(
        "matmul.f32", LINEAR_KINDS, constants=constants, source=source)
