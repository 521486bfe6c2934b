"""From model files on disk to a runnable model: weights, config, tokenizer and the forward.

``load_model`` accepts what ``sources.resolve`` returns: a ``.gguf`` file, a ``.safetensors``
file inside a model folder, or a folder holding ``config.json`` with safetensors (and possibly
GGUF) files.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from kjarni.errors import InvalidModelError, LoadFailedError
from kjarni.model import DecoderModel
from kjarni.model_config import GenerationDefaults, ModelConfig
from kjarni.models import ARCHITECTURES, supported
from kjarni.models.gpt2 import GPT2Model
from kjarni.numpy_ops import NumpyOps
from kjarni.progress import Progress
from kjarni.backend import Ops
from kjarni.tokenizer import Tokenizer
from kjarni.weights import Weights, check_shapes, load_weights


@dataclass
class LoadedModel:
    """Everything a generator needs from one model's files."""

    path: Path
    config: ModelConfig
    tokenizer: Tokenizer
    generation_defaults: GenerationDefaults
    weights: Weights
    model: DecoderModel | GPT2Model


def build_model(config: ModelConfig, weights: Weights, ops: Ops) -> DecoderModel | GPT2Model:
    """The forward of ``config.model_type``'s family (kjarni/models/) with ``weights`` uploaded to ``ops``."""
    family = ARCHITECTURES.get(config.model_type)
    if family is None:
        raise InvalidModelError(
            f"{config.source}: architecture {config.model_type!r} is not supported; supported: {supported()}"
        )
    return family.forward(config, weights, ops)


def find_model_file(path: Path, prefer: str = "safetensors") -> Path:
    """The file (GGUF) or folder (safetensors) to load from ``path``.

    A folder holding both formats is read as ``prefer`` says (``"safetensors"`` or ``"gguf"``).
    """
    if not path.exists():
        raise LoadFailedError(f"model path {str(path)!r} does not exist; pass a .gguf file or a model folder")
    if path.is_file():
        if path.suffix in (".gguf", ".safetensors"):
            return path if path.suffix == ".gguf" else path.parent
        raise LoadFailedError(f"{path}: not a model file (expected .gguf or .safetensors)")
    ggufs = sorted(path.glob("*.gguf"))
    has_safetensors = (path / "config.json").exists() and any(path.glob("*.safetensors"))
    if has_safetensors and (prefer == "safetensors" or not ggufs):
        return path
    if len(ggufs) == 1:
        return ggufs[0]
    if len(ggufs) > 1:
        names = ", ".join(p.name for p in ggufs)
        raise LoadFailedError(f"{path} holds several GGUF files ({names}); pass the one to load")
    raise LoadFailedError(
        f"{path} holds no model: expected config.json with *.safetensors, or a .gguf file"
    )


def load_model(
    path: str | Path,
    *,
    ops: Ops | None = None,
    prefer: str = "safetensors",
    quiet: bool = True,
    check: Callable[[Weights, ModelConfig], None] | None = None,
    max_context: int | None = None,
) -> LoadedModel:
    """Load the model at ``path`` onto ``ops`` (the numpy backend unless given).

    ``max_context`` caps the context the model is built for (its RoPE table is sized by it). A
    file whose context would need more memory than the machine has for that table is refused,
    naming ``max_context`` as the fix, rather than attempted.

    With ``quiet=False`` a progress bar on stderr counts the weight bytes converted and uploaded.
    ``check(weights, config)`` runs after the files are read and before anything is uploaded
    (the GPU's memory estimate uses it).
    """
    source = find_model_file(Path(path), prefer)
    ops = ops or NumpyOps()
    weights = load_weights(source)
    if source.suffix == ".gguf":
        reader = weights.gguf_reader
        config = ModelConfig.from_gguf(reader, path=source)
        tokenizer = Tokenizer.from_gguf(reader)
        defaults = GenerationDefaults.from_gguf(reader)
    else:
        config = ModelConfig.from_json(source / "config.json")
        tokenizer = Tokenizer.from_dir(source)
        generation_config = source / "generation_config.json"
        defaults = GenerationDefaults.from_json(generation_config) if generation_config.exists() else GenerationDefaults()
    check_shapes(weights, config)
    config = fit_context(config, max_context)
    if check is not None:
        check(weights, config)
    with Progress(_stored_bytes(weights), f"loading {source.name}", quiet) as bar:
        model = _counting_uploads(ops, bar, lambda: build_model(config, weights, ops))
    return LoadedModel(source, config, tokenizer, defaults, weights, model)


def fit_context(config: ModelConfig, max_context: int | None = None) -> ModelConfig:
    """``config`` with its context capped to ``max_context``; refused when what the load sizes by
    the context (the RoPE table and its temporaries) would take more than half the available memory."""
    if max_context is not None and max_context < config.max_position_embeddings:
        scaling = config.rope_scaling
        if scaling is not None and scaling.get("rope_type") == "longrope" and scaling.get("factor") is None:
            # LongRoPE's attention factor derives from the full context: keep it as the file means it.
            scaling = {**scaling, "factor": config.max_position_embeddings / scaling["original_max_position_embeddings"]}
        config = dataclasses.replace(config, max_position_embeddings=max_context, rope_scaling=scaling)
    needed = config.max_position_embeddings * _ROPE_BYTES_PER_DIM * (config.rotary_dim or config.head_dim)
    available = _available_memory()
    if available is not None and needed > available // 2:
        raise LoadFailedError(
            f"{config.source}: a context of {config.max_position_embeddings} positions needs "
            f"{needed / 2**30:.1f} GiB for its RoPE table alone, more than half of the {available / 2**30:.1f} GiB "
            "of memory available; load it with a smaller max_context "
            "(with_load_config(lambda c: c.max_context(4096))), or fix the file's context_length"
        )
    return config


_ROPE_BYTES_PER_DIM = 16
"""Bytes per position and rotary dimension while a RoPE table is built: the float32 table and
about three temporaries of its size (angles, cos, sin)."""


def _available_memory() -> int | None:
    """Bytes of memory the system can give now (MemAvailable), or None where it cannot tell."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def _stored_bytes(weights: Weights) -> int:
    return sum(_nbytes(weights.raw(name)) for name in weights.names() if weights.alias_of(name) is None)


def _nbytes(part: Any) -> int:
    return int(part.data.nbytes if hasattr(part, "ggml_type") else part.nbytes)


def _counting_uploads(ops: Ops, bar: Progress, build: Callable[[], Any]) -> Any:
    """Run ``build`` with ``ops.weight`` counting each upload's stored bytes on ``bar``.

    The count wraps this one instance for the duration of the load only, so the model code and the
    backends stay free of progress reporting and nothing is left on the hot path.
    """
    upload = ops.weight

    def counted(parts: Any, *, name: str) -> Any:
        handle = upload(parts, name=name)
        if not name.startswith("rope"):  # RoPE tables are computed, not read from the files
            bar.update(sum(_nbytes(p) for p in (parts if isinstance(parts, (list, tuple)) else [parts])))
        return handle

    ops.weight = counted  # type: ignore[method-assign]
    try:
        return build()
    finally:
        del ops.weight  # back to the class's method
