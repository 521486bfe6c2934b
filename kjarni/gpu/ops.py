"""WgpuOps: the `Ops` contract (kjarni/backend.py) on a WebGPU device, matching NumpyOps.

Every op records dispatches into the context's one command encoder; ``read``, ``argmax`` and
``top_k`` submit it once and read back only what they return, so a decode step (all layers,
final norm, LM head, argmax) is one submit. Activations are `GpuTensor` handles on pooled buffers
that go back to the pool when the handle dies, so a steady decode loop allocates nothing; uniforms
and bind groups are created once per shape and reused.
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass, field
from typing import Any, ClassVar, Sequence

import numpy as np

from kjarni.errors import ContextOverflowError, InvalidConfigurationError, InvalidModelError
from kjarni.gpu import kernels
from kjarni.gpu import sampling as gpu_sampling
from kjarni.gpu.context import Scratch, Stats, WgpuContext
from kjarni.gpu.params import (
    ATTENTION,
    ATTENTION_STEP,
    ELEMENTWISE,
    LAYER_NORM,
    LINEAR,
    LINEAR_BIAS,
    LINEAR_NORM,
    LINEAR_RESIDUAL,
    LINEAR_SILU,
    RMS_NORM,
    ROPE_STORE,
    SELECT,
    SILU_MUL,
    STEP,
)
from kjarni.backend import DeviceTokens, WeightSource
from kjarni.weights import QuantTensor

LINEAR_KINDS = ("uniform", "read", "read", "read", "read", "read", "read", "rw")
EMBED_KINDS = ("uniform", "read", "read", "read", "rw")
ROPE_KINDS = ("uniform", "uniform", "read", "read", "rw", "rw", "rw")
ATTENTION_KINDS = ("uniform", "uniform", "read", "read", "read", "rw")
COMBINE_KINDS = ("uniform", "uniform", "read", "rw")
SELECT_KINDS = ("uniform", "read", "rw", "rw")
RMS_KINDS = ("uniform", "read", "read", "rw")
LAYER_NORM_KINDS = ("uniform", "read", "read", "read", "rw")
SILU_KINDS = ("uniform", "read", "rw")
ADD_KINDS = ("uniform", "read", "read", "rw")

DECODE_CHUNK = 64  # keys per split of attention_decode (its workgroup size)
SINGLE_MAX_KEYS = 2048  # attention_single.wgsl's MAX_KEYS: keys it holds in workgroup memory
SINGLE_WG = 512  # threads of attention_single
STEP_MAX_KEYS = 1024  # attention_step.wgsl's MAX_KEYS
MAX_TOP_K = 256  # larger k reads the row back and selects on the CPU
TOKEN_RING_BYTES = 65536  # argmax_ahead's readback ring: 8192 (id, status) pairs, read before that many more are chosen


def _fold(workgroups: int) -> tuple[int, int, int]:
    """A 1-D workgroup count as an (x, y) grid within the 65535-per-dimension limit."""
    x = min(max(workgroups, 1), 32768)
    return x, -(-workgroups // x), 1


class GpuTensor:
    """An activation ``[tokens, features]`` of float32 in a pooled GPU buffer."""

    __slots__ = ("scratch", "buffer", "shape")

    def __init__(self, scratch: Scratch, shape: tuple[int, int]) -> None:
        self.scratch = scratch  # holds the buffer out of the pool while this handle lives
        self.buffer = scratch.buffer
        self.shape = shape

    def __repr__(self) -> str:
        return f"GpuTensor{self.shape}"


class _SiluMulPending(GpuTensor):
    """``silu_mul(source)`` not computed yet: the next `linear` reads ``[gate | up]`` and applies
    it while loading x (``LINEAR_SILU``), saving a dispatch per layer. Anything else that needs the
    values (``buffer``, ``scratch``) runs the silu_mul kernel first, at that point of the recording."""

    __slots__ = ("source", "_ops", "_done")

    def __init__(self, ops: "WgpuOps", source: GpuTensor) -> None:  # noqa: UP037 (defined below)
        self.source = source
        self._ops = ops
        self._done: GpuTensor | None = None
        self.shape = (source.shape[0], source.shape[1] // 2)

    def _materialize(self) -> GpuTensor:
        if self._done is None:
            self._done = self._ops._silu_mul_now(self.source)
        return self._done

    @property  # type: ignore[override]
    def buffer(self) -> Any:
        return self._materialize().buffer

    @property  # type: ignore[override]
    def scratch(self) -> Scratch:
        return self._materialize().scratch

    def __repr__(self) -> str:
        return f"GpuTensor{self.shape} (silu_mul pending)"


class _RopePending(GpuTensor):
    """``rope_store(qkv, ...)`` of one token not recorded yet: the next `attention` on it runs
    attention_step.wgsl, which rotates q and k, stores k and v and attends in one dispatch. Anything
    else that reads q (``buffer``, ``scratch``) records rope_store at that point (storing the same
    k and v again is harmless), and a handle dropped with nothing stored records it then, so the
    cache always receives the token's keys and values."""

    __slots__ = ("qkv", "rope", "kv_cache", "layer", "start", "stored", "_ops", "_done")

    def __init__(self, ops: "WgpuOps", qkv: GpuTensor, rope, kv_cache, layer: int, start: int, width: int) -> None:  # noqa: UP037
        self.qkv, self.rope, self.kv_cache, self.layer, self.start = qkv, rope, kv_cache, layer, start
        self.stored = False  # attention_step has written k and v
        self._ops = ops
        self._done: GpuTensor | None = None
        self.shape = (1, width)

    def _materialize(self) -> GpuTensor:
        if self._done is None:
            self._done = self._ops._rope_store_now(self.qkv, self.rope, self.kv_cache, self.layer, self.start)
            self.stored = True
        return self._done

    def __del__(self) -> None:
        if not self.stored:
            self._materialize()

    @property  # type: ignore[override]
    def buffer(self) -> Any:
        return self._materialize().buffer

    @property  # type: ignore[override]
    def scratch(self) -> Scratch:
        return self._materialize().scratch

    def __repr__(self) -> str:
        return f"GpuTensor{self.shape} (rope_store pending)"


class _AttentionPartials(GpuTensor):
    """The output of a split attention_step not merged yet: ``partials`` holds, per head, ``splits``
    runs of ``hd4`` vec4 outputs then (m, l). The next one-token `linear` merges them while loading
    x (matvec.tmpl.wgsl, flag ``attn``), saving a dispatch; anything else that reads the values
    (``buffer``, ``scratch``) runs attention_combine first, at that point of the recording."""

    __slots__ = ("partials", "splits", "hd4", "_ops", "_done")

    def __init__(self, ops: "WgpuOps", partials: Scratch, width: int, splits: int, hd4: int) -> None:  # noqa: UP037
        self.partials, self.splits, self.hd4 = partials, splits, hd4
        self._ops = ops
        self._done: GpuTensor | None = None
        self.shape = (1, width)

    def _materialize(self) -> GpuTensor:
        if self._done is None:
            self._done = self._ops._merge_attention(self)
        return self._done

    @property  # type: ignore[override]
    def buffer(self) -> Any:
        return self._materialize().buffer

    @property  # type: ignore[override]
    def scratch(self) -> Scratch:
        return self._materialize().scratch

    def __repr__(self) -> str:
        return f"GpuTensor{self.shape} (attention merge pending)"


class GpuTokens(DeviceTokens):
    """Ids chosen by `WgpuOps.argmax_ahead` or `sample_ahead`: ``buffer`` holds them for the next
    embed, then a status per id; a copy of both waits at ``ring_offset`` of the readback ring for
    `WgpuOps.read_tokens`."""

    __slots__ = ("scratch", "buffer", "ring_offset")

    def __init__(self, scratch: Scratch, count: int, ring_offset: int) -> None:
        super().__init__(count)
        self.scratch = scratch
        self.buffer = scratch.buffer
        self.ring_offset = ring_offset


@dataclass(eq=False)
class _Segment:
    """Rows ``row_offset .. row_offset + rows`` of a matrix in one format, within one binding."""

    format: str  # "f32", "f16" or a GGUF type name ("Q8_0", ...)
    row_offset: int
    rows: int
    w_a: Any
    w_b: Any
    linear_kernel: str
    dense: bool  # f32/f16: the linear_body kernels; else quant.py's `main`


@dataclass(eq=False)
class GpuWeight:
    """A weight uploaded once: a vector (``buffer``), an f32 table (``buffer``) or a matrix (``segments``)."""

    name: str
    kind: str  # "vector", "table" or "matrix"
    shape: tuple[int, ...]
    nbytes: int
    buffer: Any = None
    segments: list[_Segment] = field(default_factory=list)
    plans: dict = field(default_factory=dict, repr=False)  # WgpuOps._linear: dispatch plans per use

    @property
    def formats(self) -> list[str]:
        return sorted({s.format for s in self.segments})


