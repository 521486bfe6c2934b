"""NumpyOps: the executable specification of the backend contract in backend.py.

float32 throughout and written for reading. Every constant is float32: one float64 scalar
would promote the activations and make decoding ten times slower.
"""

from __future__ import annotations

import weakref
from typing import Sequence

import gguf
import numpy as np

from kjarni.errors import ContextOverflowError, InvalidConfigurationError
from kjarni.backend import WeightSource
from kjarni.weights import QuantTensor


def _as_f32(part: WeightSource) -> np.ndarray:
    if isinstance(part, QuantTensor):
        return part.dequantize()
    return np.ascontiguousarray(part, dtype=np.float32)


ATTENTION_ROWS = 64
"""Query rows per attention step (fewer where the scores would pass ``ATTENTION_BYTES``): speed only."""

ATTENTION_BYTES = 64 << 20
"""Bound on one attention step's scores buffer (``kv_heads x rows x keys x groups`` float32)."""

KEY_CHUNK = 256
"""Keys per product in attention, chunks aligned to position 0: every product has one shape."""

F16_TILE_ELEMENTS = 1 << 18
"""Weights widened to float32 per step of the f16 path: 1 MiB, which stays in L2 while it is used."""


F16_MAX = float(np.finfo(np.float16).max)
F16_LOAD_ROWS = 4096
"""Rows of a quantized tensor dequantized at a time while loading in f16 (bounds the float32 transient)."""


def _as_f16(part: WeightSource, name: str) -> np.ndarray:
    """A weight matrix as float16; a quantized one dequantized a few thousand rows at a time."""
    if isinstance(part, QuantTensor):
        rows, width = part.shape
        out = np.empty(part.shape, dtype=np.float16)
        for first in range(0, rows, F16_LOAD_ROWS):
            chunk = gguf.quants.dequantize(part.data[first : first + F16_LOAD_ROWS], part.ggml_type)
            out[first : first + F16_LOAD_ROWS] = _checked_for_f16(chunk.reshape(-1, width), name)
        return out
    array = _checked_for_f16(np.asarray(part), name)
    return array if array.dtype == np.float16 else array.astype(np.float16)


def _checked_for_f16(values: np.ndarray, name: str) -> np.ndarray:
    """``values``, refused when one is not finite or beyond float16's range (it would become inf)."""
    largest = max(float(values.max()), -float(values.min())) if values.size else 0.0  # NaN propagates
    if not largest <= F16_MAX:
        raise InvalidConfigurationError(
            f"{name} holds a value of magnitude {largest:.3g}, beyond float16's {F16_MAX:g}: it cannot be "
            f"stored as f16; load it with cpu_weight_format 'f32' (the default)"
        )
    return values


_F16_TO_F32_EXPONENT = np.float32(2.0**112)


def _widen_f16(bits: np.ndarray, out: np.ndarray, scratch: np.ndarray) -> None:
    """float16 bit patterns (uint16) into ``out`` as float32, exactly for every finite value
    (subnormals and signed zeros included), in five in-cache integer passes: about twice as fast
    as numpy's own float16 cast. Magnitude bits shifted into an f32's place read as the value times
    2^-112, which one multiply undoes; then the sign bit is put back."""
    np.bitwise_and(bits, 0x7FFF, out=scratch, casting="unsafe")
    np.left_shift(scratch, 13, out=scratch)
    np.multiply(scratch.view(np.float32), _F16_TO_F32_EXPONENT, out=out)
    np.bitwise_and(bits, 0x8000, out=scratch, casting="unsafe")
    np.left_shift(scratch, 16, out=scratch)
    np.bitwise_or(out.view(np.uint32), scratch, out=out.view(np.uint32))


