"""Shared fixtures: one WebGPU context per test session (skipped with the reason where none exists)."""

from __future__ import annotations

import os
import tempfile

import pytest

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
