"""Which WebGPU adapter kjarni opens, and whether a device is good enough for it.

Adapters are numbered in the runtime's enumeration order (``kjarni devices`` shows the numbers).
The choice, first rule that applies:

1. ``adapter_index=N`` (``GeneratorBuilder.gpu``, ``--gpu N``), else ``KJARNI_GPU_ADAPTER=N``:
   adapter N; a number with no adapter is an error listing those there are.
2. A GPU assigned by a scheduler: ``ray.get_gpu_ids()`` inside a Ray worker, else
   ``CUDA_VISIBLE_DEVICES`` (its first entry). Vulkan, Metal and D3D12 ignore that variable, so
   kjarni maps it: CUDA GPU ``k`` is the ``k``-th NVIDIA adapter of one backend (Vulkan first),
   in PCI bus order where every adapter's bus is known (Dawn on Linux), else in enumeration
   order; a ``GPU-<uuid>`` entry matches the adapter's device UUID (Dawn only). See
   docs/serving.md for when this can be wrong.
3. Otherwise the best adapter that passes ``backend`` (default ``WGPU_BACKEND_TYPE``) and
   ``name`` (a case-insensitive substring): usable before unusable, then by
   ``power_preference``: ``"high-performance"`` (the default) puts discrete GPUs first,
   ``"low-power"`` integrated ones; CPU (software) adapters come last, OpenGL after the others.

The chosen adapter is logged (logger ``kjarni.gpu``, INFO) with the rule that chose it.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Sequence

from kjarni.errors import GpuUnavailableError, InvalidConfigurationError, UnsuitableDeviceError

log = logging.getLogger("kjarni.gpu")

ADAPTER_ENV = "KJARNI_GPU_ADAPTER"
NVIDIA_VENDOR_ID = 0x10DE
POWER_PREFERENCES = ("high-performance", "low-power")

# Features kjarni uses when the device has them (none is required): subgroup operations for the
# faster matvec/attention kernels, timestamps for profiling, f16 shaders for later kernels.
# "subgroup-matrix": tensor cores (Dawn's chromium-experimental-subgroup-matrix; wgpu-native has none).
WANTED_FEATURES = ("shader-f16", "subgroup", "timestamp-query", "subgroup-matrix")

# Limits kjarni's kernels need, at least (WebGPU's defaults are lower for the first two:
# attention_single runs 512 invocations a workgroup).
REQUIRED_LIMITS = {
    "max-compute-invocations-per-workgroup": 512,
    "max-compute-workgroup-size-x": 512,
    "max-storage-buffers-per-shader-stage": 8,
    "max-compute-workgroup-storage-size": 16384,
    "max-storage-buffer-binding-size": 128 << 20,
    "max-buffer-size": 256 << 20,
}
# Limits kjarni asks for as high as the adapter goes (large weights, big workgroup tiles).
_MAXED_LIMITS = (
    "max-buffer-size",
    "max-storage-buffer-binding-size",
    "max-compute-workgroup-storage-size",
    "max-compute-invocations-per-workgroup",
    "max-compute-workgroup-size-x",
)

_TYPE_RANK = {
    "high-performance": {"DiscreteGPU": 0, "IntegratedGPU": 1, "VirtualGPU": 2, "Unknown": 3, "CPU": 4},
    "low-power": {"IntegratedGPU": 0, "DiscreteGPU": 1, "VirtualGPU": 2, "Unknown": 3, "CPU": 4},
}
_BACKEND_ORDER = ("Vulkan", "Metal", "D3D12", "D3D11", "OpenGL", "OpenGLES")


def missing_requirements(limits: dict[str, int]) -> list[str]:
    """The limits in ``limits`` below what kjarni needs, as ``"name: have X, need Y"``."""
    missing = []
    for name, need in REQUIRED_LIMITS.items():
        have = limits.get(name)
        if have is None or int(have) < need:
            missing.append(f"{name}: have {have if have is not None else 'none'}, need {need}")
    return missing


def device_request(adapter: Any) -> dict[str, Any]:
    """Keyword arguments for ``adapter.request_device_sync(**...)`` giving kjarni what it needs.

    For an application that makes the device it shares with kjarni: the features kjarni uses
    that the adapter has, and kjarni's limits at the adapter's maximum. Add your own to them.
    """
    from kjarni.gpu.runtime import runtime_of

    runtime = runtime_of(adapter)
    features = runtime.features_of(adapter)
    return {
        "required_features": [runtime.native_feature(f) for f in WANTED_FEATURES if f in features],
        "required_limits": _limits_to_request(adapter.limits),
    }


def _limits_to_request(limits: Any) -> dict[str, int]:
    wanted = {name: int(limits[name]) for name in _MAXED_LIMITS if name in limits}
    if "max-storage-buffers-per-shader-stage" in limits:
        wanted["max-storage-buffers-per-shader-stage"] = min(int(limits["max-storage-buffers-per-shader-stage"]), 10)
    return wanted


@dataclass(frozen=True)
class AdapterInfo:
    """One adapter as kjarni sees it (``kjarni devices`` prints these)."""

    index: int
    name: str
    backend: str
    adapter_type: str
    runtime: str
    vendor_id: int = 0
    device_id: int = 0
    description: str = ""
    limits: dict[str, int] = field(default_factory=dict)
    features: frozenset[str] = frozenset()
    problems: tuple[str, ...] = ()  # why kjarni cannot use it; empty when it can
    uuid: str | None = None  # CUDA-style "GPU-..." (Dawn, Vulkan)
    pci_bus: str | None = None  # "0000:17:00.0" (Dawn, Linux)
    device_local_bytes: int | None = None  # sum of device-local memory heaps (Dawn)
    handle: Any = field(default=None, repr=False, compare=False)  # the runtime's GPUAdapter

    @property
    def usable(self) -> bool:
        return not self.problems

    @property
    def is_nvidia(self) -> bool:
        return self.vendor_id == NVIDIA_VENDOR_ID or "nvidia" in self.name.lower()

    def summary(self) -> str:
        """``#0 NVIDIA H200 (Vulkan, DiscreteGPU)``."""
        return f"#{self.index} {self.name} ({self.backend}, {self.adapter_type})"

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: everything but the handle."""
        return {
            "index": self.index, "name": self.name, "backend": self.backend, "type": self.adapter_type,
            "runtime": self.runtime, "vendor_id": self.vendor_id, "device_id": self.device_id,
            "description": self.description, "usable": self.usable, "problems": list(self.problems),
            "max_buffer_size": self.limits.get("max-buffer-size"),
            "max_storage_buffer_binding_size": self.limits.get("max-storage-buffer-binding-size"),
            "max_compute_workgroup_storage_size": self.limits.get("max-compute-workgroup-storage-size"),
            "features": sorted(f for f in self.features if f in WANTED_FEATURES),
            "uuid": self.uuid, "pci_bus": self.pci_bus, "device_local_bytes": self.device_local_bytes,
        }


def describe(adapter: Any, index: int, runtime: Any) -> AdapterInfo:
    """`AdapterInfo` of a runtime's ``adapter`` at position ``index`` of its enumeration."""
    info = adapter.info
    limits = {k: int(v) for k, v in adapter.limits.items() if isinstance(v, int)}
    extras = runtime.adapter_extras(adapter)
    return AdapterInfo(
        index=index,
        name=str(info.get("device") or info.get("description") or "unknown adapter"),
        backend=str(info.get("backend_type") or "unknown"),
        adapter_type=str(info.get("adapter_type") or "Unknown"),
        runtime=runtime.name,
        vendor_id=int(info.get("vendor_id") or 0),
        device_id=int(info.get("device_id") or 0),
        description=str(info.get("description") or ""),
        limits=limits,
        features=runtime.features_of(adapter),
        problems=tuple(missing_requirements(limits)),
        uuid=extras.get("uuid"),
        pci_bus=extras.get("pci_bus"),
        device_local_bytes=extras.get("device_local_bytes"),
        handle=adapter,
    )