class NumpyKVCache:
    """Keys and values, ``[layers, kv_heads, capacity, head_dim]`` each, allocated once."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int) -> None:
        shape = (num_layers, num_kv_heads, capacity, head_dim)
        self.keys = np.zeros(shape, dtype=np.float32)
        self.values = np.zeros(shape, dtype=np.float32)
        self.capacity = capacity
        self.offset = 0

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def trim(self, n: int) -> int:
        """Forget the last ``n`` positions; returns the new offset."""
        self.offset -= min(max(n, 0), self.offset)
        return self.offset


_T = gguf.GGMLQuantizationType
INT_DOT_TYPES = frozenset({_T.Q8_0, _T.Q5_0, _T.Q4_K})
"""GGUF types whose one-token products the GPU computes against int8-quantized activations
(matvec_dot.tmpl.wgsl, GpuTuning.matvec_int_dot); ``quantize_activations=True`` mirrors it."""
INT_DOT_PREFILL_TYPES = INT_DOT_TYPES | {_T.Q4_0, _T.Q4_1, _T.Q5_1, _T.Q6_K}
"""GGUF types whose prefill products the GPU computes against int8-quantized activations off
tensor cores (matmul_dot.tmpl.wgsl, GpuTuning.matmul_int_dot; kernels.DOT_SCALING);
``quantized_prefill_min_tokens`` mirrors it."""


def quantize_blocks(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``x`` (float32, a multiple of 32 values a row) as int8 blocks of 32 the way
    matvec_dot.tmpl.wgsl quantizes it: ``q = round(v * 127 / max|v|)`` (half to even, int8,
    ``[blocks, 32]``) and the block scales ``d = max|v| / 127`` (float32, ``[blocks, 1]``)."""
    blocks = x.reshape(-1, 32)
    amax = np.abs(blocks).max(axis=1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127.0) / amax, np.float32(0.0))
    return np.round(blocks * inv).astype(np.int8), amax / np.float32(127.0)


def quantize_activations(x: np.ndarray) -> np.ndarray:
    """``x`` rounded as matvec_dot.tmpl.wgsl rounds it (`quantize_blocks`): ``v' = q d``. The
    error of a value is at most ``max|v| / 254`` of its block."""
    q, d = quantize_blocks(x)
    return (q * d).astype(np.float32).reshape(x.shape)


WEIGHT_FORMATS = ("f32", "f16")
ACTIVATION_FORMATS = ("f32", "f16")


