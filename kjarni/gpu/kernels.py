"""WGSL sources: loaded from the ``kjarni.shaders`` package and specialised by small substitution.

A shader may contain two directives, written as WGSL comments so every file stays valid to read:

- ``// #include other.wgsl`` pastes another file of the package (shared kernel bodies);
- ``// #if FLAG`` / ``// #else`` / ``// #endif`` keeps one side depending on the variant's flags
  (``subgroup`` when the device has subgroup operations, ``kv_f16`` for a half-precision KV cache).
"""

from __future__ import annotations

import functools
import re
from importlib import resources
from pathlib import Path

_DIRECTIVE = re.compile(r"^\s*//\s*#(include|if|else|endif)\b\s*(.*?)\s*$")


@functools.cache
def raw_source(filename: str) -> str:
    """The text of ``shaders/<filename>`` as packaged (or from the checkout when not installed)."""
    try:
        return resources.files("kjarni.shaders").joinpath(filename).read_text(encoding="utf-8")
    except (FileNotFoundError, ModuleNotFoundError):
        # A plain checkout without `pip install -e .`: shaders/ sits next to kjarni/.
        return (Path(__file__).resolve().parents[2] / "shaders" / filename).read_text(encoding="utf-8")


def exists(stem: str) -> bool:
    try:
        raw_source(stem + ".wgsl")
    except FileNotFoundError:
        return False
    return True


@functools.cache
def source(stem: str, flags: frozenset[str] = frozenset()) -> str:
    """``shaders/<stem>.wgsl`` with includes pasted and ``#if`` blocks resolved for ``flags``."""
    return _preprocess(raw_source(stem + ".wgsl"), flags, stem)


def _preprocess(text: str, flags: frozenset[str], where: str) -> str:
    out: list[str] = []
    keep = [True]  # one entry per open #if: whether its current branch is kept (and all outer ones)
    for line in text.splitlines():
        m = _DIRECTIVE.match(line)
        if not m:
            if keep[-1]:
                out.append(line)
            continue
        kind, arg = m.groups()
        if kind == "include":
            if keep[-1]:
                out.append(_preprocess(raw_source(arg), flags, arg))
        elif kind == "if":
            keep.append(keep[-1] and arg in flags)
        elif kind == "else":
            if len(keep) < 2:
                raise ValueError(f"{where}: #else without #if")
            keep[-1] = keep[-2] and not keep[-1]
        else:
            if len(keep) < 2:
                raise ValueError(f"{where}: #endif without #if")
            keep.pop()
    if len(keep) != 1:
        raise ValueError(f"{where}: unterminated #if")
    return "\n".join(out) + "\n"


def struct_fields(wgsl: str, struct_name: str = "Params") -> list[tuple[str, str]]:
    """``[(field, type), ...]`` of ``struct <struct_name>`` in WGSL source (for the layout test)."""
    m = re.search(r"struct\s+" + struct_name + r"\s*\{(.*?)\}", wgsl, re.S)
    if not m:
        return []
    body = re.sub(r"//[^\n]*", "", m.group(1))
    return [(name, kind) for name, kind in re.findall(r"(\w+)\s*:\s*(\w+)\s*,?", body)]
