"""The integer-dot decode product (shaders/matvec_dot.tmpl.wgsl) against numpy, Q8_0 / Q5_0 / Q4_K.

Each format's variant is dispatched through `WgpuOps` as a decode step does (one token). The
reference is NumpyOps(quantize_activations=True): the dequantized weight times x rounded to int8
blocks of 32 exactly as the kernel rounds it, so the tolerance is the float32 one of the float
template's tests; a second check bounds the distance to the float32 reference (the documented
cost of quantizing x). Rows are odd (not a multiple of any row set), every configuration family
runs (groups narrower than, as wide as and wider than lavapipe's 8-lane subgroups, 1, 2 and 4 rows,
1 and 2 chunks a trip, grids capped below the row sets), with every flag (bias, residual, fused
norm, silu(gate) * up) and the merge of split attention partials; and a SwiGLU MLP whose gate_up
writes silu(gate) up (glu).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from kjarni.numpy_ops import NumpyOps, quantize_activations
from tests.test_gpu_matvec import check_swiglu_glu, flag_inputs, kernel_of, upload
from tests.test_gpu_quant import random_quant

T = gguf.GGMLQuantizationType
FORMATS = ["Q8_0", "Q5_0", "Q4_K"]
CONFIGS = [(128, 16, 2, 2, 0), (64, 8, 4, 1, 0), (128, 32, 1, 2, 3), (32, 4, 2, 1, 0), (256, 64, 4, 2, 2)]
REF = NumpyOps(quantize_activations=True)
FLOAT_REF = NumpyOps()


@pytest.fixture(scope="module")
def ops(wgpu_context):
    from kjarni.gpu import WgpuOps

    if not wgpu_context.has_subgroups:
        pytest.skip("matvec_dot.tmpl.wgsl needs subgroups")
    return WgpuOps(wgpu_context, weight_format="f32")


def cols_for(fmt: str) -> list[int]:
    return [512, 1792] if fmt == "Q4_K" else [96, 2080]


def test_quantize_activations_rounds_blocks_of_32_to_int8_levels():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 96)).astype(np.float32)
    x[0, 32:64] = 0.0  # an all-zero block stays zero (no division by zero)
    q = quantize_activations(x)
    for b in range(3):
        block, got = x[0, 32 * b : 32 * b + 32], q[0, 32 * b : 32 * b + 32]
        amax = np.abs(block).max()
        if amax == 0:
            assert not got.any()
            continue
        levels = got / (amax / np.float32(127))
        np.testing.assert_allclose(levels, np.round(levels), atol=1e-4)  # integer levels
        assert np.abs(levels).max() == pytest.approx(127, abs=1e-4)
        assert np.abs(got - block).max() <= amax / 254 * (1 + 1e-5)


def test_numpy_quantizes_only_one_token_products_by_int_dot_formats():
    rng = np.random.default_rng(1)
    q8 = REF.weight(random_quant(T.Q8_0, 8, 64, seed=1), name="a.weight")
    q6 = REF.weight(random_quant(T.Q6_K, 8, 256, seed=2), name="b.weight")
    x64, x256 = rng.standard_normal((1, 64)).astype(np.float32), rng.standard_normal((1, 256)).astype(np.float32)
    np.testing.assert_array_equal(REF.linear(x64, q8), FLOAT_REF.linear(quantize_activations(x64), q8))
    np.testing.assert_array_equal(REF.linear(x256, q6), FLOAT_REF.linear(x256, q6))  # no int-dot decoder
    two = rng.standard_normal((2, 64)).astype(np.float32)
    np.testing.assert_array_equal(REF.linear(two, q8), FLOAT_REF.linear(two, q8))  # several tokens: float


def test_numpy_quantizes_x_for_the_int_dot_parts_of_a_mixed_weight_only():
    """A weight stacked from a Q4_K part and a Q6_K part (a Q4_K_M q/k with its Q6_K v): the one-token
    product rounds x for the Q4_K rows and keeps it for the Q6_K rows, as the GPU runs each segment."""
    rng = np.random.default_rng(2)
    q4, q6 = random_quant(T.Q4_K, 8, 256, seed=4), random_quant(T.Q6_K, 5, 256, seed=5)
    mixed = REF.weight([q4, q6], name="qkv.weight")
    x = rng.standard_normal((1, 256)).astype(np.float32)
    got = REF.linear(x, mixed)
    want_q4 = FLOAT_REF.linear(quantize_activations(x), FLOAT_REF.weight(q4, name="q.weight"))
    want_q6 = FLOAT_REF.linear(x, FLOAT_REF.weight(q6, name="v.weight"))
    np.testing.assert_allclose(got[:, :8], want_q4, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got[:, 8:], want_q6, rtol=1e-6, atol=1e-6)
    # The two differ by far more than that where x is not rounded: the rows did take their own x.
    assert np.abs(got[:, :8] - FLOAT_REF.linear(x, FLOAT_REF.weight(q4, name="q.weight"))).max() > 1e-4
    # Several tokens (no prefill rounding asked for): float32 for every row.
    two = rng.standard_normal((2, 256)).astype(np.float32)
    np.testing.assert_allclose(REF.linear(two, mixed), FLOAT_REF.linear(two, mixed), rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
def test_a_mixed_format_weight_matches_numpy_segment_by_segment(ops):
    """The GPU runs the Q4_K segment of a [Q4_K | Q6_K] weight through matvec_dot (x in int8) and
    the Q6_K one through the float template; numpy's matched reference mirrors that per row."""
    rng = np.random.default_rng(3)
    q4, q6 = random_quant(T.Q4_K, 37, 512, seed=6), random_quant(T.Q6_K, 11, 512, seed=7)
    weight, w = ops.weight([q4, q6], name="mixed"), REF.weight([q4, q6], name="mixed.weight")
    assert [s.format for s in weight.segments] == ["Q4_K", "Q6_K"]
    x = rng.standard_normal((1, 512)).astype(np.float32)
    got = ops.read(ops.linear(upload(ops, x), weight))
    scale = float(np.abs(x).sum() * np.abs(w).max())
    np.testing.assert_allclose(got, REF.linear(x, w), rtol=1e-4, atol=1e-5 * scale)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_matvec_dot_matches_numpy_with_quantized_x_in_every_configuration_and_flag(ops, fmt):
    """Every configuration and flag."""
    rng = np.random.default_rng(1)
    for cols in cols_for(fmt):
        rows = 37
        qt = random_quant(T[fmt], rows, cols, seed=cols)
        weight, w = ops.weight(qt, name=f"w{cols}"), REF.weight(qt, name=f"w{cols}.weight")
        assert kernel_of(ops, weight) == f"matvec_dot.{fmt}:main"
        bias, bvec, norm, nw, x, gate_up, res = flag_inputs(ops, rng, rows, cols)
        scale = float(np.abs(x).sum() * np.abs(w).max())  # a bound on |y|: errors relative to it
        for config in CONFIGS:
            ops.tuning.matvec_dot_configs = {(fmt, rows, cols): config}
            weight.plans.clear()
            cases = [
                (ops.linear(upload(ops, x), weight), REF.linear(x, w), FLOAT_REF.linear(x, w)),
                (ops.linear(upload(ops, x), weight, bias, upload(ops, res)), REF.linear(x, w, bvec, res),
                 FLOAT_REF.linear(x, w, bvec, res)),
                (ops.norm_linear(upload(ops, x), norm, 1e-5, weight, bias), REF.norm_linear(x, nw, 1e-5, w, bvec),
                 FLOAT_REF.norm_linear(x, nw, 1e-5, w, bvec)),
                (ops.linear(ops.silu_mul(upload(ops, gate_up)), weight, residual=upload(ops, res)),
                 REF.linear(REF.silu_mul(gate_up), w, None, res), FLOAT_REF.linear(FLOAT_REF.silu_mul(gate_up), w, None, res)),
            ]
            for i, (got, want, exact) in enumerate(cases):
                got = ops.read(got)
                np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * max(scale, 1.0),
                                           err_msg=f"{fmt} {rows}x{cols} config {config} case {i}")
                # Quantizing x moves y by at most sum |w| max|v| / 254 per block: well under 1%.
                assert np.abs(got - exact).max() <= 0.01 * max(scale, 1.0), f"{fmt} config {config} case {i}"
    ops.tuning.matvec_dot_configs = {}


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,cols", [("Q8_0", 64), ("Q4_K", 256)])
def test_matvec_dot_on_a_vocabulary_sized_lm_head(ops, fmt, cols):
    """151,936 rows (Qwen2.5's vocabulary) with the fused norm, in the default configuration."""
    rows = 151936
    qt = random_quant(T[fmt], rows, cols, seed=5)
    weight, w = ops.weight(qt, name="lm_head"), REF.weight(qt, name="lm_head.weight")
    assert kernel_of(ops, weight) == f"matvec_dot.{fmt}:main"
    rng = np.random.default_rng(5)
    x = rng.standard_normal((1, cols)).astype(np.float32)
    nw = (1 + 0.2 * rng.standard_normal(cols)).astype(np.float32)
    got = ops.read(ops.norm_linear(upload(ops, x), ops.weight(nw, name="nw"), 1e-6, weight))
    want = REF.norm_linear(x, nw, 1e-6, w)
    scale = float(np.abs(x * nw).sum() * np.abs(w).max())
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * max(scale, 1.0))


