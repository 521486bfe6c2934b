"""The streams a Generator hands out: ``TokenStream`` (blocking) and ``AsyncTokenStream`` (asyncio),
and ``GeneratedToken``, what they yield.

A stream holds its Generator's lock from its creation until it is exhausted or closed
(``close()``, leaving a ``for`` loop over it early, garbage collection, the exit of the thread that
opened it, a cancelled asyncio task): the thread token below is what ties a stream to the thread
that opened it. The async stream runs the blocking loop in a worker thread that checks for
cancellation between tokens. The Generator (generator.py) makes them; they call back only into it.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator

from kjarni.errors import GenerationFailedError, KjarniError
from kjarni.generator.config import ResolvedGenerationConfig

if TYPE_CHECKING:
    from kjarni.generator.generator import Generator


@dataclass(frozen=True)
class GeneratedToken:
    """One generated token as a stream yields it.

    ``text`` is the text this token adds (``""`` while a multi-byte character is incomplete, for
    special tokens, and for the end token); ``logprob`` is the model's log-probability of the token;
    ``finish_reason`` is set on the last token of a generation: ``"eos"`` (the model's end token),
    ``"stop"`` (a stop string), ``"length"`` (max_tokens) or ``"context"`` (the context is full).
    A generation stopped by ``Generator.cancel()`` has no such last token: its stream just ends,
    with the stream's ``finish_reason`` (and ``last_stats.finish_reason``) ``"cancelled"``.
    """

    text: str
    token_id: int
    is_special: bool = False
    logprob: float | None = None
    finish_reason: str | None = None



class _ThreadToken:
    """Stands for one live thread: kept only in that thread's ``threading.local``, so it is
    finalized when the thread exits, which releases a stream the thread left open."""

    __slots__ = ("__weakref__",)


_threads = threading.local()


def _thread_token() -> _ThreadToken:
    token = getattr(_threads, "token", None)
    if token is None:
        token = _threads.token = _ThreadToken()
    return token


def _close_orphan(stream_ref: weakref.ref[TokenStream]) -> None:
    """The thread that opened a stream exited without closing it: close it now."""
    stream = stream_ref()
    if stream is not None:
        stream.close()


class TokenStream:
    """A running generation: an iterator of ``GeneratedToken`` (or of ``str`` for text streams).

    Holds its Generator from creation until exhausted or closed. It is freed at once by
    ``close()`` (from any thread), by leaving a ``with`` block or a ``for`` loop over it (``break``,
    ``return``, an exception: the loop's iterator closes the stream; use ``next(stream)`` to take
    tokens piecemeal), by garbage collection, and by the exit of the thread that opened it.
    ``close()`` from another thread while a step runs lets that step finish, then the stream ends
    (finish reason ``"cancelled"``). Iterating a closed stream ends it.
    """

    def __init__(
        self,
        generator: Generator,
        prompt_ids: list[int],
        config: ResolvedGenerationConfig,
        *,
        text_only: bool,
        stop: threading.Event | None = None,
        cancel_epoch: int | None = None,
    ) -> None:
        self._generator = generator
        self._text_only = text_only
        self._epoch = generator._cancel_epoch if cancel_epoch is None else cancel_epoch
        self._state = threading.Lock()  # guards the fields below against close() from another thread
        self._held = False
        self._done = False
        self._running = False  # a step is being computed (by the owning thread)
        self._stop_requested = False
        self._orphan_guard: weakref.finalize | None = None
        self._events: Iterator[Any] | None = None
        self.stats: Any = None
        self.prompt_tokens = len(prompt_ids)
        self.config = config
        """The resolved settings this generation runs with."""
        self.finish_reason: str | None = None
        token = generator._acquire(stop)
        if token is None:
            self._done = True  # cancelled while waiting for the Generator: an empty stream
            return
        self._held = True
        self._orphan_guard = weakref.finalize(token, _close_orphan, weakref.ref(self))
        try:
            self._events, self.stats = generator._events(prompt_ids, config)
        except BaseException:
            self.close()
            raise

    def __iter__(self) -> Iterator[Any]:
        """The remaining items; leaving the loop before the end closes the stream."""
        try:
            while True:
                try:
                    item = self.__next__()
                except StopIteration:
                    return
                yield item
        finally:
            self.close()

    def __next__(self) -> Any:
        while True:
            with self._state:
                if self._done or self._events is None:
                    raise StopIteration
                cancelled = self._stop_requested or self._generator._cancel_epoch != self._epoch
                self._running = not cancelled
                events = self._events
            if cancelled:
                self._end_cancelled()
                raise StopIteration
            try:
                event = next(events)
            except BaseException as error:
                self._step_done()
                self.close()
                if isinstance(error, StopIteration | KjarniError) or not isinstance(error, Exception):
                    raise
                raise GenerationFailedError(
                    f"generation on {self._generator.model_name} failed: {type(error).__name__}: {error}"
                ) from error
            self._step_done()
            reason = getattr(event, "finish_reason", None)
            if reason is not None:  # the last event: the stats are complete
                self.finish_reason = reason
                self._generator.last_stats = self.stats
            if not self._text_only:
                return GeneratedToken(
                    text=event.text,
                    token_id=int(event.token_id),
                    is_special=bool(getattr(event, "is_special", False)),
                    logprob=getattr(event, "logprob", None),
                    finish_reason=reason,
                )
            if event.text:
                return event.text

    def _step_done(self) -> None:
        with self._state:
            self._running = False

    def _end_cancelled(self) -> None:
        self.finish_reason = "cancelled"
        if self.stats is not None:
            self.stats.finish_reason = "cancelled"
            self._generator.last_stats = self.stats
        self.close()

    def close(self) -> None:
        """Stop generating and free the Generator (idempotent; any thread).

        Called from another thread while this stream computes a step, it returns at once and the
        stream ends after that step, freeing the Generator then.
        """
        with self._state:
            if self._running:
                self._stop_requested = True
                return
            self._done = True
            events, self._events = self._events, None
            held, self._held = self._held, False
            guard, self._orphan_guard = self._orphan_guard, None
        try:
            if events is not None and hasattr(events, "close"):
                events.close()
        finally:
            if guard is not None:
                guard.detach()
            if held:
                self._generator._release()

    def text(self) -> str:
        """Consume the rest of the stream and return its text."""
        if self._text_only:
            return "".join(self)
        return "".join(token.text for token in self)

    def __enter__(self) -> TokenStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - never raise from a finalizer
            pass


_END = object()

# How many tokens an async worker may compute ahead of its consumer: enough to hide the hop
# between threads, few enough that an abandoned stream stops computing almost at once.
_ASYNC_WINDOW = 4


class _Failure:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class _Worker:
    """What an async stream's worker thread shares with it. The thread holds this, never the
    stream itself, so dropping the stream runs its finalizer, which stops the thread."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.finished = threading.Event()
        self.window = threading.Semaphore(_ASYNC_WINDOW)
        self.stats: Any = None
        self.finish_reason: str | None = None
        self.thread: threading.Thread | None = None


def _work(
    worker: _Worker,
    generator: Generator,
    prompt_ids: list[int],
    config: ResolvedGenerationConfig,
    text_only: bool,
    loop: asyncio.AbstractEventLoop,
    queue: asyncio.Queue[Any],
    cancel_epoch: int,
) -> None:
    """The worker thread of an ``AsyncTokenStream``: run the blocking stream, hand items to the loop."""

    def put(item: Any) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            worker.stop.set()

    stream: TokenStream | None = None
    try:
        stream = TokenStream(
            generator, prompt_ids, config, text_only=text_only, stop=worker.stop, cancel_epoch=cancel_epoch
        )
        worker.stats = stream.stats
        for item in stream:
            # Wait for room in the window, watching for cancellation meanwhile.
            while not worker.window.acquire(timeout=0.05):
                if worker.stop.is_set():
                    break
            if worker.stop.is_set():
                break
            put(item)
        worker.finish_reason = stream.finish_reason
    except BaseException as error:  # noqa: BLE001 - handed to the awaiting task
        put(_Failure(error))
    finally:
        if stream is not None:
            stream.close()
        worker.finished.set()
        put(_END)


class AsyncTokenStream:
    """The asyncio form of ``TokenStream``: ``async for`` over it, or ``await`` it first.

    The blocking loop runs in a worker thread started on the first ``__anext__``, at most a few
    tokens ahead of the consumer. ``aclose()`` (or leaving ``async with``), cancelling the task
    while it awaits the next token, or dropping the stream stops the worker before its next
    token; ``aclose()`` also waits until the Generator is free.
    """

    def __init__(self, generator: Generator, prompt_ids: list[int], config: ResolvedGenerationConfig, *, text_only: bool) -> None:
        self._generator = generator
        self._prompt_ids = prompt_ids
        self._text_only = text_only
        self.config = config
        """The resolved settings this generation runs with."""
        self._worker = _Worker()
        self._cancel_epoch = generator._cancel_epoch  # Generator.cancel() after this stops it
        self._queue: asyncio.Queue[Any] | None = None
        self._ended = False

    @property
    def stats(self) -> Any:
        """The generation's ``GenerationStats`` once it started (filled in as it runs)."""
        return self._worker.stats

    @property
    def finish_reason(self) -> str | None:
        """Why the generation ended (``"eos"``, ``"stop"``, ``"length"``, ``"context"``, ``"cancelled"``), once it has."""
        return self._worker.finish_reason

    def __await__(self):  # noqa: ANN204 - `await gen.astream(p)` gives the stream itself
        async def itself() -> AsyncTokenStream:
            return self

        return itself().__await__()

    def __aiter__(self) -> AsyncTokenStream:
        return self

    async def __anext__(self) -> Any:
        if self._ended:
            raise StopAsyncIteration
        if self._queue is None:
            self._start(asyncio.get_running_loop())
        assert self._queue is not None
        try:
            item = await self._queue.get()
        except BaseException:  # cancelled: stop the worker before it computes another token
            self._worker.stop.set()
            self._ended = True
            raise
        if item is _END:
            self._ended = True
            raise StopAsyncIteration
        if isinstance(item, _Failure):
            self._ended = True
            raise item.error
        self._worker.window.release()
        return item

    def _start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._queue = asyncio.Queue()
        args = (
            self._worker, self._generator, self._prompt_ids, self.config, self._text_only, loop, self._queue,
            self._cancel_epoch,
        )
        thread = threading.Thread(target=_work, args=args, name=f"kjarni-generate-{self._generator.model_name}", daemon=True)
        self._worker.thread = thread
        thread.start()

    async def aclose(self) -> None:
        """Stop generating and wait until the Generator is free."""
        self._worker.stop.set()
        self._ended = True
        if self._worker.thread is not None and not self._worker.finished.is_set():
            await asyncio.to_thread(self._worker.finished.wait)

    async def text(self) -> str:
        """Consume the rest of the stream and return its text."""
        pieces = [item if self._text_only else item.text async for item in self]
        return "".join(pieces)

    async def __aenter__(self) -> AsyncTokenStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __del__(self) -> None:
        self._worker.stop.set()


