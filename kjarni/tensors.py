"""Tensors as a model file stores them: `QuantTensor` (GGUF quantized blocks, dequantized on
request), the GGUF types kjarni loads, and bf16 bit patterns to float32. Below both the loader
(weights.py) and the backend contract (backend.py), which hand these to each other.
"""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np

GGMLType = gguf.GGMLQuantizationType

def _dequantizable_types() -> frozenset:
    traits = getattr(gguf.quants, "_type_traits", None)  # gguf's registry of numpy dequantizers
    if traits is None:  # a future gguf without the registry: trust its documented set
        names = ("BF16 Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K Q3_K Q4_K Q5_K Q6_K IQ2_XXS IQ2_XS IQ2_S IQ3_XXS "
                 "IQ3_S IQ1_S IQ1_M IQ4_NL IQ4_XS").split()
        return frozenset(GGMLType[n] for n in names if n in GGMLType.__members__)
    return frozenset(traits)


# GGUF tensor types kjarni loads: plain floats plus everything gguf.quants can dequantize.
SUPPORTED_GGML_TYPES: frozenset = frozenset({GGMLType.F32, GGMLType.F16}) | _dequantizable_types()


@dataclasses.dataclass(frozen=True, eq=False)
class QuantTensor:
    """A GGUF tensor kept as stored blocks.

    `shape` is the HF layout, `(out_features, in_features)` for a matrix; `data` is `np.uint8`
    `[rows, bytes_per_row]` with rows already in HF order (llama q/k permutation undone).
    """

    ggml_type: GGMLType
    shape: tuple[int, ...]
    data: np.ndarray

    @property
    def block_size(self) -> int:
        """Weights per quantization block (32 for Q4_0..Q8_0, 256 for K-quants)."""
        return gguf.GGML_QUANT_SIZES[self.ggml_type][0]

    @property
    def type_size(self) -> int:
        """Bytes per quantization block."""
        return gguf.GGML_QUANT_SIZES[self.ggml_type][1]

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def dequantize(self) -> np.ndarray:
        """The tensor as float32 in `shape`."""
        values = gguf.quants.dequantize(self.data, self.ggml_type)
        return values.astype(np.float32, copy=False).reshape(self.shape)

    def __repr__(self) -> str:
        return f"QuantTensor({self.ggml_type.name}, shape={self.shape}, {self.nbytes} bytes)"


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) to float32, exactly: bf16 is the top half of an f32."""
    return (bits.astype(np.uint32) << 16).view(np.float32)
