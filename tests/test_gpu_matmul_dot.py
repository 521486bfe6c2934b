"""The integer-dot prefill product (shaders/matmul_dot_prep.wgsl, shaders/matmul_dot.tmpl.wgsl)
against numpy, Q8_0 / Q5_0 / Q4_K (GpuTuning.matmul_int_dot).

The prep's quants and scales are compared with numpy_ops.quantize_blocks: the GPU's float arithmetic
(WGSL's division, exact to 2.5 ULP; with the fused norm or silu_mul, its scale and exp) may differ
from numpy's in the last bit, so a value at a rounding tie may land one level apart: each one is
counted and checked to be at a tie, and the scales agree to a few ULP.
The product is checked through `WgpuOps` as a prefill runs it, against
NumpyOps(quantize_activations=True, quantized_prefill_min_tokens=10): the dequantized weight times
x rounded exactly as the prep rounds it, at the float32 tolerance of the decode matvec_dot tests.
Rows and tokens are odd (not multiples of the 64-row tile, nor of 64 or 128 tokens), both tiles
and a K split over workgroups run, and a weight of two segments (a row offset) of two formats.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from kjarni.gpu import kernels
from kjarni.numpy_ops import NumpyOps, quantize_activations, quantize_blocks
from tests.test_gpu_matvec import upload
from tests.test_gpu_quant import random_quant

T = gguf.GGMLQuantizationType
FORMATS = list(kernels.DOT_FORMATS)  # Q8_0, Q5_0, Q4_0 (one scale a block), Q4_K, Q4_1, Q5_1 (and a min), Q6_K (a scale a half)
PREFILL = 10  # GpuTuning.matvec_max_tokens + 1: the first token count a prefill product has
REF = NumpyOps(quantize_activations=True, quantized_prefill_min_tokens=PREFILL)
FLOAT_REF = NumpyOps()


@pytest.fixture(scope="module")
def ops(wgpu_context):
    from kjarni.gpu import WgpuOps

    if not wgpu_context.has_subgroups:
        pytest.skip("matmul_dot_prep.wgsl needs subgroups")
    ops = WgpuOps(wgpu_context, weight_format="f32")
    ops.tuning.tensor_cores = False  # tensor cores come first where a device has them
    ops.tuning.matmul_int_dot = True
    return ops


def plan_kernels(ops, weight, tokens: int) -> list[str]:
    dispatches = ops.linear_kernels.plan((tokens, weight.shape[1]), weight, None, None, None, 0.0, False)[0]
    return [pipeline.kjarni_name for pipeline, *_ in dispatches]


def test_numpy_rounds_the_formats_the_gpu_kernels_round():
    """numpy_ops' int-dot type sets name the formats kernels.py renders integer-dot kernels for."""
    from kjarni.numpy_ops import INT_DOT_PREFILL_TYPES, INT_DOT_TYPES

    assert {t.name for t in INT_DOT_TYPES} == set(kernels.MATVEC_DOT_FORMATS)
    assert {t.name for t in INT_DOT_PREFILL_TYPES} == set(kernels.DOT_FORMATS)


def test_numpy_quantizes_prefill_products_from_the_token_count_given():
    rng = np.random.default_rng(0)
    q8 = REF.weight(random_quant(T.Q8_0, 8, 64, seed=1), name="a.weight")
    for tokens, quantized in ((1, True), (PREFILL - 1, False), (PREFILL, True), (40, True)):
        x = rng.standard_normal((tokens, 64)).astype(np.float32)
        want = FLOAT_REF.linear(quantize_activations(x) if quantized else x, q8)
        np.testing.assert_array_equal(REF.linear(x, q8), want, err_msg=f"{tokens} tokens")
    narrow = REF.weight(random_quant(T.Q8_0, 8, 96, seed=1), name="n.weight")  # rows of 96: the GPU's SIMT matmul
    x = rng.standard_normal((PREFILL, 96)).astype(np.float32)
    np.testing.assert_array_equal(REF.linear(x, narrow), FLOAT_REF.linear(x, narrow))
    q41 = REF.weight(random_quant(T.Q4_1, 8, 64, seed=2), name="q41.weight")  # prefill rounds it, decode does not
    x = rng.standard_normal((PREFILL, 64)).astype(np.float32)
    np.testing.assert_array_equal(REF.linear(x, q41), FLOAT_REF.linear(quantize_activations(x), q41))
    np.testing.assert_array_equal(REF.linear(x[:1], q41), FLOAT_REF.linear(x[:1], q41))
    prefill_only = NumpyOps(quantized_prefill_min_tokens=PREFILL)  # quantize_activations off: decode in float32
    w8 = prefill_only.weight(random_quant(T.Q8_0, 8, 64, seed=1), name="a.weight")
    np.testing.assert_array_equal(prefill_only.linear(x, w8), FLOAT_REF.linear(quantize_activations(x), w8))
    np.testing.assert_array_equal(prefill_only.linear(x[:1], w8), FLOAT_REF.linear(x[:1], w8))
    off = NumpyOps(quantize_activations=True)  # 0: one-token products only
    w = off.weight(random_quant(T.Q8_0, 8, 64, seed=1), name="a.weight")
    x = rng.standard_normal((PREFILL, 64)).astype(np.float32)
    np.testing.assert_array_equal(off.linear(x, w), FLOAT_REF.linear(x, w))


