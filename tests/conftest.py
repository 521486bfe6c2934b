"""Shared fixtures: one WebGPU context per test session (skipped with the reason where none exists);
and the rule that only tests marked `slow` touch the real models."""

from __future__ import annotations

import os
import sys
import tempfile
from contextlib import contextmanager

import pytest

from kjarni.sources import cache_dir as _cache_dir

# Mesa warns "XDG_RUNTIME_DIR is invalid" on every device creation; a private 0700 folder silences it.
if not os.environ.get("XDG_RUNTIME_DIR") or not os.path.isdir(os.environ["XDG_RUNTIME_DIR"]):
    os.environ["XDG_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="kjarni-xdg-")


@pytest.fixture(scope="session")
def wgpu_context():
    """The session's `WgpuContext`, or a skip naming why no adapter could be had."""
    try:
        from kjarni.gpu import WgpuContext
    except ImportError as exc:  # wgpu not installed
        pytest.skip(f"wgpu is not importable: {exc}")
    from kjarni.errors import GpuUnavailableError

    try:
        return WgpuContext()
    except GpuUnavailableError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def gpu_ops(wgpu_context):
    """`WgpuOps` with f32 weights and KV cache (parity with NumpyOps) on the session context."""
    from kjarni.gpu import WgpuOps

    return WgpuOps(wgpu_context, weight_format="f32")


@pytest.fixture(scope="session")
def tint_compile():
    """A function compiling WGSL as Dawn gets it (``Runtime.prepare_shader`` for ``dawn``, with the
    ``subgroup`` flag) on Dawn's Null device, where Tint validates it with no GPU; raises on a
    refused source. Skips with the reason where wgpudawn or its Null backend is missing."""
    pytest.importorskip("wgpudawn")
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    from tint_check import null_device

    from kjarni.gpu.runtime import load_runtime

    try:
        device = null_device()
    except Exception as exc:  # noqa: BLE001 - reported as the skip reason
        pytest.skip(f"no Dawn Null device here: {exc}")
    dawn = load_runtime("dawn")

    def compile_(code: str, label: str) -> None:
        device.create_shader_module(code=dawn.prepare_shader(code, frozenset({"subgroup"})), label=label)

    return compile_


# ---------------------------------------------------------------- real models only in slow tests
# A test that opens a file of the real model cache (the GGUFs tests/real_models.py fetches, and
# anything else kept there) or runs pip to download a model must be marked `slow`, so that
# `-m "not slow"` downloads and loads nothing. An audit hook sees every open() in this process
# (numpy's memmap and gguf's reader included) and every subprocess; while a test that is not slow
# sets up or runs, a violation raises at once and fails the test with the message below even if
# the code under test caught the error. (A kjarni child process is not watched.)

_REAL_CACHE = os.path.realpath(_cache_dir()) + os.sep  # $KJARNI_CACHE_DIR or ~/.cache/kjarni, as the session began
_guarded: dict[str, object] = {"test": None, "violations": []}


def _real_model_access(event: str, args: tuple) -> str | None:
    if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        path = os.fsdecode(args[0])
        if os.path.realpath(path).startswith(_REAL_CACHE):
            return f"opened {path} in the real model cache {_REAL_CACHE}"
    elif event == "subprocess.Popen" and isinstance(args[1], (list, tuple)):
        argv = [os.fsdecode(a) if isinstance(a, (str, bytes, os.PathLike)) else "" for a in args[1]]
        if "pip" in argv and "download" in argv:
            return f"ran {' '.join(argv)} (a model download)"
    return None


def _audit(event: str, args: tuple) -> None:
    if _guarded["test"] is None or event not in ("open", "subprocess.Popen"):
        return
    found = _real_model_access(event, args)
    if found:
        _guarded["violations"].append(found)
        raise RuntimeError(f"{_guarded['test']} is not marked slow but {found}")


sys.addaudithook(_audit)


@contextmanager
def _no_real_models(item: pytest.Item):
    if item.get_closest_marker("slow") is not None:
        yield
        return
    _guarded.update(test=item.nodeid, violations=[])
    try:
        yield
    finally:
        violations = _guarded["violations"]
        _guarded.update(test=None, violations=[])
        if violations:
            raise pytest.fail.Exception(
                f"{item.nodeid} loads a real model but is not marked slow: {violations[0]}. Mark it "
                "@pytest.mark.slow (real models load only in slow tests), or use a tiny model (tests/tiny_models.py)",
                pytrace=False,
            ) from None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    with _no_real_models(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    with _no_real_models(item):
        return (yield)
