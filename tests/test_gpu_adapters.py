"""Choosing the adapter (index, name, power preference, the GPU a scheduler assigned), the runtime,
the device checks and the GPU memory budget: over fake adapters, plus a few checks on the real one."""

from __future__ import annotations

import json
import sys
import types

import pytest

from kjarni.errors import GpuUnavailableError, InvalidConfigurationError, UnsuitableDeviceError
from kjarni.gpu import adapters as ad
from kjarni.gpu import runtime as rt
from kjarni.gpu.adapters import AdapterInfo, Assignment, assigned_gpu, choose_adapter


def fake(index: int, name: str, backend: str = "Vulkan", kind: str = "DiscreteGPU", vendor: int = 0x10DE, **extra) -> AdapterInfo:
    limits = dict(ad.REQUIRED_LIMITS)
    limits.update(extra.pop("limits", {}))
    return AdapterInfo(index, name, backend, kind, "wgpu", vendor_id=vendor, limits=limits,
                       problems=tuple(ad.missing_requirements(limits)), **extra)


# A workstation: an Intel iGPU listed first, two identical NVIDIA GPUs, then each again via OpenGL.
HOST = [
    fake(0, "Intel(R) UHD Graphics 770", kind="IntegratedGPU", vendor=0x8086),
    fake(1, "NVIDIA H200", pci_bus="0000:b1:00.0"),
    fake(2, "NVIDIA H200", pci_bus="0000:17:00.0"),
    fake(3, "NVIDIA H200", backend="OpenGL"),
    fake(4, "llvmpipe (LLVM 15.0.6, 256 bits)", kind="CPU", vendor=0x10005),
]


# ---------------------------------------------------------------- by index, name, power preference


def test_an_index_picks_that_adapter_whatever_its_rank():
    assert choose_adapter(HOST, index=4).adapter.name.startswith("llvmpipe")
    assert choose_adapter(HOST, index=0).reason == "adapter_index=0"


def test_an_index_with_no_adapter_is_a_typed_error_listing_the_adapters():
    with pytest.raises(GpuUnavailableError) as info:
        choose_adapter(HOST, index=7, index_source="KJARNI_GPU_ADAPTER")
    message = str(info.value)
    assert "KJARNI_GPU_ADAPTER=7" in message and "no adapter 7" in message
    for a in HOST:
        assert a.summary() in message


def test_a_negative_or_non_integer_index_is_a_configuration_error():
    for bad in (-1, 1.5, True):
        with pytest.raises(InvalidConfigurationError, match="adapter_index"):
            choose_adapter(HOST, index=bad)


def test_an_index_that_contradicts_the_name_filter_is_refused():
    with pytest.raises(GpuUnavailableError, match="does not match name 'Intel'"):
        choose_adapter(HOST, index=1, name="Intel")


def test_default_is_the_first_discrete_gpu_and_low_power_prefers_the_integrated_one():
    assert choose_adapter(HOST).adapter.index == 1
    assert choose_adapter(HOST, power_preference="high-performance").adapter.index == 1
    assert choose_adapter(HOST, power_preference="low-power").adapter.index == 0


def test_a_name_filter_is_a_case_insensitive_substring():
    assert choose_adapter(HOST, name="intel").adapter.index == 0
    assert choose_adapter(HOST, name="llvmpipe").adapter.index == 4
    with pytest.raises(GpuUnavailableError, match="name containing 'Radeon'; found: #0 Intel"):
        choose_adapter(HOST, name="Radeon")


def test_a_backend_filter_and_opengl_after_the_others():
    assert choose_adapter(HOST, backend="opengl").adapter.index == 3
    only_gl_and_vk = [fake(0, "GPU", backend="OpenGL"), fake(1, "GPU", backend="Vulkan")]
    assert choose_adapter(only_gl_and_vk).adapter.index == 1


def test_an_unknown_power_preference_is_a_configuration_error():
    with pytest.raises(InvalidConfigurationError, match="power_preference='fast'"):
        choose_adapter(HOST, power_preference="fast")


def test_usable_adapters_come_before_ones_lacking_limits():
    weak = fake(0, "Old GPU", limits={"max-compute-invocations-per-workgroup": 256})
    good = fake(1, "Software", kind="CPU", vendor=0)
    assert not weak.usable and "max-compute-invocations-per-workgroup: have 256, need 512" in weak.problems
    assert choose_adapter([weak, good]).adapter.index == 1


# ---------------------------------------------------------------- the GPU a scheduler assigned