def list_adapters(runtime: Any) -> list[AdapterInfo]:
    """Every adapter of ``runtime`` (a `kjarni.gpu.runtime.Runtime`), numbered in enumeration order."""
    return [describe(a, i, runtime) for i, a in enumerate(runtime.enumerate_adapters())]


# ------------------------------------------------------------------ the GPU a scheduler assigned


@dataclass(frozen=True)
class Assignment:
    """A GPU given to this process by a scheduler: a CUDA ordinal or a CUDA UUID."""

    source: str  # "ray.get_gpu_ids()" or "CUDA_VISIBLE_DEVICES"
    value: str  # the entry as written
    ordinal: int | None = None
    uuid: str | None = None


def assigned_gpu(environ: dict[str, str] | None = None, ray_gpu_ids: Sequence[Any] | None = None) -> Assignment | None:
    """The GPU a scheduler assigned to this process, or None.

    ``ray_gpu_ids`` defaults to ``ray.get_gpu_ids()`` when Ray is imported and initialised (kjarni
    never imports Ray itself); else the first entry of ``CUDA_VISIBLE_DEVICES``. Empty, ``-1``
    and MIG entries assign nothing kjarni can map.
    """
    environ = os.environ if environ is None else environ
    if ray_gpu_ids is None:
        ray_gpu_ids = _ray_gpu_ids()
    if ray_gpu_ids:
        source, value = "ray.get_gpu_ids()", str(ray_gpu_ids[0]).strip()
    else:
        raw = environ.get("CUDA_VISIBLE_DEVICES")
        if raw is None or not raw.strip():
            return None
        source, value = "CUDA_VISIBLE_DEVICES", raw.split(",")[0].strip()
    if value.isdigit():
        return Assignment(source, value, ordinal=int(value))
    if value.upper().startswith("GPU-"):
        return Assignment(source, value, uuid=value.lower())
    return None  # "-1", "MIG-...", garbage: nothing to map to an adapter


