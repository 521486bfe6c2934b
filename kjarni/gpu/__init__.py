"""The WebGPU backend: `WgpuContext` (device, buffers, pipelines) and `WgpuOps` (the Ops contract).

`kjarni.gpu.adapters` chooses the adapter (`list_adapters`, `device_request` for an application
that shares its device); `kjarni.gpu.runtime` maps wgpu-py and wgpudawn; `GpuTuning` holds the
kernel choices a benchmark may override (``WgpuOps(tuning=...)``).
"""

from kjarni.gpu.adapters import device_request
from kjarni.gpu.context import WgpuContext, find_adapter
from kjarni.gpu.ops import GpuTensor, GpuWeight, WgpuKVCache, WgpuOps
from kjarni.gpu.tuning import GpuTuning

__all__ = ["GpuTensor", "GpuTuning", "GpuWeight", "WgpuContext", "WgpuKVCache", "WgpuOps", "device_request", "find_adapter"]