class NumpyOps:
    """The CPU backend: plain numpy, float32.

    ``weight_format="f16"`` is the lower-memory mode: weight matrices are stored as float16 (half
    the memory of float32) and every product still computes in float32, a tile of rows at a time
    (`_linear_f16`). Weights are rounded to f16 once, so logits differ from the float32 reference
    by that rounding; norms, biases and activations stay float32.

    ``activations="f16"`` rounds the input of each linear (of at least
    ``f16_activation_min_tokens`` rows) to float16 before the float32 product: the math of the
    GPU's tensor-core prefill (f16 x f16 products, f32 sums), to check the GPU against tightly and
    to measure what that rounding costs against the float32 reference.

    ``quantize_activations=True`` rounds the input of every one-token product by a Q8_0, Q5_0 or
    Q4_K weight (`INT_DOT_TYPES`) to int8 blocks of 32 (`quantize_activations`), as the GPU's
    integer-dot decode product does: the reference to check that kernel against tightly. A weight
    concatenated from parts of several formats (a Q4_K q/k with a Q6_K v) rounds it for the rows of
    its int-dot parts only, as the GPU runs each part (segment) with its own kernel.
    ``quantized_prefill_min_tokens`` (whatever ``quantize_activations`` says): products of at
    least this many rows by a weight of `INT_DOT_PREFILL_TYPES` (those and Q4_0, Q4_1, Q5_1,
    Q6_K), with rows of a multiple of 64 values, are rounded too, as the GPU's integer-dot
    prefill (matmul_dot.tmpl.wgsl, ``GpuTuning.matmul_int_dot``, which needs that width; narrower
    rows keep the float32 SIMT matmul) does above ``GpuTuning.matvec_max_tokens``; 0, the
    default: only one-token products.
    """

    name = "cpu"
    decode_ahead = 1  # results are ready when computed: nothing to gain from running ahead

    def __init__(
        self,
        attention_rows: int = ATTENTION_ROWS,
        weight_format: str = "f32",
        *,
        activations: str = "f32",
        f16_activation_min_tokens: int = 1,
        quantize_activations: bool = False,
        quantized_prefill_min_tokens: int = 0,
    ) -> None:
        # Query rows per attention step: any value gives the same bits (see _attend), only speed.
        self.attention_rows = attention_rows
        if weight_format not in WEIGHT_FORMATS:
            raise InvalidConfigurationError(
                f"NumpyOps weight_format {weight_format!r} is not one of: {', '.join(WEIGHT_FORMATS)}"
            )
        if activations not in ACTIVATION_FORMATS:
            raise InvalidConfigurationError(
                f"NumpyOps activations {activations!r} is not one of: {', '.join(ACTIVATION_FORMATS)}"
            )
        self.weight_format = weight_format
        # "f16": the input of every linear of at least f16_activation_min_tokens rows is rounded
        # to float16 first (after the norm and silu_mul before it), as the GPU's tensor-core
        # prefill does (matmul_sgmat.tmpl.wgsl), so the GPU can be checked against it tightly.
        self.activations = activations
        self.f16_activation_min_tokens = int(f16_activation_min_tokens)
        self.quantize_activations = bool(quantize_activations)
        self.quantized_prefill_min_tokens = int(quantized_prefill_min_tokens)
        # Weights with parts loaded from INT_DOT_TYPES tensors (by id, the array kept weakly), whose
        # one-token products read quantized activations for those parts' rows when
        # quantize_activations is on; and with parts of INT_DOT_PREFILL_TYPES, whose prefill products
        # do (quantized_prefill_min_tokens). The rows: `_int_dot_rows` / `_int_dot_prefill_rows`,
        # None where every part is of those types.
        self._int_dot_weights: weakref.WeakValueDictionary[int, np.ndarray] = weakref.WeakValueDictionary()
        self._int_dot_prefill_weights: weakref.WeakValueDictionary[int, np.ndarray] = weakref.WeakValueDictionary()
        self._int_dot_rows: dict[int, list[tuple[int, int]] | None] = {}
        self._int_dot_prefill_rows: dict[int, list[tuple[int, int]] | None] = {}
        self._tile = np.empty(0, dtype=np.float32)  # the f16 path's float32 tile, grown once
        self._scratch = np.empty(0, dtype=np.uint32)

    def weight(self, parts: WeightSource | Sequence[WeightSource], *, name: str) -> np.ndarray:
        if isinstance(parts, (np.ndarray, QuantTensor)):
            parts = [parts]
        if self.weight_format == "f16" and name.endswith(".weight") and all(len(p.shape) == 2 for p in parts):
            arrays = [_as_f16(p, name) for p in parts]  # the lower-memory mode's weight matrices
        else:
            arrays = [_as_f32(p) for p in parts]
        out = arrays[0] if len(arrays) == 1 else np.concatenate(arrays, axis=0)
        if out.ndim == 2:
            types = [p.ggml_type if isinstance(p, QuantTensor) else None for p in parts]
            self._note_rows(out, [a.shape[0] for a in arrays], [t in INT_DOT_TYPES for t in types],
                            self._int_dot_weights, self._int_dot_rows)
            self._note_rows(out, [a.shape[0] for a in arrays], [t in INT_DOT_PREFILL_TYPES for t in types],
                            self._int_dot_prefill_weights, self._int_dot_prefill_rows)
        return out

    @staticmethod
    def _note_rows(out: np.ndarray, heights: list[int], chosen: list[bool], weights: weakref.WeakValueDictionary,
                   rows: dict[int, list[tuple[int, int]] | None]) -> None:
        """Notes ``out`` in ``weights`` (and its rows of ``chosen`` parts in ``rows``; None: all)
        where any part is chosen; the entry goes with the array."""
        if not any(chosen):
            return
        ends = np.cumsum(heights).tolist()
        spans = [(end - h, end) for h, end, c in zip(heights, ends, chosen) if c]
        key = id(out)
        weights[key] = out
        rows[key] = None if all(chosen) else spans
        weakref.finalize(out, rows.pop, key, None)

    @property
    def has_int_dot_weights(self) -> bool:
        """Whether a loaded weight is one whose one-token products ``quantize_activations`` rounds."""
        return len(self._int_dot_weights) > 0

    @property
    def has_int_dot_prefill_weights(self) -> bool:
        """Whether a loaded weight is one whose prefill products ``quantized_prefill_min_tokens`` rounds."""
        return len(self._int_dot_prefill_weights) > 0

    def new_kv_cache(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int) -> NumpyKVCache:
        return NumpyKVCache(num_layers, num_kv_heads, head_dim, capacity)

    def embed(self, table: np.ndarray, token_ids: np.ndarray) -> np.ndarray:
        rows = table[np.asarray(token_ids, dtype=np.int64)]
        return rows if rows.dtype == np.float32 else rows.astype(np.float32)

    def rms_norm(self, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        variance = np.mean(x * x, axis=-1, keepdims=True)
        return x / np.sqrt(variance + np.float32(eps)) * weight

    def layer_norm(self, x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
        centered = x - np.mean(x, axis=-1, keepdims=True)
        variance = np.mean(centered * centered, axis=-1, keepdims=True)
        return centered / np.sqrt(variance + np.float32(eps)) * weight + bias

    def linear(
        self,
        x: np.ndarray,
        weight: np.ndarray,
        bias: np.ndarray | None = None,
        residual: np.ndarray | None = None,
    ) -> np.ndarray:
        if self.activations == "f16" and x.shape[0] >= self.f16_activation_min_tokens:
            x = x.astype(np.float16).astype(np.float32)
        spans: list[tuple[int, int]] | None = []  # rows whose product reads x rounded to int8; None: all
        if self.quantize_activations and x.shape[0] == 1 and self._int_dot_weights.get(id(weight)) is weight:
            spans = self._int_dot_rows.get(id(weight), [])
        elif (0 < self.quantized_prefill_min_tokens <= x.shape[0] and x.shape[1] % 64 == 0
              and self._int_dot_prefill_weights.get(id(weight)) is weight):
            spans = self._int_dot_prefill_rows.get(id(weight), [])
        if spans is None:
            x = quantize_activations(x)
        if spans:  # each run of rows once: the int-dot parts' from the rounded x, the others' from x
            xq = quantize_activations(x)
            y = np.empty((x.shape[0], weight.shape[0]), np.float32)
            row = 0
            for start, end in [*spans, (weight.shape[0], weight.shape[0])]:
                if row < start:
                    y[:, row:start] = self._product(x, weight[row:start])
                if start < end:
                    y[:, start:end] = self._product(xq, weight[start:end])
                row = end
        else:
            y = self._product(x, weight)
        if bias is not None:
            y += bias
        if residual is not None:
            y += residual
        return y

    def _product(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        """``x @ weight.T``, computed as ``(weight @ x.T).T``: for a few rows (speculative
        verification) OpenBLAS then streams the weight once like a matrix-vector product instead of
        repacking it first, 2-3x faster at 2-8 rows and no slower for one row or a long prompt."""
        if weight.dtype == np.float16:
            return self._linear_f16(x, weight)
        return (weight @ x.T).T  # column-major for several rows; the ops after it take any layout

    def _linear_f16(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        """``(weight @ x.T).T`` for an f16 ``weight``: each tile of its rows widened to float32 in a
        buffer that stays in cache, then multiplied; the result has the float32 path's layout."""
        rows, width = weight.shape
        tile_rows = max(1, F16_TILE_ELEMENTS // width)
        if self._tile.size < tile_rows * width:
            self._tile = np.empty(tile_rows * width, dtype=np.float32)
            self._scratch = np.empty(tile_rows * width, dtype=np.uint32)
        tile = self._tile[: tile_rows * width].reshape(tile_rows, width)
        scratch = self._scratch[: tile_rows * width].reshape(tile_rows, width)
        out = np.empty((rows, x.shape[0]), dtype=np.float32)
        columns = np.ascontiguousarray(x.T)
        bits = weight.view(np.uint16)
        for first in range(0, rows, tile_rows):
            count = min(tile_rows, rows - first)
            _widen_f16(bits[first : first + count], tile[:count], scratch[:count])
            np.matmul(tile[:count], columns, out=out[first : first + count])
        return out.T

    def norm_linear(
        self,
        x: np.ndarray,
        norm_weight: np.ndarray,
        eps: float,
        weight: np.ndarray,
        bias: np.ndarray | None = None,
    ) -> np.ndarray:
        return self.linear(self.rms_norm(x, norm_weight, eps), weight, bias)

    def swiglu_mlp(
        self,
        x: np.ndarray,
        norm_weight: np.ndarray,
        eps: float,
        gate_up: np.ndarray,
        down: np.ndarray,
        residual: np.ndarray | None = None,
    ) -> np.ndarray:
        return self.linear(self.silu_mul(self.norm_linear(x, norm_weight, eps, gate_up)), down, residual=residual)

    def rope_store(
        self, qkv: np.ndarray, rope: np.ndarray | None, kv_cache: NumpyKVCache, layer: int, start: int
    ) -> np.ndarray:
        tokens = qkv.shape[0]
        _, num_kv_heads, capacity, head_dim = kv_cache.keys.shape
        if start + tokens > capacity:
            raise ContextOverflowError(
                f"{start + tokens} positions do not fit in a KV cache of {capacity}",
                tokens=start + tokens,
                context=capacity,
            )
        kv_width = num_kv_heads * head_dim
        num_heads = (qkv.shape[1] - 2 * kv_width) // head_dim
        q = qkv[:, : num_heads * head_dim].reshape(tokens, num_heads, head_dim)
        k = qkv[:, num_heads * head_dim : num_heads * head_dim + kv_width].reshape(tokens, num_kv_heads, head_dim)
        v = qkv[:, num_heads * head_dim + kv_width :].reshape(tokens, num_kv_heads, head_dim)
        if rope is not None:
            table = rope[start : start + tokens]
            half = table.shape[1] // 2
            cos, sin = table[:, None, :half], table[:, None, half:]
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        kv_cache.keys[layer, :, start : start + tokens] = k.transpose(1, 0, 2)
        kv_cache.values[layer, :, start : start + tokens] = v.transpose(1, 0, 2)
        return q.reshape(tokens, num_heads * head_dim)

    def attention(
        self, q: np.ndarray, kv_cache: NumpyKVCache, layer: int, start: int, window: int | None = None
    ) -> np.ndarray:
        tokens = q.shape[0]
        _, num_kv_heads, _, head_dim = kv_cache.keys.shape
        num_heads = q.shape[1] // head_dim
        groups = num_heads // num_kv_heads
        # [kv_heads, tokens, groups, head_dim], scaled: a row's query heads sharing one kv head sit
        # together, one small matrix per row and kv head.
        q = q.reshape(tokens, num_kv_heads, groups, head_dim).transpose(1, 0, 2, 3)
        q = np.multiply(q, np.float32(1.0 / np.sqrt(head_dim)), order="C")
        keys, values = kv_cache.keys[layer], kv_cache.values[layer]  # [kv_heads, capacity, head_dim]
        # activations="f16": the scaled q, the keys and values (where the cache is not f16 already)
        # and the softmax weights rounded to f16 for the products, as the GPU's tensor-core
        # prefill attention (attention_tc.tmpl.wgsl) does.
        f16 = self.activations == "f16" and tokens >= self.f16_activation_min_tokens
        if f16:
            q = q.astype(np.float16).astype(np.float32)
            keys, values = (a.astype(np.float16).astype(np.float32) for a in (keys, values))
        out = np.empty_like(q)
        last_chunk = (start + tokens - 1) // KEY_CHUNK
        row_bytes = num_kv_heads * (last_chunk + 1) * groups * KEY_CHUNK * 4
        step = max(1, min(self.attention_rows, ATTENTION_BYTES // row_bytes))
        for t in range(0, tokens, step):
            end = min(tokens, t + step)
            out[:, t:end] = _attend(q[:, t:end], keys, values, start + t, window, f16)
        return out.transpose(1, 0, 2, 3).reshape(tokens, num_heads * head_dim)

    def silu_mul(self, x: np.ndarray) -> np.ndarray:
        half = x.shape[1] // 2
        gate, up = x[:, :half], x[:, half:]
        return gate / (np.float32(1.0) + np.exp(-gate)) * up

    def gelu(self, x: np.ndarray) -> np.ndarray:
        inner = _SQRT_2_OVER_PI * (x + np.float32(0.044715) * x * x * x)
        return np.float32(0.5) * x * (np.float32(1.0) + np.tanh(inner))

    def add(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return a + b

    def rows(self, x: np.ndarray, first: int, count: int) -> np.ndarray:
        return x[first : first + count]

    def read(self, x: np.ndarray) -> np.ndarray:
        return np.asarray(x, dtype=np.float32)

    def argmax(self, x: np.ndarray) -> np.ndarray:
        ids = np.argmax(x, axis=-1).astype(np.int64)
        ids[_non_finite_rows(x)] = -1  # the contract's flag for NaN / inf logits (ops.py)
        return ids

    def top_k(self, x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        k = min(k, x.shape[-1])
        part = np.argpartition(-x, k - 1, axis=-1)[:, :k]
        values = np.take_along_axis(x, part, axis=-1)
        order = np.lexsort((part, -values), axis=-1)
        ids = np.take_along_axis(part, order, axis=-1).astype(np.int64)
        ids[_non_finite_rows(x)] = -1
        return np.take_along_axis(x, np.maximum(ids, 0), axis=-1), ids


def _non_finite_rows(x: np.ndarray) -> np.ndarray:
    """Rows of ``x`` holding a NaN or an inf: one ``isfinite`` pass over what argmax reads anyway."""
    return ~np.isfinite(x).all(axis=-1)


_SQRT_2_OVER_PI = np.float32(np.sqrt(2.0 / np.pi))


def _attend(
    q: np.ndarray, keys: np.ndarray, values: np.ndarray, first_position: int, window: int | None, f16: bool = False
) -> np.ndarray:
    """Attention of scaled query rows ``[kv_heads, rows, groups, head_dim]`` at consecutive positions.
    ``f16``: the softmax weights (after the exp, before their sums and the product with the
    values) rounded to f16.

    A row gets the same bits however many rows it is computed with, on any BLAS, by construction:
    every matrix product is one query row's ``[groups, head_dim]`` against one chunk of KEY_CHUNK
    keys aligned to position 0 (scores, ``[groups, KEY_CHUNK]``), or those weights against the
    chunk's values, so each product's shapes and inputs are the row's own whatever the batch (a
    chunk the cache ends inside is zero-filled to full size). The rest is elementwise, exact (the
    max), numpy's sum over one chunk's KEY_CHUNK contiguous weights (its order fixed by that
    length), or chunk after chunk in order. Keys a row does not see weigh exactly 0, so the chunks
    a batch adds past a row's last one change nothing. (One product for many rows would not do:
    BLAS picks its kernels, and so its rounding, by the matrix sizes, which are the batch's.)
    """
    num_kv_heads, rows, groups, head_dim = q.shape
    last_position = first_position + rows - 1
    # Chunks some row sees: from the first inside the earliest row's window to the last row's own.
    first = 0 if window is None else max(0, first_position - window + 1) // KEY_CHUNK
    end = last_position // KEY_CHUNK + 1
    chunks = end - first
    whole = min(end, keys.shape[1] // KEY_CHUNK) - first  # chunks the cache holds in full
    low, held = first * KEY_CHUNK, (first + whole) * KEY_CHUNK

    def by_chunk(part: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """``part``'s full chunks ``[kv_heads, 1, whole, KEY_CHUNK, head_dim]``, and the last one zero-filled."""
        full = part[:, low:held].reshape(num_kv_heads, 1, whole, KEY_CHUNK, head_dim)
        if whole == chunks:
            return full, None
        last = np.zeros((num_kv_heads, 1, 1, KEY_CHUNK, head_dim), dtype=np.float32)
        last[:, 0, 0, : part.shape[1] - held] = part[:, held:]
        return full, last

    # Scores [kv_heads, rows, chunks, groups, KEY_CHUNK]: one product per row, kv head and chunk.
    scores = np.empty((num_kv_heads, rows, chunks, groups, KEY_CHUNK), dtype=np.float32)
    q = q[:, :, None]
    full, last = by_chunk(keys)
    np.matmul(q, full.swapaxes(-1, -2), out=scores[:, :, :whole])
    if last is not None:
        np.matmul(q, last.swapaxes(-1, -2), out=scores[:, :, whole:])
    positions = np.arange(first_position, last_position + 1)[:, None]
    key_positions = np.arange(low, end * KEY_CHUNK)[None, :]
    hidden = key_positions > positions
    if window is not None:
        hidden |= key_positions <= positions - window
    np.copyto(scores, -np.inf, where=hidden.reshape(rows, chunks, 1, KEY_CHUNK))
    scores -= scores.max(axis=(2, 4), keepdims=True)
    np.exp(scores, out=scores)
    if f16:
        scores[...] = scores.astype(np.float16)

    sums = scores.sum(axis=-1)  # [kv_heads, rows, chunks, groups]
    products = np.empty((num_kv_heads, rows, chunks, groups, head_dim), dtype=np.float32)
    full, last = by_chunk(values)
    np.matmul(scores[:, :, :whole], full, out=products[:, :, :whole])
    if last is not None:
        np.matmul(scores[:, :, whole:], last, out=products[:, :, whole:])
    mixed, total = products[:, :, 0].copy(), sums[:, :, 0].copy()
    for chunk in range(1, chunks):  # in order; a chunk a row does not see adds exact zeros
        mixed += products[:, :, chunk]
        total += sums[:, :, chunk]
    mixed /= total[..., None]
    return mixed


def _rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Hugging Face rotate-half RoPE on ``[tokens, heads, head_dim]``; dims past ``2 * cos.shape[-1]`` pass."""
    half = cos.shape[-1]
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    return np.concatenate((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), axis=-1)