class WgpuKVCache:
    """Keys and values per layer, ``[kv_heads, capacity, head_dim]`` each (f32 or f16), allocated once."""

    def __init__(self, context: WgpuContext, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int, kv_format: str) -> None:
        if head_dim % 4 or head_dim > 256:
            raise InvalidModelError(f"the GPU backend needs head_dim a multiple of 4 and at most 256, got {head_dim}")
        element = 2 if kv_format == "f16" else 4
        layer_bytes = num_kv_heads * capacity * head_dim * element
        if layer_bytes > context.max_binding_size:
            raise InvalidConfigurationError(
                f"a KV cache of {capacity} positions needs {layer_bytes} bytes per layer, more than this GPU's "
                f"binding limit of {context.max_binding_size}; ask for a smaller capacity"
            )
        self.keys = [context.storage(layer_bytes, f"k{i}") for i in range(num_layers)]
        self.values = [context.storage(layer_bytes, f"v{i}") for i in range(num_layers)]
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.capacity = capacity
        self.kv_format = kv_format
        self.offset = 0
        self._nbytes = 2 * num_layers * layer_bytes

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def trim(self, n: int) -> int:
        """Forget the last ``n`` positions; returns the new offset."""
        self.offset -= min(max(n, 0), self.offset)
        return self.offset


ATTENTION_TILED_BYTES = 30720  # attention_tiled.wgsl's workgroup memory: q, k, v 8 KiB each, p 4, maxima 2


def matmul_workgroup_bytes(tm: int, tn: int, bk: int, ksplit: int, nbuf: int = 1) -> int:
    """Workgroup memory of matmul.tmpl.wgsl's tiles: per thread group and buffer, x as BK x
    (2 TM + 1) and W as BK x 2 TN vec4s."""
    return nbuf * ksplit * bk * (2 * tm + 1 + 2 * tn) * 16


