"""The WebGPU backend: `WgpuContext` (device, buffers, pipelines) and `WgpuOps` (the Ops contract).

`kjarni.gpu.adapters` chooses the adapter (`list_adapters`, `device_request` for an application
that shares its device); `kjarni.gpu.runtime` maps wgpu-py and wgpudawn.
"""

from kjarni.gpu.adapters import device_request
from kjarni.gpu.context import WgpuContext, find_adapter
from kjarni.gpu.ops import GpuTensor, GpuWeight, WgpuKVCache, WgpuOps

__all__ = ["GpuTensor", "GpuWeight", "WgpuContext", "WgpuKVCache", "WgpuOps", "device_request", "find_adapter"]
