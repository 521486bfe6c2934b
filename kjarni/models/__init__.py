"""One module per architecture family (Hugging Face ``model_type``), registered in ``ARCHITECTURES``.

Adding a family is one module holding what is specific to it (see ``architecture.Architecture``)
plus an entry here; the generic modules (model_config, weights, loader, registry) only look it up.
"""

from __future__ import annotations

from kjarni.errors import InvalidModelError
from kjarni.models import gpt2, llama, mistral, phi3, qwen2
from kjarni.models.architecture import Architecture

ARCHITECTURES: dict[str, Architecture] = {
    family.ARCHITECTURE.model_type: family.ARCHITECTURE for family in (llama, mistral, qwen2, phi3, gpt2)
}
"""config.json ``model_type`` -> its family's record; the models kjarni can run."""


def supported() -> str:
    """The supported model types, for error messages."""
    return ", ".join(ARCHITECTURES)


def find_architecture(model_type: str, source: str) -> Architecture:
    """The family record of ``model_type``; ``InvalidModelError`` naming ``source`` when there is none."""
    found = ARCHITECTURES.get(model_type)
    if found is None:
        raise InvalidModelError(
            f"{source}: architecture {model_type or '(no model_type)'!s} is not supported; supported: {supported()}"
        )
    return found


__all__ = ["ARCHITECTURES", "Architecture", "find_architecture", "supported"]
