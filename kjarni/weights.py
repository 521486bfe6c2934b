"""Model tensors under canonical Hugging Face names, read from safetensors or GGUF.

safetensors files are read by a small reader of our own (8-byte header length, JSON header, raw
data), memory-mapped, because the safetensors numpy API cannot hand back bf16 and because we want
precise errors for truncated files. GGUF files go through `gguf.GGUFReader`; quantized tensors stay
as stored blocks (`QuantTensor`) and are dequantized only when `Weights.f32` asks.

Format quirks are fixed here, once, as each family's module (kjarni/models/) declares them: GGUF
names map to HF names through one literal table plus the family's overrides, GGUFs whose converter
permuted the q/k rows get them un-permuted, a family's ``sanitize`` fixes its safetensors (GPT-2's
Conv1D matrices), and a missing `lm_head.weight` aliases the family's embedding.

Over 500 lines because it holds two readers of the same job, banner-separated: safetensors (our own
reader: header, spans, shards) and GGUF (names, q/k permutation, truncation checks), both ending
in the one `Weights` type and checked against one tensor list. Most of the length is the precise
error for each way a file can be broken.
"""

from __future__ import annotations

import json
import math
import re
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import gguf
import numpy as np

from kjarni.errors import InvalidModelError, LoadFailedError
from kjarni.models import ARCHITECTURES, find_architecture
from kjarni.tensors import SUPPORTED_GGML_TYPES, GGMLType, QuantTensor, bf16_to_f32

if TYPE_CHECKING:
    from kjarni.model_config import ModelConfig

# ================================================================ tensors


class Weights:
    """A model's tensors under Hugging Face names.

    `raw(name)` gives a tensor as stored (f32 or f16 array, bf16 widened to f32, or `QuantTensor`);
    `f32(name)` gives float32. Both may return memory-mapped or shared arrays: treat them as
    read-only (converted results are marked so). `lm_head.weight` is an alias of the embedding when
    the file has none (tied embeddings); `alias_of` says so. `gguf_reader` is the open
    `gguf.GGUFReader` for a GGUF file (None for safetensors), so config and tokenizer reuse it.
    """

    def __init__(self, path: Path, tensors: dict[str, Any], *, format: str,
                 aliases: dict[str, str] | None = None, gguf_reader: Any = None) -> None:
        self.path = Path(path)
        self.format = format
        self.gguf_reader = gguf_reader
        self._tensors = tensors
        self._aliases = dict(aliases or {})
        # Converted arrays are shared while someone holds them (tied lm_head, repeated calls) and
        # freed as soon as nobody does: Weights itself never pins a float32 copy.
        self._converted: weakref.WeakValueDictionary = weakref.WeakValueDictionary()

    def names(self) -> list[str]:
        """Every tensor name, aliases included."""
        return [*self._tensors, *self._aliases]

    def __contains__(self, name: object) -> bool:
        return name in self._tensors or name in self._aliases

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._tensors) + len(self._aliases)

    def alias_of(self, name: str) -> str | None:
        """The stored tensor `name` stands for, or None when `name` is stored itself."""
        return self._aliases.get(name)

    def _stored(self, name: str) -> tuple[str, Any]:
        key = self._aliases.get(name, name)
        try:
            return key, self._tensors[key]
        except KeyError:
            raise LoadFailedError(
                f"{self.path}: no tensor named {name}; the file has {len(self._tensors)} tensors "
                f"(e.g. {', '.join(list(self._tensors)[:3])}). Is it a complete model of a supported architecture?"
            ) from None

    def stored_type(self, name: str) -> str:
        """How the tensor is stored: "F32", "F16", "BF16" or a GGML quant type name such as "Q4_1"."""
        tensor = self._stored(name)[1]
        if isinstance(tensor, QuantTensor):
            return tensor.ggml_type.name
        return {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(np.uint16): "BF16"}[tensor.dtype]

    def shape(self, name: str) -> tuple[int, ...]:
        """The HF-layout shape, without converting anything."""
        return tuple(int(x) for x in self._stored(name)[1].shape)

    def raw(self, name: str) -> np.ndarray | QuantTensor:
        """The tensor as stored; bf16 comes back widened to float32 (exact)."""
        key, tensor = self._stored(name)
        if isinstance(tensor, np.ndarray) and tensor.dtype == np.uint16:
            return self._convert(key, tensor)
        return tensor

    def f32(self, name: str) -> np.ndarray:
        """The tensor as float32 (dequantized or widened as needed)."""
        key, tensor = self._stored(name)
        if isinstance(tensor, np.ndarray) and tensor.dtype == np.float32:
            return tensor
        return self._convert(key, tensor)

    def _convert(self, key: str, tensor: Any) -> np.ndarray:
        cached = self._converted.get(key)
        if cached is not None:
            return cached
        if isinstance(tensor, QuantTensor):
            try:
                out = tensor.dequantize()
            except (ValueError, TypeError, IndexError) as exc:
                raise LoadFailedError(
                    f"{self.path}: tensor {key} ({tensor.ggml_type.name}) cannot be dequantized ({exc}); "
                    "the file is corrupted"
                ) from None
        elif tensor.dtype == np.uint16:
            out = bf16_to_f32(tensor)
        else:
            out = tensor.astype(np.float32)
        out.flags.writeable = False
        self._converted[key] = out
        return out

    def __repr__(self) -> str:
        return f"Weights({self.path}, {self.format}, {len(self._tensors)} tensors)"