def _ray_gpu_ids() -> list[Any]:
    ray = sys.modules.get("ray")
    if ray is None:
        return []
    try:
        return list(ray.get_gpu_ids()) if ray.is_initialized() else []
    except Exception:  # noqa: BLE001 - not inside a Ray worker
        return []


def _nvidia_in_cuda_order(adapters: Sequence[AdapterInfo]) -> list[AdapterInfo]:
    """The NVIDIA adapters of the first backend that has any, in PCI bus order when every bus
    is known, else in enumeration order."""
    nvidia = [a for a in adapters if a.is_nvidia and a.adapter_type != "CPU"]
    for backend in (*_BACKEND_ORDER, *sorted({a.backend for a in nvidia})):
        group = [a for a in nvidia if a.backend == backend]
        if group:
            if all(a.pci_bus for a in group):
                group.sort(key=lambda a: a.pci_bus)
            return group
    return []


# ------------------------------------------------------------------ the choice


@dataclass(frozen=True)
class Choice:
    """The adapter chosen and the rule that chose it (for the log, stats and ``kjarni devices``)."""

    adapter: AdapterInfo
    reason: str


def _listing(adapters: Sequence[AdapterInfo]) -> str:
    return "; ".join(a.summary() + ("" if a.usable else " [not usable]") for a in adapters) or "none"


def env_adapter_index(environ: dict[str, str] | None = None) -> int | None:
    """``KJARNI_GPU_ADAPTER`` as an index, or None when unset."""
    environ = os.environ if environ is None else environ
    raw = environ.get(ADAPTER_ENV, "").strip()
    if not raw:
        return None
    if not raw.isdigit():
        raise InvalidConfigurationError(
            f"{ADAPTER_ENV}={raw!r} is not an adapter index; set it to a number from `kjarni devices` (0, 1, ...)"
        )
    return int(raw)


def choose_adapter(
    adapters: Sequence[AdapterInfo],
    *,
    index: int | None = None,
    name: str | None = None,
    backend: str | None = None,
    power_preference: str | None = None,
    assignment: Assignment | None = None,
    index_source: str = "adapter_index",
) -> Choice:
    """The adapter to open among ``adapters`` (see the module docstring for the rules).

    Raises `GpuUnavailableError` when none fits, naming the adapters there are.
    """
    if power_preference is not None and power_preference not in POWER_PREFERENCES:
        raise InvalidConfigurationError(
            f"power_preference={power_preference!r}; use 'high-performance' or 'low-power'"
        )
    if not adapters:
        raise GpuUnavailableError(
            "no WebGPU adapter found. Install a Vulkan/Metal/D3D12 driver (on Linux without a GPU: "
            "mesa-vulkan-drivers), or run on the CPU backend"
        )

    def passes(a: AdapterInfo) -> bool:
        return (backend is None or a.backend.lower() == backend.lower()) and (
            name is None or name.lower() in f"{a.name} {a.description}".lower()
        )

    if index is not None:
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise InvalidConfigurationError(f"{index_source}={index!r} must be an integer >= 0")
        found = [a for a in adapters if a.index == index]
        if not found:
            raise GpuUnavailableError(
                f"{index_source}={index}: there is no adapter {index}; found: {_listing(adapters)} "
                f"(`kjarni devices` lists them)"
            )
        if not passes(found[0]):
            raise GpuUnavailableError(
                f"{index_source}={index} is {found[0].summary()}, which does not match "
                f"{'backend ' + repr(backend) if backend else ''}{' and ' if backend and name else ''}"
                f"{'name ' + repr(name) if name else ''}; drop one of them"
            )
        return Choice(found[0], f"{index_source}={index}")

    if assignment is not None:
        chosen = _assigned(adapters, assignment)
        if chosen is not None:
            return chosen

    candidates = [a for a in adapters if passes(a)]
    if not candidates:
        wanted = " and ".join(part for part in (backend and f"backend {backend!r}", name and f"name containing {name!r}") if part)
        raise GpuUnavailableError(
            f"no WebGPU adapter with {wanted}; found: {_listing(adapters)}. "
            "Install a Vulkan/Metal/D3D12 driver (on Linux without a GPU: mesa-vulkan-drivers), "
            "or run on the CPU backend"
        )
    ranks = _TYPE_RANK[power_preference or "high-performance"]

    def rank(a: AdapterInfo) -> tuple[int, int, int, int]:
        return (int(not a.usable), ranks.get(a.adapter_type, 3), int(a.backend.startswith("OpenGL")), a.index)

    best = min(candidates, key=rank)
    rule = ", ".join(
        part for part in (
            f"name containing {name!r}" if name else "",
            f"backend {backend}" if backend else "",
            power_preference or "",
        ) if part
    )
    return Choice(best, f"the best adapter{' with ' + rule if rule else ''} (discrete or integrated GPU before software)")


