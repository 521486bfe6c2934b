"""Generator.cancel() from another thread, close() from another thread, and streams whose owner is gone.

Every test counts forwards or waits on events; none relies on sleeping. A thread join with a
timeout is only a guard against a hang, never the thing asserted.
"""

from __future__ import annotations

import asyncio
import gc
import threading
from pathlib import Path
from typing import Any

import pytest

from kjarni.generator import GenerationOverrides, Generator
from tests.test_api import make_tiny_model
from tests.threads import HANG_GUARD_S, Gate, Worker, join

GREEDY = GenerationOverrides(max_tokens=40, temperature=0.0)
GREEDY_3 = GenerationOverrides(max_tokens=3, temperature=0.0)  # "served": the same text as an undisturbed call


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-cancel"))


@pytest.fixture
def generator(tiny_dir: Path) -> Generator:
    return Generator.builder().model_path(tiny_dir).cpu().quiet().build()


def test_cancel_from_another_thread_stops_generate_after_the_current_step(generator: Generator) -> None:
    full = generator.generate_with_config("the", GREEDY)
    pieces = list(generator.stream_with_config("the", GREEDY))
    assert len(pieces) == 40  # uncancelled it runs to max_tokens
    gate = Gate(generator, at=5)  # the prefill is forward 1; forward 5 computes token 5's successor's logits
    worker = Worker(lambda: generator.generate_with_config("the", GREEDY))
    assert gate.reached.wait(HANG_GUARD_S)
    generator.cancel()  # from this thread, while the worker is inside forward 5
    gate.go.set()
    text = worker.join()
    assert gate.calls == 5  # not one forward more
    assert text == "".join(p.text for p in pieces[:5])
    assert full.startswith(text) and len(text) < len(full)
    assert generator.last_stats.finish_reason == "cancelled"
    assert generator.last_stats.generated_tokens == 5


def test_cancel_leaves_later_generations_alone(generator: Generator) -> None:
    generator.cancel()  # nothing running: a no-op for what starts after it
    stream = generator.stream_with_config("the", GREEDY)
    assert len(list(stream)) == 40
    assert stream.finish_reason == "length"


def test_cancel_ends_a_stream_and_a_generation_waiting_its_turn(generator: Generator) -> None:
    stream = generator.stream_with_config("the", GREEDY)
    first = next(stream)
    waiter = Worker(lambda: generator.generate_with_config("the", GREEDY))
    generator.cancel()
    assert list(stream) == []  # the stream ends before its next step
    assert stream.finish_reason == "cancelled"
    assert first.finish_reason is None
    assert waiter.join() == ""  # the waiting generation started before cancel(): it ends with nothing


def test_cancel_stops_an_async_stream(generator: Generator) -> None:
    async def main() -> tuple[int, str | None]:
        count = 0
        async with generator.astream_with_config("the", GREEDY) as stream:
            async for _ in stream:
                count += 1
                if count == 3:
                    generator.cancel()
        return count, stream.finish_reason

    count, reason = asyncio.run(main())
    # The worker may have run up to its window ahead before seeing the cancel, never to the end.
    assert 3 <= count < 40
    assert reason == "cancelled"


def test_close_from_another_thread_while_a_step_runs_does_not_raise(generator: Generator) -> None:
    expected = generator.generate_with_config("the", GREEDY_3)
    stream = generator.stream_with_config("the", GREEDY)
    gate = Gate(generator, at=3)
    consumer = Worker(lambda: list(stream))
    assert gate.reached.wait(HANG_GUARD_S)
    stream.close()  # the consumer thread is inside forward 3: this must not raise
    gate.go.set()
    assert len(consumer.join()) == 3  # the running step finished, then the stream ended
    assert stream.finish_reason == "cancelled"
    assert gate.calls == 3
    assert generator.generate_with_config("the", GREEDY_3) == expected


def test_a_stream_left_open_by_an_exited_thread_releases_the_generator(generator: Generator) -> None:
    expected = generator.generate_with_config("the", GREEDY)
    kept: list[Any] = []  # keeps the stream alive: only the thread's exit can free it

    def open_and_leave() -> None:
        stream = generator.stream_with_config("the", GREEDY)
        next(stream)
        kept.append(stream)

    for _ in range(3):  # new threads may reuse the old thread ids: each must still be served
        thread = threading.Thread(target=open_and_leave)
        thread.start()
        join(thread)
    worker = Worker(lambda: generator.generate_with_config("the", GREEDY))
    assert worker.join() == expected
    assert len(kept) == 3
    assert all(list(stream) == [] for stream in kept)  # each was closed when its thread exited


def test_a_garbage_collected_stream_releases_the_generator(generator: Generator) -> None:
    expected = generator.generate_with_config("the", GREEDY_3)
    stream = generator.stream_with_config("the", GREEDY)
    next(stream)
    del stream
    gc.collect()
    assert Worker(lambda: generator.generate_with_config("the", GREEDY_3)).join() == expected


def test_breaking_out_of_a_named_stream_frees_the_generator(generator: Generator) -> None:
    expected = generator.generate_with_config("the", GREEDY_3)
    stream = generator.stream_with_config("the", GREEDY)
    for count, _ in enumerate(stream, start=1):
        if count == 2:
            break
    # Same thread: no "already has an open stream" error; another thread: not blocked.
    assert generator.generate_with_config("the", GREEDY_3) == expected
    assert Worker(lambda: generator.generate_with_config("the", GREEDY_3)).join() == expected
    assert list(stream) == []  # the loop's exit closed it
