"""The two WebGPU runtimes kjarni runs on, and every difference between them, in one place.

Both implement wgpu-py's Python API:

- ``"wgpu"``: wgpu-py on wgpu-native (naga compiles WGSL). The default.
- ``"dawn"``: wgpudawn, the same API on Dawn, Chrome's WebGPU (Tint compiles WGSL);
  ``pip install 'kjarni[dawn]'``. Its Python recording costs less per dispatch, and on NVIDIA
  it offers f16 and int8 subgroup matrices (tensor cores).

Chosen by ``WgpuContext(runtime=...)``, ``GeneratorBuilder.gpu(runtime=...)``, ``--runtime``
on the CLI, else ``KJARNI_WEBGPU_RUNTIME``, else ``"wgpu"``. What differs, and how kjarni
handles it (all in `Runtime`):

==========================  ==========================  ===========================================
                            wgpu (wgpu-native)          dawn (wgpudawn)
==========================  ==========================  ===========================================
subgroup feature name       ``subgroup``                ``subgroups`` (kjarni says ``subgroup``)
tensor cores                none                        ``chromium-experimental-subgroup-matrix``
                                                        (kjarni: ``subgroup-matrix``) with its configs
WGSL for subgroup builtins  nothing (``enable`` fails)  ``enable subgroups;`` (added by `prepare_shader`)
recording fast path         raw C calls (`raw_recording`)  none: the public API (already cheaper)
kernels without checks      ``...ShaderModuleTrusted``  none (the device toggle ``disable_robustness``)
toggles                     none                        instance: `DAWN_INSTANCE_TOGGLES`;
                                                        device: `DAWN_FAST_DEVICE_TOGGLES` on request,
                                                        `DAWN_DISABLED_DEVICE_TOGGLES` always off
error classes               ``wgpu.GPUError`` ...       ``wgpudawn.GPUError`` ... (`gpu_errors`);
                                                        out-of-memory is a ``MemoryError`` in both
limits                      the same names; kjarni requests only those the adapter lists
==========================  ==========================  ===========================================
"""

from __future__ import annotations

import functools
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Sequence

from kjarni.errors import GpuUnavailableError, InvalidConfigurationError
from kjarni.quiet import quiet_mesa

RUNTIMES = ("wgpu", "dawn")
RUNTIME_ENV = "KJARNI_WEBGPU_RUNTIME"

# Dawn's instance/adapter toggles kjarni sets before Dawn's instance exists: experimental
# features (subgroup matrices) need `allow_unsafe_apis`; NVIDIA's f16 subgroup-matrix
# configuration appears only with `vulkan_enable_f16_on_nvidia` (ggml-webgpu sets both).
DAWN_INSTANCE_TOGGLES = ("allow_unsafe_apis", "vulkan_enable_f16_on_nvidia")
# Device toggles that drop Dawn's bounds clamping and workgroup-memory zeroing: faster, and
# safe only for kernels that guard every access and initialise their shared memory. Off unless
# asked for (`WgpuContext(dawn_device_toggles=DAWN_FAST_DEVICE_TOGGLES)`).
DAWN_FAST_DEVICE_TOGGLES = ("disable_robustness", "disable_workgroup_init")

# kjarni's feature names -> Dawn's, where they differ.
DAWN_FEATURE_NAMES = {"subgroup": "subgroups", "subgroup-matrix": "chromium-experimental-subgroup-matrix"}

# Device toggles kjarni turns off: Dawn rounds timestamp queries (a browser's guard against timing
# attacks) to steps of about 13 us on the H200, which blurs kjarni's per-kernel profile.
DAWN_DISABLED_DEVICE_TOGGLES = ("timestamp_quantization",)

# WGSL builtins that need `enable subgroups;` on Dawn.
_SUBGROUP_USE = re.compile(r"\bsubgroup[A-Z_]\w*|\bsubgroup_(size|invocation_id)\b")