def _prep(ops, x_in, tokens: int, cols: int, flags: int, norm=None, eps: float = 1e-5):
    """matmul_dot_prep dispatched alone: (quants [tokens, cols] int8, d and d sum q [tokens, cols / 32])."""
    from kjarni.gpu.linear import LINEAR_KINDS, dot_prep_bytes
    from kjarni.gpu.params import LINEAR

    ctx = ops.context
    size = dot_prep_bytes(tokens, cols)
    out = ctx.scratch(size)
    params = ctx.uniform(LINEAR.pack(rows=cols, cols=cols, tokens=tokens, flags=flags, row_offset=0, y_stride=cols, eps=eps))
    d = ctx.dummy
    ctx.dispatch(ctx.pipeline("matmul_dot_prep", LINEAR_KINDS),
                 (params, x_in.buffer, d, d, d, d, norm.buffer if norm is not None else d, out.buffer), (tokens, 1, 1))
    raw = ctx.read(out.buffer, 0, size)
    q = np.frombuffer(raw[: tokens * cols], np.int8).reshape(tokens, cols)
    scales = np.frombuffer(raw[tokens * cols:], np.float32).reshape(tokens, cols // 32, 2)
    return q, scales[..., 0], scales[..., 1]


def _at_ties_only(q, want_q, v) -> int:
    """How many quants differ from numpy's, after checking that each is one level off and at a
    rounding tie (its level within 1e-3 of x.5)."""
    differ = q != want_q
    assert np.abs(q.astype(np.int32) - want_q).max() <= 1
    blocks = v.reshape(-1, 32)
    amax = np.abs(blocks).max(axis=1, keepdims=True)
    levels = (blocks * (np.float32(127) / np.where(amax > 0, amax, np.float32(1)))).reshape(q.shape)
    assert np.all(np.abs(np.abs(levels[differ] % 1) - 0.5) < 1e-3), "a quant differs away from a rounding tie"
    return int(differ.sum())


@pytest.mark.gpu
@pytest.mark.parametrize("cols", [64, 192, 2112])
def test_prep_quantizes_a_plain_x_as_numpy_to_wgsl_division_precision(ops, cols):
    """127 / max and max / 127 are WGSL divisions, exact to 2.5 ULP (an H100 is a ULP off numpy
    on some scales): the scales agree to 3 ULP, and a quant may be a level apart only at a tie."""
    rng = np.random.default_rng(cols)
    tokens = 13
    x = rng.standard_normal((tokens, cols)).astype(np.float32)
    x[2, 32:64] = 0.0  # an all-zero block: zero quants and scale
    q, d, s = _prep(ops, upload(ops, x), tokens, cols, 0)
    want_q, want_d = quantize_blocks(x)
    assert _at_ties_only(q, want_q.reshape(tokens, cols), x) <= 2
    np.testing.assert_allclose(d, want_d.reshape(tokens, -1), rtol=3 * 2.0 ** -23, atol=0)
    assert not q[2, 32:64].any() and d[2, 1] == 0 and s[2, 1] == 0
    sums = q.reshape(tokens, -1, 32).astype(np.int32).sum(axis=2).astype(np.float32)
    np.testing.assert_array_equal(s, d * sums)  # d sum q: one f32 product of the GPU's own values


@pytest.mark.gpu
@pytest.mark.parametrize("fused", ["norm", "silu"])
def test_prep_with_a_fused_norm_or_silu_rounds_as_numpy_but_at_ties(ops, fused):
    """The norm's scale and silu's exp differ from numpy's in the last bit, so a value whose level
    is within that of a tie (x.5) may round the other way: one level, only there."""
    from kjarni.gpu.params import LINEAR_NORM, LINEAR_SILU

    rng = np.random.default_rng(7)
    tokens, cols = 21, 2112
    if fused == "norm":
        x = rng.standard_normal((tokens, cols)).astype(np.float32)
        nw = (1 + 0.2 * rng.standard_normal(cols)).astype(np.float32)
        v = FLOAT_REF.rms_norm(x, nw, 1e-5)
        q, d, _ = _prep(ops, upload(ops, x), tokens, cols, LINEAR_NORM, ops.weight(nw, name="nw"))
    else:
        x = rng.standard_normal((tokens, 2 * cols)).astype(np.float32)
        v = FLOAT_REF.silu_mul(x)
        q, d, _ = _prep(ops, upload(ops, x), tokens, cols, LINEAR_SILU)
    want_q, want_d = quantize_blocks(np.ascontiguousarray(v, np.float32))
    np.testing.assert_allclose(d, want_d.reshape(tokens, -1), rtol=1e-6)
    assert _at_ties_only(q, want_q.reshape(tokens, cols), v) <= 1e-3 * q.size


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_matmul_dot_matches_numpy_on_every_tile_split_and_epilogue(ops, fmt):
    rng = np.random.default_rng(3)
    cols = 768 if fmt in ("Q4_K", "Q6_K") else 832  # 12 or 13 steps of 64: 3 splits of whole steps
    rows = 100  # a full 64-row tile and a partial one
    qt = random_quant(T[fmt], rows, cols, seed=5)
    weight, w = ops.weight(qt, name="w"), REF.weight(qt, name="w.weight")
    bias = ops.weight(rng.standard_normal(rows).astype(np.float32), name="b")
    bvec = np.frombuffer(ops.context.queue.read_buffer(bias.buffer), np.float32)[:rows]
    try:
        for ti in kernels.DOT_TILES:
            for splits in (1, 3):
                ops.tuning.matmul_dot_tile, ops.tuning.matmul_dot_splits = ti, splits
                weight.plans.clear()
                want_kernels = ["matmul_dot_prep:main", f"matmul_dot.{fmt}_t{ti}:main"] + (["matmul_reduce:main"] if splits > 1 else [])
                assert plan_kernels(ops, weight, 75) == want_kernels
                for tokens in (PREFILL, 75):  # under one tile; a full 64-token tile and a partial one
                    x = rng.standard_normal((tokens, cols)).astype(np.float32)
                    res = rng.standard_normal((tokens, rows)).astype(np.float32)
                    scale = float(np.abs(x).sum(axis=1).max() * np.abs(w).max())  # a bound on |y|
                    got = ops.read(ops.linear(upload(ops, x), weight, bias, upload(ops, res)))
                    want = REF.linear(x, w, bvec, res)
                    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * scale,
                                               err_msg=f"{fmt} TI {ti} splits {splits} tokens {tokens}")
                    # Quantizing x moves y by at most sum |w| max|v| / 254 per block: well under 1%.
                    assert np.abs(got - FLOAT_REF.linear(x, w, bvec, res)).max() <= 0.01 * scale
    finally:
        ops.tuning.matmul_dot_tile, ops.tuning.matmul_dot_splits = 4, None


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,cols", [("Q8_0", 64), ("Q4_K", 256)])
def test_matmul_dot_on_a_vocabulary_sized_lm_head(ops, fmt, cols):
    """151,936 rows (Qwen2.5's vocabulary) at 17 tokens, the default tile: the LM head of a forward
    asked for every token's logits (a speculative verification of 16 drafted tokens)."""
    rng = np.random.default_rng(17)
    qt = random_quant(T[fmt], 151936, cols, seed=17)
    weight, w = ops.weight(qt, name="lm_head"), REF.weight(qt, name="lm_head.weight")
    assert plan_kernels(ops, weight, 17)[:2] == ["matmul_dot_prep:main", f"matmul_dot.{fmt}_t4:main"]
    x = rng.standard_normal((17, cols)).astype(np.float32)
    scale = float(np.abs(x).sum(axis=1).max() * np.abs(w).max())  # a bound on |y|
    got = ops.read(ops.linear(upload(ops, x), weight))
    np.testing.assert_allclose(got, REF.linear(x, w), rtol=1e-4, atol=1e-5 * scale)


