"""What kjarni prints besides text: notices (``notice``), and keeping what its dependencies
print off the user's terminal (``quiet_mesa``).

Mesa's Vulkan drivers print "error: XDG_RUNTIME_DIR is invalid or not set in the environment."
on stderr, straight from C, every time WebGPU adapters are enumerated in a session without one
(ssh, containers, CI, services). No logging switch reaches it, so ``quiet_mesa`` gives the process
what a login session would have: a private runtime folder. The CLI calls it at start, the builder
and ``kjarni parity`` before they first look for a GPU, and every adapter enumeration
(`kjarni.gpu.runtime.Runtime.enumerate_adapters`, so a ``WgpuContext`` made directly too).
"""

from __future__ import annotations

import os
import sys
import tempfile


def notice(message: str, quiet: bool) -> None:
    """An informational line on stderr (stdout carries generated text), unless ``quiet``."""
    if not quiet:
        print(f"kjarni: {message}", file=sys.stderr, flush=True)


def quiet_mesa() -> None:
    """Point ``XDG_RUNTIME_DIR`` at a private folder (mode 700) when it is unset or not a folder;
    a valid one is left alone."""
    current = os.environ.get("XDG_RUNTIME_DIR")
    if not current or not os.path.isdir(current):
        os.environ["XDG_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="kjarni-xdg-")
