"""The f16 decode product (shaders/matvec_f16.tmpl.wgsl) against numpy.

Dispatched through `WgpuOps` as a decode step does (one token); the reference is NumpyOps on the
f16 weight as float32, with the float template's tolerance (tests/test_gpu_matvec.py). Rows are odd
(not a multiple of any row set), columns a multiple of 8 only (a row of 9 units, and one of 257:
UN-unit trips then a one-unit tail), every variant of the template (1, 2, 4 rows a group; 1, 2, 4
units a trip) runs, with groups narrower than, as wide as and wider than lavapipe's 8-lane
subgroups, grids capped below the row sets, and every flag (bias, residual, fused norm,
silu(gate) * up). The merge of split attention partials runs in tests/test_gpu_attention_step.py
(f16 weights take this kernel there by default).
"""

from __future__ import annotations

import numpy as np
import pytest

from kjarni.gpu import kernels
from kjarni.numpy_ops import NumpyOps
from tests.test_gpu_matvec import check_swiglu_glu, flag_inputs, kernel_of, make_weight, upload

# (WG, LANES, R, UN, workgroups at most): each (R, UN) variant once, lanes 4 .. 256, caps 0, 1, 2 (below
# the row sets) and 3 (above).
CONFIGS = [
    (128, 32, 1, 1, 0), (64, 4, 1, 2, 2), (256, 256, 1, 4, 0), (64, 8, 2, 1, 0), (128, 16, 2, 2, 1),
    (32, 32, 2, 4, 0), (128, 64, 4, 1, 2), (64, 16, 4, 2, 0), (256, 8, 4, 4, 3),
]
REF = NumpyOps()


@pytest.fixture(scope="module")
def ops(wgpu_context):
    from kjarni.gpu import WgpuOps

    if not wgpu_context.has_subgroups:
        pytest.skip("matvec_f16.tmpl.wgsl needs subgroups")
    return WgpuOps(wgpu_context, weight_format="f32")


def test_every_variant_is_listed_and_rendered():
    assert sorted(kernels.TEMPLATES["matvec_f16"]) == sorted(kernels.matvec_f16_variant(r, u) for r in (1, 2, 4) for u in (1, 2, 4))
    assert {(c[2], c[3]) for c in CONFIGS} == set(kernels.MATVEC_F16_SHAPES)
    for name in kernels.TEMPLATES["matvec_f16"]:
        for flags in (frozenset({"subgroup"}), frozenset({"subgroup", "attn"}), frozenset({"subgroup", "glu"})):
            text = kernels.template("matvec_f16", name, flags)
            assert "{{" not in text and "fn main" in text and "fn load_v" in text
            assert ("override SPLITS" in text) == ("attn" in flags)
            assert ("const RG: u32 = R / 2u;" in text) == ("glu" in flags)


@pytest.mark.gpu
def test_matvec_f16_matches_numpy_in_every_variant_and_flag(ops):
    """Every variant and flag."""
    rng = np.random.default_rng(1)
    for cols in (72, 2056):
        rows = 37
        weight, w = make_weight(ops, "f16", rows, cols, seed=cols)
        bias, bvec, norm, nw, x, gate_up, res = flag_inputs(ops, rng, rows, cols)
        scale = float(np.abs(x).sum() * np.abs(w).max())  # a bound on |y|: errors relative to it
        for config in CONFIGS:
            ops.tuning.matvec_f16_configs = {(rows, cols): config}
            weight.plans.clear()
            assert kernel_of(ops, weight) == f"matvec_f16.{kernels.matvec_f16_variant(*config[2:4])}:main"
            cases = [
                (ops.linear(upload(ops, x), weight), REF.linear(x, w)),
                (ops.linear(upload(ops, x), weight, bias, upload(ops, res)), REF.linear(x, w, bvec, res)),
                (ops.norm_linear(upload(ops, x), norm, 1e-5, weight, bias), REF.norm_linear(x, nw, 1e-5, w, bvec)),
                (ops.linear(ops.silu_mul(upload(ops, gate_up)), weight, residual=upload(ops, res)),
                 REF.linear(REF.silu_mul(gate_up), w, None, res)),
            ]
            for i, (got, want) in enumerate(cases):
                np.testing.assert_allclose(ops.read(got), want, rtol=1e-4, atol=1e-5 * max(scale, 1.0),
                                           err_msg=f"f16 {rows}x{cols} config {config} case {i}")
    ops.tuning.matvec_f16_configs = {}