@pytest.mark.gpu
@pytest.mark.parametrize("first, second, cols", [("Q8_0", "Q5_0", 192), ("Q4_K", "Q6_K", 256)])
def test_matmul_dot_of_two_segments_with_a_fused_norm_and_silu(ops, first, second, cols):
    """A weight concatenated from two parts of two formats (the second at a row offset; a Q4_K_M
    file's q/k and v), its input normed (norm_linear) or silu_mul's (fused into the prep): one prep
    for both segments. A value at a rounding tie may be quantized one level apart from numpy (test
    above): each such value moves y by at most its block's scale times |w|, and a row holds at most
    a few."""
    rng = np.random.default_rng(11)
    tokens = 40
    parts = [random_quant(T[first], 70, cols, seed=1), random_quant(T[second], 30, cols, seed=2)]
    weight, w = ops.weight(parts, name="w"), REF.weight(parts, name="w.weight")
    assert plan_kernels(ops, weight, tokens) == ["matmul_dot_prep:main", f"matmul_dot.{first}_t4:main", f"matmul_dot.{second}_t4:main"]
    nw = (1 + 0.2 * rng.standard_normal(cols)).astype(np.float32)
    norm = ops.weight(nw, name="nw")
    x = rng.standard_normal((tokens, cols)).astype(np.float32)
    gate_up = rng.standard_normal((tokens, 2 * cols)).astype(np.float32)
    cases = [
        (ops.norm_linear(upload(ops, x), norm, 1e-5, weight), REF.norm_linear(x, nw, 1e-5, weight=w), FLOAT_REF.rms_norm(x, nw, 1e-5)),
        (ops.linear(ops.silu_mul(upload(ops, gate_up)), weight), REF.linear(REF.silu_mul(gate_up), w), FLOAT_REF.silu_mul(gate_up)),
    ]
    for i, (got, want, v) in enumerate(cases):
        got = ops.read(got)
        scale = float(np.abs(v).sum(axis=1).max() * np.abs(w).max())
        flips = 3 * float(np.abs(v).max()) / 127 * float(np.abs(w).max())  # three values at a tie in a row
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * scale + flips, err_msg=f"case {i}")