def requested_runtime(runtime: str | None = None) -> str:
    """``runtime``, else ``KJARNI_WEBGPU_RUNTIME``, else ``"wgpu"``; an unknown name is an error."""
    where = "runtime"
    if runtime is None:
        runtime = os.environ.get(RUNTIME_ENV, "").strip() or "wgpu"
        where = RUNTIME_ENV
    name = str(runtime).strip().lower()
    name = {"wgpu-py": "wgpu", "wgpu-native": "wgpu", "native": "wgpu", "wgpudawn": "dawn"}.get(name, name)
    if name not in RUNTIMES:
        raise InvalidConfigurationError(
            f"{where}={runtime!r} is not a WebGPU runtime; use 'wgpu' (wgpu-py, the default) or 'dawn' "
            "(wgpudawn: pip install 'kjarni[dawn]')"
        )
    return name


@dataclass(frozen=True)
class Runtime:
    """One WebGPU implementation: its module and what kjarni does differently on it."""

    name: str  # "wgpu" or "dawn"
    module: Any = field(repr=False)  # wgpu or wgpudawn
    version: str
    # kjarni's feature names (wgpu-native's spelling) -> this runtime's, where they differ.
    feature_names: dict[str, str] = field(default_factory=dict, repr=False)

    @property
    def description(self) -> str:
        """``"wgpu-py 0.32.0 (wgpu-native)"`` or ``"wgpudawn 0.32.0.4 (Dawn)"``."""
        return f"wgpu-py {self.version} (wgpu-native)" if self.name == "wgpu" else f"wgpudawn {self.version} (Dawn)"

    @property
    def gpu_errors(self) -> tuple[type[BaseException], ...]:
        """The runtime's WebGPU error classes (validation, out of memory, internal)."""
        return (self.module.GPUError,)

    # ------------------------------------------------------------ features

    def native_feature(self, name: str) -> str:
        """This runtime's name for kjarni's feature ``name``."""
        return self.feature_names.get(name, name)

    def features_of(self, adapter_or_device: Any) -> frozenset[str]:
        """The features of an adapter or device, in kjarni's spelling."""
        back = {v: k for k, v in self.feature_names.items()}
        return frozenset(back.get(str(f), str(f)) for f in adapter_or_device.features)

    # ------------------------------------------------------------ adapters and devices

    def enumerate_adapters(self) -> list[Any]:
        """Every adapter the runtime sees, in its enumeration order (Mesa kept quiet: `quiet_mesa`)."""
        quiet_mesa()  # every path to an adapter comes here: the builder's, WgpuContext's, `kjarni devices`
        try:
            return list(self.module.gpu.enumerate_adapters_sync())
        except Exception as exc:  # the native library itself failed (no driver at all)
            raise GpuUnavailableError(
                f"no WebGPU adapter: {self.description} could not enumerate adapters ({exc})"
            ) from exc

    def request_device(
        self, adapter: Any, features: Sequence[str], limits: dict[str, int], device_toggles: Sequence[str] = ()
    ) -> Any:
        """A device on ``adapter`` with kjarni's ``features`` (kjarni names) and ``limits``."""
        native = [self.native_feature(f) for f in features]
        if self.name == "dawn":
            from wgpudawn.backends.dawn import extras

            try:
                return extras.request_device_sync(
                    adapter, required_features=native, required_limits=limits, enable_toggles=list(device_toggles),
                    disable_toggles=list(DAWN_DISABLED_DEVICE_TOGGLES),
                )
            except Exception:  # noqa: BLE001 - a Dawn that refuses the toggle: its quantized timers then
                return extras.request_device_sync(
                    adapter, required_features=native, required_limits=limits, enable_toggles=list(device_toggles)
                )
        if device_toggles:
            raise InvalidConfigurationError(
                f"device toggles {list(device_toggles)} are Dawn's; wgpu-native has none (use runtime='dawn')"
            )
        return adapter.request_device_sync(required_features=native, required_limits=limits)

    def adapter_extras(self, adapter: Any) -> dict[str, Any]:
        """What only Dawn tells about an adapter: ``uuid`` (CUDA's ``GPU-...`` form), ``pci_bus``
        (Linux, from the DRM render node), ``device_local_bytes`` (memory heaps). Empty on wgpu."""
        if self.name != "dawn":
            return {}
        try:
            from wgpudawn.backends.dawn import extras

            props = extras.get_adapter_properties(adapter)
        except Exception:  # noqa: BLE001 - extras are a bonus, never a reason to fail
            return {}
        out: dict[str, Any] = {}
        uuid = (props.get("vulkan_uuids") or {}).get("device_uuid")
        if uuid:
            h = bytes(uuid).hex()
            out["uuid"] = f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"
        render = (props.get("drm") or {}).get("render")
        if render:  # /sys/dev/char/MAJOR:MINOR/device links to the PCI device, e.g. 0000:17:00.0
            path = os.path.realpath(f"/sys/dev/char/{render[0]}:{render[1]}/device")
            if re.fullmatch(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]", os.path.basename(path)):
                out["pci_bus"] = os.path.basename(path)
        heaps = [h for h in props.get("memory_heaps") or () if "device-local" in str(h.get("properties"))]
        if heaps:
            out["device_local_bytes"] = int(sum(h["size"] for h in heaps))
        if props.get("subgroup_matrix_configs"):
            out["subgroup_matrix_configs"] = props["subgroup_matrix_configs"]
        return out

    def f16_matrix_subgroup_size(self, adapter: Any) -> int | None:
        """The subgroup size of the adapter's f16 x f16 -> f32 16x16x16 subgroup-matrix
        configuration (what ``matmul_sgmat.tmpl.wgsl`` and ``matmul_tc.tmpl.wgsl`` need), or None
        where it has none (wgpu; Dawn without ``vulkan_enable_f16_on_nvidia`` on NVIDIA; most Mesa
        drivers): `f16_matrix_config`'s, where that is 16 x 16."""
        config = self.f16_matrix_config(adapter)
        return config[1] if config is not None and config[0] == 16 else None

    def f16_matrix_config(self, adapter: Any) -> tuple[int, int] | None:
        """(M, subgroup size) of the adapter's square f16 x f16 -> f32 subgroup-matrix
        configuration at one fixed subgroup size: the first 16 x 16 x 16 one at 32 or 64 (NVIDIA),
        else the first 8 x 8 x 8 at 8 (Mesa 26's lavapipe); None without. ``attention_tc.tmpl.wgsl``
        runs on either, the matmul kernels on 16 x 16 only."""
        found = []
        for config in self.adapter_extras(adapter).get("subgroup_matrix_configs") or ():
            m = config.get("m")
            size = int(config.get("min_subgroup_size") or 0)
            if ((config.get("component_type"), config.get("result_component_type")) == ("f16", "f32") and m in (8, 16)
                    and (config.get("n"), config.get("k")) == (m, m) and size == int(config.get("max_subgroup_size") or 0)
                    and size in ((32, 64) if m == 16 else (8,))):
                found.append((int(m), size))
        return next((c for c in found if c[0] == 16), found[0] if found else None)

    # ------------------------------------------------------------ shaders and recording

    def prepare_shader(self, code: str, flags: frozenset[str]) -> str:
        """WGSL as this runtime wants it: Dawn needs ``enable subgroups;`` before subgroup builtins."""
        if self.name == "dawn" and "subgroup" in flags and "enable subgroups;" not in code and _SUBGROUP_USE.search(code):
            return "enable subgroups;\n" + code
        return code

    @functools.cached_property
    def raw_recording(self) -> tuple | None:
        """wgpu-native's C entry points for set_pipeline / set_bind_group / dispatch, or None.

        wgpu-py's wrappers build a cffi array for the (always empty) dynamic offsets and capture
        errors around every call, about 5 us per dispatch in Python; a decode step records ~150.
        Only for wgpu-native (Dawn's handles are not wgpu-native's); None if wgpu-py's internals move.
        """
        if self.name != "wgpu":
            return None
        try:
            from wgpu.backends.wgpu_native._ffi import ffi, lib

            return (
                lib.wgpuComputePassEncoderSetPipeline,
                lib.wgpuComputePassEncoderSetBindGroup,
                lib.wgpuComputePassEncoderDispatchWorkgroups,
                ffi.NULL,
            )
        except Exception:  # noqa: BLE001 - a changed wgpu-py: use the public API
            return None

    def unchecked_module(self, device: Any, code: str, label: str) -> Any:
        """A WGSL module compiled without naga's runtime checks (index clamping, loop bounding), or
        None where the runtime has no such entry point (Dawn: its device toggle ``disable_robustness``
        does this for every module). On wgpu-native: what ``create_shader_module`` does, through
        ``wgpuDeviceCreateShaderModuleTrusted`` with ``WGPUShaderRuntimeChecks_None``."""
        if self.name != "wgpu":
            return None
        try:
            from wgpu.backends.wgpu_native import _api
        except ImportError:
            return None
        create = getattr(_api.lib, "wgpuDeviceCreateShaderModuleTrusted", None)
        if create is None or not hasattr(_api, "new_struct_p"):
            return None
        source = _api.new_struct_p("WGPUShaderSourceWGSL *", code=_api.to_c_string_view(code))
        source[0].chain.next = _api.ffi.NULL
        source[0].chain.sType = _api.lib.WGPUSType_ShaderSourceWGSL
        desc = _api.new_struct_p(
            "WGPUShaderModuleDescriptor *",
            nextInChain=_api.ffi.cast("WGPUChainedStruct *", source),
            label=_api.to_c_string_view(label),
        )
        handle = _api.libf.wgpuDeviceCreateShaderModuleTrusted(device._internal, desc, 0)
        if handle == _api.ffi.NULL:
            raise RuntimeError(f"shader module {label} could not be created")
        return _api.GPUShaderModule(label, handle, device)


