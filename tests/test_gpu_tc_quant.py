"""Tensor-core prefill for quantized weights (matmul_tc.tmpl.wgsl's .<format> variants): each weight
tile dequantized by the format's block decoder and rounded to f16 in workgroup memory, then the
f16 MMA. The GPU products run where the adapter has an f16 subgroup-matrix configuration (Dawn:
KJARNI_WEBGPU_RUNTIME=dawn, e.g. on NVIDIA's Vulkan driver) and skip with the reason elsewhere;
the kernel choice (GpuTuning.tc_quant*) and the Tint compile of every variant (Dawn's Null
device, where wgpudawn is installed) run anywhere.

The reference is NumpyOps with f16 weights and f16 activations: a quantized tensor loaded with
``weight_format="f16"`` is dequantized in float32 and rounded to f16 once, which is the GPU's
rounding bit for bit (every dequantized value d q, d sc q - dmin m, ... is exact in float32)."""

from __future__ import annotations

import re
import types

import gguf
import numpy as np
import pytest

from kjarni.gpu import kernels
from kjarni.gpu.linear import Linear
from kjarni.gpu.tuning import GpuTuning
from kjarni.numpy_ops import NumpyOps
from tests.test_gpu_prefill import f16_round, rand, upload
from tests.test_gpu_quant import random_quant

T = gguf.GGMLQuantizationType
ref16 = NumpyOps(weight_format="f16", activations="f16")
ref32 = NumpyOps()

TILES = [(4, 4, 2, 2, 2, 1), (2, 2, 2, 2, 2, 1), (4, 2, 2, 4, 2, 1), (2, 2, 2, 2, 4, 1), (4, 4, 2, 2, 2, 3), (2, 2, 2, 2, 2, 3),
         (4, 2, 2, 4, 2, 5)]


def _stub_linear(sg: int | None = 32, tuning: GpuTuning | None = None, backend: str = "Vulkan") -> Linear:
    """A Linear over a context that has only what tc_tile reads (no device)."""
    context = types.SimpleNamespace(f16_matrix_subgroup=sg, max_workgroup_storage=48 << 10, info={"backend_type": backend})
    return Linear(context, tuning or GpuTuning())


def _seg(fmt: str, rows: int, row_offset: int = 0):
    return types.SimpleNamespace(format=fmt, rows=rows, row_offset=row_offset)


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_K", "Q5_0"])
def test_quantized_prefill_products_pick_the_quantized_tensor_core_tile(fmt):
    tuning = GpuTuning(tc_quant=True)
    linear = _stub_linear(tuning=tuning)
    assert linear.tc_tile(_seg(fmt, 1152), 512, 1536, 1152) == tuning.tc_quant_tile
    tuning.tc_quant_tiles = {(fmt, 1152, 1536): (2, 2, 2, 2, 2, 1), (fmt, 896, 1536): None}
    assert linear.tc_tile(_seg(fmt, 1152), 512, 1536, 1152) == (2, 2, 2, 2, 2, 1)
    assert linear.tc_tile(_seg(fmt, 896), 512, 1536, 896) is None  # named None: the SIMT kernel
    # The first kernel's tiles (f16 only) do not take a quantized product away from matmul_tc.
    tuning.sgmat_tiles = {(1152, 1536): (64, 128, 32, 2, 4)}
    assert linear.tc_tile(_seg(fmt, 1152), 512, 1536, 1152) == (2, 2, 2, 2, 2, 1)
    assert linear.tc_tile(_seg("f16", 1152), 512, 1536, 1152) is None


@pytest.mark.parametrize("fmt", ["f16", "Q8_0"])
def test_vec4_tiles_only_on_vulkan_where_their_load_units_were_measured(fmt):
    """SHARED 5 tiles read offsets in vec4<u32> elements, as Dawn's Vulkan backend does; on any other
    backend the same tile runs with f16 workgroup tiles (SHARED 3), whose offsets are f16 values."""
    tuning = GpuTuning(tc_quant=True, tc_tiles={(1152, 1536): (4, 2, 2, 4, 2, 5)},
                       tc_quant_tiles={("Q8_0", 1152, 1536): (4, 2, 2, 4, 2, 5)})
    for backend, shared in (("Vulkan", 5), ("Metal", 3), ("D3D12", 3)):
        assert _stub_linear(tuning=tuning, backend=backend).tc_tile(_seg(fmt, 1152), 512, 1536, 1152) == (4, 2, 2, 4, 2, shared)


