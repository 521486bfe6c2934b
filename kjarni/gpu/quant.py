"""GGUF quantized weights repacked for the GPU: aligned ``u32`` arrays the linear/embed kernels read.

GGUF blocks are byte-packed structs (Q8_0 is 34 bytes, Q5_0 22, Q6_K 210), and WGSL storage has
no 8- or 16-bit types, so each tensor is split once at load into two ``u32`` arrays:

- ``w_a`` ``[rows, words_a]``: the packed quants of every block of a row, in block order, bytes
  exactly as GGUF stores them (little-endian words), so nibble/byte order stays GGUF's.
- ``w_b`` ``[rows, words_b]``: the side data of a row's blocks (f16 scales/mins as pairs, K-quant
  sub-block scales).

Both are row-major, so rows ``r0 .. r1`` are the contiguous slices ``w_a[r0:r1]`` and
``w_b[r0:r1]``: a weight larger than the storage binding limit splits into row chunks
(`split_rows`) without touching the data. Per row, with ``nb = cols / block_size`` blocks
(value ``j`` of block ``b`` is column ``b * block_size + j``; "f16 pair" means block ``2k`` in the
low half of word ``k`` and block ``2k+1`` in the high half):

====== ======================================== ==============================================
format w_a per block (words)                    w_b per row
====== ======================================== ==============================================
Q4_0   4: qs (byte i: value i low nibble,       ceil(nb/2) words: d as f16 pairs
          value i+16 high nibble)
Q4_1   4: qs as Q4_0                            nb words: d (low half), m (high half)
Q5_0   5: qs as Q4_0, then qh (bit j: value     ceil(nb/2) words: d as f16 pairs
          j's 5th bit)
Q5_1   5: qs, qh as Q5_0                        nb words: d (low half), m (high half)
Q8_0   8: 32 int8 values                        ceil(nb/2) words: d as f16 pairs
Q4_K   32: 128 qs bytes (byte 32j+l: value      4 words per block: (d, dmin) f16 pair, then
          64j+l low nibble, 64j+32+l high)      the 12 GGUF scale bytes (6-bit sc/m, 8 each)
Q6_K   48: 32 words ql, then 16 words qh        5 words per block: 16 int8 scales, then d
          (GGUF order, see dequantize below)    (f16 in the low half)
====== ======================================== ==============================================

Values: Q4_0 ``d*(q-8)``, Q4_1 ``d*q+m``, Q5_0 ``d*(q-16)``, Q5_1 ``d*q+m``, Q8_0 ``d*q``,
Q4_K ``(d*sc[s])*q - dmin*m[s]`` (``s`` = value // 32), Q6_K ``(d*scale[value // 16])*(q-32)``.
`dequantize_repacked` is the executable form of this table; tests hold it bit-exact to
``gguf.quants.dequantize``.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import gguf
import numpy as np

from kjarni.errors import InvalidModelError

if TYPE_CHECKING:
    from kjarni.weights import QuantTensor

T = gguf.GGMLQuantizationType

SUPPORTED = frozenset({T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q6_K})
"""GGUF types with a repack, a ``linear_<format>`` and an ``embed_<format>`` kernel."""


ROWS_PER_WORKGROUP = 4
"""Rows one workgroup of the subgroup variant covers on a 32-wide GPU: dispatch
``workgroup_count(rows)``; the kernels loop over rows, so any count is correct."""

MAX_WORKGROUPS = 65535


@dataclasses.dataclass(frozen=True, eq=False)
class RepackedWeight:
    """A quantized ``[rows, cols]`` matrix as the GPU kernels read it (layouts: module docstring).

    ``row_offset`` is the first row of this chunk within the whole weight (0 unless from
    `split_rows`); it goes to the kernels' ``Params.row_offset``.
    """

    format_name: str
    rows: int
    cols: int
    w_a: np.ndarray  # uint32 [rows, words_a]
    w_b: np.ndarray  # uint32 [rows, words_b]
    kernel: str  # shader file stem of the linear kernel, e.g. "linear_q8_0"
    row_offset: int = 0

    @property
    def nbytes(self) -> int:
        return int(self.w_a.nbytes + self.w_b.nbytes)


# ================================================================ repack


def _f16_pairs(d: np.ndarray) -> np.ndarray:
    """uint8 [rows, nb, 2] f16 fields -> uint32 [rows, ceil(nb/2)], block 2k in the low half."""
    rows, nb, _ = d.shape
    halves = np.zeros((rows, nb + (nb & 1)), dtype=np.uint16)
    halves[:, :nb] = d.reshape(rows, nb * 2).view(np.uint16)
    return halves.view(np.uint32)


def _words(fields: np.ndarray) -> np.ndarray:
    """uint8 [rows, nb, n*4] -> uint32 [rows, nb*n] (a contiguous copy, little-endian words)."""
    rows = fields.shape[0]
    return np.ascontiguousarray(fields).reshape(rows, -1).view(np.uint32)


def repack(qt: QuantTensor) -> RepackedWeight:
    """Split a GGUF quantized matrix into the aligned ``w_a`` / ``w_b`` arrays of its format."""
    qtype = T(qt.ggml_type)
    if qtype not in SUPPORTED:
        names = ", ".join(sorted(t.name for t in SUPPORTED))
        raise InvalidModelError(
            f"GGUF tensor type {qtype.name} has no GPU kernel (supported: {names}); "
            "run this model on the CPU backend or pick a GGUF quantized with a supported type"
        )
    if len(qt.shape) != 2:
        raise InvalidModelError(f"quantized GPU weights must be 2-D matrices, got shape {qt.shape} ({qtype.name})")
    rows, cols = (int(n) for n in qt.shape)
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    nb = cols // block_size
    data = np.asarray(qt.data)
    if cols % block_size or data.dtype != np.uint8 or data.shape != (rows, nb * type_size):
        raise InvalidModelError(
            f"{qtype.name} tensor of shape {qt.shape}: expected uint8 data [{rows}, {nb * type_size}] "
            f"(cols a multiple of {block_size}), got {data.dtype} {data.shape}; the GGUF file is inconsistent"
        )
    blocks = data.reshape(rows, nb, type_size)
    if qtype == T.Q4_0:
        w_a, w_b = _words(blocks[:, :, 2:18]), _f16_pairs(blocks[:, :, 0:2])
    elif qtype == T.Q4_1:
        w_a, w_b = _words(blocks[:, :, 4:20]), _words(blocks[:, :, 0:4])
    elif qtype == T.Q5_0:
        # qs first, then qh: each block's five words are its quants
        w_a = _words(np.concatenate([blocks[:, :, 6:22], blocks[:, :, 2:6]], axis=2))
        w_b = _f16_pairs(blocks[:, :, 0:2])
    elif qtype == T.Q5_1:
        w_a = _words(np.concatenate([blocks[:, :, 8:24], blocks[:, :, 4:8]], axis=2))
        w_b = _words(blocks[:, :, 0:4])
    elif qtype == T.Q8_0:
        w_a, w_b = _words(blocks[:, :, 2:34]), _f16_pairs(blocks[:, :, 0:2])
    elif qtype == T.Q4_K:
        w_a, w_b = _words(blocks[:, :, 16:144]), _words(blocks[:, :, 0:16])
    else:  # Q6_K: ql 128, qh 64, scales 16, d 2
        w_a = _words(blocks[:, :, 0:192])
        side = np.zeros((rows, nb, 20), dtype=np.uint8)
        side[:, :, 0:18] = blocks[:, :, 192:210]
        w_b = _words(side)
    name = qtype.name
    return RepackedWeight(name, rows, cols, w_a, w_b, "linear_" + name.lower())


def split_rows(rw: RepackedWeight, max_bytes: int) -> list[RepackedWeight]:
    """Row chunks of ``rw`` whose ``w_a`` and ``w_b`` each fit in ``max_bytes`` (views, no copies).

    Use the device's ``max-storage-buffer-binding-size``; each chunk is one dispatch with its own
    ``row_offset``.
    """
    row_bytes = max(rw.w_a.shape[1], rw.w_b.shape[1]) * 4
    per_chunk = max_bytes // row_bytes
    if per_chunk < 1:
        raise InvalidModelError(
            f"one row of a {rw.format_name} weight [{rw.rows}, {rw.cols}] needs {row_bytes} bytes, "
            f"more than the {max_bytes}-byte storage binding limit of this GPU"
        )
    if per_chunk >= rw.rows:
        return [rw]
    return [
        dataclasses.replace(
            rw, rows=min(per_chunk, rw.rows - r), w_a=rw.w_a[r : r + per_chunk], w_b=rw.w_b[r : r + per_chunk],
            row_offset=rw.row_offset + r,
        )
        for r in range(0, rw.rows, per_chunk)
    ]


# ================================================================ reference dequantization


def _bytes(words: np.ndarray, rows: int, nb: int) -> np.ndarray:
    return words.view(np.uint8).reshape(rows, nb, -1)


def _f16(halves_u8: np.ndarray) -> np.ndarray:
    """uint8 [..., 2] -> float32 [..., 1]."""
    return np.ascontiguousarray(halves_u8).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """uint8 [rows, nb, 16] -> uint8 [rows, nb, 32]: low nibbles are values 0..15, high 16..31."""
    return np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=2)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """uint8 [rows, nb, 4] (a little-endian u32 per block) -> uint8 [rows, nb, 32], bit j of value j."""
    return np.unpackbits(qh, axis=2, bitorder="little")


def dequantize_repacked(rw: RepackedWeight) -> np.ndarray:
    """Float32 ``[rows, cols]`` from the repacked arrays, with gguf's float32 operation order
    (so results are bit-exact with ``gguf.quants.dequantize``). The layout spec in numpy form."""
    rows, cols, fmt = rw.rows, rw.cols, rw.format_name
    qtype = T[fmt]
    block_size = gguf.GGML_QUANT_SIZES[qtype][0]
    nb = cols // block_size
    a = _bytes(np.ascontiguousarray(rw.w_a), rows, nb)
    if fmt in ("Q4_0", "Q5_0", "Q8_0"):
        d = np.ascontiguousarray(rw.w_b).view(np.uint16)[:, :nb].view(np.float16).astype(np.float32)[:, :, None]
    if fmt in ("Q4_1", "Q5_1"):
        dm = _bytes(np.ascontiguousarray(rw.w_b), rows, nb)
        d, m = _f16(dm[:, :, 0:2]), _f16(dm[:, :, 2:4])
    if fmt == "Q4_0":
        out = d * (_nibbles(a).astype(np.int8) - np.int8(8)).astype(np.float32)
    elif fmt == "Q4_1":
        out = d * _nibbles(a).astype(np.float32) + m
    elif fmt == "Q5_0":
        q = _nibbles(a[:, :, 0:16]) | (_high_bits(a[:, :, 16:20]) << np.uint8(4))
        out = d * (q.astype(np.int8) - np.int8(16)).astype(np.float32)
    elif fmt == "Q5_1":
        q = _nibbles(a[:, :, 0:16]) | (_high_bits(a[:, :, 16:20]) << np.uint8(4))
        out = d * q.astype(np.float32) + m
    elif fmt == "Q8_0":
        out = a.view(np.int8).astype(np.float32) * d
    elif fmt == "Q4_K":
        side = _bytes(np.ascontiguousarray(rw.w_b), rows, nb)
        d, dmin = _f16(side[:, :, 0:2]), _f16(side[:, :, 2:4])
        sc, mn = gguf.quants.Q4_K.get_scale_min(side[:, :, 4:16].reshape(rows * nb, 12))
        scale = (d.reshape(-1, 1) * sc.astype(np.float32)).reshape(rows, nb, 8, 1)
        offset = (dmin.reshape(-1, 1) * mn.astype(np.float32)).reshape(rows, nb, 8, 1)
        # byte 32j+l: value 64j+l in the low nibble, 64j+32+l in the high one
        qs = a.reshape(rows, nb, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
        q = (qs & np.uint8(0x0F)).reshape(rows, nb, 8, 32).astype(np.float32)
        out = scale * q - offset
    elif fmt == "Q6_K":
        side = _bytes(np.ascontiguousarray(rw.w_b), rows, nb)
        d = _f16(side[:, :, 16:18])[:, :, :, None]
        scale = (d * side[:, :, 0:16].view(np.int8).astype(np.float32)[:, :, :, None])  # [rows, nb, 16, 1]
        # value 128h + 32k + l: ql byte 64h + 32(k&1) + l, nibble k>>1; qh byte 32h + l, bits 2k..2k+1
        ql = a[:, :, 0:128].reshape(rows, nb, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
        ql = (ql & np.uint8(0x0F)).reshape(rows, nb, 2, 4, 32)
        qh = a[:, :, 128:192].reshape(rows, nb, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)
        qh = (qh & np.uint8(0x03)).reshape(rows, nb, 2, 4, 32)
        q = ((ql | (qh << np.uint8(4))).astype(np.int8) - np.int8(32)).reshape(rows, nb, 16, 16).astype(np.float32)
        out = scale * q
    else:
        raise InvalidModelError(f"no repacked layout for {fmt}")
    return out.reshape(rows, cols)


# ================================================================ shaders


def shader_source(kernel: str, *, subgroups: bool = True) -> str:
    """WGSL of ``shaders/<kernel>.wgsl`` for a device with or without subgroup operations: the
    quantized linear kernels' ``main`` is one subgroup per row (``subgroupAdd``; device feature
    ``"subgroup"``, plus ``main_t``) or one workgroup per row (shared-memory reduction), chosen by
    linear_quant_body.wgsl's ``#if subgroup``."""
    from kjarni.gpu import kernels

    return kernels.source(kernel, frozenset({"subgroup"}) if subgroups else frozenset())


def workgroup_count(rows: int, *, subgroups: bool = True) -> int:
    """Workgroups to dispatch (x) for a linear kernel over ``rows`` rows: every kernel strides over
    rows, so this only sets parallelism."""
    per = ROWS_PER_WORKGROUP if subgroups else 1
    return max(1, min(-(-rows // per), MAX_WORKGROUPS))