# ================================================================ entry points


def load_weights(path: str | Path) -> Weights:
    """Load a `.safetensors` file, a folder of safetensors (sharded with an index or not), or a `.gguf` file."""
    path = Path(path)
    if not path.exists():
        raise LoadFailedError(f"{path} does not exist; pass a .gguf file, a .safetensors file or a model folder")
    if path.is_dir():
        return _load_safetensors_folder(path)
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == b"GGUF" or path.suffix == ".gguf":
        return _load_gguf(path)
    if path.suffix == ".safetensors":
        return _finish_safetensors(path, _read_safetensors(path))
    raise LoadFailedError(f"{path} is neither a .gguf nor a .safetensors file; kjarni reads those two formats")


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a model of this config needs, with its HF-layout shape (its family's list)."""
    return find_architecture(config.model_type, config.source).expected_shapes(config)


def check_shapes(weights: Weights, config: ModelConfig) -> None:
    """Raise LoadFailedError naming the first tensor that is missing or disagrees with the config.

    The layer count is checked against the layers the tensors hold first, so a config claiming
    2**32 layers is refused before a shape is computed for any of them.
    """
    layer_name = _layer_name()
    layers = {int(m.group(1)) for name in weights.names() if (m := layer_name.match(name))}
    if len(layers) != config.num_hidden_layers or (layers and max(layers) != config.num_hidden_layers - 1):
        held = f"layers 0 .. {max(layers)}" if layers and max(layers) == len(layers) - 1 else f"{len(layers)} layers"
        raise LoadFailedError(
            f"{weights.path}: the config says num_hidden_layers = {config.num_hidden_layers} but the tensors hold "
            f"{held}; the weights and the config do not belong to the same model"
        )
    for name, expected in expected_shapes(config).items():
        if name not in weights:
            raise LoadFailedError(
                f"{weights.path}: tensor {name} is missing; the file does not hold a complete "
                f"{config.model_type} model with {config.num_hidden_layers} layers"
            )
        actual = weights.shape(name)
        if actual != expected:
            raise LoadFailedError(
                f"{weights.path}: tensor {name} has shape {actual} but the config expects {expected}; "
                "the weights and the config do not belong to the same model"
            )
    for i in range(config.num_hidden_layers):  # o_proj bias is optional (llama attention_bias)
        name = f"model.layers.{i}.self_attn.o_proj.bias"
        if name in weights and weights.shape(name) != (config.hidden_size,):
            raise LoadFailedError(
                f"{weights.path}: tensor {name} has shape {weights.shape(name)} but the config expects "
                f"{(config.hidden_size,)}"
            )


def _layer_name() -> re.Pattern[str]:
    """A tensor name's layer number, under any family's layer prefix (``model.layers.{}.``, ...)."""
    prefixes = dict.fromkeys(re.escape(family.block_prefix.split("{}")[0]) for family in ARCHITECTURES.values())
    return re.compile(rf"(?:{'|'.join(prefixes)})(\d+)\.")

# ================================================================ safetensors

_ST_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2")}  # bf16 kept as bits


def _read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Memory-map one safetensors file: {name: array}, bf16 as uint16 bit patterns."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise LoadFailedError(
                    f"{path} is truncated: {size} bytes, shorter than the 8-byte header length; download it again"
                )
            header_len = int.from_bytes(head, "little")
            if header_len > _ST_MAX_HEADER:
                raise LoadFailedError(
                    f"{path} is corrupted: its header length field says {header_len} bytes, more than the "
                    f"{_ST_MAX_HEADER} safetensors allows; download it again"
                )
            if 8 + header_len > size:
                raise LoadFailedError(
                    f"{path} is truncated or corrupted: its header claims {header_len} bytes but the file has "
                    f"only {size} bytes; download it again"
                )
            header_bytes = f.read(header_len)
    except OSError as exc:
        raise LoadFailedError(f"{path} cannot be read: {exc.strerror or exc}") from None
    try:
        header = json.loads(header_bytes)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoadFailedError(f"{path} has a corrupted safetensors header (not valid JSON: {exc}); download it again") from None
    except RecursionError:
        raise LoadFailedError(f"{path} has a corrupted safetensors header (JSON nested too deeply to be one); "
                              "download it again") from None
    if not isinstance(header, dict):
        raise LoadFailedError(f"{path} has a corrupted safetensors header (not a JSON object)")
    header.pop("__metadata__", None)

    data_start = 8 + header_len
    buffer = np.memmap(path, dtype=np.uint8, mode="r").view(np.ndarray) if size else np.empty(0, np.uint8)
    tensors: dict[str, np.ndarray] = {}
    spans: list[tuple[int, int, str]] = []
    for name, info in header.items():
        entry = _st_entry(info)
        if entry is None:
            raise LoadFailedError(
                f"{path} has a corrupted safetensors header: bad entry for tensor {name}: {info!r:.200} (expected "
                '{"dtype": str, "shape": [non-negative ints], "data_offsets": [begin, end]}); download it again'
            )
        dtype_name, shape, begin, end = entry
        dtype = _ST_DTYPES.get(dtype_name)
        if dtype is None:
            raise InvalidModelError(
                f"{path}: tensor {name} has dtype {dtype_name}; kjarni reads F32, F16 and BF16 safetensors "
                "(quantized safetensors such as GPTQ/AWQ are not supported; use the unquantized model or a GGUF)"
            )
        nbytes = math.prod(shape) * dtype.itemsize
        if begin < 0 or end - begin != nbytes:
            raise LoadFailedError(
                f"{path} has a corrupted safetensors header: tensor {name} is {dtype_name}{shape} "
                f"({nbytes} bytes) but its data_offsets span {end - begin} bytes"
            )
        if data_start + end > size:
            raise LoadFailedError(
                f"{path} is truncated: tensor {name} ends at byte {data_start + end} but the file has only "
                f"{size} bytes; download it again"
            )
        spans.append((begin, end, name))
        tensors[name] = buffer[data_start + begin:data_start + end].view(dtype).reshape(shape)
    _check_st_spans(path, spans, size - data_start)
    return tensors


