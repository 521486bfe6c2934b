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


def test_an_unknown_activation_format_is_a_configuration_error():
    with pytest.raises(InvalidConfigurationError, match="activations 'bf16' is not one of: f32, f16"):
        NumpyOps(activations="bf16")
