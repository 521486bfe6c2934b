"""The rule of tests/conftest.py: a test not marked `slow` that touches the real model cache fails."""

from __future__ import annotations

import os
import sys

import pytest

import tests.conftest as guard


def test_opening_a_file_in_the_real_model_cache_fails_a_test_not_marked_slow(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    (cache / "m").mkdir(parents=True)
    (cache / "m" / "model.gguf").write_bytes(b"GGUF")
    link = tmp_path / "elsewhere.gguf"
    link.symlink_to(cache / "m" / "model.gguf")  # a link from outside (tests/real_models.py makes such)
    monkeypatch.setattr(guard, "_REAL_CACHE", str(cache) + os.sep)  # stands in for ~/.cache/kjarni
    for path in (cache / "m" / "model.gguf", link):
        with pytest.raises(RuntimeError, match="is not marked slow but opened"):
            open(path, "rb")
    assert len(guard._guarded["violations"]) == 2
    guard._guarded["violations"].clear()  # this test's own deliberate violations: not a failure
    (tmp_path / "other.gguf").write_bytes(b"GGUF")  # outside the cache: allowed
    assert guard._guarded["violations"] == []


def test_a_pip_download_is_a_violation_and_a_fake_pip_is_not() -> None:
    real = guard._real_model_access("subprocess.Popen", (sys.executable, [sys.executable, "-m", "pip", "download", "x"], None, None))
    assert real is not None and "a model download" in real
    fake = (sys.executable, [sys.executable, "/tmp/fake_pip.py", "download", "x"], None, None)  # tests/test_sources.py
    assert guard._real_model_access("subprocess.Popen", fake) is None


@pytest.mark.slow
def test_a_slow_test_may_open_the_real_model_cache(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(guard, "_REAL_CACHE", str(tmp_path) + os.sep)
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    assert guard._guarded["test"] is None