_ST_MAX_HEADER = 100_000_000  # the safetensors library's own limit on the JSON header


def _st_entry(info: Any) -> tuple[str, list[int], int, int] | None:
    """(dtype, shape, begin, end) of one header entry, or None when it is not well-formed."""
    def is_int(x: Any) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    if not isinstance(info, dict):
        return None
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or not isinstance(shape, list) or not isinstance(offsets, list) or len(offsets) != 2:
        return None
    if not all(is_int(d) and d >= 0 for d in shape) or not all(is_int(o) for o in offsets):
        return None
    return dtype, shape, offsets[0], offsets[1]


def _check_st_spans(path: Path, spans: list[tuple[int, int, str]], data_size: int) -> None:
    """Tensors tile the data section exactly, as the safetensors library checks: no overlap, no gap."""
    expected = 0
    for begin, end, name in sorted(spans):
        if begin != expected:
            what = "overlaps the tensor before it" if begin < expected else f"leaves a gap of {begin - expected} bytes"
            raise LoadFailedError(
                f"{path} has a corrupted safetensors header: tensor {name}'s data_offsets [{begin}, {end}] "
                f"{what} (it should start at {expected}); download it again"
            )
        expected = end
    if expected != data_size:
        raise LoadFailedError(
            f"{path} has a corrupted safetensors header: its tensors cover {expected} bytes of data but the "
            f"file holds {data_size} after the header; download it again"
        )


