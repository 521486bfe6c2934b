"""WgpuContext: one WebGPU device and everything made on it once.

It holds the adapter and device (its own, or an application's: see `WgpuContext`), buffers (weights, the KV cache, a pool of activation buffers),
pipelines (created once per kernel, variant and constants), bind groups (created once per set of
buffers), the per-step data (one small uniform and the token ids, written once per forward) and a
persistent MAP_READ staging buffer. Work is recorded lazily into one command encoder and one
compute pass; `read` ends them, submits once and reads back only the bytes asked for. Several
models (each a `WgpuOps`) may share one context. It runs on wgpu-py or wgpudawn
(`kjarni.gpu.runtime`); the adapter is chosen by `kjarni.gpu.adapters`.

Over 500 lines because it is one class that owns the device's lifetime: buffer pool, pipeline
and bind-group caches, recording and readback all touch the same encoder and submit state, so
they stay together (the jobs above it are split out: runtime, adapters, the ops modules).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import wgpu

from kjarni.errors import GenerationFailedError, GpuUnavailableError, InvalidConfigurationError
from kjarni.gpu import adapters as _adapters
from kjarni.gpu import kernels
from kjarni.gpu.runtime import Runtime, load_runtime, requested_runtime, runtime_of

# Flags and enum values are WebGPU's numbers and strings, the same in wgpu-py and wgpudawn.
BU = wgpu.BufferUsage
STORAGE = BU.STORAGE | BU.COPY_DST | BU.COPY_SRC
UNIFORM = BU.UNIFORM | BU.COPY_DST


def _describe(adapter: Any) -> str:
    info = adapter.info
    return f"{info.get('device') or info.get('description')} ({info.get('backend_type')}, {info.get('adapter_type')})"


def find_adapter(
    name: str | None = None,
    backend: str | None = None,
    *,
    index: int | None = None,
    power_preference: str | None = None,
    runtime: str | None = None,
) -> Any:
    """The adapter `WgpuContext` would open (the runtime's GPUAdapter), by the rules of
    `kjarni.gpu.adapters`: ``index`` (or ``KJARNI_GPU_ADAPTER``), the scheduler's GPU, else the
    best one matching ``backend`` (default ``WGPU_BACKEND_TYPE``: ``Vulkan``, ``Metal``,
    ``D3D12``, ``OpenGL``) and ``name`` (a case-insensitive substring of its description).
    """
    choice = _adapters.select(
        load_runtime(runtime), name=name, backend=backend, index=index, power_preference=power_preference
    )
    return choice.adapter.handle


@dataclass
class Stats:
    """Counters a test or benchmark can read; ``last_dispatches`` is the last submit's dispatch count."""

    dispatches: int = 0
    submits: int = 0
    last_dispatches: int = 0
    pending_dispatches: int = 0
    bind_groups: int = 0
    pipelines: int = 0
    pooled_buffers: int = 0
    pooled_bytes: int = 0
    weight_bytes: int = 0
    freed_bytes: int = 0  # buffers destroyed by release and collect
    kernel_times: list[tuple[str, float]] = field(default_factory=list)
    runtime: str = ""  # "wgpu-py 0.32.0 (wgpu-native)" or "wgpudawn 0.32.0.4 (Dawn)"
    adapter: str = ""  # "NVIDIA H200 (Vulkan, DiscreteGPU)"


class Scratch:
    """A pooled activation buffer; returned to the pool when the last handle using it goes away.

    ``__del__`` (CPython frees on the last reference) rather than ``weakref.finalize``, which
    costs several microseconds per activation on the decode hot path.
    """

    __slots__ = ("buffer", "size", "_free", "__weakref__")

    def __init__(self, buffer: Any, size: int, free: list | None = None) -> None:
        self.buffer = buffer
        self.size = size
        self._free = free

    def __del__(self) -> None:
        free = self._free
        if free is not None:
            free.append(self.buffer)


class WgpuContext:
    """A WebGPU device plus the buffers, pipelines and bind groups made on it, each once.

    Which device:

    - ``device`` (and optionally its ``adapter``): an application's own GPUDevice, from wgpu-py
      or wgpudawn. kjarni checks its limits up front (`UnsuitableDeviceError` names what is
      missing; `kjarni.gpu.device_request` says what to ask for), uses only what it creates on
      it, and never destroys or reconfigures it: `close` frees kjarni's buffers only.
    - ``adapter``: an application's GPUAdapter; kjarni requests its own device on it.
    - otherwise kjarni chooses an adapter of ``runtime`` (see `kjarni.gpu.adapters`):
      ``adapter_index`` (else ``KJARNI_GPU_ADAPTER``), the GPU a scheduler assigned
      (``CUDA_VISIBLE_DEVICES``, Ray), else the best one matching ``adapter_name`` (a substring
      of its description), ``backend`` (default ``WGPU_BACKEND_TYPE``) and ``power_preference``
      (``"high-performance"``, the default, or ``"low-power"``).

    ``runtime``: ``"wgpu"`` (wgpu-py, the default) or ``"dawn"`` (wgpudawn), default
    ``KJARNI_WEBGPU_RUNTIME``; see `kjarni.gpu.runtime`. ``dawn_device_toggles``: Dawn device
    toggles (e.g. `kjarni.gpu.runtime.DAWN_FAST_DEVICE_TOGGLES`).
    ``max_binding_size`` lowers the storage binding limit (tests use it to exercise the split of
    large weights across bindings).
    ``submit_every``: submit after this many recorded dispatches so the GPU starts on the first
    layers while Python records the rest (default None: one submit per read, i.e. per step).
    ``raw_recording``: record dispatches through wgpu-native directly (False: the public API;
    always the public API on Dawn).
    ``memory_budget``: bytes of GPU memory kjarni may use (default ``KJARNI_GPU_MEMORY_MB``, else
    unknown); a model whose estimate is larger is refused before anything is uploaded.
    Raises `GpuUnavailableError` when no adapter or device can be had.
    """

    def __init__(
        self,
        adapter_name: str | None = None,
        *,
        backend: str | None = None,
        max_binding_size: int | None = None,
        use_subgroups: bool = True,
        submit_every: int | None = None,
        raw_recording: bool = True,
        memory_budget: int | None = None,
        device: Any = None,
        adapter: Any = None,
        adapter_index: int | None = None,
        power_preference: str | None = None,
        runtime: str | None = None,
        dawn_device_toggles: Sequence[str] = (),
    ) -> None:
        from kjarni.gpu.memory import budget_from_env, checked_budget

        # WebGPU does not report an adapter's memory: the budget is the caller's (or
        # KJARNI_GPU_MEMORY_MB); models estimated above it are refused before upload.
        self.memory_budget = checked_budget(memory_budget) if memory_budget is not None else budget_from_env()
        given = device if device is not None else adapter
        if given is not None:
            if adapter_index is not None or adapter_name is not None or power_preference is not None:
                raise InvalidConfigurationError(
                    "an application's device or adapter was given together with adapter_index, adapter_name "
                    "or power_preference; pass one or the other"
                )
            self.runtime: Runtime = runtime_of(given)
            if runtime is not None and requested_runtime(runtime) != self.runtime.name:
                raise InvalidConfigurationError(
                    f"runtime={runtime!r}, but the device/adapter given is {self.runtime.description}'s; drop runtime"
                )
            if adapter is None:
                adapter = getattr(device, "adapter", None)
            self.adapter = adapter
            self.adapter_choice = "given by the application"
        else:
            self.runtime = load_runtime(runtime)
            choice = _adapters.select(
                self.runtime, name=adapter_name, backend=backend, index=adapter_index, power_preference=power_preference
            )
            if choice.adapter.problems:
                raise GpuUnavailableError(
                    f"adapter {choice.adapter.summary()} (chosen by {choice.reason}) cannot run kjarni: "
                    f"{'; '.join(choice.adapter.problems)}"
                )
            self.adapter = choice.adapter.handle
            self.adapter_choice = choice.reason
        self.info = dict(self.adapter.info) if self.adapter is not None else {}
        self.description = _describe(self.adapter) if self.adapter is not None else "an application's device"
        self.owns_device = device is None
        if device is None:
            limits = self.adapter.limits
            offered = self.runtime.features_of(self.adapter)
            features = [f for f in _adapters.WANTED_FEATURES if f in offered]
            required = _adapters._limits_to_request(limits)
            try:
                device = self.runtime.request_device(self.adapter, features, required, dawn_device_toggles)
            except InvalidConfigurationError:
                raise
            except Exception as exc:
                raise GpuUnavailableError(f"could not open a device on {self.description}: {exc}") from exc
        else:
            if dawn_device_toggles:
                raise InvalidConfigurationError("dawn_device_toggles apply to a device kjarni creates, not an application's")
            _adapters.check_device(device, self.runtime)
        self.device = device
        limits = device.limits  # what the device has, which for an application's may be below the adapter's
        self.queue = self.device.queue
        self.features = self.runtime.features_of(device) & frozenset(_adapters.WANTED_FEATURES)
        self.missing_features = frozenset(_adapters.WANTED_FEATURES) - self.features
        self.has_f16 = "shader-f16" in self.features
        self.has_subgroups = use_subgroups and "subgroup" in self.features
        self.has_timestamps = "timestamp-query" in self.features
        # Tensor cores (Dawn): (matrix size, subgroup size) of a square f16 subgroup-matrix
        # configuration, 16 or 8 (Mesa's lavapipe offers 8 x 8 x 8 only; attention_tc runs on
        # either), None without one (always on wgpu-native); the prefill matmuls need 16 x 16 and
        # read its subgroup size from f16_matrix_subgroup.
        self.f16_matrix = (
            self.runtime.f16_matrix_config(self.adapter)
            if "subgroup-matrix" in self.features and self.has_f16 and self.has_subgroups and self.adapter is not None
            else None
        )
        self.f16_matrix_subgroup = self.f16_matrix[1] if self.f16_matrix is not None and self.f16_matrix[0] == 16 else None
        self.max_buffer_size = int(limits["max-buffer-size"])
        self.max_binding_size = int(limits["max-storage-buffer-binding-size"])
        if max_binding_size is not None:
            self.max_binding_size = min(self.max_binding_size, int(max_binding_size))
        self.storage_alignment = int(limits["min-storage-buffer-offset-alignment"])
        self.max_workgroup_storage = int(limits["max-compute-workgroup-storage-size"])
        self.submit_every = submit_every
        self.stats = Stats(runtime=self.runtime.description, adapter=self.description)
        self._layouts: dict[tuple[str, ...], tuple[Any, Any]] = {}
        self._pipelines: dict[tuple, Any] = {}
        self._bind_groups: dict[tuple, Any] = {}
        self._retired: list[Any] = []  # buffers of KV caches gone, for `collect`
        self._uniforms: dict[bytes, Any] = {}
        self._pool: dict[int, list[Any]] = {}
        self._encoder: Any = None
        self._pass: Any = None
        self._pass_handle: Any = None
        self._pipeline_in_pass: Any = None
        self._raw = self.runtime.raw_recording if raw_recording else None
        self._spare_staging: list[Any] = []  # staging buffers of `read` / `read_later`, free again
        self._step_values: dict[str, bytes] = {}
        self._step_used: set[str] = set()
        self._step_buffers: dict[str, Any] = {}
        self._created: list[Any] = []  # every buffer this context made for itself (freed by close)
        self.closed = False
        # The stand-in for unused bindings: at least one 16x16 f32 subgroup matrix, which Dawn checks
        # statically where matmul_tc.tmpl.wgsl may load the residual as one.
        self.dummy = self._own(self.device.create_buffer(size=1024, usage=STORAGE, label="dummy"))
        self._profile: list[tuple[str, int]] | None = None
        self._query_set: Any = None
        # Step capture (kjarni/gpu/capture.py): the recording in progress, the pool's buffers (a
        # tape may bind only those it pinned), and a count bumped when buffers are destroyed.
        self._capture: Any = None
        self._scratch_ids: set[int] = set()
        self.epoch = 0

    def _own(self, buffer: Any) -> Any:
        self._created.append(buffer)
        return buffer

    def release(self, buffers: Sequence[Any]) -> int:
        """Destroy ``buffers`` (a model's weights and KV cache) and forget the bind groups using
        them; returns the bytes freed. Recorded work is submitted first."""
        if not any(b is not None for b in buffers):
            return 0
        self.epoch += 1  # every step tape may bind them: none replays again
        return self._destroy(buffers)

    def retire(self, buffers: Sequence[Any]) -> None:
        """Buffers whose owner is gone (a KV cache garbage-collected: `WgpuKVCache`'s finalizer),
        freed by the next `collect`. Only noted here: a finalizer may run in the middle of
        recording a step."""
        self._retired.extend(buffers)

    def collect(self) -> int:
        """Destroy the retired buffers and forget the bind groups holding them (which would keep
        them alive: a KV cache per generation otherwise stays on the device for good); returns
        the bytes freed. No step tape replays them: tapes live on the KV cache that owned them."""
        if not self._retired or self.closed:  # (closing destroyed them)
            return 0
        retired, self._retired = self._retired, []
        return self._destroy(retired)

    def _destroy(self, buffers: Sequence[Any]) -> int:
        doomed = {id(b) for b in buffers if b is not None}
        self.flush()
        for key in [k for k in self._bind_groups if any(id(b) in doomed for b in k[1:])]:
            del self._bind_groups[key]
        freed = 0
        for buffer in {id(b): b for b in buffers if b is not None}.values():
            freed += int(buffer.size)
            buffer.destroy()
        self.stats.freed_bytes += freed
        return freed

    def close(self) -> None:
        """Free what this context created: pooled, staging, uniform and per-step buffers, and the
        device too when kjarni created it. An application's device is left as it was (kjarni
        neither destroys nor reconfigures it). Idempotent; the context is unusable afterwards."""
        if self.closed:
            return
        self.closed = True
        self.epoch += 1
        self._end_pass()
        self._encoder = None
        owned = [*self._created, *self._uniforms.values(), *self._step_buffers.values(), *self._retired]
        owned += [b for free in self._pool.values() for b in free]
        self._retired = []
        owned += self._spare_staging
        self._spare_staging = []
        self._bind_groups.clear()
        self._pipelines.clear()
        self._uniforms.clear()
        self._step_buffers.clear()
        self._pool.clear()
        for buffer in {id(b): b for b in owned}.values():
            buffer.destroy()
        if self._query_set is not None:
            self._query_set.destroy()
            self._query_set = None
        if self.owns_device:
            self.device.destroy()

    # ------------------------------------------------------------------ buffers

    def upload(self, data: np.ndarray, label: str) -> Any:
        """A storage buffer holding ``data``'s bytes (padded to 4 bytes), counted as weights."""
        raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        size = max(16, -(-raw.nbytes // 16) * 16)
        if size > self.max_buffer_size:
            raise InvalidConfigurationError(
                f"{label}: {size} bytes exceed this GPU's largest buffer ({self.max_buffer_size} bytes)"
            )
        buffer = self.device.create_buffer(size=size, usage=STORAGE, label=label)
        if raw.nbytes:
            padded = raw if raw.nbytes % 4 == 0 else np.concatenate([raw, np.zeros(4 - raw.nbytes % 4, np.uint8)])
            self.queue.write_buffer(buffer, 0, padded)
        self.stats.weight_bytes += size
        return buffer

    def storage(self, size: int, label: str) -> Any:
        """A zeroed storage buffer that lives as long as its owner (the KV cache)."""
        return self.device.create_buffer(size=max(16, -(-size // 16) * 16), usage=STORAGE, label=label)

    def scratch(self, nbytes: int) -> Scratch:
        """An activation buffer from the pool (sizes are powers of two, reused step after step)."""
        size = max(256, 1 << (max(nbytes, 1) - 1).bit_length())
        if size > self.max_binding_size:
            size = -(-nbytes // 256) * 256
            if size > self.max_binding_size:
                raise InvalidConfigurationError(
                    f"an activation of {nbytes} bytes exceeds this GPU's storage binding limit of "
                    f"{self.max_binding_size} bytes; use fewer tokens per forward (or logits='last')"
                )
        free = self._pool.get(size)
        if free is None:
            free = self._pool[size] = []
        if free:
            buffer = free.pop()
        else:
            buffer = self._own(self.device.create_buffer(size=size, usage=STORAGE, label=f"scratch{size}"))
            self._scratch_ids.add(id(buffer))
            self.stats.pooled_buffers += 1
            self.stats.pooled_bytes += size
        scratch = Scratch(buffer, size, free)
        if self._capture is not None:
            self._capture.pins.append(scratch)  # the tape's own: not reused until the tape goes
        return scratch

    def uniform(self, data: bytes) -> Any:
        """A uniform buffer holding ``data``, created once per distinct content."""
        buffer = self._uniforms.get(data)
        if buffer is None:
            buffer = self.device.create_buffer(size=len(data), usage=UNIFORM, label="params")
            self.queue.write_buffer(buffer, 0, data)
            self._uniforms[data] = buffer
        return buffer

    def step_buffer(self, name: str, data: bytes, *, usage: int = UNIFORM, capacity: int = 256) -> Any:
        """The per-step buffer ``name`` holding ``data`` for the dispatches recorded from now on.

        Written with one ``queue.write_buffer`` when its content changes. If dispatches already
        recorded (not yet submitted) read the old content, they are submitted first, so every
        recorded dispatch sees the value it was recorded with.
        """
        buffer = self._step_buffers.get(name)
        if buffer is not None and buffer.size < len(data):
            self.flush()
            buffer = None
        if buffer is None:
            size = max(capacity, 1 << (len(data) - 1).bit_length())
            buffer = self.device.create_buffer(size=size, usage=usage | BU.COPY_DST, label=f"step:{name}")
            self._step_buffers[name] = buffer
            self._step_values.pop(name, None)
        if self._step_values.get(name) != data:
            if name in self._step_used:
                self.flush()
            self.queue.write_buffer(buffer, 0, data)
            self._step_values[name] = data
        self._step_used.add(name)
        if self._capture is not None:
            self._capture.step_value(name, data, buffer)
        return buffer

    # ------------------------------------------------------------------ pipelines

    def layout(self, kinds: tuple[str, ...]) -> tuple[Any, Any]:
        """(bind group layout, pipeline layout) for bindings 0.. of ``kinds``: uniform / read / rw."""
        cached = self._layouts.get(kinds)
        if cached is None:
            types = {
                "uniform": {"buffer": {"type": wgpu.BufferBindingType.uniform}},
                "read": {"buffer": {"type": wgpu.BufferBindingType.read_only_storage}},
                "rw": {"buffer": {"type": wgpu.BufferBindingType.storage}},
            }
            entries = [
                {"binding": i, "visibility": wgpu.ShaderStage.COMPUTE, **types[kind]} for i, kind in enumerate(kinds)
            ]
            bgl = self.device.create_bind_group_layout(entries=entries)
            cached = (bgl, self.device.create_pipeline_layout(bind_group_layouts=[bgl]))
            self._layouts[kinds] = cached
        return cached

    def pipeline(
        self,
        kernel: str,
        kinds: tuple[str, ...],
        *,
        entry: str = "main",
        flags: Sequence[str] = (),
        constants: dict[str, float] | None = None,
        source: str | Callable[[], str] | None = None,
        unchecked: bool = False,
    ) -> Any:
        """The compute pipeline of ``shaders/<kernel>.wgsl`` (or ``source``, text or a function
        making it, called only on a cache miss), created once per kernel, entry, flags and constants.

        ``unchecked``: compile without naga's runtime checks (index clamping, loop bounding), for
        kernels that guard every access themselves; falls back to the checked module where
        wgpu-native's trusted entry point is missing."""
        flag_set = frozenset(flags) | ({"subgroup"} if self.has_subgroups else frozenset())
        const_items = tuple(sorted((constants or {}).items()))
        key = (kernel, entry, flag_set, const_items, kinds, unchecked)
        pipeline = self._pipelines.get(key)
        if pipeline is not None:
            return pipeline
        if source is None:
            code = kernels.source(kernel, flag_set)
        else:
            code = source() if callable(source) else source
        code = self.runtime.prepare_shader(code, flag_set)
        variant = f"{kernel}.wgsl entry {entry!r}" + (f" ({', '.join(sorted(flag_set))})" if flag_set else "")
        try:
            module = self.runtime.unchecked_module(self.device, code, kernel) if unchecked else None
            if module is None:
                module = self.device.create_shader_module(code=code, label=kernel)
            pipeline = self.device.create_compute_pipeline(
                layout=self.layout(kinds)[1],
                compute={"module": module, "entry_point": entry, "constants": dict(const_items)},
                label=f"{kernel}:{entry}",
            )
        except Exception as exc:
            raise GenerationFailedError(f"GPU kernel {variant} failed to compile on {self.description}: {exc}") from exc
        self._pipelines[key] = pipeline
        self.stats.pipelines += 1
        pipeline.kjarni_kinds = kinds
        pipeline.kjarni_name = f"{kernel}:{entry}"
        return pipeline

    def bind_group(self, pipeline: Any, buffers: Sequence[Any]) -> Any:
        """A bind group of whole ``buffers`` (bindings 0..) for ``pipeline``, created once."""
        kinds = pipeline.kjarni_kinds
        key = (kinds, *buffers)
        group = self._bind_groups.get(key)
        if group is None:
            entries = [
                {"binding": i, "resource": {"buffer": b, "offset": 0, "size": b.size}} for i, b in enumerate(buffers)
            ]
            group = self.device.create_bind_group(layout=self.layout(kinds)[0], entries=entries)
            group.kjarni_buffers = tuple(buffers)  # what a step tape rebinds (kjarni/gpu/capture.py)
            self._bind_groups[key] = group
            self.stats.bind_groups += 1
        return group

    # ------------------------------------------------------------------ recording

    def dispatch(self, pipeline: Any, buffers: Sequence[Any], grid: tuple[int, int, int]) -> None:
        """Record one dispatch of ``pipeline`` over ``grid`` with ``buffers`` bound in order."""
        self.dispatch_group(pipeline, self.bind_group(pipeline, buffers), grid)

    def dispatch_group(self, pipeline: Any, group: Any, grid: tuple[int, int, int]) -> None:
        """Record one dispatch of ``pipeline`` with a bind group from `bind_group` (the hot path:
        callers that cache their bind group skip building the buffer key)."""
        if self._profile is not None:
            self._dispatch_profiled(pipeline, group, grid)
            return
        if self._capture is not None:
            self._capture.calls.append((pipeline, group, grid))
        if self._pass is None:
            self.open_pass()
        raw = self._raw
        if raw is not None:
            handle = self._pass_handle
            if self._pipeline_in_pass is not pipeline:
                raw[0](handle, pipeline._internal)
                self._pipeline_in_pass = pipeline
            raw[1](handle, 0, group._internal, 0, raw[3])
            raw[2](handle, grid[0], grid[1], grid[2])
        else:
            if self._pipeline_in_pass is not pipeline:
                self._pass.set_pipeline(pipeline)
                self._pipeline_in_pass = pipeline
            self._pass.set_bind_group(0, group)
            self._pass.dispatch_workgroups(*grid)
        stats = self.stats
        stats.dispatches += 1
        stats.pending_dispatches += 1
        if self.submit_every and stats.pending_dispatches >= self.submit_every:
            self.flush()

    def open_pass(self) -> None:
        """Begin the compute pass that dispatches are recorded into (and its encoder) if none is open."""
        if self._pass is None:
            if self._encoder is None:
                self._encoder = self.device.create_command_encoder()
            self._pass = self._encoder.begin_compute_pass()
            self._pass_handle = self._pass._internal if self._raw else None
            self._pipeline_in_pass = None

    def copy(self, src: Any, src_offset: int, dst: Any, dst_offset: int, size: int) -> None:
        """Record a buffer copy (ends the open compute pass)."""
        if self._capture is not None:
            self._capture.refuse("a buffer copy")
        self._end_pass()
        if self._encoder is None:
            self._encoder = self.device.create_command_encoder()
        self._encoder.copy_buffer_to_buffer(src, src_offset, dst, dst_offset, size)

    def _end_pass(self) -> None:
        if self._pass is not None:
            self._pass.end()
            self._pass = None
            self._pass_handle = None

    def flush(self) -> None:
        """Submit everything recorded so far (no readback)."""
        self._end_pass()
        if self._encoder is not None:
            self.queue.submit([self._encoder.finish()])
            self._encoder = None
            self.stats.submits += 1
            self.stats.last_dispatches = self.stats.pending_dispatches
            self.stats.pending_dispatches = 0
        self._step_used.clear()

    def read(self, buffer: Any, offset: int, nbytes: int) -> bytes:
        """Run the recorded work and return ``nbytes`` of ``buffer`` from ``offset`` (one submit)."""
        data = self._start_read(buffer, offset, nbytes)()
        if self._profile is not None:
            self._resolve_profile()
        return data

    def read_later(self, buffer: Any, offset: int, nbytes: int) -> Callable[[], bytes]:
        """`read` without the wait: copies ``nbytes`` of ``buffer`` from ``offset`` into a staging
        buffer of its own, submits everything recorded so far and starts mapping it; the returned
        function waits for the bytes (once; later calls return them again). Work submitted in
        between runs on meanwhile: the map completes with the submit that holds the copy, so the
        device need not go idle while the CPU waits (a greedy loop records its next burst there).
        While profiling, it reads at once (the timestamps are resolved with the read)."""
        if self._profile is not None:
            data = self.read(buffer, offset, nbytes)
            return lambda: data
        return self._start_read(buffer, offset, nbytes)

    def _start_read(self, buffer: Any, offset: int, nbytes: int) -> Callable[[], bytes]:
        """The copy into a staging buffer from the pool (or a new one), submitted and being
        mapped; the returned function waits for the bytes (`read_later`)."""
        size = -(-nbytes // 4) * 4
        staging = next((b for b in self._spare_staging if b.size >= size), None)
        if staging is None:
            for small in self._spare_staging:  # outgrown: the pool keeps only buffers as large as the largest read
                self._created.remove(small)
                small.destroy()
            self._spare_staging = []
            staging_size = max(4096, 1 << (size - 1).bit_length())
            staging = self.device.create_buffer(size=staging_size, usage=BU.MAP_READ | BU.COPY_DST, label="staging")
            self._created.append(staging)
        else:
            self._spare_staging.remove(staging)
        self.copy(buffer, offset, staging, 0, size)
        self.flush()
        promise = staging.map_async(wgpu.MapMode.READ, 0, size)
        result: list[bytes] = []

        def wait() -> bytes:
            if result:
                return result[0]
            result.append(b"")  # a failed wait is not waited for again
            if self.closed:
                raise GenerationFailedError("a GPU read outlived its context (closed before the read was waited for)")
            try:
                promise.sync_wait()
                result[0] = bytes(staging.read_mapped(0, size, copy=True))[:nbytes]
            finally:
                if staging.map_state == "mapped":
                    staging.unmap()
                if staging.map_state == "unmapped":  # not after a failed map: that buffer is not reused
                    self._spare_staging.append(staging)
            return result[0]

        return wait

    # ------------------------------------------------------------------ profiling

    def profile(self, enabled: bool) -> None:
        """Time every dispatch with timestamp queries (one pass per dispatch) until disabled.

        Times land in ``stats.kernel_times`` as ``(kernel:entry, seconds)`` at the next read.
        """
        if enabled and not self.has_timestamps:
            raise GpuUnavailableError(f"{self.description} has no timestamp-query feature")
        self.flush()
        self._profile = [] if enabled else None
        self.stats.kernel_times = []

    def _dispatch_profiled(self, pipeline: Any, group: Any, grid: tuple[int, int, int]) -> None:
        assert self._profile is not None
        count = 2 * (len(self._profile) + 1)
        if self._query_set is None or self._query_set.count < count:
            self.flush()
            if self._profile:
                raise GenerationFailedError("profile: too many dispatches between reads (limit 2048)")
            self._query_set = self.device.create_query_set(type=wgpu.QueryType.timestamp, count=4096)
        self._end_pass()
        if self._encoder is None:
            self._encoder = self.device.create_command_encoder()
        i = len(self._profile)
        compute_pass = self._encoder.begin_compute_pass(
            timestamp_writes={
                "query_set": self._query_set,
                "beginning_of_pass_write_index": 2 * i,
                "end_of_pass_write_index": 2 * i + 1,
            }
        )
        compute_pass.set_pipeline(pipeline)
        compute_pass.set_bind_group(0, group)
        compute_pass.dispatch_workgroups(*grid)
        compute_pass.end()
        self._profile.append((pipeline.kjarni_name, i))
        self.stats.dispatches += 1
        self.stats.pending_dispatches += 1

    def _resolve_profile(self) -> None:
        assert self._profile is not None
        if not self._profile:
            return
        n = 2 * len(self._profile)
        resolve = self.device.create_buffer(size=8 * n, usage=BU.QUERY_RESOLVE | BU.COPY_SRC)
        encoder = self.device.create_command_encoder()
        encoder.resolve_query_set(self._query_set, 0, n, resolve, 0)
        self.queue.submit([encoder.finish()])
        ticks = np.frombuffer(self.queue.read_buffer(resolve), dtype=np.uint64).astype(np.float64)
        period = 1e-9  # WebGPU timestamps are nanoseconds
        self.stats.kernel_times.extend(
            (name, (ticks[2 * i + 1] - ticks[2 * i]) * period) for name, i in self._profile
        )
        self._profile = []
