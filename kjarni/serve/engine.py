"""One model serving many clients: a bounded first-come first-served queue in front of one Generator.

A ``Generator`` runs one generation at a time. ``Engine.admit`` hands a request a ``Ticket`` or
refuses it with 429 when ``max_queue`` requests already wait behind the running one; ``run``
waits its turn (asyncio's lock is FIFO), streams the text pieces, and on cancellation (the client
went away) stops the generation and waits for its worker, which computes at most the one token it
was on: the next request starts one decode step later. ``cancellations`` records, per cancelled
generation, the tokens generated when the cancel arrived and when the worker stopped.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from typing import Any, AsyncIterator

from kjarni.errors import ContextOverflowError, InvalidConfigurationError, KjarniError
from kjarni.serve.protocol import ApiError, CompletionRequest, bad


@dataclass
class Finished:
    """What a generation left once its pieces are consumed."""

    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


class Ticket:
    """A request's place in the queue; ``release`` is idempotent (called from every exit path)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._engine._admitted -= 1


class Engine:
    """The Generator behind the server, its queue, and counters (``served``, ``cancellations``)."""

    def __init__(self, generator: Any, *, max_queue: int = 64) -> None:
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 0:
            raise InvalidConfigurationError(f"max_queue={max_queue!r} must be an integer >= 0")
        self.generator = generator
        self.max_queue = max_queue
        self._lock: asyncio.Lock | None = None
        self._admitted = 0
        self.served = 0
        self.cancellations: list[tuple[int, int]] = []
        self.cancelled = threading.Event()  # set whenever a cancellation is recorded (tests wait on it)

    @property
    def model_name(self) -> str:
        return self.generator.model_name

    @property
    def admitted(self) -> int:
        """Requests running or waiting."""
        return self._admitted

    def admit(self) -> Ticket:
        """A place in the queue, or 429 when it is full."""
        if self._admitted > self.max_queue:
            raise ApiError(429, f"the server is busy: {self._admitted} requests are running or queued "
                                f"(--max-queue {self.max_queue}); retry later",
                           type="rate_limit_exceeded", code="queue_full")
        self._admitted += 1
        return Ticket(self)

    def open(self, request: CompletionRequest) -> Any:
        """The (not yet started) async text stream for ``request``; bad settings and prompts raise 400."""
        from kjarni.generator import GenerationOverrides

        try:
            overrides = GenerationOverrides(**request.settings)
            if request.chat:
                return self.generator.astream_chat(request.messages, overrides)
            return self.generator.astream_text_with_config(request.prompt, overrides)
        except ContextOverflowError as error:
            raise bad(str(error), "messages" if request.chat else "prompt", "context_length_exceeded") from None
        except InvalidConfigurationError as error:
            raise bad(str(error)) from None
        except KjarniError as error:  # a template that fails on these messages, for one
            raise bad(str(error), "messages" if request.chat else "prompt") from None

    async def run(self, stream: Any, finished: Finished, ticket: Ticket) -> AsyncIterator[str]:
        """The pieces of ``stream`` once it is this request's turn; ``finished`` is filled at the end.

        ``ticket`` is released as soon as the generation has stopped, before anything is recorded.
        """
        import anyio

        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            try:
                async for piece in stream:
                    yield piece
            finally:
                # Shielded: a cancelled request (anyio re-cancels every await) still waits for its worker.
                with anyio.CancelScope(shield=True):
                    started = stream.stats  # None while the worker is still setting up
                    cancelled_at = started.generated_tokens if started is not None else 0
                    was_cut = stream.finish_reason is None
                    await stream.aclose()
                ticket.release()
                if was_cut:
                    stats = stream.stats
                    self.cancellations.append((cancelled_at, stats.generated_tokens if stats is not None else 0))
                    self.cancelled.set()
        stats = stream.stats
        self.served += 1
        finished.finish_reason = stream.finish_reason
        finished.prompt_tokens = stats.prompt_tokens if stats is not None else 0
        finished.completion_tokens = stats.generated_tokens if stats is not None else 0