def _load_safetensors_folder(folder: Path) -> Weights:
    index_path = folder / "model.safetensors.index.json"
    if index_path.exists():
        try:
            weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
            files = list(dict.fromkeys(str(f) for f in weight_map.values()))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise LoadFailedError(f"{index_path} is not a valid safetensors index ({exc!r}); download it again") from None
    else:
        weight_map = None
        files = sorted(p.name for p in folder.glob("*.safetensors"))
        if not files:
            ggufs = sorted(folder.glob("*.gguf"))
            if len(ggufs) == 1:
                return _load_gguf(ggufs[0])
            raise LoadFailedError(
                f"{folder} has no *.safetensors files (nor a single .gguf); kjarni reads safetensors or GGUF "
                "(convert pytorch_model.bin checkpoints to safetensors first)"
            )
    tensors: dict[str, np.ndarray] = {}
    for file in files:
        shard = folder / file
        if not shard.is_file():
            raise LoadFailedError(f"{index_path} lists {file} but {shard} does not exist; the download is incomplete")
        for name, array in _read_safetensors(shard).items():
            if name in tensors:
                raise LoadFailedError(f"{shard}: tensor {name} is also in another shard; the folder mixes two models")
            tensors[name] = array
    if weight_map is not None:
        missing = [n for n in weight_map if n not in tensors]
        if missing:
            raise LoadFailedError(
                f"{index_path} lists tensor {missing[0]} in {weight_map[missing[0]]} but that shard lacks it; "
                "the download is incomplete or corrupted"
            )
    return _finish_safetensors(folder, tensors)


def _finish_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> Weights:
    for family in ARCHITECTURES.values():  # each family fixes only its own checkpoints' tensors
        if family.sanitize is not None:
            tensors = family.sanitize(tensors)
    return Weights(path, tensors, format="safetensors", aliases=_tied_head(tensors))


def _tied_head(tensors: dict[str, Any]) -> dict[str, str]:
    """``lm_head.weight`` -> the token embedding, when the checkpoint has no head of its own."""
    if "lm_head.weight" in tensors:
        return {}
    embedding = next((f.embedding for f in ARCHITECTURES.values() if f.embedding in tensors), None)
    return {} if embedding is None else {"lm_head.weight": embedding}


# ================================================================ GGUF

# One literal key map: GGUF name (blk.N. prefix removed) -> HF name (model.layers.N. prefix removed).
GGUF_TO_HF = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
GGUF_BLOCK_TO_HF = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_BLOCK_NAME = re.compile(r"blk\.(\d+)\.(.+)")