@pytest.mark.parametrize("case", ["few tokens", "rows", "offset", "no matrices", "off", "tensor cores off", "direct tile", "cols"])
def test_quantized_tensor_cores_only_where_they_apply(case):
    tuning = GpuTuning(tc_quant=True)
    seg, tokens, cols, sg = _seg("Q8_0", 1152), 512, 1536, 32
    if case == "few tokens":
        tokens = tuning.matvec_max_tokens  # decode and verify keep the matrix-vector kernels
    elif case == "rows":
        seg = _seg("Q8_0", 1160)  # not a multiple of 16
    elif case == "offset":
        seg = _seg("Q8_0", 1152, row_offset=8)
    elif case == "no matrices":
        sg = None  # wgpu-native: no subgroup matrices
    elif case == "off":
        tuning.tc_quant = False
    elif case == "tensor cores off":
        tuning.tensor_cores = False
    elif case == "direct tile":
        tuning.tc_quant_tile = (4, 2, 2, 2, 2, 0)  # operands from storage: no f16 tile to dequantize into
    elif case == "cols":
        cols = 1552  # not a multiple of BK = 32
    assert _stub_linear(sg, tuning).tc_tile(seg, tokens, cols, seg.rows) is None
    assert _stub_linear(32, GpuTuning(tc_quant=True)).tc_tile(_seg("Q8_0", 1152), 512, 1536, 1152) is not None


def test_quantized_variants_exist_only_for_shared_tiles_and_render():
    names = [n for n in kernels.TEMPLATES["matmul_tc"] if "." in n]
    assert {n.split(".")[1] for n in names} == set(kernels.TC_QUANT_FORMATS)
    assert all(re.search(r"_[spw]_sg", n) for n in names)  # SHARED 1, 3, 5: the weight tile in workgroup memory
    for fmt in kernels.TC_QUANT_FORMATS:
        text = kernels.template("matmul_tc", kernels.tc_variant(4, 4, 2, 2, 2, 1, 32, fmt))
        assert "fn fetch_w8" in text and "var<storage, read> w_a: array<f16>" not in text
    with pytest.raises(ValueError, match="SHARED"):
        kernels.tc_fields(4, 2, 2, 2, 2, 0, 32, "Q8_0")


def test_every_quantized_variant_compiles_with_tint(tint_compile):
    """Dawn's WGSL compiler accepts every quantized matmul_tc variant (Null device: no GPU needed)."""
    refused = {}
    for name in kernels.TEMPLATES["matmul_tc"]:
        try:
            tint_compile(kernels.template("matmul_tc", name), name)
        except Exception as exc:  # noqa: BLE001 - collected
            refused[name] = str(exc).splitlines()[0]
    assert not refused


# ---------------------------------------------------------------- on a device with subgroup matrices


@pytest.fixture
def tc_ops(wgpu_context):
    from kjarni.gpu import WgpuOps

    if wgpu_context.f16_matrix_subgroup is None:
        pytest.skip(f"{wgpu_context.description} on {wgpu_context.runtime.description} has no f16 subgroup-matrix "
                    "configuration (needs Dawn: KJARNI_WEBGPU_RUNTIME=dawn, on a driver that offers one)")
    ops = WgpuOps(wgpu_context, weight_format="f16")
    ops.tuning.tensor_cores = ops.tuning.tc_quant = True  # set so these tests hold whatever the defaults
    return ops


def _ran_all(weight, tokens) -> list[str]:
    plan = [p for key, p in weight.plans.items() if key[0] == tokens][-1]
    return [d[0].kjarni_name for d in plan[0]]


def _usable(ops, tile, fmt) -> bool:
    sg = ops.context.f16_matrix_subgroup
    return (kernels.tc_variant(*tile, sg, fmt) in kernels.TEMPLATES["matmul_tc"]
            and kernels.tc_workgroup_bytes(*tile) <= ops.context.max_workgroup_storage)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K, T.Q5_0, T.Q6_K, T.Q4_0, T.Q4_1, T.Q5_1])