class WgpuOps:
    """The GPU backend.

    ``weight_format`` says how float weights (safetensors, GGUF F32/F16) are kept: ``"f16"``
    (default), ``"f32"`` (parity with numpy) or ``"q8_0"`` (quantized at load; matrices whose width
    is not a multiple of 32 stay f16). GGUF quantized blocks stay as stored wherever a kernel
    exists, and are converted to ``weight_format`` otherwise. ``kv_format``: ``"f16"`` or ``"f32"``
    (default: f32 with f32 weights, else f16)."""

    name = "gpu"
    matvec_max_tokens = 9  # up to this many tokens (decode, speculative verify of k <= 8) matrix-vector kernels run, else tiled matmul
    # Prefill matmul tiles (matmul.tmpl.wgsl; chosen from tools/sweep_matmul.py on the H200):
    # 128x128 (K split over 2 thread groups) from this many such tiles, else 64 tokens x 128 rows.
    matmul_min_big_tiles = 1024
    matmul_split_k_below = 512  # fewer 64x128 tiles than this: 4 thread groups split K in each
    # Prefill products split over K across workgroups too (grid z, summed by matmul_reduce): None
    # = automatic (products with fewer than matmul_split_tiles tiles get about that many
    # workgroups, at most matmul_max_splits per tile), or an int; never with a fused norm.
    matmul_splits: int | None = None
    matmul_split_tiles = 128
    matmul_max_splits = 6
    matmul_nbuf = 1  # 2: double-buffered tiles (one barrier a K step) where workgroup memory allows
    # Per (segment rows, cols): (TM, TN, BK, KSPLIT, NBUF, S) measured by tools/sweep_matmul.py,
    # overriding the rules above (S = 1 where a fused norm forbids the split). Defaults: the H200
    # sweeps' fastest on Qwen2.5-0.5B's and 1.5B's products at 512 tokens, f16 (docs/benchmarks.md,
    # fifth session; the 1.5B ones from the first sweep, before f16's loads were kept raw again),
    # used for every format and token count of those shapes.
    matmul_configs: ClassVar[dict[tuple[int, int], tuple[int, int, int, int, int, int]]] = {
        (1152, 896): (8, 16, 8, 4, 1, 1),  # 0.5B qkv (fused norm)
        (896, 896): (8, 16, 8, 4, 1, 2),  # 0.5B o_proj
        (9728, 896): (8, 16, 8, 1, 1, 1),  # 0.5B gate_up (fused norm)
        (896, 4864): (8, 16, 8, 4, 1, 2),  # 0.5B down_proj
        (2048, 1536): (8, 8, 8, 2, 2, 1),  # 1.5B qkv
        (1536, 1536): (8, 16, 8, 4, 1, 4),  # 1.5B o_proj
        (17920, 1536): (8, 16, 8, 1, 2, 1),  # 1.5B gate_up
        (1536, 8960): (8, 16, 8, 4, 1, 4),  # 1.5B down_proj
    }
    # Tensor cores (matmul_sgmat.tmpl.wgsl: f16 activations x f16 weights, f32 sums) for the
    # prefill of f16 segments where the device has an f16 subgroup-matrix configuration (Dawn):
    # per (segment rows, cols) a tile of kernels.SGMAT_TILES, else `sgmat_tile`'s choice. Off by
    # default: the one H200 measurement (docs/benchmarks.md, Dawn) found it no faster than the SIMT
    # kernels, and the written-out version since has not run on a GPU yet.
    tensor_cores = False
    sgmat_tiles: ClassVar[dict[tuple[int, int], tuple[int, int, int, int, int] | None]] = {}  # None: SIMT
    sgmat_split_counts: ClassVar[dict[tuple[int, int], int]] = {}  # per (rows, cols), over the rule below
    sgmat_splits: int | None = None  # K split over workgroups: None = automatic (below), or a count
    sgmat_split_below = 264  # fewer tiles than this (2 waves of the H200's 132 SMs): split K
    sgmat_max_splits = 4
    matvec_rows = 4  # rows per workgroup of the matvec kernels
    matvec_max_threads = 256  # threads per matvec workgroup: about one 8-column chunk each, 64 ..= this
    matvec_subgroup_max_chunks = 256  # rows up to 8 x this columns: one subgroup per rows (matvec_sg)
    matvec_subgroup_threads = 256  # workgroup size of matvec_sg (8 subgroups of 32)
    # f16/f32 decode shapes (rows of a segment, cols) -> (threads, rows, chunks per step) of
    # linear_body's matvec_u, from tools/sweep_matvec.py on the target GPU; other shapes keep
    # matvec_sg / matvec. Empty until measured: assign a new dict (per instance or subclass).
    matvec_configs: ClassVar[dict[tuple[int, int], tuple[int, int, int]]] = {}
    matvec_u_default = True  # rows of <= 2048 columns: matvec_u as the H200 sweep chose (else matvec_sg)
    # Several tokens (speculative verify), from these minimums to matvec_max_tokens: linear_body's
    # matvec_t (f16/f32) and the quantized main_t load each weight chunk once for up to 4 x
    # matvec_t_quads tokens. A minimum above matvec_max_tokens keeps the per-token kernels (compare).
    matvec_t_min_tokens = 2
    quant_t_min_tokens = 2
    matvec_t_quads = 3  # token quads (tiles of 4) per pass of matvec_t / main_t: 1, 2 or 3
    # f16/f32 shapes (rows of a segment, cols) -> (threads, rows) of matvec_t; other shapes: 128
    # threads on 4 rows (2 under 1024 rows), 32 threads from 65536 rows, 256 on 4 past 2048 columns.
    matvec_t_configs: ClassVar[dict[tuple[int, int], tuple[int, int]]] = {}
    quant_split_k_min_cols: int | None = None  # quantized decode rows this long: a workgroup per row (SPLIT_K)
    quant_split_k_threads = 256  # threads sharing a row with SPLIT_K
    # One-token products (decode): matvec.tmpl.wgsl; per (format, rows, cols) of a segment ->
    # (WG, LANES, R, UN) from tools/sweep_matvec.py, else `matvec_config`'s defaults.
    matvec_template = True
    matvec_template_configs: ClassVar[dict[tuple[str, int, int], tuple[int, int, int, int]]] = {}
    fuse_rope = True  # one-token rope_store is recorded by the next attention (attention_step.wgsl)
    attention_step_threads = 1024  # threads of attention_step (at most; hd / 4 times a power of two)
    # Flash-decoding inside attention_step: workgroups per head, each over a run of the keys, merged
    # by the o_proj matvec (1: one workgroup per head writes the output); needs subgroups.
    attention_step_splits = 8
    attention_split_threads = 128  # threads of a split attention_step (at most; hd / 4 times a power of two)
    # The merging matvec (o_proj after a split attention_step): WG threads, LANES lanes a row, one
    # row a group, 2 units a trip. Its workgroups each merge the whole x: fewer, larger ones read
    # the partials fewer times. H200 (0.5B o_proj, 256 / 32): 12.5 us against 7.4 unmerged.
    matvec_attn_threads = 256
    matvec_attn_lanes = 32
    fuse_silu = True  # silu_mul is applied inside the following linear (LINEAR_SILU)
    prefill_submit_every = 24  # prefill: submit after a linear once this many dispatches wait
    attention_prefill_lanes = 8  # threads sharing a query row in attention_prefill (at most the smallest subgroup size)
    attention_tiled = True  # prefill with head_dim 64: attention_tiled.wgsl (else attention_prefill)
    attention_tiled_chunk = 128  # keys per workgroup of attention_tiled past this many (a multiple of 32; 0: no split)
    attention_partial_max_bytes = 64 << 20  # attention_tiled's split partials: longer chunks beyond this
    attention_single_max = 768  # decode attends in one pass up to this many positions (H200: wins at 512, loses at 1000)
    decode_ahead = 8  # greedy decode: steps submitted per readback, each fed the previous step's id on the GPU
    finite_check = True  # argmax / top_k flag NaN and inf logits (False only to measure the check's cost)

    def __init__(self, context: WgpuContext | None = None, *, weight_format: str = "f16", kv_format: str | None = None) -> None:
        if weight_format not in ("f16", "f32", "q8_0"):
            raise InvalidConfigurationError(f"weight_format must be 'f16', 'f32' or 'q8_0', not {weight_format!r}")
        kv_format = kv_format or ("f32" if weight_format == "f32" else "f16")
        if kv_format not in ("f16", "f32"):
            raise InvalidConfigurationError(f"kv_format must be 'f16' or 'f32', not {kv_format!r}")
        self.context = context if context is not None else WgpuContext()
        self.weight_format = weight_format
        self.kv_format = kv_format
        self.weight_bytes = 0
        self._noticed: set[str] = set()
        self._plans: dict[tuple, Any] = {}  # small ops: (pipelines, uniforms, grids) per shape
        self._step_start = -1
        self._step_bytes = b""
        self._token_ring: Any = None
        self._ring_cursor = 0
        self._weights: list[GpuWeight] = []  # what `close` frees: this model's buffers only
        self._kv_caches: weakref.WeakSet[WgpuKVCache] = weakref.WeakSet()

    @property
    def stats(self) -> Stats:
        """Dispatch, submit, pipeline and buffer counters of the context (``last_dispatches``: last submit)."""
        return self.context.stats

    # ------------------------------------------------------------------ weights

    def weight(self, parts: WeightSource | Sequence[WeightSource], *, name: str) -> GpuWeight:
        ctx = self.context
        if isinstance(parts, (np.ndarray, QuantTensor)):
            parts = [parts]
        parts = list(parts)
        if all(isinstance(p, np.ndarray) and p.ndim == 1 for p in parts):
            vector = np.concatenate([np.asarray(p, dtype=np.float32) for p in parts])
            return self._register(GpuWeight(name, "vector", vector.shape, vector.nbytes, buffer=ctx.upload(vector, name)))
        if name == "rope" or name.startswith("rope.") or name.endswith(".rope"):
            table = np.ascontiguousarray(np.concatenate([np.asarray(p, np.float32) for p in parts]))
            return self._register(GpuWeight(name, "table", table.shape, table.nbytes, buffer=ctx.upload(table, name)))
        segments: list[_Segment] = []
        row = 0
        cols = None
        # Consecutive parts of one format are stacked and uploaded together; a format change
        # (e.g. Q4_K q/k with a Q6_K v) starts a new segment that writes its own rows of y.
        for group in self._group_parts(parts, name):
            fmt, arrays = group
            cols = cols if cols is not None else _cols(arrays[0])
            if _cols(arrays[0]) != cols:
                raise InvalidModelError(f"{name}: parts have different column counts")
            segments.extend(self._upload_matrix(fmt, arrays, row, name))
            row += sum(_rows(a) for a in arrays)
        nbytes = sum(_nbytes(s) for s in segments)
        return self._register(GpuWeight(name, "matrix", (row, cols), nbytes, segments=segments))

    def _register(self, w: GpuWeight) -> GpuWeight:
        self.weight_bytes += w.nbytes
        self._weights.append(w)
        return w

    def close(self) -> int:
        """Free this model's GPU buffers (weights, KV caches, token ring) and nothing else: the
        context, its device and other models on it keep working. Returns the bytes freed."""
        buffers = [self._token_ring, *(b for c in list(self._kv_caches) for b in (*c.keys, *c.values))]
        for w in self._weights:
            buffers += [w.buffer, *(b for seg in w.segments for b in (seg.w_a, seg.w_b))]
            w.plans.clear()
        self._weights, self._token_ring = [], None
        self._kv_caches = weakref.WeakSet()
        self._plans.clear()
        return self.context.release([b for b in buffers if b is not None and b is not self.context.dummy])

    def _group_parts(self, parts: list, name: str) -> list[tuple[str, list]]:
        from kjarni.gpu import quant

        groups: list[tuple[str, list]] = []
        for p in parts:
            if isinstance(p, QuantTensor) and quant.T(p.ggml_type) in quant.SUPPORTED and kernels.exists(
                "linear_" + quant.T(p.ggml_type).name.lower()
            ):
                fmt, item = quant.T(p.ggml_type).name, p
            else:
                if isinstance(p, QuantTensor):
                    kind = quant.T(p.ggml_type).name
                    if kind not in self._noticed:
                        self._noticed.add(kind)
                        print(f"kjarni: {kind} weights have no GPU kernel; converting them to {self.weight_format} at load",
                              file=sys.stderr)
                    array = p.dequantize()
                else:
                    array = np.asarray(p, dtype=np.float32)
                    if array.ndim != 2:
                        raise InvalidModelError(f"{name}: expected a 2-D matrix, got shape {array.shape}")
                fmt, item = self._stored_form(array)
            if groups and groups[-1][0] == fmt:
                groups[-1][1].append(item)
            else:
                groups.append((fmt, [item]))
        return groups

    def _stored_form(self, array: np.ndarray) -> tuple[str, Any]:
        """How a float matrix is kept: as ``weight_format`` says; Q8_0 needs whole 32-column blocks."""
        if self.weight_format != "q8_0":
            return self.weight_format, array
        if array.shape[1] % 32:
            return "f16", array
        import gguf

        blocks = gguf.quants.quantize(np.ascontiguousarray(array, dtype=np.float32), gguf.GGMLQuantizationType.Q8_0)
        return "Q8_0", QuantTensor(gguf.GGMLQuantizationType.Q8_0, tuple(array.shape), blocks)

    def _upload_matrix(self, fmt: str, arrays: list, row0: int, name: str) -> list[_Segment]:
        from kjarni.gpu import quant

        ctx = self.context
        limit = ctx.max_binding_size
        if fmt in ("f16", "f32"):
            matrix = arrays[0] if len(arrays) == 1 else np.concatenate(arrays, axis=0)
            rows, cols = matrix.shape
            padded_cols = -(-cols // 8) * 8
            dtype = np.float16 if fmt == "f16" else np.float32
            row_bytes = padded_cols * np.dtype(dtype).itemsize
            per_chunk = limit // row_bytes
            if per_chunk < 1:
                raise InvalidModelError(f"{name}: one row of {row_bytes} bytes exceeds the GPU binding limit {limit}")
            segments = []
            for r in range(0, rows, per_chunk):
                chunk = np.zeros((min(per_chunk, rows - r), padded_cols), dtype=dtype)
                chunk[:, :cols] = matrix[r : r + per_chunk]
                buf = ctx.upload(chunk, f"{name}[{r}:]")
                segments.append(
                    _Segment(fmt, row0 + r, chunk.shape[0], buf, ctx.dummy, f"linear_{fmt}", True)
                )
            return segments
        reps = [quant.repack(a) for a in arrays]
        rep = reps[0]
        if len(reps) > 1:
            import dataclasses

            rep = dataclasses.replace(
                rep,
                rows=sum(r.rows for r in reps),
                w_a=np.concatenate([r.w_a for r in reps]),
                w_b=np.concatenate([r.w_b for r in reps]),
            )
        return [
            _Segment(
                fmt, row0 + chunk.row_offset, chunk.rows, ctx.upload(chunk.w_a, name), ctx.upload(chunk.w_b, name),
                chunk.kernel, False,
            )
            for chunk in quant.split_rows(rep, limit)
        ]

    # ------------------------------------------------------------------ activations

    def _new(self, tokens: int, features: int) -> GpuTensor:
        return GpuTensor(self.context.scratch(tokens * features * 4), (tokens, features))

    def new_kv_cache(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int) -> WgpuKVCache:
        cache = WgpuKVCache(self.context, num_layers, num_kv_heads, head_dim, capacity, self.kv_format)
        self._kv_caches.add(cache)
        return cache

    def embed(self, table: GpuWeight, token_ids: np.ndarray | GpuTokens) -> GpuTensor:
        ctx = self.context
        rows, cols = table.shape
        if isinstance(token_ids, GpuTokens):  # chosen on the GPU by argmax_ahead: in range by construction
            tokens, id_buffer = len(token_ids), token_ids.buffer
        else:
            ids = np.asarray(token_ids).reshape(-1)
            if ids.size == 0 or ids.min() < 0 or ids.max() >= rows:
                raise InvalidConfigurationError(f"token ids must be in [0, {rows}), got {ids.tolist()[:16]}")
            tokens = int(ids.size)
            # One ids buffer per table: GPT-2 gathers token and position rows in the same step.
            id_buffer = ctx.step_buffer(
                "ids:" + table.name, ids.astype(np.uint32).tobytes(), usage=_storage_usage(), capacity=16384
            )
        out = self._new(tokens, cols)
        for seg in table.segments:
            pipeline = self._template_pipeline("embed", seg.format, EMBED_KINDS)
            params = ctx.uniform(LINEAR.pack(rows=seg.rows, cols=cols, tokens=tokens, row_offset=seg.row_offset))
            ctx.dispatch(pipeline, (params, id_buffer, seg.w_a, seg.w_b, out.buffer), (min(tokens, 65535), 1, 1))
        return out

    def rms_norm(self, x: GpuTensor, weight: GpuWeight, eps: float) -> GpuTensor:
        ctx = self.context
        tokens, cols = x.shape
        out = self._new(tokens, cols)
        pipeline = ctx.pipeline("rms_norm", RMS_KINDS)
        params = ctx.uniform(RMS_NORM.pack(cols=cols, tokens=tokens, eps=eps))
        ctx.dispatch(pipeline, (params, x.buffer, weight.buffer, out.buffer), (tokens, 1, 1))
        return out

    def layer_norm(self, x: GpuTensor, weight: GpuWeight, bias: GpuWeight, eps: float) -> GpuTensor:
        ctx = self.context
        tokens, cols = x.shape
        out = self._new(tokens, cols)
        pipeline = ctx.pipeline("layer_norm", LAYER_NORM_KINDS)
        params = ctx.uniform(LAYER_NORM.pack(cols=cols, tokens=tokens, eps=eps))
        ctx.dispatch(pipeline, (params, x.buffer, weight.buffer, bias.buffer, out.buffer), (tokens, 1, 1))
        return out

    def linear(self, x: GpuTensor, weight: GpuWeight, bias: GpuWeight | None = None, residual: GpuTensor | None = None) -> GpuTensor:
        return self._linear(x, weight, bias, residual, None, 0.0)

    def norm_linear(self, x: GpuTensor, norm_weight: GpuWeight, eps: float, weight: GpuWeight, bias: GpuWeight | None = None) -> GpuTensor:
        return self._linear(x, weight, bias, None, norm_weight, eps)

    def _linear(self, x, weight, bias, residual, norm_weight, eps) -> GpuTensor:
        # The hot path of a decode step (4 of its 6 dispatches per layer): everything that depends
        # only on the shapes and weights is planned once and kept on the weight; the bind groups
        # are cached per (x, residual, y) buffers, which repeat step after step (pooled).
        ctx = self.context
        tokens = x.shape[0]
        silu = type(x) is _SiluMulPending and self._silu_fusable(weight, tokens)
        attn = None
        if type(x) is _AttentionPartials:
            attn = (x.splits, x.hd4)
            fusable = weight.plans.get(("merge", attn))  # whether this weight's matvec merges them, decided once
            if fusable is None:
                fusable = weight.plans[("merge", attn)] = self._merge_fusable(x, weight)
            if not fusable:
                attn = None
        key = (tokens, id(bias), residual is not None, id(norm_weight), eps, silu, attn)
        plan = weight.plans.get(key)
        if plan is None:
            plan = weight.plans[key] = self._plan_linear(x, weight, bias, residual, norm_weight, eps, silu, attn)
        dispatches, groups, rows, common = plan
        x_buffer = x.source.buffer if silu else x.partials.buffer if attn else x.buffer
        out = GpuTensor(ctx.scratch(tokens * rows * 4), (tokens, rows))
        r_buffer = residual.buffer if residual is not None else None
        # Split K (prefill, few tiles): the partial sums go through a scratch of S x [tokens, rows],
        # free again once recorded (later users of the pool write it after the reduce has read it).
        partials = ctx.scratch(common[4]) if common[4] else None
        p_buffer = partials.buffer if partials is not None else None
        bound = groups.get((x_buffer, r_buffer, out.buffer, p_buffer))
        if bound is None:
            bias_buffer, norm_buffer, _, _, _ = common
            dummy, r = ctx.dummy, r_buffer or ctx.dummy
            buffers = {  # per role: bindings 1 .. 7 (x, w_a, w_b, bias, residual, norm_weight, y)
                "out": lambda w_a, w_b: (x_buffer, w_a, w_b, bias_buffer, r, norm_buffer, out.buffer),
                "partial": lambda w_a, w_b: (x_buffer, w_a, w_b, dummy, dummy, norm_buffer, p_buffer),
                "reduce": lambda w_a, w_b: (p_buffer, dummy, dummy, bias_buffer, r, dummy, out.buffer),
            }
            bound = groups[(x_buffer, r_buffer, out.buffer, p_buffer)] = [
                ctx.bind_group(pipeline, (params, *buffers[role](w_a, w_b))) for pipeline, params, _, w_a, w_b, role in dispatches
            ]
        for (pipeline, _, grid, _, _, _), group in zip(dispatches, bound):
            ctx.dispatch_group(pipeline, group, grid)
        if tokens > self.matvec_max_tokens and ctx.stats.pending_dispatches >= self.prefill_submit_every:
            ctx.flush()  # a long prompt: the GPU starts on these layers while Python records the next
        return out

    def _silu_fusable(self, weight: GpuWeight, tokens: int) -> bool:
        """Whether every kernel this linear would run reads ``[gate | up]`` (``LINEAR_SILU``): the
        matrix-vector kernels and matmul.tmpl.wgsl do; a format without a matmul kernel does not."""
        if weight.kind != "matrix":
            return False
        return tokens <= self.matvec_max_tokens or all(kernels.has_template("matmul", s.format) for s in weight.segments)

    def _merge_fusable(self, x: _AttentionPartials, weight: GpuWeight) -> bool:
        """Whether the one-token product by ``weight`` can merge split attention partials while
        loading x: every segment runs matvec.tmpl.wgsl, and x fits its workgroup memory."""
        cols = x.shape[1]
        return (weight.kind == "matrix" and cols <= 4096 and weight.shape[1] == cols
                and all(self.matvec_config(s.format, s.rows, cols) is not None for s in weight.segments))

    def _plan_linear(self, x, weight, bias, residual, norm_weight, eps, silu: bool, attn: tuple[int, int] | None = None) -> tuple:
        """(dispatches [(pipeline, params, grid, w_a, w_b, role)], bind group cache, rows, (bias, norm
        buffers, bias, norm, bytes of split-K partials)); role "out" writes y, "partial" the partials
        of a prefill matmul split over K, "reduce" adds them into y (matmul_reduce.wgsl)."""
        ctx = self.context
        tokens, cols = x.shape
        rows = weight.shape[0]
        if weight.kind != "matrix" or weight.shape[1] != cols:
            raise InvalidConfigurationError(f"linear: x of shape {x.shape} does not fit weight {weight.name} {weight.shape}")
        flags = (
            (LINEAR_BIAS if bias is not None else 0)
            | (LINEAR_RESIDUAL if residual is not None else 0)
            | (LINEAR_NORM if norm_weight is not None else 0)
            | (LINEAR_SILU if silu else 0)
        )
        dispatches = []
        for seg in weight.segments:
            tile = self.sgmat_tile(seg, tokens, cols)
            if tile is not None:
                splits = self._sgmat_splits(tile, seg.rows, tokens, cols, rows)
            else:
                splits = self._matmul_splits(seg.rows, tokens, cols, flags, rows) if self._uses_matmul(seg, tokens) else 1
            if splits == 1:
                pipeline, params, grid = self._linear_plan(seg, cols, rows, tokens, flags, eps, attn)
                dispatches.append((pipeline, params, grid, seg.w_a, seg.w_b, "out"))
                continue
            # Split K: partial sums (no bias, no residual) into the scratch, then matmul_reduce.
            kept = LINEAR_SILU | (LINEAR_NORM if tile is not None else 0)  # matmul_sgmat's norm covers whole rows
            pipeline, params, grid = self._linear_plan(seg, cols, rows, tokens, flags & kept, eps)
            dispatches.append((pipeline, params, (grid[0], grid[1], splits), seg.w_a, seg.w_b, "partial"))
            params = ctx.uniform(LINEAR.pack(rows=seg.rows, cols=splits, tokens=tokens, flags=flags & (LINEAR_BIAS | LINEAR_RESIDUAL),
                                             row_offset=seg.row_offset, y_stride=rows, eps=eps))
            reduce = ctx.pipeline("matmul_reduce", LINEAR_KINDS)
            dispatches.append((reduce, params, (-(-seg.rows // 256), tokens, 1), ctx.dummy, ctx.dummy, "reduce"))
        most = max((d[2][2] for d in dispatches if d[5] == "partial"), default=1)
        common = (
            bias.buffer if bias is not None else ctx.dummy,
            norm_weight.buffer if norm_weight is not None else ctx.dummy,
            bias,  # held so that their ids in the plan key stay theirs
            norm_weight,
            most * tokens * rows * 4 if most > 1 else 0,  # the partials' scratch
        )
        return dispatches, {}, rows, common

    def _linear_plan(self, seg: _Segment, cols: int, rows: int, tokens: int, flags: int, eps: float,
                     attn: tuple[int, int] | None = None):
        from kjarni.gpu import quant

        ctx = self.context
        params = ctx.uniform(
            LINEAR.pack(rows=seg.rows, cols=cols, tokens=tokens, flags=flags, row_offset=seg.row_offset, y_stride=rows, eps=eps)
        )
        tile = self.sgmat_tile(seg, tokens, cols)
        if tile is not None:  # tensor cores
            bm, bn, bk, sm, sn = tile
            variant = kernels.sgmat_variant(bm, bn, bk, sm, sn, ctx.f16_matrix_subgroup)

            def source_sg() -> str:
                return kernels.template("matmul_sgmat", variant)

            pipeline = ctx.pipeline("matmul_sgmat." + variant, LINEAR_KINDS, source=source_sg)
            return pipeline, params, (-(-seg.rows // bn), -(-tokens // bm), 1)
        if self._uses_matmul(seg, tokens):
            tm, tn, bk, ksplit, nbuf = self.matmul_config(seg.rows, tokens, cols)
            constants = {"TM": tm, "TN": tn, "BK": bk, "KSPLIT": ksplit, "NBUF": nbuf}
            pipeline = self._template_pipeline("matmul", seg.format, LINEAR_KINDS, constants)
            return pipeline, params, (-(-seg.rows // (8 * tn)), -(-tokens // (8 * tm)), 1)
        config = self.matvec_config(seg.format, seg.rows, cols) if tokens == 1 else None
        if config is not None:
            # One token (decode): matvec.tmpl.wgsl rendered for the format (its block decoder).
            threads, lanes, r, un = config
            fmt = seg.format
            variant = frozenset({"attn"}) if attn else frozenset()

            def source_mv() -> str:
                return kernels.template("matvec", fmt, variant)

            constants = {"WG": threads, "LANES": lanes, "R": r, "UN": un}
            if attn:  # x: split attention partials, merged per workgroup (fewer, larger workgroups)
                threads, lanes, r, un = self.matvec_attn_threads, self.matvec_attn_lanes, 1, 2
                constants = {"WG": threads, "LANES": lanes, "R": r, "UN": un, "SPLITS": attn[0], "HD4": attn[1]}
            pipeline = ctx.pipeline("matvec." + fmt, LINEAR_KINDS, flags=tuple(variant), constants=constants, source=source_mv)
            return pipeline, params, _fold(-(-seg.rows // (r * threads // lanes)))
        if not seg.dense:
            if self.quant_t_min_tokens <= tokens <= self.matvec_max_tokens and ctx.has_subgroups:
                # Several tokens: `main_t` dequantizes each unit once for up to 4 x tiles tokens.
                def source_t() -> str:
                    return quant.shader_source(seg.linear_kernel, subgroups=True)

                constants = {"QT": max(1, min(self.matvec_t_quads, 3, -(-tokens // 4)))}
                pipeline = ctx.pipeline(
                    seg.linear_kernel, LINEAR_KINDS, entry="main_t", constants=constants, source=source_t, flags=("quant",)
                )
                return pipeline, params, (quant.workgroup_count(seg.rows), 1, 1)
            min_cols = self.quant_split_k_min_cols
            if tokens <= self.matvec_max_tokens and ctx.has_subgroups and min_cols is not None and cols >= min_cols:
                # Long rows, few of them (down_proj): the whole workgroup shares each row (SPLIT_K).
                def source() -> str:
                    return quant.shader_source(seg.linear_kernel, subgroups=True)

                constants = {"WG": self.quant_split_k_threads, "SPLIT_K": True}
                pipeline = ctx.pipeline(seg.linear_kernel, LINEAR_KINDS, constants=constants, source=source, flags=("quant",))
                return pipeline, params, (min(seg.rows, 65535), 1, 1)
            pipeline = self._pipeline(seg, seg.linear_kernel, LINEAR_KINDS, "main")
            return pipeline, params, (quant.workgroup_count(seg.rows, subgroups=ctx.has_subgroups), 1, 1)
        if self.matvec_t_min_tokens <= tokens <= self.matvec_max_tokens and ctx.has_subgroups:
            # Several tokens (speculative verify): matvec_t applies each weight chunk to up to
            # 4 x quads tokens held in registers; long rows split K over 256 threads as matvec does.
            quads = max(1, min(self.matvec_t_quads, 3, -(-tokens // 4)))
            threads, r = self.matvec_t_configs.get((seg.rows, cols)) or (
                (32 if seg.rows >= 65536 else 128, 4 if seg.rows >= 1024 else 2) if -(-cols // 8) <= 256 else (256, 4)
            )
            constants = {"WG": threads, "R": r, "Q": quads}
            pipeline = ctx.pipeline(seg.linear_kernel, LINEAR_KINDS, entry="matvec_t", constants=constants)
            return pipeline, params, _fold(-(-seg.rows // r))
        config = self.matvec_configs.get((seg.rows, cols)) if tokens <= self.matvec_max_tokens and ctx.has_subgroups else None
        if config is not None:
            # A configuration measured for this shape (tools/sweep_matvec.py): matvec_u with
            # `threads` threads on `r` rows, `u` 8-column chunks per thread per step.
            threads, r, u = config
            constants = {"WG": threads, "R": r, "U": u}
            pipeline = ctx.pipeline(seg.linear_kernel, LINEAR_KINDS, entry="matvec_u", constants=constants)
            return pipeline, params, _fold(-(-seg.rows // r))
        if tokens <= self.matvec_max_tokens and ctx.has_subgroups and self.matvec_u_default and -(-cols // 8) <= 256:
            # The H200 sweep's winners for rows of up to 2048 columns (tools/sweep_matvec.py, see
            # docs/benchmarks.md): 128 threads on 4 rows (2 when rows are few), and 32 threads
            # for a very tall matrix (the LM head), where many small workgroups fill the GPU.
            threads = 32 if seg.rows >= 65536 else 128
            r = 4 if seg.rows >= 1024 else 2
            pipeline = ctx.pipeline(seg.linear_kernel, LINEAR_KINDS, entry="matvec_u", constants={"WG": threads, "R": r, "U": 1})
            return pipeline, params, _fold(-(-seg.rows // r))
        if tokens <= self.matvec_max_tokens and ctx.has_subgroups and -(-cols // 8) <= self.matvec_subgroup_max_chunks:
            # Rows of up to a few thousand columns: one subgroup per 1, 2 or 4 rows (more rows per
            # subgroup only where there are rows enough to keep every SM busy), no barriers.
            r = 4 if seg.rows >= 8192 else 2 if seg.rows >= 2048 else 1
            threads = self.matvec_subgroup_threads
            constants = {"R": r, "WG": threads}
            pipeline = ctx.pipeline(seg.linear_kernel, LINEAR_KINDS, entry="matvec_sg", constants=constants)
            return pipeline, params, _fold(-(-(-(-seg.rows // r)) // (threads // 32)))
        chunks = -(-cols // 8)
        threads = max(64, min(self.matvec_max_threads, 1 << (chunks.bit_length() - 1)))
        constants = {"R": self.matvec_rows, "WG": threads}
        pipeline = ctx.pipeline(seg.linear_kernel, LINEAR_KINDS, entry="matvec", constants=constants)
        return pipeline, params, _fold(-(-seg.rows // self.matvec_rows))

    def matvec_config(self, fmt: str, rows: int, cols: int) -> tuple[int, int, int, int] | None:
        """(WG, LANES, R, UN) of matvec.tmpl.wgsl for a one-token product of a ``rows`` x ``cols``
        segment in ``fmt``, or None where it does not apply (no subgroups, ``cols`` not a multiple
        of 8, ``matvec_template`` off): ``matvec_template_configs`` first (per (format, rows, cols),
        from tools/sweep_matvec.py), else the H200 sweep's winners on Qwen2.5-0.5B's matrices
        (docs/benchmarks.md), the same for f16 and the quantized formats: a vocabulary-sized LM head
        16 lanes on 4 rows (two row groups a subgroup, many rows a workgroup); rows longer than 2048
        columns (down_proj) split over 256 lanes, 2 rows; thousands of rows (gate_up) 32 lanes on
        4 rows; small matrices (q/k/v, o_proj) 64 lanes on 1 row, to spread over every SM."""
        if not (self.matvec_template and self.context.has_subgroups and cols % 8 == 0 and kernels.has_template("matvec", fmt)):
            return None
        config = self.matvec_template_configs.get((fmt, rows, cols))
        if config is not None:
            return config
        if rows >= 65536:
            return 128, 16, 4, 1
        if cols > 2048:
            return 256, 256, 2, 1
        if rows >= 4096:
            return 128, 32, 4, 2
        return 128, 64, 1, 2

    def _uses_matmul(self, seg: _Segment, tokens: int) -> bool:
        return tokens > self.matvec_max_tokens and kernels.has_template("matmul", seg.format)

    def sgmat_tile(self, seg: _Segment, tokens: int, cols: int) -> tuple[int, int, int, int, int] | None:
        """(BM, BN, BK, SM, SN) of the tensor-core matmul for this prefill product, or None for the
        SIMT kernels: f16 weights, more than ``matvec_max_tokens`` tokens, ``tensor_cores`` on (off by
        default) and
        a device with an f16 subgroup-matrix configuration, ``cols`` a multiple of BK. Tiles:
        ``sgmat_tiles`` per (rows, cols) (None there: SIMT), else 64 x 128 where that makes at least 2 waves of 132
        workgroups, else 64 x 64."""
        sg = self.context.f16_matrix_subgroup
        if not (self.tensor_cores and sg and seg.format == "f16" and tokens > self.matvec_max_tokens):
            return None
        if (seg.rows, cols) in self.sgmat_tiles and self.sgmat_tiles[(seg.rows, cols)] is None:
            return None  # measured: the SIMT kernel is faster for this shape
        tile = self.sgmat_tiles.get((seg.rows, cols))
        if tile is None:
            tile = (64, 128, 32, 2, 4) if -(-seg.rows // 128) * -(-tokens // 64) >= 264 else (64, 64, 32, 2, 2)
        if cols % tile[2] or kernels.sgmat_variant(*tile, sg) not in kernels.TEMPLATES["matmul_sgmat"]:
            return None
        return tile

    def _sgmat_splits(self, tile: tuple[int, int, int, int, int], rows: int, tokens: int, cols: int, y_stride: int) -> int:
        """Workgroups splitting K (grid z, then matmul_reduce) for the tensor-core matmul:
        ``sgmat_splits`` if set, else ``sgmat_split_counts[(rows, cols)]``, else enough to make about ``sgmat_split_below`` workgroups when
        the tiles are fewer (at most ``sgmat_max_splits``, at least 4 K steps each), within one
        storage binding of partials."""
        bm, bn, bk = tile[:3]
        tiles = -(-rows // bn) * -(-tokens // bm)
        splits = self.sgmat_splits if self.sgmat_splits is not None else self.sgmat_split_counts.get((rows, cols))
        if splits is None:
            splits = min(self.sgmat_max_splits, -(-self.sgmat_split_below // tiles)) if tiles < self.sgmat_split_below else 1
        splits = min(int(splits), cols // bk // 4)
        if splits <= 1 or splits * tokens * y_stride * 4 > self.context.max_binding_size:
            return 1
        return splits

    def _matmul_splits(self, rows: int, tokens: int, cols: int, flags: int, y_stride: int) -> int:
        """Workgroups splitting K (grid z) for the prefill matmul of this segment: 1 unless
        ``matmul_splits`` says more and the product allows it (no fused norm, which needs whole
        rows; partials within one storage binding; at least two steps of K per split)."""
        tm, tn, bk, ksplit, _ = self.matmul_config(rows, tokens, cols)
        splits = self.matmul_splits
        measured = self.matmul_configs.get((rows, cols))
        if splits is None and measured is not None:
            splits = measured[5]
        if splits is None:
            tiles = -(-rows // (8 * tn)) * -(-tokens // (8 * tm))
            splits = min(self.matmul_max_splits, self.matmul_split_tiles // tiles) if tiles < self.matmul_split_tiles else 1
        splits = min(int(splits), cols // (2 * bk * ksplit))
        if splits <= 1 or flags & LINEAR_NORM or splits * tokens * y_stride * 4 > self.context.max_binding_size:
            return 1
        return splits

    def matmul_config(self, rows: int, tokens: int, cols: int) -> tuple[int, int, int, int, int]:
        """(TM, TN, BK, KSPLIT, NBUF) of the prefill matmul (matmul.tmpl.wgsl) for a product of
        ``tokens`` x ``cols`` by ``rows`` x ``cols``: ``matmul_configs`` for a measured shape,
        else these rules.

        128x128 output tiles, with K split over 2 thread groups, only when there are many (less
        L2 traffic, little wave tail); else 64 tokens x 128 rows, where few tiles (o_proj,
        down_proj of a small model) split K over 4 thread groups so each SM gets more warps.
        ``matmul_nbuf`` tiles per group (2: double-buffered)."""
        measured = self.matmul_configs.get((rows, cols))
        if measured is not None:
            tm, tn, bk, ksplit, nbuf = measured[:5]
        elif -(-rows // 128) * -(-tokens // 128) >= self.matmul_min_big_tiles:
            tm, tn, bk, ksplit, nbuf = 16, 16, 16, 2 if cols >= 64 else 1, self.matmul_nbuf
        else:
            few = -(-rows // 128) * -(-tokens // 64) < self.matmul_split_k_below
            tm, tn, bk, ksplit, nbuf = 8, 16, 8, 4 if few and cols >= 256 else 1, self.matmul_nbuf
        # Within the device's workgroup memory (128x128 tiles with KSPLIT 2 need 32.5 KiB; many
        # devices allow 32): fewer K groups first, then one buffer; and KSPLIT BK NBUF >= 2
        # max(TM, TN) (the groups' sums meet in the tiles).
        limit = self.context.max_workgroup_storage
        while ksplit > 1 and (matmul_workgroup_bytes(tm, tn, bk, ksplit, nbuf) > limit or ksplit * bk * nbuf < 2 * max(tm, tn)):
            ksplit //= 2
        if nbuf > 1 and matmul_workgroup_bytes(tm, tn, bk, ksplit, nbuf) > limit:
            nbuf = 1
        return tm, tn, bk, ksplit, nbuf

    def _template_pipeline(self, op: str, fmt: str, kinds: tuple[str, ...], constants: dict | None = None) -> Any:
        """The pipeline of ``shaders/<op>.tmpl.wgsl`` rendered for weight format ``fmt`` (kernels.TEMPLATES),
        named ``<op>.<fmt>``."""

        def source() -> str:
            return kernels.template(op, fmt)

        return self.context.pipeline(f"{op}.{fmt}", kinds, constants=constants, source=source)

    def _pipeline(self, seg: _Segment, kernel: str, kinds: tuple[str, ...], entry: str) -> Any:
        ctx = self.context
        if seg.dense:
            return ctx.pipeline(kernel, kinds, entry=entry)
        from kjarni.gpu import quant

        def source() -> str:
            return quant.shader_source(kernel, subgroups=ctx.has_subgroups)

        return ctx.pipeline(kernel, kinds, entry=entry, source=source, flags=("quant",))

    def rope_store(
        self, qkv: GpuTensor, rope: GpuWeight | None, kv_cache: WgpuKVCache, layer: int, start: int
    ) -> GpuTensor:
        ctx = self.context
        tokens, width = qkv.shape
        hd, kv = kv_cache.head_dim, kv_cache.num_kv_heads
        heads = (width - 2 * kv * hd) // hd
        if start + tokens > kv_cache.capacity:
            raise ContextOverflowError(
                f"{start + tokens} positions do not fit in a KV cache of {kv_cache.capacity}",
                tokens=start + tokens,
                context=kv_cache.capacity,
            )
        if rope is not None and (rope.kind != "table" or start + tokens > rope.shape[0] or rope.shape[1] > hd):
            raise InvalidConfigurationError(f"rope table {rope.name} {rope.shape} does not cover position {start + tokens - 1}")
        if tokens == 1 and self.fuse_rope and start + 1 <= min(self.attention_single_max, STEP_MAX_KEYS):
            return _RopePending(self, qkv, rope, kv_cache, layer, start, heads * hd)  # attention_step does it
        return self._rope_store_now(qkv, rope, kv_cache, layer, start)

    def _rope_store_now(self, qkv: GpuTensor, rope: GpuWeight | None, kv_cache: WgpuKVCache, layer: int, start: int) -> GpuTensor:
        ctx = self.context
        tokens, width = qkv.shape
        hd, kv = kv_cache.head_dim, kv_cache.num_kv_heads
        heads = (width - 2 * kv * hd) // hd
        step = self._step(start)
        rotary_dim = 0 if rope is None else rope.shape[1]
        key = ("rope_store", tokens, heads, kv, hd, kv_cache.capacity, rotary_dim, kv_cache.kv_format)
        plan = self._plans.get(key)
        if plan is None:
            params = ctx.uniform(
                ROPE_STORE.pack(
                    num_heads=heads, num_kv_heads=kv, head_dim=hd, tokens=tokens, capacity=kv_cache.capacity,
                    rotary_dim=rotary_dim,
                )
            )
            pipeline = ctx.pipeline("rope_store", ROPE_KINDS, flags=self._kv_flags(kv_cache))
            plan = self._plans[key] = (pipeline, params, _fold(-(-tokens * (heads + 2 * kv) * (hd // 2) // 64)))
        pipeline, params, grid = plan
        q = self._new(tokens, heads * hd)
        table = ctx.dummy if rope is None else rope.buffer
        buffers = (params, step, qkv.buffer, table, kv_cache.keys[layer], kv_cache.values[layer], q.buffer)
        ctx.dispatch(pipeline, buffers, grid)
        return q

    def _step(self, start: int) -> Any:
        """The per-step uniform holding ``start`` (packed once per step, shared by every layer)."""
        if start != self._step_start:
            self._step_start, self._step_bytes = start, STEP.pack(start=start)
        return self.context.step_buffer("start", self._step_bytes)

    def _subgroup_flag(self) -> frozenset[str]:
        return frozenset({"subgroup"}) if self.context.has_subgroups else frozenset()

    @staticmethod
    def _kv_flags(kv_cache: WgpuKVCache) -> tuple[str, ...]:
        return ("kv_f16",) if kv_cache.kv_format == "f16" else ()

    def attention(
        self, q: GpuTensor, kv_cache: WgpuKVCache, layer: int, start: int, window: int | None = None
    ) -> GpuTensor:
        ctx = self.context
        if type(q) is _RopePending:
            if q.kv_cache is kv_cache and q.layer == layer and q.start == start and not q.stored:
                return self._attention_step(q, window)
            q = q._materialize()
        tokens, width = q.shape
        hd, kv = kv_cache.head_dim, kv_cache.num_kv_heads
        heads = width // hd
        step = self._step(start)
        max_splits = -(-kv_cache.capacity // DECODE_CHUNK)
        key = ("attention", tokens, heads, kv, hd, kv_cache.capacity, window or 0)

        def uniform(splits: int) -> Any:  # the attention Params with this stride of split partials
            return ctx.uniform(
                ATTENTION.pack(
                    num_heads=heads, num_kv_heads=kv, head_dim=hd, tokens=tokens, capacity=kv_cache.capacity,
                    max_splits=splits, scale=float(np.float32(1.0 / np.sqrt(hd))), window=window or 0,
                )
            )

        params = self._plans.get(key)
        if params is None:
            params = self._plans[key] = uniform(max_splits)
        flags = self._kv_flags(kv_cache)
        out = self._new(tokens, width)
        k_buf, v_buf = kv_cache.keys[layer], kv_cache.values[layer]
        span = start + tokens if not window else min(start + tokens, window)  # keys a query row sees
        if tokens <= self.matvec_max_tokens and span <= min(self.attention_single_max, SINGLE_MAX_KEYS):
            # Short context: one workgroup per (head, row) over all its keys, one dispatch.
            single = self._plans.get(("attention_single", hd, flags))
            if single is None:
                single = self._plans[("attention_single", hd, flags)] = ctx.pipeline(
                    "attention_single", ATTENTION_KINDS, flags=flags, constants={"HEAD_DIM": hd, "WG": SINGLE_WG}
                )
            ctx.dispatch(single, (params, step, q.buffer, k_buf, v_buf, out.buffer), (heads, tokens, 1))
        elif tokens <= self.matvec_max_tokens:
            # Flash-decoding: chunks of DECODE_CHUNK positions in parallel, then one merge.
            partial = ctx.scratch(tokens * heads * max_splits * (hd + 2) * 4)
            decode = ctx.pipeline(
                "attention_decode", ATTENTION_KINDS, flags=flags, constants={"HEAD_DIM": hd, "WG": DECODE_CHUNK}
            )
            splits = -(-(start + tokens) // DECODE_CHUNK)
            ctx.dispatch(decode, (params, step, q.buffer, k_buf, v_buf, partial.buffer), (heads, splits, tokens))
            combine = ctx.pipeline("attention_combine", COMBINE_KINDS, constants={"CHUNK": DECODE_CHUNK})
            ctx.dispatch(combine, (params, step, partial.buffer, out.buffer), (heads, tokens, 1))
        elif hd == 64 and self.attention_tiled and ctx.max_workgroup_storage >= ATTENTION_TILED_BYTES:
            # Register-tiled flash attention: 32 query rows x 32-key tiles per workgroup; past
            # `attention_tiled_chunk` keys the keys are split over workgroups too (grid z), and
            # attention_combine merges the splits as for flash-decoding.
            # The partials grow with tokens x splits: long prompts take longer chunks (doubling).
            chunk = self.attention_tiled_chunk
            if chunk:
                fits = min(self.attention_partial_max_bytes, ctx.max_binding_size) // (tokens * heads * (hd + 2) * 4)
                while -(-(start + tokens) // chunk) > max(1, fits):
                    chunk *= 2
            splits = -(-(start + tokens) // chunk) if chunk else 1
            grid = (-(-tokens // 32), heads, splits)
            if splits <= 1:
                tiled = ctx.pipeline("attention_tiled", ATTENTION_KINDS, flags=flags)
                ctx.dispatch(tiled, (params, step, q.buffer, k_buf, v_buf, out.buffer), grid)
                return out
            split_params = uniform(splits)
            partial = ctx.scratch(tokens * heads * splits * (hd + 2) * 4)
            tiled = ctx.pipeline("attention_tiled", ATTENTION_KINDS, flags=flags, constants={"CHUNK": chunk})
            ctx.dispatch(tiled, (split_params, step, q.buffer, k_buf, v_buf, partial.buffer), grid)
            combine = ctx.pipeline("attention_combine", COMBINE_KINDS, constants={"CHUNK": chunk})
            ctx.dispatch(combine, (split_params, step, partial.buffer, out.buffer), (heads, tokens, 1))
        else:
            # Threads per query row: a power of two dividing hd / 4, within a subgroup.
            dt = 1
            while ctx.has_subgroups and dt < self.attention_prefill_lanes and (hd // 4) % (2 * dt) == 0:
                dt *= 2
            rows_per_group = max(1, 256 // dt) if dt > 1 else 32

            def source() -> str:
                # Private arrays cannot be sized by an override: size q and the output row exactly.
                text = kernels.source("attention_prefill", frozenset(flags) | self._subgroup_flag())
                text = text.replace("const DT: u32 = 1u;", f"const DT: u32 = {dt}u;")
                return text.replace("const MAX_D4: u32 = 64u;", f"const MAX_D4: u32 = {hd // 4}u;")

            prefill = ctx.pipeline(
                "attention_prefill", ATTENTION_KINDS, flags=(*flags, f"lanes{dt}"),
                constants={"HEAD_DIM": hd, "BQ": rows_per_group}, source=source,
            )
            grid = (-(-tokens // rows_per_group), heads, 1)
            ctx.dispatch(prefill, (params, step, q.buffer, k_buf, v_buf, out.buffer), grid)
        return out

    def _attention_step(self, pending: _RopePending, window: int | None) -> GpuTensor:
        """rope_store + attention of one token in one dispatch (attention_step.wgsl)."""
        ctx = self.context
        kv_cache, rope, qkv = pending.kv_cache, pending.rope, pending.qkv
        hd, kv = kv_cache.head_dim, kv_cache.num_kv_heads
        heads = pending.shape[1] // hd
        rotary_dim = 0 if rope is None else rope.shape[1]
        splits = max(1, self.attention_step_splits) if ctx.has_subgroups else 1
        key = ("attention_step", heads, kv, hd, kv_cache.capacity, rotary_dim, window or 0, kv_cache.kv_format, splits)
        plan = self._plans.get(key)
        if plan is None:
            params = ctx.uniform(ATTENTION_STEP.pack(
                num_heads=heads, num_kv_heads=kv, head_dim=hd, capacity=kv_cache.capacity, rotary_dim=rotary_dim,
                window=window or 0, scale=float(np.float32(1.0 / np.sqrt(hd))),
            ))
            # WG: hd / 4 times a power of two, at most attention_step_threads and the device's limit;
            # KL threads per key in the scores (a divisor of hd / 4; subgroup shuffles).
            most = self.attention_split_threads if splits > 1 else self.attention_step_threads
            limit = min(most, int(ctx.adapter.limits["max-compute-invocations-per-workgroup"]))
            threads = hd // 4
            while threads * 2 <= limit:
                threads *= 2
            kl = next(k for k in (4, 2, 1) if (hd // 4) % k == 0) if ctx.has_subgroups else 1
            pipeline = ctx.pipeline("attention_step", ROPE_KINDS, flags=self._kv_flags(kv_cache),
                                    constants={"HEAD_DIM": hd, "WG": threads, "KL": kl, "SPLITS": splits})
            plan = self._plans[key] = (pipeline, params)
        pipeline, params = plan
        if splits > 1:
            partials = ctx.scratch(heads * splits * (hd + 4) * 4)
            out_buffer = partials.buffer
        else:
            out = self._new(1, heads * hd)
            out_buffer = out.buffer
        table = ctx.dummy if rope is None else rope.buffer
        buffers = (params, self._step(pending.start), qkv.buffer, table, kv_cache.keys[pending.layer],
                   kv_cache.values[pending.layer], out_buffer)
        ctx.dispatch(pipeline, buffers, (heads, splits, 1))
        pending.stored = True
        if splits > 1:
            return _AttentionPartials(self, partials, heads * hd, splits, hd // 4)
        return out

    def _merge_attention(self, x: _AttentionPartials) -> GpuTensor:
        """attention_combine over a split attention_step's partials (when no matvec merges them)."""
        ctx = self.context
        heads = x.shape[1] // (4 * x.hd4)
        key = ("attention_merge", heads, x.hd4, x.splits)
        plan = self._plans.get(key)
        if plan is None:
            params = ctx.uniform(ATTENTION.pack(num_heads=heads, num_kv_heads=1, head_dim=4 * x.hd4, tokens=1, capacity=0,
                                                max_splits=x.splits, scale=1.0, window=0))
            pipeline = ctx.pipeline("attention_combine", COMBINE_KINDS, constants={"SPLITS": x.splits, "PAD": 4})
            plan = self._plans[key] = (pipeline, params)
        pipeline, params = plan
        out = self._new(1, x.shape[1])
        ctx.dispatch(pipeline, (params, self._step(self._step_start), x.partials.buffer, out.buffer), (heads, 1, 1))
        return out

    def silu_mul(self, x: GpuTensor) -> GpuTensor:
        if self.fuse_silu and type(x) is GpuTensor:
            return _SiluMulPending(self, x)  # the next linear applies it while loading (LINEAR_SILU)
        return self._silu_mul_now(x)

    def _silu_mul_now(self, x: GpuTensor) -> GpuTensor:
        ctx = self.context
        tokens, width = x.shape
        half = width // 2
        key = ("silu_mul", tokens, half)
        plan = self._plans.get(key)
        if plan is None:
            params = ctx.uniform(SILU_MUL.pack(half=half, tokens=tokens))
            plan = self._plans[key] = (ctx.pipeline("silu_mul", SILU_KINDS), params, _fold(-(-tokens * half // 64)))
        pipeline, params, grid = plan
        out = self._new(tokens, half)
        ctx.dispatch(pipeline, (params, x.buffer, out.buffer), grid)
        return out

    def gelu(self, x: GpuTensor) -> GpuTensor:
        ctx = self.context
        tokens, width = x.shape
        out = self._new(tokens, width)
        params = ctx.uniform(ELEMENTWISE.pack(count=tokens * width))
        ctx.dispatch(ctx.pipeline("gelu", SILU_KINDS), (params, x.buffer, out.buffer), _fold(-(-tokens * width // 64)))
        return out

    def add(self, a: GpuTensor, b: GpuTensor) -> GpuTensor:
        ctx = self.context
        if a.shape != b.shape:
            raise InvalidConfigurationError(f"add: shapes {a.shape} and {b.shape} differ")
        tokens, width = a.shape
        out = self._new(tokens, width)
        params = ctx.uniform(ELEMENTWISE.pack(count=tokens * width))
        buffers = (params, a.buffer, b.buffer, out.buffer)
        ctx.dispatch(ctx.pipeline("add", ADD_KINDS), buffers, _fold(-(-tokens * width // 64)))
        return out

    def rows(self, x: GpuTensor, first: int, count: int) -> GpuTensor:
        tokens, features = x.shape
        if not (0 <= first and count >= 0 and first + count <= tokens):
            raise InvalidConfigurationError(f"rows {first}..{first + count} outside an activation of {tokens} rows")
        if first == 0:
            return GpuTensor(x.scratch, (count, features))  # a prefix view of the same buffer
        out = self._new(count, features)
        self.context.copy(x.buffer, first * features * 4, out.buffer, 0, count * features * 4)
        return out

    # ------------------------------------------------------------------ readback

    def read(self, x: GpuTensor) -> np.ndarray:
        tokens, features = x.shape
        data = self.context.read(x.buffer, 0, tokens * features * 4)
        return np.frombuffer(data, dtype=np.float32).reshape(tokens, features).copy()

    def argmax(self, x: GpuTensor) -> np.ndarray:
        tokens = x.shape[0]
        out = self._argmax(x)
        words = np.frombuffer(self.context.read(out.buffer, 0, tokens * 8), dtype=np.uint32)
        return gpu_sampling.decode_ring(words, [tokens])[0]

    def argmax_ahead(self, x: GpuTensor) -> GpuTokens:
        """`argmax` left on the GPU and submitted: a forward can embed the result before the CPU
        reads it (`read_tokens`), so a greedy loop records step n + 1 while the GPU runs step n."""
        return self._ahead(self._argmax(x), x.shape[0])

    def sample_ahead(self, x: GpuTensor, sampler: Any, draw: float) -> GpuTokens:
        """A token drawn on the GPU from the last row of ``x`` with ``sampler`` and the uniform
        ``draw`` (kjarni/gpu/sampling.py), left on the device like `argmax_ahead`. Only for
        samplers `samples_ahead` accepts."""
        return self._ahead(gpu_sampling.record_sample(self, x, sampler, draw), 1)

    def samples_ahead(self, sampler: Any) -> bool:
        """Whether `sample_ahead` can draw for ``sampler`` on the GPU (top-k, no repetition penalty)."""
        return gpu_sampling.runs_on_device(sampler)

    def _ahead(self, out: Scratch, tokens: int) -> GpuTokens:
        """Copies ``out`` ([tokens] ids, then [tokens] statuses) into the readback ring and submits."""
        ctx = self.context
        if self._token_ring is None:
            self._token_ring = ctx.storage(TOKEN_RING_BYTES, "token ring")
        if self._ring_cursor + 8 * tokens > TOKEN_RING_BYTES:
            self._ring_cursor = 0
        ctx.copy(out.buffer, 0, self._token_ring, self._ring_cursor, 8 * tokens)
        handle = GpuTokens(out, tokens, self._ring_cursor)
        self._ring_cursor += 8 * tokens
        ctx.flush()
        return handle

    def read_tokens(self, handles: Sequence[GpuTokens]) -> list[np.ndarray]:
        """The ids of ``handles`` in one readback: ``-1`` where the logits were not finite,
        ``kjarni.backend.UNDECIDED`` for a draw left to the CPU (`gpu_sampling.decode_ring`)."""
        if not handles:
            return []
        ring, counts = self._token_ring, [len(h) for h in handles]
        offsets = [h.ring_offset for h in handles]
        read = self.context.read
        if all(offsets[i + 1] == offsets[i] + 8 * counts[i] for i in range(len(handles) - 1)):
            data = read(ring, offsets[0], 8 * sum(counts))
        else:  # the ring wrapped between them
            data = b"".join(read(ring, offset, 8 * count) for offset, count in zip(offsets, counts))
        return gpu_sampling.decode_ring(np.frombuffer(data, dtype=np.uint32), counts)

    def _argmax(self, x: GpuTensor) -> Scratch:
        """Records the argmax of each row of ``x`` into a new ``[2, tokens]`` u32 buffer: the ids,
        then a status per row (`gpu_sampling.NOT_FINITE` where the row holds a NaN or an inf)."""
        ctx = self.context
        tokens, cols = x.shape
        chunks = -(-cols // 2048)
        partial = ctx.scratch(tokens * chunks * 8)
        out = ctx.scratch(tokens * 8)
        params = ctx.uniform(SELECT.pack(cols=cols, tokens=tokens, chunks=chunks, k=1))
        buffers = (params, x.buffer, partial.buffer, out.buffer)
        constants = self._finite_constants()
        ctx.dispatch(ctx.pipeline("argmax", SELECT_KINDS, entry="chunks", constants=constants), buffers, (chunks, tokens, 1))
        ctx.dispatch(ctx.pipeline("argmax", SELECT_KINDS, entry="main", constants=constants), buffers, (1, tokens, 1))
        return out

    def _finite_constants(self) -> dict[str, float] | None:
        return None if self.finite_check else {"FINITE_CHECK": 0}

    def top_k(self, x: GpuTensor, k: int) -> tuple[np.ndarray, np.ndarray]:
        tokens, cols = x.shape
        k = min(int(k), cols)
        if k < 1:
            raise InvalidConfigurationError(f"top_k needs k >= 1, got {k}")
        if k > MAX_TOP_K:
            logits = self.read(x)
            part = np.argpartition(-logits, k - 1, axis=-1)[:, :k]
            values = np.take_along_axis(logits, part, axis=-1)
            order = np.lexsort((part, -values), axis=-1)
            ids = np.take_along_axis(part, order, axis=-1).astype(np.int64)
            values = np.take_along_axis(logits, ids, axis=-1)
            ids[~np.isfinite(logits).all(axis=-1)] = -1  # as the kernel flags them (ops.py)
            return values, ids
        out = self._top_k(x, k)
        pairs = np.frombuffer(self.context.read(out.buffer, 0, tokens * k * 8), dtype=np.uint32).reshape(tokens, k, 2)
        values, ids = pairs[:, :, 0].copy().view(np.float32), pairs[:, :, 1].astype(np.int64)
        ids[~np.isfinite(values[:, 0])] = -1  # the first pair carries a NaN / inf logit as it is (top_k.wgsl)
        return values, ids

    def _top_k(self, x: GpuTensor, k: int, per_chunk: int = 0) -> Scratch:
        """Records the ``k`` (<= MAX_TOP_K, <= cols) best (value bits, index) pairs of each row into
        a new ``[tokens, k]`` buffer; NaN and inf rank first and the first pair keeps their bits.
        ``per_chunk`` > 0: top_k.wgsl's sampling variant (``per_chunk`` candidates per interleaved
        chunk), with a ``[tokens]`` "incomplete" pair after the ``[tokens, k]`` ones."""
        ctx = self.context
        tokens, cols = x.shape
        chunks = -(-cols // 2048)
        partial = ctx.scratch(tokens * chunks * (per_chunk or k) * 8)
        out = ctx.scratch(tokens * (k + (1 if per_chunk else 0)) * 8)
        params = ctx.uniform(SELECT.pack(cols=cols, tokens=tokens, chunks=chunks, k=k))
        buffers = (params, x.buffer, partial.buffer, out.buffer)
        constants = {**(self._finite_constants() or {}), **({"PER_CHUNK": per_chunk} if per_chunk else {})} or None
        ctx.dispatch(ctx.pipeline("top_k", SELECT_KINDS, entry="chunks", constants=constants), buffers, (chunks, tokens, 1))
        ctx.dispatch(ctx.pipeline("top_k", SELECT_KINDS, entry="main", constants=constants), buffers, (1, tokens, 1))
        return out


def _storage_usage() -> int:
    import wgpu

    return wgpu.BufferUsage.STORAGE


def _rows(a: Any) -> int:
    return int(a.shape[0])


def _cols(a: Any) -> int:
    return int(a.shape[1])


def _nbytes(seg: _Segment) -> int:
    return int(seg.w_a.size) + (int(seg.w_b.size) if not seg.dense else 0)