def hf_name(gguf_name: str, arch: str = "llama") -> str:
    """The HF name of a GGUF tensor of architecture ``arch`` (its family's overrides of the llama.cpp
    maps above); names outside the maps are kept as they are."""
    family = ARCHITECTURES.get(arch)
    top = {**GGUF_TO_HF, **(family.gguf_names if family else {})}
    if gguf_name in top:
        return top[gguf_name]
    match = _BLOCK_NAME.fullmatch(gguf_name)
    if match:
        block = {**GGUF_BLOCK_TO_HF, **(family.gguf_block_names if family else {})}
        if match.group(2) in block:
            prefix = (family.block_prefix if family else "model.layers.{}.").format(match.group(1))
            return prefix + block[match.group(2)]
    return gguf_name


class _Truncated(Exception):
    def __init__(self, end: int, size: int, part: str) -> None:
        super().__init__(end, size, part)
        self.end, self.size, self.part = end, size, part


class _FastGGUFReader(gguf.GGUFReader):
    """`gguf.GGUFReader` over a plain ndarray view of its memmap, with bounds checks.

    Slicing an np.memmap runs Python-level `__array_finalize__` each time; the tokenizer metadata
    makes ~250k slices, so the stock reader takes 2-6 s on these files and this one 3-4x less.
    Reads past the end raise `_Truncated` instead of yielding short arrays.
    """

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self._part = "header"
        super().__init__(path, mode="r")

    def _build_tensors(self, start_offs: int, fields: Any) -> None:
        self._part = "tensor data"  # the header parsed fine; what follows is the data section
        super()._build_tensors(start_offs, fields)

    @property
    def data(self) -> np.ndarray:
        return self._data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._data = value.view(np.ndarray)  # the view's .base keeps the mapping alive
        self._size = len(self._data)

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
        count = int(count)
        dt = np.dtype(dtype)
        end = offset + dt.itemsize * count
        if end > self._size:
            raise _Truncated(end, self._size, self._part)
        arr = self._data[offset:end].view(dt)
        return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))


def open_gguf(path: str | Path) -> gguf.GGUFReader:
    """Open a GGUF file with `gguf.GGUFReader` semantics; every failure becomes a kjarni error."""
    path = Path(path)
    if not path.is_file():
        raise LoadFailedError(f"{path} does not exist or is not a file")
    size = path.stat().st_size
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise LoadFailedError(f"{path} is not a GGUF file (it starts with {magic!r}, not b'GGUF'); download it again")
    try:
        return _FastGGUFReader(path)
    except _Truncated as exc:
        what = "is truncated" if exc.part == "tensor data" else "is truncated or its header is corrupted"
        raise LoadFailedError(
            f"{path} {what}: its {exc.part} needs bytes up to {exc.end} but the file has only {size}; "
            "download it again"
        ) from None
    except UnicodeDecodeError as exc:
        raise LoadFailedError(
            f"{path}: a GGUF metadata key, string value or tensor name is not valid UTF-8 (byte "
            f"{exc.object[exc.start]:#04x}: {exc.reason}); the file is corrupted. Download it again"
        ) from None
    except ValueError as exc:
        if "GGMLQuantizationType" in str(exc):
            raise InvalidModelError(
                f"{path} holds a tensor type this gguf package does not know ({exc}); update gguf or use another "
                "quantization of the model"
            ) from None
        raise LoadFailedError(f"{path}: the GGUF header is corrupted ({exc}); download the file again") from None
    except (KeyError, IndexError, OverflowError, TypeError, MemoryError, OSError) as exc:
        raise LoadFailedError(
            f"{path}: the GGUF header is corrupted ({type(exc).__name__}: {exc}); download the file again"
        ) from None


