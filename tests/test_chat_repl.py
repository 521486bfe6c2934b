"""`kjarni chat`, the terminal REPL: commands and memory by feeding stdin, Ctrl-C by a real SIGINT."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kjarni import chat_repl
from kjarni.generator import Generator
from tests.serve_fixtures import make_endless_model
from tests.test_api import make_tiny_model

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Generator:
    folder = make_tiny_model(tmp_path_factory.mktemp("repl-tiny"))
    return Generator.builder().model_path(folder).cpu().greedy().max_tokens(4).prefix_cache(True).quiet().build()


class Recording:
    """The Generator with every conversation it was asked to answer recorded."""

    def __init__(self, generator: Generator) -> None:
        self.generator = generator
        self.model_name = generator.model_name
        self.asked: list[list[dict]] = []

    def stream_chat_tokens(self, messages: list[dict]):  # noqa: ANN201
        self.asked.append([dict(m) for m in messages])
        return self.generator.stream_chat_tokens(messages)


def run_repl(generator: object, lines: list[str], system: str | None = None) -> tuple[int, str]:
    stdout = io.StringIO()
    code = chat_repl.run(generator, system=system, stdin=io.StringIO("".join(f"{line}\n" for line in lines)), stdout=stdout)
    return code, stdout.getvalue()


def test_the_conversation_is_remembered_between_turns(tiny: Generator) -> None:
    spy = Recording(tiny)
    code, out = run_repl(spy, ["Hi", "", "And again?"])
    assert code == 0
    first = tiny.chat([{"role": "user", "content": "Hi"}])
    assert spy.asked == [
        [{"role": "user", "content": "Hi"}],
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": first}, {"role": "user", "content": "And again?"}],
    ]
    assert out.startswith(chat_repl.PROMPT + first)


def test_system_reset_and_exit(tiny: Generator) -> None:
    spy = Recording(tiny)
    code, out = run_repl(spy, ["/system Be brief.", "One", "/reset", "Two", "/system", "Three", "/exit", "never read"], system="start")
    assert code == 0
    assert [m[0] for m in spy.asked] == [
        {"role": "system", "content": "Be brief."}, {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Two"},
    ]
    assert [len(m) for m in spy.asked] == [2, 2, 3]  # /reset forgot "One" and its answer; /system removed it
    assert "[system message set]" in out and "[conversation cleared]" in out and "[system message removed]" in out
    assert "never read" not in str(spy.asked)


def test_end_of_input_leaves_and_unknown_commands_are_named(tiny: Generator) -> None:
    spy = Recording(tiny)
    code, out = run_repl(spy, ["/frobnicate"])
    assert code == 0 and spy.asked == []
    assert "[unknown command /frobnicate; commands: /reset, /system TEXT, /exit" in out


def test_a_failing_turn_leaves_the_conversation_as_it_was(tiny: Generator) -> None:
    spy = Recording(tiny)
    code, out = run_repl(spy, ["word " * 300, "Hi"])
    assert code == 0 and "[error: the prompt is" in out
    assert spy.asked[-1] == [{"role": "user", "content": "Hi"}]


# ---------------------------------------------------------------- Ctrl-C, in a real process


@pytest.fixture(scope="module")
def endless_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_endless_model(tmp_path_factory.mktemp("endless"))


class Output:
    """A child's stdout read on a thread; ``wait_for`` blocks until a text has appeared."""

    def __init__(self, pipe: object) -> None:
        self.text = ""
        self._changed = threading.Condition()
        threading.Thread(target=self._read, args=(pipe,), daemon=True).start()

    def _read(self, pipe: object) -> None:
        try:
            while chunk := os.read(pipe.fileno(), 4096):  # type: ignore[attr-defined]
                with self._changed:
                    self.text += chunk.decode("utf-8", errors="replace")
                    self._changed.notify_all()
        except OSError:  # a terminal whose other end closed (EIO) has ended too
            pass

    def wait_for(self, text: str, start: int = 0) -> int:
        """The index just past the first ``text`` at or after ``start`` (a timeout only fails the test)."""
        with self._changed:
            found = self._changed.wait_for(lambda: self.text.find(text, start) >= 0, timeout=300)
            assert found, f"{text!r} never appeared; output so far: {self.text[-500:]!r}"
            return self.text.find(text, start) + len(text)

    def wait_for_any(self, characters: str, start: int) -> None:
        with self._changed:
            found = self._changed.wait_for(lambda: any(c in self.text[start:] for c in characters), timeout=300)
            assert found, f"none of {characters!r} appeared; output so far: {self.text[-500:]!r}"


# `python -m kjarni` with Ctrl-C's default disposition: a shell starts background jobs (`pytest &`)
# with SIGINT ignored, children inherit that, and the second Ctrl-C below would then never arrive.
KJARNI_WITH_CTRL_C = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
                      "sys.argv[0] = 'kjarni'; runpy.run_module('kjarni', run_name='__main__', alter_sys=True)")


def test_ctrl_c_stops_the_answer_not_the_program(endless_model: Path) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", KJARNI_WITH_CTRL_C, "chat", "--model-path", str(endless_model), "--device", "cpu",
         "--greedy", "--max-tokens", "6000", "--quiet"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO,
    )
    out, err = Output(child.stdout), Output(child.stderr)  # stderr: shown if the test fails
    try:
        at = out.wait_for(chat_repl.PROMPT)
        child.stdin.write(b"Tell me everything.\n")
        child.stdin.flush()
        out.wait_for_any("ab", at)  # the answer's first letter: it is streaming now
        child.send_signal(signal.SIGINT)
        after = out.wait_for(f"\n{chat_repl.STOPPED}\n{chat_repl.PROMPT}", at)
        answer = out.text[at:after].split("\n", 1)[0]
        assert set(answer) <= {"a", "b"} and 0 < len(answer) < 6000
        child.send_signal(signal.SIGINT)  # at the prompt: a fresh prompt, the program stays
        out.wait_for(f"\n{chat_repl.PROMPT}", after)
        child.stdin.write(b"/reset\n/exit\n")
        child.stdin.flush()
        assert child.wait(timeout=120) == 0
        assert "[conversation cleared]" in out.text
    except AssertionError as error:
        raise AssertionError(f"{error}\nthe child's stderr: {err.text[-2000:]!r}") from error
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_on_a_terminal_it_reads_with_input_and_ctrl_d_leaves(tmp_path: Path) -> None:
    import pty

    folder = make_tiny_model(tmp_path / "pty-tiny")
    leader, follower = pty.openpty()
    child = subprocess.Popen(
        [sys.executable, "-m", "kjarni", "chat", "--model-path", str(folder), "--device", "cpu", "--greedy",
         "--max-tokens", "3", "--quiet"],
        stdin=follower, stdout=follower, stderr=follower, cwd=REPO, env={**os.environ, "TERM": "dumb"},
    )
    os.close(follower)
    out = Output(os.fdopen(leader, "rb", buffering=0))
    try:
        out.wait_for(chat_repl.HELP)  # the banner, shown on a terminal only
        at = out.wait_for(chat_repl.PROMPT)
        os.write(leader, b"/system Be brief.\r")
        at = out.wait_for("[system message set]", at)
        at = out.wait_for(chat_repl.PROMPT, at)
        os.write(leader, b"Hi\r")  # answered (3 tokens), then the prompt again
        out.wait_for(chat_repl.PROMPT, out.wait_for("Hi", at))
        os.write(leader, b"\x04")  # Ctrl-D
        assert child.wait(timeout=120) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
