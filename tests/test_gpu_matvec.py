"""The decode matrix-vector template (shaders/matvec.tmpl.wgsl) against numpy, every weight format.

Each format's variant of the template is rendered from kjarni.gpu.kernels' variant table and
dispatched through `WgpuOps` as a decode step does (one token); the reference is NumpyOps on the
dequantized weight (the numpy backend's own arithmetic). Rows are odd (not a multiple of any
row tile), columns a multiple of the block only, and every configuration family runs: one
subgroup-wide group per row tile, groups narrower than a subgroup (xor reduction only), and
groups spanning several subgroups (through workgroup memory).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from kjarni.gpu import kernels
from kjarni.numpy_ops import NumpyOps
from tests.test_gpu_quant import random_quant

T = gguf.GGMLQuantizationType
FORMATS = ["f32", "f16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q6_K"]
CONFIGS = [(128, 32, 4, 2), (128, 32, 1, 1), (64, 8, 2, 2), (256, 256, 4, 1), (32, 32, 2, 2), (128, 64, 1, 2)]
REF = NumpyOps()


@pytest.fixture(scope="module")
def ops(wgpu_context):
    from kjarni.gpu import WgpuOps

    if not wgpu_context.has_subgroups:
        pytest.skip("matvec.tmpl.wgsl needs subgroups")
    ops = WgpuOps(wgpu_context, weight_format="f32")
    # The float template for every format: Q8_0 / Q5_0 / Q4_K otherwise run the integer-dot
    # product (tests/test_gpu_matvec_dot.py).
    ops.tuning.matvec_int_dot = False
    ops.tuning.matvec_f16 = False  # f16 otherwise runs matvec_f16.tmpl.wgsl (tests/test_gpu_matvec_f16.py)
    return ops


def make_weight(ops, fmt: str, rows: int, cols: int, seed: int):
    """(GPU weight, its float32 values as numpy sees them)."""
    rng = np.random.default_rng(seed)
    if fmt in ("f32", "f16"):
        w = rng.standard_normal((rows, cols)).astype(np.float32) * 0.1
        if fmt == "f16":
            w = w.astype(np.float16).astype(np.float32)
        ops.weight_format = fmt
        try:
            return ops.weight(w, name=f"w{seed}"), w
        finally:
            ops.weight_format = "f32"
    qt = random_quant(T[fmt], rows, cols, seed=seed)
    return ops.weight(qt, name=f"w{seed}"), qt.dequantize().astype(np.float32)


def upload(ops, a):
    from kjarni.gpu import GpuTensor

    t = GpuTensor(ops.context.scratch(a.nbytes), a.shape)
    ops.context.queue.write_buffer(t.buffer, 0, np.ascontiguousarray(a, np.float32))
    return t


def kernel_of(ops, weight, tokens=1) -> str:
    seg = weight.segments[0]
    pipeline, _, _ = ops.linear_kernels.segment_kernel(seg, weight.shape[1], weight.shape[0], tokens, 0, 0.0)
    return pipeline.kjarni_name


def cols_for(fmt: str) -> list[int]:
    return [512, 1536] if fmt in ("Q4_K", "Q6_K") else [96, 2080] if fmt.startswith("Q") else [72, 2056]


def flag_inputs(ops, rng, rows: int, cols: int):
    """The inputs of a one-token product with every fused flag: the bias (on the GPU, and as the
    GPU holds it), the norm weight (both), x, a gate/up pair and a residual, drawn in that order."""
    bias = ops.weight(rng.standard_normal(rows).astype(np.float32), name="b")
    nw = (1 + 0.2 * rng.standard_normal(cols)).astype(np.float32)
    norm = ops.weight(nw, name="nw")
    x = rng.standard_normal((1, cols)).astype(np.float32)
    gate_up = rng.standard_normal((1, 2 * cols)).astype(np.float32)
    res = rng.standard_normal((1, rows)).astype(np.float32)
    bvec = np.frombuffer(ops.context.queue.read_buffer(bias.buffer), np.float32)[:rows]
    return bias, bvec, norm, nw, x, gate_up, res


def record_pipelines(ops, monkeypatch) -> list[tuple[str, dict]]:
    """The pipelines ``ops`` requests from now on, as (kernel, keyword arguments), each still built."""
    requested = []
    pipeline = ops.context.pipeline

    def spy(kernel, kinds, **kw):
        requested.append((kernel, kw))
        return pipeline(kernel, kinds, **kw)

    monkeypatch.setattr(ops.context, "pipeline", spy)
    return requested


def check_swiglu_glu(ops, monkeypatch, ref, mlp, configure, configs, kernel_name) -> None:
    """Runs one token's SwiGLU MLP (`Linear.record_swiglu`) through every configuration, with
    ``matvec_glu`` on and off, and checks that gate_up's kernel took its ``glu`` flag exactly where
    the configuration has an even number of rows a group (R, ``config[2]``) and that the result is
    ``ref``'s MLP. ``mlp``: (gate_up, down on the GPU, their values gu, dw as ``ref`` holds them,
    the norm weight nw and its GPU copy, x, residual); ``configure(config)`` sets gate_up's
    configuration; ``kernel_name(config)``: the pipeline gate_up must request."""
    gate_up, down, gu, dw, nw, norm, x, res = mlp
    want = ref.swiglu_mlp(x, nw, 1e-5, gu, dw, residual=res)
    h = ref.silu_mul(ref.norm_linear(x, nw, 1e-5, gu))
    scale = float(np.abs(h).sum() * np.abs(dw).max())  # a bound on |down's product|
    requested = record_pipelines(ops, monkeypatch)
    try:
        for glu_on in (True, False):
            ops.tuning.matvec_glu = glu_on
            for config in configs:
                configure(config)
                gate_up.plans.clear()
                down.plans.clear()
                requested.clear()
                got = ops.read(ops.swiglu_mlp(upload(ops, x), norm, 1e-5, gate_up, down, residual=upload(ops, res)))
                glu = glu_on and config[2] % 2 == 0
                flagged = [(kernel, "glu" in kw.get("flags", ())) for kernel, kw in requested]
                assert (kernel_name(config), glu) in flagged, (config, flagged)
                assert not any(flag for _, flag in flagged) or glu
                np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * max(scale, 1.0), err_msg=f"{config} glu {glu}")
    finally:
        ops.tuning.matvec_glu = True


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_matvec_template_matches_numpy_in_every_configuration_and_flag(ops, fmt):
    rng = np.random.default_rng(1)
    for cols in cols_for(fmt):
        rows = 37
        weight, w = make_weight(ops, fmt, rows, cols, seed=cols)
        assert kernel_of(ops, weight) == f"matvec.{fmt}:main"
        bias, bvec, norm, nw, x, gate_up, res = flag_inputs(ops, rng, rows, cols)
        scale = float(np.abs(x).sum() * np.abs(w).max())  # a bound on |y|: errors relative to it
        for config in CONFIGS:
            ops.tuning.matvec_template_configs = {(fmt, rows, cols): config}
            weight.plans.clear()
            cases = [
                (ops.linear(upload(ops, x), weight), REF.linear(x, w)),
                (ops.linear(upload(ops, x), weight, bias, upload(ops, res)), REF.linear(x, w, bvec, res)),
                (ops.norm_linear(upload(ops, x), norm, 1e-5, weight, bias), REF.norm_linear(x, nw, 1e-5, w, bvec)),
                (ops.linear(ops.silu_mul(upload(ops, gate_up)), weight, residual=upload(ops, res)),
                 REF.linear(REF.silu_mul(gate_up), w, None, res)),
            ]
            for i, (got, want) in enumerate(cases):
                np.testing.assert_allclose(ops.read(got), want, rtol=1e-4, atol=1e-5 * max(scale, 1.0),
                                           err_msg=f"{fmt} {rows}x{cols} config {config} case {i}")
    ops.tuning.matvec_template_configs = {}


@pytest.mark.gpu
def test_matvec_template_on_a_vocabulary_sized_lm_head(ops):
    """151,936 rows (Qwen2.5's vocabulary) with the fused norm, in the default configuration."""
    rows, cols = 151936, 64
    weight, w = make_weight(ops, "f16", rows, cols, seed=3)
    assert kernel_of(ops, weight) == "matvec.f16:main"
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, cols)).astype(np.float32)
    nw = (1 + 0.2 * rng.standard_normal(cols)).astype(np.float32)
    got = ops.read(ops.norm_linear(upload(ops, x), ops.weight(nw, name="nw"), 1e-6, weight))
    np.testing.assert_allclose(got, REF.norm_linear(x, nw, 1e-6, w), rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,cols,kernel", [("f16", 64, "linear_f16:matvec_t"), ("Q8_0", 64, "linear_q8_0:main_t"),
                                              ("Q4_K", 256, "linear_q4_k:main_t"), ("Q6_K", 256, "linear_q6_k:main_t")])