def _unpermute_rows(rows: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation: per head, rows (0, d/2, 1, d/2+1, ...) back to HF's (0, 1, ..., d-1).

    llama.cpp interleaves each head's two rotary halves for its interleaved RoPE; HF (and kjarni)
    rotate halves. Works on float rows and on rows of quantized blocks alike.
    """
    n = rows.shape[0]
    return np.ascontiguousarray(
        rows.reshape(n_head, n // n_head // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)
    )


def _load_gguf(path: Path) -> Weights:
    reader = open_gguf(path)
    size = path.stat().st_size

    def meta(key: str, kind: type) -> Any:
        field = reader.fields.get(key)
        if field is None:
            return None
        try:
            value = field.contents()
            if kind is int and (isinstance(value, (bool, float)) or not isinstance(value, (int, np.integer))):
                raise TypeError(f"a {type(value).__name__}, not an integer")
            return kind(value)
        except Exception as exc:  # invalid UTF-8, a value of the wrong type: gguf raises assorted errors
            raise LoadFailedError(
                f"{path}: GGUF metadata {key} cannot be read as {kind.__name__} ({type(exc).__name__}: {exc}); "
                "the file is corrupted. Re-download it"
            ) from None

    arch = meta("general.architecture", str) or ""
    n_head = meta(f"{arch}.attention.head_count", int)
    n_kv_head = meta(f"{arch}.attention.head_count_kv", int)
    n_kv_head = n_head if n_kv_head is None else n_kv_head
    permuted = arch in ARCHITECTURES and ARCHITECTURES[arch].gguf_permuted_qk

    tensors: dict[str, Any] = {}
    for t in reader.tensors:
        name = hf_name(t.name, arch)
        if t.tensor_type not in SUPPORTED_GGML_TYPES:
            supported = ", ".join(sorted(x.name for x in SUPPORTED_GGML_TYPES))
            raise InvalidModelError(
                f"{path}: tensor {t.name} is stored as {t.tensor_type.name}, which kjarni cannot dequantize; "
                f"supported types: {supported}. Use another quantization of the model"
            )
        if t.data_offset + t.n_bytes > size:
            raise LoadFailedError(
                f"{path} is truncated: tensor {t.name} ends at byte {t.data_offset + t.n_bytes} but the file has "
                f"{size}; download it again"
            )
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        try:
            if t.tensor_type in (GGMLType.F32, GGMLType.F16):
                value: Any = t.data.reshape(shape)
            elif t.tensor_type == GGMLType.BF16:
                value = t.data.view(np.uint16).reshape(shape)
            else:
                value = t.data.reshape(math.prod(shape[:-1]), -1)
        except ValueError:  # dims whose product does not match the stored bytes, or quant rows that do not split
            raise LoadFailedError(
                f"{path}: tensor {t.name} claims shape {shape} ({t.tensor_type.name}) but holds {t.n_bytes} bytes "
                "that do not form it; the file is corrupted. Re-download it"
            ) from None
        if permuted and (".self_attn.q_proj." in name or ".self_attn.k_proj." in name):
            heads = n_head if ".q_proj." in name else n_kv_head
            if not heads or value.shape[0] % (2 * heads):
                raise LoadFailedError(
                    f"{path}: tensor {t.name} has {value.shape[0]} rows, not a multiple of 2 x {heads} heads; "
                    "the head counts in the metadata disagree with the tensors"
                )
            value = _unpermute_rows(value, heads)
        value.flags.writeable = False  # mapped file data, or our permuted copy of it: never edited
        if t.tensor_type not in (GGMLType.F32, GGMLType.F16, GGMLType.BF16):
            value = QuantTensor(t.tensor_type, shape, value)
        if name in tensors:
            raise LoadFailedError(f"{path}: two tensors map to {name}; the file is corrupted")
        tensors[name] = value

    return Weights(path, tensors, format="gguf", aliases=_tied_head(tensors), gguf_reader=reader)


__all__ = [
    "GGUF_BLOCK_TO_HF", "GGUF_TO_HF", "QuantTensor", "SUPPORTED_GGML_TYPES", "Weights", "bf16_to_f32",
    "check_shapes", "expected_shapes", "hf_name", "load_weights", "open_gguf",
]