@pytest.mark.parametrize("tokens,rows,cols", [(16, 32, 256), (70, 144, 512), (130, 208, 1280)])
def test_quantized_tc_matmul_matches_numpy_with_f16_rounding(tc_ops, qtype, tile, splits, tokens, rows, cols):
    ops, fmt = tc_ops, qtype.name
    if not _usable(ops, tile, fmt):
        pytest.skip("tile not made at this subgroup size, or beyond this device's workgroup memory")
    ops.tuning.tc_quant_tiles = {(fmt, rows, cols): tile}
    ops.tuning.tc_splits = splits  # 3: over grid z, then matmul_reduce
    rng = np.random.default_rng(tokens * rows + cols)
    qt = random_quant(qtype, rows, cols, seed=rows + cols)
    x, b, r, nw = rand(rng, tokens, cols), rand(rng, rows), rand(rng, tokens, rows), rand(rng, cols)
    w16 = ref16.weight(qt, name="w.weight").astype(np.float32)  # dequantized, rounded to f16
    assert np.array_equal(w16, f16_round(qt.dequantize()))
    gx, gw, gb, gr = upload(ops, x), ops.weight(qt, name="w.weight"), ops.weight(b, name="b"), upload(ops, r)
    assert [s.format for s in gw.segments] == [fmt]  # kept quantized on the device
    variant = "matmul_tc." + kernels.tc_variant(*tile, ops.context.f16_matrix_subgroup, fmt)
    for bias, residual in ((gb, gr), (None, gr), (gb, None), (None, None)):
        got = ops.read(ops.linear(gx, gw, bias, residual=residual))
        ran = _ran_all(gw, tokens)
        assert ran[:2] == ["matmul_tc_prep:main", variant + ":main"], ran
        want = ref16.linear(x, w16, b if bias else None, r if residual else None)
        np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max(), rtol=0)  # f32 sums in another order
    # ... and measurably not the float32 product of the dequantized weight (the roundings happened)
    exact = ref32.linear(x, qt.dequantize(), b, r)
    assert np.abs(exact - ref16.linear(x, w16, b, r)).max() > 1e-5 * np.abs(exact).max()
    got = ops.read(ops.norm_linear(gx, ops.weight(nw, name="n"), 1e-5, gw, gb))
    want = ref16.norm_linear(x, nw, 1e-5, w16, b)
    # The norm's f32 scale differs in its last bits, which can flip an f16 rounding of an activation.
    np.testing.assert_allclose(got, want, atol=4e-5 * np.abs(want).max(), rtol=0)


def test_quantized_tc_matmul_applies_a_pending_silu_mul(tc_ops):
    ops = tc_ops
    rng = np.random.default_rng(7)
    tokens, cols, rows = 70, 256, 48
    qt = random_quant(T.Q4_K, rows, cols, seed=5)
    gate_up, r = rand(rng, tokens, 2 * cols), rand(rng, tokens, rows)
    gw = ops.weight(qt, name="w.weight")
    ops.tuning.tc_splits = 1
    before = ops.stats.dispatches
    got = ops.read(ops.linear(ops.silu_mul(upload(ops, gate_up)), gw, residual=upload(ops, r)))
    assert ops.stats.dispatches - before == 4, "two uploads, the prep and one matmul: no silu_mul dispatch"
    assert _ran_all(gw, tokens)[1].endswith(".Q4_K:main")
    want = ref16.linear(ref32.silu_mul(gate_up), f16_round(qt.dequantize()), None, r)
    np.testing.assert_allclose(got, want, atol=4e-5 * np.abs(want).max(), rtol=0)


def test_quantized_prefill_keeps_simt_when_tc_quant_is_off(tc_ops):
    """Off tensor cores the quantized prefill runs the SIMT matmul in float32 where the integer-dot
    one (tests/test_gpu_matmul_dot.py) is off too."""
    ops = tc_ops
    ops.tuning.tc_quant = False
    ops.tuning.matmul_int_dot = False
    qt = random_quant(T.Q8_0, 32, 256, seed=1)
    gw = ops.weight(qt, name="w.weight")
    x = rand(np.random.default_rng(1), 40, 256)
    got = ops.read(ops.linear(upload(ops, x), gw))
    assert _ran_all(gw, 40)[0] == "matmul.Q8_0:main"
    want = ref32.linear(x, qt.dequantize())
    np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max(), rtol=0)
