"""Compile every kernel the GPU tests build through Dawn's WGSL compiler (Tint), here, without a Dawn GPU.

Dawn does not run on Mesa 22.3's lavapipe, but wgpudawn has Dawn's Null backend: a device that
executes nothing and still parses and validates WGSL with Tint. This runs pytest on the given test
files (default: every ``tests/test_gpu_*.py``) on the usual wgpu-py adapter and, for every
pipeline a `WgpuContext` creates, compiles the same source as Dawn would get it
(`Runtime.prepare_shader` for ``dawn``) on a Null device with ``subgroups``, ``shader-f16`` and
``chromium-experimental-subgroup-matrix``. Prints JSON: kernels compiled, and each distinct
kernel variant Tint refuses with its first error line.

    python tools/tint_check.py                       # all GPU test files
    python tools/tint_check.py tests/test_gpu_kernels.py -k rms
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def null_device():
    """A Dawn device on the Null backend (Tint validation only), or raise if wgpudawn lacks it."""
    import wgpudawn
    from wgpudawn.backends.dawn import _api, extras
    from wgpudawn.backends.dawn._mappings import enum_str2int

    from kjarni.gpu.runtime import DAWN_INSTANCE_TOGGLES

    try:
        extras.set_instance_extras(backends=["All"], enable_toggles=list(DAWN_INSTANCE_TOGGLES))
    except Exception:  # noqa: BLE001 - the instance exists already
        pass
    null = enum_str2int["BackendType"]["Null"]
    adapter = wgpudawn.gpu._request_adapter("core", "high-performance", False, _api.ffi.NULL, null).sync_wait()
    wanted = ["subgroups", "shader-f16", "chromium-experimental-subgroup-matrix"]
    return extras.request_device_sync(adapter, required_features=[f for f in wanted if f in adapter.features])


def main() -> int:
    import pytest

    from kjarni.gpu import context as context_module
    from kjarni.gpu.runtime import load_runtime

    device = null_device()
    dawn = load_runtime("dawn")
    seen: dict[str, str | None] = {}
    original = context_module.WgpuContext.pipeline

    def pipeline(self, kernel, kinds, *, entry="main", flags=(), constants=None, source=None, unchecked=False):
        result = original(self, kernel, kinds, entry=entry, flags=flags, constants=constants, source=source,
                          unchecked=unchecked)
        flag_set = frozenset(flags) | ({"subgroup"} if self.has_subgroups else frozenset())
        if source is None:
            from kjarni.gpu import kernels

            code = kernels.source(kernel, flag_set)
        else:
            code = source() if callable(source) else source
        code = dawn.prepare_shader(code, flag_set)
        key = f"{kernel} [{','.join(sorted(flag_set))}] #{hash(code) & 0xFFFFFF:06x}"
        if key not in seen:
            try:
                device.create_shader_module(code=code, label=kernel)
                seen[key] = None
            except Exception as exc:  # noqa: BLE001 - collected and reported
                seen[key] = " | ".join(line.strip() for line in str(exc).splitlines()[:3] if line.strip())
        return result

    context_module.WgpuContext.pipeline = pipeline
    args = sys.argv[1:] or sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_gpu_*.py"))
    os.chdir(ROOT)
    code = pytest.main(["-q", "-p", "no:cacheprovider", "-x", *args])
    failures = {k: v for k, v in seen.items() if v}
    print(json.dumps({"pytest_exit": int(code), "variants_compiled": len(seen), "refused": len(failures),
                      "errors": failures}, indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
