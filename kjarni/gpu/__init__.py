"""The WebGPU backend: `WgpuContext` (device, buffers, pipelines) and `WgpuOps` (the Ops contract)."""

from kjarni.gpu.context import WgpuContext, find_adapter
from kjarni.gpu.ops import GpuTensor, GpuWeight, WgpuKVCache, WgpuOps

__all__ = ["GpuTensor", "GpuWeight", "WgpuContext", "WgpuKVCache", "WgpuOps", "find_adapter"]