def test_a_few_token_product_on_a_vocabulary_sized_lm_head(ops, fmt, cols, kernel):
    """151,936 rows at 2 and 9 tokens: the LM head of a speculative verification (k + 1 tokens)."""
    weight, w = make_weight(ops, fmt, 151936, cols, seed=9)
    rng = np.random.default_rng(9)
    for tokens in (2, 9):
        assert kernel_of(ops, weight, tokens) == kernel
        x = rng.standard_normal((tokens, cols)).astype(np.float32)
        got = ops.read(ops.linear(upload(ops, x), weight))
        scale = float(np.abs(x).sum(axis=1).max() * np.abs(w).max())  # a bound on |y|: errors relative to it
        np.testing.assert_allclose(got, REF.linear(x, w), rtol=1e-4, atol=1e-5 * max(scale, 1.0),
                                   err_msg=f"{fmt} {tokens} tokens")


@pytest.mark.gpu
def test_several_tokens_and_columns_not_a_multiple_of_8_keep_the_older_kernels(ops):
    weight, _ = make_weight(ops, "f16", 40, 64, seed=4)
    assert kernel_of(ops, weight, tokens=3) == "linear_f16:matvec_t"
    odd, _ = make_weight(ops, "f16", 40, 60, seed=5)
    assert not kernel_of(ops, odd).startswith("matvec.")


def test_every_format_with_a_linear_kernel_has_a_block_decoder_for_the_template():
    from kjarni.gpu import quant

    assert set(kernels.BLOCKS) == {"f32", "f16"} | {t.name for t in quant.SUPPORTED}
    for fmt in kernels.BLOCKS:
        text = kernels.template("matvec", fmt, frozenset({"subgroup"}))
        assert "{{" not in text and "fn unit_values" in text and "fn main" in text
