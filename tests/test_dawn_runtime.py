"""The Dawn runtime's pieces that run anywhere (no Dawn adapter needed): the tensor-core feature and
configuration mapping in kjarni/gpu/runtime.py, and NumpyOps' f16-activation mode, the reference
the tensor-core prefill is checked against (tests/test_gpu_tensor_cores.py)."""

from __future__ import annotations

import types

import numpy as np
import pytest

from kjarni.errors import InvalidConfigurationError
from kjarni.gpu import runtime as rt
from kjarni.numpy_ops import NumpyOps

F16_CONFIG = {"component_type": "f16", "result_component_type": "f32", "m": 16, "n": 16, "k": 16,
              "min_subgroup_size": 32, "max_subgroup_size": 32}
I8_CONFIG = {"component_type": "i8", "result_component_type": "i32", "m": 16, "n": 16, "k": 32,
             "min_subgroup_size": 32, "max_subgroup_size": 32}


def _runtime_with(configs, name="dawn"):
    runtime = rt.Runtime(name, None, "0", dict(rt.DAWN_FEATURE_NAMES) if name == "dawn" else {})
    object.__setattr__(runtime, "adapter_extras", lambda adapter: {"subgroup_matrix_configs": configs} if name == "dawn" else {})
    return runtime


def test_the_subgroup_matrix_feature_has_dawns_name_and_maps_back():
    dawn = rt.Runtime("dawn", None, "0", dict(rt.DAWN_FEATURE_NAMES))
    assert dawn.native_feature("subgroup-matrix") == "chromium-experimental-subgroup-matrix"
    device = types.SimpleNamespace(features={"chromium-experimental-subgroup-matrix", "subgroups", "shader-f16"})
    assert dawn.features_of(device) == {"subgroup-matrix", "subgroup", "shader-f16"}
    assert rt.Runtime("wgpu", None, "0").native_feature("subgroup-matrix") == "subgroup-matrix"


@pytest.mark.parametrize(
    ("configs", "expected"),
    [
        ([I8_CONFIG, F16_CONFIG], 32),  # NVIDIA with vulkan_enable_f16_on_nvidia
        ([I8_CONFIG], None),  # NVIDIA without it: int8 only
        ([{**F16_CONFIG, "min_subgroup_size": 64, "max_subgroup_size": 64}], 64),
        ([{**F16_CONFIG, "min_subgroup_size": 32, "max_subgroup_size": 64}], None),  # size not fixed
        ([{**F16_CONFIG, "result_component_type": "f16"}], None),  # f16 sums: not what the kernel does
        ([{**F16_CONFIG, "m": 8, "n": 8, "k": 8}], None),
        ([], None),
    ],
)
def test_the_f16_tensor_core_configuration_is_found_in_dawns_list(configs, expected):
    assert _runtime_with(configs).f16_matrix_subgroup_size(None) == expected


LVP8 = {**F16_CONFIG, "m": 8, "n": 8, "k": 8, "min_subgroup_size": 8, "max_subgroup_size": 8}


@pytest.mark.parametrize(
    ("configs", "expected"),
    [
        ([I8_CONFIG, F16_CONFIG], (16, 32)),  # NVIDIA
        ([LVP8, {**LVP8, "result_component_type": "f16"}], (8, 8)),  # Mesa 26's lavapipe
        ([LVP8, F16_CONFIG], (16, 32)),  # 16 x 16 where both exist
        ([{**LVP8, "min_subgroup_size": 16, "max_subgroup_size": 16}], None),  # 8 x 8 only at subgroup size 8
        ([{**F16_CONFIG, "n": 8}], None),  # not square
        ([I8_CONFIG], None),
        ([], None),
    ],
)
def test_the_attention_matrix_configuration_is_square_f16_16_or_8(configs, expected):
    """attention_tc's configuration (WgpuContext.f16_matrix): f16 x f16 -> f32, square, 16 x 16 at
    subgroup size 32 or 64, or 8 x 8 at 8 (the only one Mesa 26's lavapipe offers)."""
    assert _runtime_with(configs).f16_matrix_config(None) == expected
    assert _runtime_with(configs, name="wgpu").f16_matrix_config(None) is None


def test_wgpu_native_offers_no_tensor_cores():
    assert _runtime_with([F16_CONFIG], name="wgpu").f16_matrix_subgroup_size(None) is None


def test_the_sgmat_tiles_render_only_with_whole_loads_per_thread():
    from kjarni.gpu import kernels

    names = kernels.TEMPLATES["matmul_sgmat"]
    for bm, bn, bk, sm, sn in kernels.SGMAT_TILES:
        for sg in (32, 64):
            threads = sm * sn * sg
            whole = bn * bk % (8 * threads) == 0 and bm * bk % (4 * threads) == 0
            assert (kernels.sgmat_variant(bm, bn, bk, sm, sn, sg) in names) == whole
    source = kernels.template("matmul_sgmat", kernels.sgmat_variant(64, 64, 32, 2, 2, 32))
    assert "const BM: u32 = 64u;" in source and "{{" not in source and "enable chromium_experimental_subgroup_matrix;" in source


