"""Weight upload: vectors, rope tables and matrices as `GpuWeight`, matrices in `Segment`s.

A matrix is kept in the format its kernel reads: f32/f16 rows padded to 8 columns, GGUF blocks
repacked by kjarni/gpu/quant.py where a kernel exists (else dequantized and kept as
``weight_format``), and split into row ranges that each fit one storage binding.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from kjarni.backend import WeightSource
from kjarni.errors import InvalidModelError
from kjarni.gpu import kernels
from kjarni.gpu.context import WgpuContext
from kjarni.weights import QuantTensor


@dataclass(eq=False)
class Segment:
    """Rows ``row_offset .. row_offset + rows`` of a matrix in one format, within one binding."""

    format: str  # "f32", "f16" or a GGUF type name ("Q8_0", ...)
    row_offset: int
    rows: int
    w_a: Any
    w_b: Any
    linear_kernel: str
    dense: bool  # f32/f16: the linear_body kernels; else quant.py's `main`

    @property
    def nbytes(self) -> int:
        return int(self.w_a.size) + (int(self.w_b.size) if not self.dense else 0)


@dataclass(eq=False)
class GpuWeight:
    """A weight uploaded once: a vector (``buffer``), an f32 table (``buffer``) or a matrix (``segments``)."""

    name: str
    kind: str  # "vector", "table" or "matrix"
    shape: tuple[int, ...]
    nbytes: int
    buffer: Any = None
    segments: list[Segment] = field(default_factory=list)
    plans: dict = field(default_factory=dict, repr=False)  # kjarni/gpu/linear.py: dispatch plans per use

    @property
    def formats(self) -> list[str]:
        return sorted({s.format for s in self.segments})


class Uploader:
    """Uploads weights to ``context`` as ``weight_format`` says (see `WgpuOps`); notes once per
    GGUF type that has no GPU kernel and is converted at load."""

    def __init__(self, context: WgpuContext, weight_format: str) -> None:
        self.context = context
        self.weight_format = weight_format
        self._noticed: set[str] = set()

    def weight(self, parts: WeightSource | Sequence[WeightSource], name: str) -> GpuWeight:
        ctx = self.context
        if isinstance(parts, (np.ndarray, QuantTensor)):
            parts = [parts]
        parts = list(parts)
        if all(isinstance(p, np.ndarray) and p.ndim == 1 for p in parts):
            vector = np.concatenate([np.asarray(p, dtype=np.float32) for p in parts])
            return GpuWeight(name, "vector", vector.shape, vector.nbytes, buffer=ctx.upload(vector, name))
        if name == "rope" or name.startswith("rope.") or name.endswith(".rope"):
            table = np.ascontiguousarray(np.concatenate([np.asarray(p, np.float32) for p in parts]))
            return GpuWeight(name, "table", table.shape, table.nbytes, buffer=ctx.upload(table, name))
        segments: list[Segment] = []
        row = 0
        cols = None
        # Consecutive parts of one format are stacked and uploaded together; a format change
        # (e.g. Q4_K q/k with a Q6_K v) starts a new segment that writes its own rows of y.
        for fmt, arrays in self._group_parts(parts, name):
            cols = cols if cols is not None else int(arrays[0].shape[1])
            if int(arrays[0].shape[1]) != cols:
                raise InvalidModelError(f"{name}: parts have different column counts")
            segments.extend(self._upload_matrix(fmt, arrays, row, name))
            row += sum(int(a.shape[0]) for a in arrays)
        nbytes = sum(s.nbytes for s in segments)
        return GpuWeight(name, "matrix", (row, cols), nbytes, segments=segments)

    def _group_parts(self, parts: list, name: str) -> list[tuple[str, list]]:
        from kjarni.gpu import quant  # imports gguf: only once a model loads

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

    def _upload_matrix(self, fmt: str, arrays: list, row0: int, name: str) -> list[Segment]:
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
                segments.append(Segment(fmt, row0 + r, chunk.shape[0], buf, ctx.dummy, f"linear_{fmt}", True))
            return segments
        reps = [quant.repack(a) for a in arrays]
        rep = reps[0]
        if len(reps) > 1:
            rep = dataclasses.replace(
                rep,
                rows=sum(r.rows for r in reps),
                w_a=np.concatenate([r.w_a for r in reps]),
                w_b=np.concatenate([r.w_b for r in reps]),
            )
        return [
            Segment(
                fmt, row0 + chunk.row_offset, chunk.rows, ctx.upload(chunk.w_a, name), ctx.upload(chunk.w_b, name),
                chunk.kernel, False,
            )
            for chunk in quant.split_rows(rep, limit)
        ]
