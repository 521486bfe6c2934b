"""Mutated model files for the reader fuzz tests (tests/test_fuzz_readers.py, tools/fuzz_readers.py).

A tiny random llama (tests/tiny_models.py) is written once as a GGUF file and once as a Hugging
Face safetensors folder; `GgufLayout` and `SafetensorsFile` locate every field of those files so a
mutation can rewrite one value in place (a metadata scalar, an array count, a tensor's dims, a
safetensors data_offsets pair...). `load_outcome` loads a file with kjarni and sorts what happened
into the three outcomes the fuzz figures count:

- ``typed``: refused with a ``KjarniError`` (a message naming the inconsistency);
- ``accepted``: loaded into a model consistent with the file (layers, vocabulary and context as
  the file says; `_check_loaded`) that generates a few greedy tokens (or refuses NaN/inf logits
  with ``NonFiniteLogitsError``, which counts as typed);
- ``other``: anything else: an exception that is not a ``KjarniError``, a loaded model that
  disagrees with its file, or a peak of traced memory above ``MEMORY_LIMIT``.
"""

from __future__ import annotations

import dataclasses
import json
import tracemalloc
from functools import lru_cache
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from tests.tiny_models import random_state_dict, save_gguf_model, save_safetensors_model, tiny_config, tiny_vocab

MEMORY_LIMIT = 64 * 2**20
"""Peak traced allocation allowed while loading a ~60 KB tiny model and generating 3 tokens."""

BASE_CONFIG = tiny_config("llama", max_position_embeddings=64)


# ---------------------------------------------------------------- the base files


@lru_cache(maxsize=None)
def base_gguf() -> bytes:
    """The tiny llama as GGUF bytes (written once per process)."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        path = save_gguf_model(Path(folder) / "tiny.gguf", BASE_CONFIG, random_state_dict(BASE_CONFIG, seed=5))
        return path.read_bytes()


def tokenizer_json() -> str:
    """A byte-level BPE tokenizer.json over the tiny vocabulary (what the safetensors folder ships)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokens, _, merges = tiny_vocab(BASE_CONFIG["vocab_size"])
    tokenizer = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, [tuple(m.split(" ")) for m in merges]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer.to_str()


@lru_cache(maxsize=None)
def base_safetensors() -> tuple[bytes, str, str]:
    """(model.safetensors bytes, config.json text, tokenizer.json text) of the tiny llama."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        path = save_safetensors_model(Path(folder), BASE_CONFIG, random_state_dict(BASE_CONFIG, seed=5))
        return (path / "model.safetensors").read_bytes(), (path / "config.json").read_text(), tokenizer_json()


def write_safetensors_folder(folder: Path, weights: bytes, config: str | None = None, tokenizer: str | None = None) -> Path:
    """A model folder holding ``weights`` as model.safetensors, with the base config and tokenizer unless given."""
    _, base_config, base_tokenizer = base_safetensors()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.safetensors").write_bytes(weights)
    (folder / "config.json").write_text(base_config if config is None else config)
    (folder / "tokenizer.json").write_text(base_tokenizer if tokenizer is None else tokenizer)
    return folder


# ---------------------------------------------------------------- GGUF layout and in-place edits


@dataclasses.dataclass(frozen=True)
class Slot:
    """One value in a GGUF file: ``offset`` and numpy ``dtype`` of its bytes, and what it is."""

    offset: int
    dtype: np.dtype
    what: str  # "value" (a scalar), "count" (a string or array length), "type" (a type tag), "dims", "tensor_type", "data_offset"
    key: str   # the metadata key or tensor name it belongs to


class GgufLayout:
    """Every editable slot of a GGUF file, found with the stock `gguf.GGUFReader`."""

    def __init__(self, data: bytes) -> None:
        import tempfile

        with tempfile.NamedTemporaryFile(suffix=".gguf") as f:
            f.write(data)
            f.flush()
            reader = gguf.GGUFReader(f.name)
            self.slots: list[Slot] = [
                Slot(8, np.dtype("<u8"), "count", "<tensor count>"),
                Slot(16, np.dtype("<u8"), "count", "<kv count>"),
            ]
            self.fields: dict[str, list[Slot]] = {}
            for key, field in reader.fields.items():
                self.fields[key] = self._field_slots(key, field, tensor=False)
            for tensor in reader.tensors:
                self.fields[tensor.name] = self._field_slots(tensor.name, tensor.field, tensor=True)
            self.data_start = int(reader.data_offset)
            self.tensor_spans = {t.name: (int(t.data_offset), int(t.n_bytes)) for t in reader.tensors}
            del reader
        for slots in self.fields.values():
            self.slots.extend(slots)

    @staticmethod
    def _field_slots(key: str, field: Any, *, tensor: bool) -> list[Slot]:
        slots, offset = [], int(field.offset)
        value_parts = set(int(i) for i in field.data)
        for i, part in enumerate(field.parts):
            dtype = np.dtype(part.dtype).newbyteorder("<")
            if tensor:
                what = ["count", "name", "count", "dims", "tensor_type", "data_offset"][i]
            elif i == 0:
                what = "count"  # key length
            elif i == 2:
                what = "type"
            elif i in value_parts:
                what = "value"
            elif dtype == np.uint64 and part.size == 1:
                what = "count"  # a string length or an array count
            elif dtype == np.uint32 and part.size == 1:
                what = "type"  # an array's element type
            else:
                what = "bytes"
            if what not in ("name", "bytes") and part.size:
                for j in range(part.size):
                    slots.append(Slot(offset + j * dtype.itemsize, dtype, what, key))
            elif part.size:
                slots.append(Slot(offset, np.dtype(np.uint8), what if what == "name" else "bytes", key))
            offset += part.nbytes
        return slots

    def slot(self, key: str, what: str, index: int = 0) -> Slot:
        return [s for s in self.fields[key] if s.what == what][index]


def put(data: bytearray, slot: Slot, value: Any) -> None:
    """Overwrite one slot in place with ``value`` cast to the slot's type (wrapping like C)."""
    if slot.dtype.kind == "f":
        raw = np.array([value], dtype=np.float64).astype(slot.dtype).tobytes()
    elif slot.dtype.kind == "b":
        raw = np.array([bool(value)]).astype(slot.dtype).tobytes()
    else:
        bits = slot.dtype.itemsize * 8
        raw = (int(value) % (1 << bits)).to_bytes(slot.dtype.itemsize, "little")  # two's complement
    data[slot.offset : slot.offset + len(raw)] = raw