def test_f16_activations_round_the_input_of_each_linear_once():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((12, 40), dtype=np.float32)
    w = rng.standard_normal((24, 40), dtype=np.float32)
    b = rng.standard_normal(24, dtype=np.float32)
    ops = NumpyOps(activations="f16")
    rounded = x.astype(np.float16).astype(np.float32)
    assert not np.array_equal(rounded, x)
    np.testing.assert_array_equal(ops.linear(x, w, b), NumpyOps().linear(rounded, w, b))
    nw = rng.standard_normal(40, dtype=np.float32)
    normed = NumpyOps().rms_norm(x, nw, 1e-6)  # rounded after the norm, as the GPU does
    np.testing.assert_array_equal(ops.norm_linear(x, nw, 1e-6, w), NumpyOps().linear(normed.astype(np.float16).astype(np.float32), w))
    assert not np.array_equal(ops.linear(x, w), NumpyOps().linear(x, w))


def test_f16_activations_leave_products_of_fewer_rows_than_the_threshold_alone():
    rng = np.random.default_rng(4)
    w = rng.standard_normal((8, 16), dtype=np.float32)
    ops = NumpyOps(activations="f16", f16_activation_min_tokens=10)  # the GPU's decode rows stay f32
    few, many = rng.standard_normal((9, 16), dtype=np.float32), rng.standard_normal((10, 16), dtype=np.float32)
    np.testing.assert_array_equal(ops.linear(few, w), NumpyOps().linear(few, w))
    np.testing.assert_array_equal(ops.linear(many, w), NumpyOps().linear(many.astype(np.float16).astype(np.float32), w))


def test_f16_activations_round_q_k_v_and_the_softmax_weights_of_a_prefill_attention():
    """NumpyOps(activations="f16").attention, as attention_tc computes it: the scaled q, the keys,
    the values and the softmax weights exp(s - max) rounded to f16, the weights' sum of the
    rounded values; here against a dense causal softmax written out (GQA: 4 query heads on 2 KV
    heads), to float32's rounding; fewer rows than the threshold stay the f32 attention."""
    from kjarni.numpy_ops import NumpyKVCache

    def r16(a):
        return a.astype(np.float16).astype(np.float32)

    rng = np.random.default_rng(5)
    tokens, heads, kv, hd, start = 11, 4, 2, 16, 5
    cache = NumpyKVCache(1, kv, hd, 32)
    cache.keys[0, :, : start + tokens] = rng.standard_normal((kv, start + tokens, hd), dtype=np.float32)
    cache.values[0, :, : start + tokens] = rng.standard_normal((kv, start + tokens, hd), dtype=np.float32)
    q = rng.standard_normal((tokens, heads * hd), dtype=np.float32)
    got = NumpyOps(activations="f16", f16_activation_min_tokens=10).attention(q, cache, 0, start)
    want, flips = np.empty_like(q), np.empty_like(q)
    for t in range(tokens):
        for h in range(heads):
            qs = r16(q[t, h * hd:(h + 1) * hd] * np.float32(1.0 / np.sqrt(hd)))
            k, v = r16(cache.keys[0, h // 2, : start + t + 1]), r16(cache.values[0, h // 2, : start + t + 1])
            s = k @ qs
            p32 = np.exp(s - s.max())
            p = r16(p32)
            want[t, h * hd:(h + 1) * hd] = p @ v / p.sum()
            # Scores summed in another order (another BLAS) can round a weight this close to an f16
            # midpoint the other way: one f16 ulp of it times its value.
            ulp = np.spacing(p.astype(np.float16)).astype(np.float32)
            near = ulp / 2 - np.abs(p32 - p) <= 1e-5 * p32
            flips[t, h * hd:(h + 1) * hd] = (near * ulp) @ np.abs(v) / p.sum()
    assert np.all(np.abs(got - want) <= flips + 1e-5 * np.abs(want).max())
    exact = NumpyOps().attention(q, cache, 0, start)
    assert np.abs(got - exact).max() > 1e-4  # the roundings happened
    few = NumpyOps(activations="f16", f16_activation_min_tokens=12).attention(q, cache, 0, start)
    np.testing.assert_array_equal(few, exact)  # the f32 path itself, same inputs, same process: equal on any BLAS


def test_an_unknown_activation_format_is_a_configuration_error():
    with pytest.raises(InvalidConfigurationError, match="activations 'bf16' is not one of: f32, f16"):
        NumpyOps(activations="bf16")