@pytest.mark.gpu
def test_matvec_dot_off_runs_the_float_template(ops):
    weight = ops.weight(random_quant(T.Q4_K, 8, 256, seed=3), name="w")
    assert kernel_of(ops, weight) == "matvec_dot.Q4_K:main"
    ops.tuning.matvec_int_dot = False
    try:
        weight.plans.clear()
        assert kernel_of(ops, weight) == "matvec.Q4_K:main"
    finally:
        ops.tuning.matvec_int_dot = True


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_swiglu_gate_up_writes_silu_gate_times_up_where_its_groups_have_even_rows(ops, monkeypatch, fmt):
    """One token's SwiGLU MLP with quantized weights (`Linear.record_swiglu`): where gate_up's
    matvec_dot has an even number of rows a group, its ``glu`` flag writes silu(gate) up (the last
    row set partly past the end in one configuration, a grid capped below the row sets in two)
    and down quantizes that plain x; with odd rows, or ``matvec_glu`` off, gate_up writes
    [gate | up] and down applies the silu. Both match numpy's MLP with x rounded to int8 as the
    kernels round it."""
    hidden, inter = (256, 512) if fmt == "Q4_K" else (96, 160)
    rng = np.random.default_rng(12)
    gu_q, dw_q = random_quant(T[fmt], 2 * inter, hidden, seed=13), random_quant(T[fmt], hidden, inter, seed=14)
    gate_up, gu = ops.weight(gu_q, name="gate_up"), REF.weight(gu_q, name="gate_up.weight")
    down, dw = ops.weight(dw_q, name="down"), REF.weight(dw_q, name="down.weight")
    # The norm weight scaled so that gate is of order 1 (silu's exp stays finite in numpy).
    nw = ((1 + 0.2 * rng.standard_normal(hidden)) / (np.abs(gu).mean() * np.sqrt(hidden))).astype(np.float32)
    norm = ops.weight(nw, name="nw")
    x = rng.standard_normal((1, hidden)).astype(np.float32)
    res = rng.standard_normal((1, hidden)).astype(np.float32)
    mlp = (gate_up, down, gu, dw, nw, norm, x, res)

    def configure(config):
        ops.tuning.matvec_dot_configs = {(fmt, 2 * inter, hidden): config}

    try:  # the last configuration's 3 groups leave the last row set partly filled
        check_swiglu_glu(ops, monkeypatch, REF, mlp, configure, CONFIGS + [(96, 32, 4, 1, 0)], lambda config: f"matvec_dot.{fmt}")
    finally:
        ops.tuning.matvec_dot_configs = {}