@pytest.mark.parametrize(
    ("environ", "ray_ids", "expected"),
    [
        ({}, [], None),
        ({"CUDA_VISIBLE_DEVICES": ""}, [], None),
        ({"CUDA_VISIBLE_DEVICES": "-1"}, [], None),
        ({"CUDA_VISIBLE_DEVICES": "MIG-3c1e"}, [], None),
        ({"CUDA_VISIBLE_DEVICES": "1"}, [], Assignment("CUDA_VISIBLE_DEVICES", "1", ordinal=1)),
        ({"CUDA_VISIBLE_DEVICES": " 3,2"}, [], Assignment("CUDA_VISIBLE_DEVICES", "3", ordinal=3)),
        ({"CUDA_VISIBLE_DEVICES": "GPU-AbC"}, [], Assignment("CUDA_VISIBLE_DEVICES", "GPU-AbC", uuid="gpu-abc")),
        ({"CUDA_VISIBLE_DEVICES": "0"}, ["1"], Assignment("ray.get_gpu_ids()", "1", ordinal=1)),
    ],
)
def test_the_assignment_is_read_from_ray_first_then_cuda_visible_devices(environ, ray_ids, expected):
    assert assigned_gpu(environ, ray_gpu_ids=ray_ids) == expected


def test_ray_gpu_ids_are_read_only_when_ray_is_imported_and_initialised(monkeypatch):
    monkeypatch.delitem(sys.modules, "ray", raising=False)
    assert assigned_gpu({}) is None
    calls = []
    fake_ray = types.SimpleNamespace(is_initialized=lambda: True, get_gpu_ids=lambda: calls.append(1) or [2])
    monkeypatch.setitem(sys.modules, "ray", fake_ray)
    assert assigned_gpu({"CUDA_VISIBLE_DEVICES": "0"}) == Assignment("ray.get_gpu_ids()", "2", ordinal=2)
    assert calls == [1]


def test_cuda_gpu_k_is_the_kth_nvidia_adapter_in_pci_bus_order_skipping_other_vendors():
    # Both NVIDIA adapters know their PCI bus: CUDA 0 is the lower bus (index 2), CUDA 1 index 1.
    zero = choose_adapter(HOST, assignment=Assignment("CUDA_VISIBLE_DEVICES", "0", ordinal=0))
    one = choose_adapter(HOST, assignment=Assignment("CUDA_VISIBLE_DEVICES", "1", ordinal=1))
    assert (zero.adapter.index, one.adapter.index) == (2, 1)
    assert "PCI bus order" in zero.reason and "CUDA_VISIBLE_DEVICES=0" in zero.reason


def test_without_pci_buses_the_enumeration_order_is_used():
    host = [fake(0, "Intel", kind="IntegratedGPU", vendor=0x8086), fake(1, "NVIDIA A"), fake(2, "NVIDIA B")]
    choice = choose_adapter(host, assignment=Assignment("CUDA_VISIBLE_DEVICES", "1", ordinal=1))
    assert choice.adapter.index == 2 and "enumeration order" in choice.reason


def test_an_explicit_index_wins_over_the_assignment():
    choice = choose_adapter(HOST, index=0, assignment=Assignment("CUDA_VISIBLE_DEVICES", "1", ordinal=1))
    assert choice.adapter.index == 0


def test_an_assigned_gpu_beyond_the_nvidia_adapters_is_a_typed_error():
    with pytest.raises(GpuUnavailableError, match="CUDA_VISIBLE_DEVICES=5 assigns CUDA GPU 5, but only 2 NVIDIA Vulkan") as info:
        choose_adapter(HOST, assignment=Assignment("CUDA_VISIBLE_DEVICES", "5", ordinal=5))
    assert "KJARNI_GPU_ADAPTER" in str(info.value)


def test_an_assignment_with_no_nvidia_adapter_falls_back_to_the_usual_choice():
    host = [fake(0, "llvmpipe", kind="CPU", vendor=0x10005)]
    assert choose_adapter(host, assignment=Assignment("CUDA_VISIBLE_DEVICES", "0", ordinal=0)).adapter.index == 0


def test_a_uuid_assignment_matches_the_adapter_uuid():
    host = [fake(0, "NVIDIA H200", uuid="gpu-aaaa"), fake(1, "NVIDIA H200", uuid="gpu-bbbb")]
    assert choose_adapter(host, assignment=Assignment("CUDA_VISIBLE_DEVICES", "GPU-BBBB", uuid="gpu-bbbb")).adapter.index == 1
    with pytest.raises(GpuUnavailableError, match="no adapter has that device UUID"):
        choose_adapter(host, assignment=Assignment("CUDA_VISIBLE_DEVICES", "GPU-CCCC", uuid="gpu-cccc"))
    # wgpu-native reports no UUIDs: the usual choice, with a warning.
    assert choose_adapter(HOST, assignment=Assignment("CUDA_VISIBLE_DEVICES", "GPU-X", uuid="gpu-x")).adapter.index == 1


