"""Which models the Generator can run: a thin layer over ``kjarni.registry``."""

from __future__ import annotations

import os
from pathlib import Path

from kjarni import registry
from kjarni.errors import InvalidModelError, LoadFailedError
from kjarni.generator.presets import ALL_V1_PRESETS


def available_models() -> list[str]:
    """Names of every registry model this kjarni version can generate with, in registry order."""
    return [entry.name for entry in registry.entries() if entry.architecture in registry.SUPPORTED_ARCHITECTURES]


def suggested_models() -> list[str]:
    """A short list to start from: the default model, then the presets' models, in registry order."""
    wanted = {registry.DEFAULT_MODEL, *(preset.model for preset in ALL_V1_PRESETS)}
    return [name for name in available_models() if name in wanted]


def is_generator_model(model: str | os.PathLike[str]) -> None:
    """Return None when ``model`` (a registry name or a local path) can be used for generation.

    Otherwise raise the reason: ``UnknownModelError`` (not in the registry, with close matches),
    ``InvalidModelError`` (not a decoder, an unsupported architecture, or a feature this version
    lacks) or ``LoadFailedError`` (a local path whose files cannot be read).
    """
    text = os.fspath(model)
    path = Path(text).expanduser()
    if text and path.exists():
        _check_local(path)
        return
    entry = registry.find_entry(text)  # raises UnknownModelError / InvalidModelError
    if entry.architecture not in registry.SUPPORTED_ARCHITECTURES:
        raise InvalidModelError(
            f"Model {entry.name!r} is a {entry.architecture} model, which kjarni cannot generate with; "
            f"supported: {', '.join(sorted(registry.SUPPORTED_ARCHITECTURES))}"
        )


def _check_local(path: Path) -> None:
    """Read a local model's config (config.json or GGUF metadata) and check it is a supported decoder."""
    from kjarni.model_config import ModelConfig

    if path.is_dir():
        if (path / "config.json").is_file():
            config = ModelConfig.from_json(path / "config.json")
        else:
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) != 1:
                raise LoadFailedError(
                    f"{path} has no config.json and {len(ggufs)} .gguf files; pass a .gguf file or a folder with config.json"
                )
            return _check_local(ggufs[0])
    elif path.suffix.lower() == ".gguf":
        import gguf

        try:
            reader = gguf.GGUFReader(str(path))
        except Exception as error:  # noqa: BLE001 - any failure means an unreadable file
            raise LoadFailedError(f"{path} is not a readable GGUF file ({error}); re-download it") from error
        config = ModelConfig.from_gguf(reader)
    else:
        raise LoadFailedError(f"{path} is not a model: pass a .gguf file or a folder with config.json")
    if config.model_type not in registry.SUPPORTED_ARCHITECTURES:
        raise InvalidModelError(
            f"{path}: architecture {config.model_type!r} is not supported; supported: "
            f"{', '.join(sorted(registry.SUPPORTED_ARCHITECTURES))}"
        )