def _dawn_backends() -> list[str]:
    """Dawn's instance backends from ``WGPU_BACKEND_TYPE`` (wgpu-py's variable), default all."""
    forced = os.environ.get("WGPU_BACKEND_TYPE", "").strip()
    if not forced:
        return ["All"]
    return [{"d3d12": "DX12", "dx12": "DX12", "d3d11": "D3D11"}.get(forced.lower(), forced.capitalize() if forced.lower() != "opengl" else "OpenGL")]


@functools.cache
def load_runtime(name: str | None = None) -> Runtime:
    """The runtime ``name`` (see `requested_runtime`), imported once.

    Raises `GpuUnavailableError` naming the extra when wgpudawn is not installed.
    """
    name = requested_runtime(name)
    if name == "wgpu":
        try:
            import wgpu
        except ImportError as exc:
            raise GpuUnavailableError(f"the wgpu runtime needs wgpu-py ({exc}); pip install kjarni") from None
        return Runtime("wgpu", wgpu, wgpu.__version__)
    try:
        import wgpudawn
        from wgpudawn.backends.dawn import extras
    except ImportError as exc:
        raise GpuUnavailableError(
            f"runtime 'dawn' needs the wgpudawn package, which is not installed ({exc}): "
            "pip install 'kjarni[dawn]', or use runtime='wgpu' (the default)"
        ) from None
    try:
        # Must come before Dawn's instance exists; an application that made its own instance
        # first keeps its toggles (then f16 subgroup matrices may be missing on NVIDIA).
        extras.set_instance_extras(backends=_dawn_backends(), enable_toggles=list(DAWN_INSTANCE_TOGGLES))
    except Exception:  # noqa: BLE001 - the instance exists already
        pass
    return Runtime("dawn", wgpudawn, wgpudawn.__version__, DAWN_FEATURE_NAMES)


def runtime_of(obj: Any) -> Runtime:
    """The runtime that made a GPUAdapter or GPUDevice (an application's own)."""
    module = type(obj).__module__.split(".")[0]
    if module == "wgpudawn":
        return load_runtime("dawn")
    if module == "wgpu":
        return load_runtime("wgpu")
    if "wgpudawn" in sys.modules and isinstance(obj, (sys.modules["wgpudawn"].GPUDevice, sys.modules["wgpudawn"].GPUAdapter)):
        return load_runtime("dawn")
    raise InvalidConfigurationError(
        f"{type(obj).__module__}.{type(obj).__name__} is not a wgpu-py or wgpudawn GPUAdapter/GPUDevice"
    )
