"""Deterministic thread tests of a Generator: count forwards, wait on events, never sleep.

A join or wait with ``HANG_GUARD_S`` only guards against a hang; it is never the thing asserted.
"""

from __future__ import annotations

import threading
from typing import Any

HANG_GUARD_S = 60


class Gate:
    """Wraps a Generator's model forward: counts calls, and at call ``at`` signals ``reached`` and
    waits for ``go``."""

    def __init__(self, generator: Any, at: int) -> None:
        self.calls = 0
        self.at = at
        self.reached = threading.Event()
        self.go = threading.Event()
        model = generator.decoder.model
        forward = model.forward

        def gated(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            if self.calls == self.at:
                self.reached.set()
                assert self.go.wait(HANG_GUARD_S)
            return forward(*args, **kwargs)

        model.forward = gated


class WatchedLock:
    """Stands in for ``Generator._lock``: counts acquisitions, and sets ``contended`` once a caller
    finds the lock held (so a test knows a generation is waiting its turn)."""

    def __init__(self, lock: Any) -> None:
        self._lock = lock
        self.acquired = 0
        self.contended = threading.Event()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if not self._lock.acquire(False):
            self.contended.set()
            if not self._lock.acquire(blocking, timeout):
                return False
        self.acquired += 1
        return True

    def release(self) -> None:
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()


class Worker(threading.Thread):
    """Runs ``target`` in a thread; ``join()`` re-raises what it raised and returns its result."""

    def __init__(self, target: Any) -> None:
        super().__init__(daemon=True)
        self._target_fn = target
        self.result: Any = None
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.result = self._target_fn()
        except BaseException as error:  # noqa: BLE001 - re-raised by join
            self.error = error

    def join(self, timeout: float | None = HANG_GUARD_S) -> Any:  # type: ignore[override]
        super().join(timeout)
        assert not self.is_alive(), "the thread hung"
        if self.error is not None:
            raise self.error
        return self.result


def join(thread: threading.Thread) -> None:
    thread.join(HANG_GUARD_S)
    assert not thread.is_alive(), "the thread hung"


def join_async_workers() -> None:
    """Wait for every async stream's worker thread (named ``kjarni-generate-...``) to end."""
    for thread in threading.enumerate():
        if thread.name.startswith("kjarni-generate"):
            join(thread)