def test_kjarni_gpu_adapter_must_be_an_index(monkeypatch):
    assert ad.env_adapter_index({}) is None
    assert ad.env_adapter_index({"KJARNI_GPU_ADAPTER": " 2 "}) == 2
    with pytest.raises(InvalidConfigurationError, match="KJARNI_GPU_ADAPTER='gpu1' is not an adapter index"):
        ad.env_adapter_index({"KJARNI_GPU_ADAPTER": "gpu1"})


def test_no_adapters_at_all_is_gpu_unavailable():
    with pytest.raises(GpuUnavailableError, match="no WebGPU adapter"):
        choose_adapter([])


# ---------------------------------------------------------------- devices given by an application


class _FakeDevice:
    def __init__(self, **limits):
        self.limits = {**ad.REQUIRED_LIMITS, **limits}


def test_a_device_below_the_required_limits_is_refused_naming_each_limit():
    device = _FakeDevice(**{"max-compute-invocations-per-workgroup": 256, "max-compute-workgroup-size-x": 256})
    with pytest.raises(UnsuitableDeviceError) as info:
        ad.check_device(device, rt.Runtime("wgpu", None, "0"))
    assert info.value.missing_limits == [
        "max-compute-invocations-per-workgroup: have 256, need 512",
        "max-compute-workgroup-size-x: have 256, need 512",
    ]
    assert "device_request(adapter)" in str(info.value)
    ad.check_device(_FakeDevice(), rt.Runtime("wgpu", None, "0"))  # enough: no error


# ---------------------------------------------------------------- runtimes


def test_the_runtime_comes_from_the_argument_then_the_environment(monkeypatch):
    monkeypatch.delenv("KJARNI_WEBGPU_RUNTIME", raising=False)
    assert rt.requested_runtime() == "wgpu"
    monkeypatch.setenv("KJARNI_WEBGPU_RUNTIME", "Dawn")
    assert rt.requested_runtime() == "dawn"
    assert rt.requested_runtime("wgpu") == "wgpu"
    monkeypatch.setenv("KJARNI_WEBGPU_RUNTIME", "vulkan")
    with pytest.raises(InvalidConfigurationError, match="KJARNI_WEBGPU_RUNTIME='vulkan' is not a WebGPU runtime"):
        rt.requested_runtime()


def test_dawn_without_wgpudawn_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "wgpudawn", None)  # import wgpudawn raises ImportError
    rt.load_runtime.cache_clear()
    try:
        with pytest.raises(GpuUnavailableError, match=r"pip install 'kjarni\[dawn\]'"):
            rt.load_runtime("dawn")
    finally:
        rt.load_runtime.cache_clear()


def test_feature_names_and_the_subgroups_enable_line_are_mapped_per_runtime():
    dawn = rt.Runtime("dawn", None, "0", {"subgroup": "subgroups"})
    wgpu_native = rt.Runtime("wgpu", None, "0")
    assert dawn.native_feature("subgroup") == "subgroups" and wgpu_native.native_feature("subgroup") == "subgroup"
    device = types.SimpleNamespace(features={"subgroups", "shader-f16"})
    assert dawn.features_of(device) == {"subgroup", "shader-f16"}
    code = "fn f() -> u32 { return subgroupAdd(1u); }\n"
    assert dawn.prepare_shader(code, frozenset({"subgroup"})) == "enable subgroups;\n" + code
    assert dawn.prepare_shader(code, frozenset()) == code  # the variant without subgroups
    assert dawn.prepare_shader("fn f() {}\n", frozenset({"subgroup"})) == "fn f() {}\n"  # no builtin used
    assert wgpu_native.prepare_shader(code, frozenset({"subgroup"})) == code
    assert dawn.raw_recording is None and dawn.unchecked_module(None, code, "x") is None


def test_device_toggles_on_wgpu_native_are_refused():
    with pytest.raises(InvalidConfigurationError, match="Dawn's"):
        rt.Runtime("wgpu", None, "0").request_device(None, [], {}, ["disable_robustness"])


# ---------------------------------------------------------------- the memory budget


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "NaN", "0", "-5", "lots"])
def test_a_gpu_memory_budget_that_is_not_a_positive_finite_number_is_a_typed_error(monkeypatch, value):
    from kjarni.gpu.memory import budget_from_env

    monkeypatch.setenv("KJARNI_GPU_MEMORY_MB", value)
    with pytest.raises(InvalidConfigurationError, match=f"KJARNI_GPU_MEMORY_MB='{value}'"):
        budget_from_env()


def test_a_gpu_memory_budget_in_megabytes(monkeypatch):
    from kjarni.gpu.memory import budget_from_env

    monkeypatch.setenv("KJARNI_GPU_MEMORY_MB", "1.5")
    assert budget_from_env() == 3 * 2**19
    monkeypatch.delenv("KJARNI_GPU_MEMORY_MB")
    assert budget_from_env() is None