def _assigned(adapters: Sequence[AdapterInfo], assignment: Assignment) -> Choice | None:
    where = f"{assignment.source}={assignment.value}"
    if assignment.uuid is not None:
        for a in adapters:
            if a.uuid is not None and a.uuid.lower() == assignment.uuid:
                return Choice(a, f"{where}: the adapter with that device UUID")
        if any(a.uuid for a in adapters):
            raise GpuUnavailableError(
                f"{where}: no adapter has that device UUID; found: {_listing(adapters)}. "
                f"Set {ADAPTER_ENV} to the index to use"
            )
        log.warning(
            "%s is a UUID, which this runtime cannot match (only Dawn reports adapter UUIDs); "
            "set %s to an index from `kjarni devices`. Choosing as if it were unset.", where, ADAPTER_ENV,
        )
        return None
    group = _nvidia_in_cuda_order(adapters)
    if not group:
        log.info("%s names a CUDA GPU but no NVIDIA adapter exists here; choosing as if it were unset", where)
        return None
    assert assignment.ordinal is not None
    if assignment.ordinal >= len(group):
        raise GpuUnavailableError(
            f"{where} assigns CUDA GPU {assignment.ordinal}, but only {len(group)} NVIDIA "
            f"{group[0].backend} adapter{'s' if len(group) > 1 else ''} exist: {_listing(group)}. "
            f"Set {ADAPTER_ENV} to the index to use (see `kjarni devices`)"
        )
    chosen = group[assignment.ordinal]
    order = "PCI bus order" if all(a.pci_bus for a in group) else "enumeration order"
    return Choice(chosen, f"{where}: NVIDIA {chosen.backend} adapter {assignment.ordinal} in {order}")


def check_device(device: Any, runtime: Any) -> None:
    """Raise `UnsuitableDeviceError` naming each limit of ``device`` below kjarni's needs."""
    limits = {k: int(v) for k, v in device.limits.items() if isinstance(v, int)}
    missing = missing_requirements(limits)
    if missing:
        raise UnsuitableDeviceError(
            f"this {runtime.name} device lacks what kjarni needs: {'; '.join(missing)}. Request the "
            "device with adapter.request_device_sync(**kjarni.gpu.device_request(adapter)) "
            "(add your own features and limits to those)",
            missing_limits=missing,
        )


def select(
    runtime: Any,
    *,
    name: str | None = None,
    backend: str | None = None,
    index: int | None = None,
    power_preference: str | None = None,
) -> Choice:
    """Choose an adapter of ``runtime`` by the rules above, reading ``KJARNI_GPU_ADAPTER``,
    ``WGPU_BACKEND_TYPE`` and the scheduler's assignment from the environment; logs the choice."""
    index_source = "adapter_index"
    if index is None:
        index = env_adapter_index()
        index_source = ADAPTER_ENV
    backend = backend or os.environ.get("WGPU_BACKEND_TYPE", "").strip() or None
    adapters = list_adapters(runtime)
    if not adapters:
        raise GpuUnavailableError(
            f"{runtime.description} found no WebGPU adapter. Install a Vulkan/Metal/D3D12 driver (on Linux "
            "without a GPU: mesa-vulkan-drivers)"
            + (", or use runtime='wgpu' (Dawn needs a full Vulkan 1.1 driver; lavapipe of Mesa 22 is not one)" if runtime.name == "dawn" else "")
            + ", or run on the CPU backend"
        )
    choice = choose_adapter(
        adapters, index=index, name=name, backend=backend, power_preference=power_preference,
        assignment=assigned_gpu() if index is None else None, index_source=index_source,
    )
    log.info("kjarni: %s runs on adapter %s, chosen by %s", runtime.description, choice.adapter.summary(), choice.reason)
    return choice