def gguf_with(**values: Any) -> bytes:
    """The base GGUF with metadata scalars replaced in place: ``gguf_with(**{"llama.block_count": 1})``."""
    data = bytearray(base_gguf())
    layout = GgufLayout(bytes(data))
    for key, value in values.items():
        put(data, layout.slot(key, "value"), value)
    return bytes(data)


def gguf_array_count(key: str, count: int) -> bytes:
    """The base GGUF with the element count of array ``key`` replaced (a lying count)."""
    data = bytearray(base_gguf())
    layout = GgufLayout(bytes(data))
    put(data, [s for s in layout.fields[key] if s.what == "count"][1], count)
    return bytes(data)


# ---------------------------------------------------------------- safetensors layout


def split_safetensors(data: bytes) -> tuple[dict[str, Any], bytes]:
    """(header dict, tensor bytes) of a safetensors file."""
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def join_safetensors(header: Any, body: bytes, *, raw_header: bytes | None = None) -> bytes:
    """A safetensors file from a header (any JSON value, or raw bytes) and the tensor bytes."""
    text = raw_header if raw_header is not None else json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + body


# ---------------------------------------------------------------- outcomes


class _TooMuchMemory(Exception):
    pass


def load_outcome(path: Path) -> tuple[str, str]:
    """Load ``path`` (a GGUF file or a model folder) and return ``(outcome, detail)``; see the module doc."""
    from kjarni.errors import KjarniError
    from kjarni.stream import GenerationParams, stream_generate
    from kjarni.loader import load_model

    tracing = tracemalloc.is_tracing()
    if not tracing:
        tracemalloc.start()
    tracemalloc.reset_peak()
    try:
        try:
            loaded = load_model(path)
            consistent = _check_loaded(path, loaded)
            if consistent is not None:
                return "other", f"accepted but wrong: {consistent}"
            prompt = loaded.tokenizer.encode("the theme") or [0]
            params = GenerationParams(max_tokens=3, temperature=0.0)
            ids = [e.token_id for e in stream_generate(loaded.model, loaded.tokenizer, prompt, params)]
            if not ids or not all(0 <= i < loaded.config.vocab_size for i in ids):
                return "other", f"accepted but generated {ids}"
        except KjarniError as error:
            return _memory_checked("typed", f"{type(error).__name__}: {error}")
        except BaseException as error:  # noqa: BLE001 - counting what escapes is the point
            if isinstance(error, (KeyboardInterrupt, SystemExit)):
                raise
            return "other", f"{type(error).__module__}.{type(error).__name__}: {str(error)[:300]}"
        return _memory_checked("accepted", "loaded and generated")
    finally:
        if not tracing:
            tracemalloc.stop()


def _memory_checked(outcome: str, detail: str) -> tuple[str, str]:
    peak = tracemalloc.get_traced_memory()[1]
    if peak > MEMORY_LIMIT:
        return "other", f"{outcome} after a peak of {peak / 2**20:.0f} MiB traced ({detail[:200]})"
    return outcome, detail


def _check_loaded(path: Path, loaded: Any) -> str | None:
    """None when the loaded model is the one its file describes, else what disagrees."""
    config, weights = loaded.config, loaded.weights
    layers = {int(n.split(".")[2]) for n in weights.names() if n.startswith("model.layers.")}
    if layers != set(range(config.num_hidden_layers)):
        return f"config has {config.num_hidden_layers} layers, the tensors {sorted(layers)[:5]}..."
    if weights.shape("model.embed_tokens.weight")[0] != config.vocab_size:
        return "vocab_size differs from the embedding"
    if loaded.tokenizer.vocab_size > config.vocab_size:
        return f"the tokenizer has {loaded.tokenizer.vocab_size} tokens, the model {config.vocab_size}"
    if loaded.model.context_size > config.max_position_embeddings or loaded.model.context_size < 1:
        return f"context {loaded.model.context_size}"
    return None