# ---------------------------------------------------------------- the real adapters (lavapipe in CI)


def _wgpu_runtime():
    try:
        return rt.load_runtime("wgpu")
    except GpuUnavailableError as exc:
        pytest.skip(str(exc))


@pytest.mark.gpu
def test_index_zero_is_the_adapter_kjarni_opens_by_default(wgpu_context, monkeypatch):
    from kjarni.gpu import WgpuContext
    from kjarni.gpu.context import _describe

    for name in ("KJARNI_GPU_ADAPTER", "CUDA_VISIBLE_DEVICES", "WGPU_BACKEND_TYPE"):
        monkeypatch.delenv(name, raising=False)
    found = ad.list_adapters(wgpu_context.runtime)  # the runtime the session runs (KJARNI_WEBGPU_RUNTIME)
    assert found[0].index == 0 and found[0].usable
    assert choose_adapter(found).adapter.index == 0
    ctx = WgpuContext(adapter_index=0)
    try:
        assert ctx.description == wgpu_context.description == _describe(found[0].handle)
        assert ctx.adapter_choice == "adapter_index=0"
        assert ctx.stats.adapter == ctx.description and ctx.stats.runtime == wgpu_context.runtime.description
        assert ctx.stats.runtime.startswith("wgpu-py " if ctx.runtime.name == "wgpu" else "wgpudawn ")
    finally:
        ctx.close()


@pytest.mark.gpu
def test_kjarni_gpu_adapter_past_the_last_adapter_is_a_typed_error_listing_them(wgpu_context, monkeypatch):
    from kjarni.gpu import WgpuContext

    count = len(ad.list_adapters(_wgpu_runtime()))
    monkeypatch.setenv("KJARNI_GPU_ADAPTER", str(count))
    with pytest.raises(GpuUnavailableError, match=f"KJARNI_GPU_ADAPTER={count}: there is no adapter {count}; found: #0 "):
        WgpuContext()


@pytest.mark.gpu
def test_kjarni_devices_lists_each_adapter_with_its_index(wgpu_context, capsys, monkeypatch):
    from kjarni.cli import main

    monkeypatch.delenv("KJARNI_GPU_ADAPTER", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert main(["devices", "--json", "--runtime", "wgpu"]) == 0
    report = json.loads(capsys.readouterr().out)
    found = ad.list_adapters(_wgpu_runtime())
    assert [a["index"] for a in report["adapters"]] == list(range(len(found)))
    assert [a["backend"] for a in report["adapters"]] == [a.backend for a in found]
    assert report["default"] == choose_adapter(found).adapter.index
    assert report["runtime"].startswith("wgpu-py")
    first = report["adapters"][0]
    assert first["max_storage_buffer_binding_size"] == found[0].limits["max-storage-buffer-binding-size"]
    assert first["usable"] is True and first["problems"] == []
    assert main(["devices", "--runtime", "wgpu"]) == 0
    table = capsys.readouterr().out
    assert table.splitlines()[0].startswith("runtime: wgpu-py")
    assert f"*  0      {found[0].name}" in table


# ---------------------------------------------------------------- the CLI's device options


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from tests.test_api import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-adapters"))


def test_generate_refuses_gpu_n_with_device_cpu(tiny_dir, capsys):
    from kjarni.cli import main

    assert main(["generate", "hi", "--model-path", str(tiny_dir), "--device", "cpu", "--gpu", "0", "-q"]) == 2
    assert "--device cpu contradicts --gpu" in capsys.readouterr().err


def test_the_device_options_map_to_gpu_arguments():
    from kjarni.cli import _Parser, add_device_options, device_options

    parser = _Parser(prog="serve")
    add_device_options(parser)
    args = parser.parse_args(["--gpu", "1", "--runtime", "dawn"])
    assert device_options(args) == {"adapter_index": 1, "runtime": "dawn"} and args.device is None
    assert device_options(parser.parse_args(["--device", "gpu"])) == {}


@pytest.mark.gpu
def test_generate_gpu_n_runs_on_adapter_n_and_a_missing_one_lists_the_adapters(wgpu_context, tiny_dir, capsys, monkeypatch):
    from kjarni.cli import main

    monkeypatch.delenv("KJARNI_GPU_ADAPTER", raising=False)
    base = ["generate", "hi", "--model-path", str(tiny_dir), "--max-tokens", "3", "--greedy", "-q", "--runtime", "wgpu"]
    assert main([*base, "--gpu", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["device"] == "gpu"
    count = len(ad.list_adapters(_wgpu_runtime()))
    assert main([*base, "--gpu", str(count)]) == 1
    err = capsys.readouterr().err
    assert f"adapter_index={count}: there is no adapter {count}; found: #0 " in err