@pytest.mark.gpu
def test_matvec_f16_on_a_vocabulary_sized_lm_head(ops):
    """151,936 rows (Qwen2.5's vocabulary) with the fused norm, in the default configuration."""
    rows, cols = 151936, 64
    weight, w = make_weight(ops, "f16", rows, cols, seed=3)
    assert kernel_of(ops, weight).startswith("matvec_f16.")
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, cols)).astype(np.float32)
    nw = (1 + 0.2 * rng.standard_normal(cols)).astype(np.float32)
    got = ops.read(ops.norm_linear(upload(ops, x), ops.weight(nw, name="nw"), 1e-6, weight))
    np.testing.assert_allclose(got, REF.norm_linear(x, nw, 1e-6, w), rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_rows_too_long_for_workgroup_memory_a_shape_set_to_none_or_the_switch_off_run_the_float_template(ops):
    limit = ops.context.max_workgroup_storage
    cols = ((limit - 2304) // 4 // 8 + 1) * 8  # the first multiple of 8 whose x does not fit
    config = (128, 32, 2, 2, 0)
    ops.tuning.matvec_f16_configs = {(3, cols): config, (3, cols - 8): config, (5, 64): None}
    try:
        long, _ = make_weight(ops, "f16", 3, cols, seed=6)
        assert kernel_of(ops, long) == "matvec.f16:main"
        fits, _ = make_weight(ops, "f16", 3, cols - 8, seed=7)
        assert kernel_of(ops, fits) == "matvec_f16.r2u2:main"
        measured_slower, _ = make_weight(ops, "f16", 5, 64, seed=8)
        assert kernel_of(ops, measured_slower) == "matvec.f16:main"
        ops.tuning.matvec_f16 = False
        fits.plans.clear()
        assert kernel_of(ops, fits) == "matvec.f16:main"
    finally:
        ops.tuning.matvec_f16 = True
        ops.tuning.matvec_f16_configs = {}


@pytest.mark.gpu
def test_the_rules_keep_the_float_template_for_rows_longer_than_4864_columns(ops):
    linear = ops.linear_kernels
    if not linear.matvec_f16_fits("f16", 4872):
        pytest.skip("x of 4872 columns does not fit this device's workgroup memory")
    assert linear.matvec_f16_config("f16", 1000, 4872) is None
    assert linear.matvec_f16_config("f16", 1000, 4864) is not None
    assert linear.matvec_f16_config("Q8_0", 1000, 4864) is None


@pytest.mark.gpu
def test_swiglu_gate_up_writes_silu_gate_times_up_in_every_even_row_variant(ops, monkeypatch):
    """One token's SwiGLU MLP (`Linear.record_swiglu`): where gate_up's matvec_f16 has an even
    number of rows a group, its ``glu`` flag writes silu(gate) up (72 output rows: past the end of
    some row sets, grids capped below them) and down reads it plainly; with odd rows, or
    ``matvec_glu`` off, gate_up writes [gate | up] and down applies the silu. Both match numpy's
    MLP."""
    hidden, inter = 64, 72
    rng = np.random.default_rng(9)
    gate_up, gu = make_weight(ops, "f16", 2 * inter, hidden, seed=10)
    down, dw = make_weight(ops, "f16", hidden, inter, seed=11)
    nw = (1 + 0.2 * rng.standard_normal(hidden)).astype(np.float32)
    x = rng.standard_normal((1, hidden)).astype(np.float32)
    res = rng.standard_normal((1, hidden)).astype(np.float32)
    mlp = (gate_up, down, gu, dw, nw, ops.weight(nw, name="nw"), x, res)

    def configure(config):
        ops.tuning.matvec_f16_configs = {(2 * inter, hidden): config}

    try:
        check_swiglu_glu(ops, monkeypatch, REF, mlp, configure, CONFIGS,
                         lambda config: f"matvec_f16.{kernels.matvec_f16_variant(*config[2:4])}")
    finally:
        ops.tuning.matvec_f16_configs = {}