@pytest.mark.gpu
def test_matmul_int_dot_off_or_unfit_runs_the_simt_matmul(ops):
    # (the SIMT matmul splits K over workgroups for so few tiles: matmul_reduce after it)
    weight = ops.weight(random_quant(T.Q8_0, 8, 96, seed=3), name="w")  # 96 columns: not a multiple of 64
    assert plan_kernels(ops, weight, 20) == ["matmul.Q8_0:main", "matmul_reduce:main"]
    weight = ops.weight(random_quant(T.Q8_0, 8, 128, seed=3), name="w")
    assert plan_kernels(ops, weight, 20) == ["matmul_dot_prep:main", "matmul_dot.Q8_0_t4:main"]
    assert plan_kernels(ops, weight, 1) == ["matvec_dot.Q8_0:main"]
    ops.tuning.matmul_int_dot = False
    try:
        weight.plans.clear()
        assert plan_kernels(ops, weight, 20) == ["matmul.Q8_0:main", "matmul_reduce:main"]
    finally:
        ops.tuning.matmul_int_dot = True


def test_every_matmul_dot_variant_and_the_prep_compile_with_tint(tint_compile):
    for variant in kernels.TEMPLATES["matmul_dot"]:
        tint_compile(kernels.template("matmul_dot", variant, frozenset({"idot", "i8tile"})), f"matmul_dot.{variant}")
    tint_compile(kernels.source("matmul_dot_prep", frozenset({"subgroup"})), "matmul_dot_prep")
