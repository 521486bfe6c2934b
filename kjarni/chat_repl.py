"""``kjarni chat``: an interactive terminal conversation with a model, answers streamed.

    > What is the capital of France?
    The capital of France is Paris.
    > /system Answer in French.
    > /reset

Commands: ``/reset`` forgets the conversation (the system message stays), ``/system TEXT`` sets the
system message (``/system`` alone removes it), ``/exit`` or Ctrl-D leaves. Ctrl-C while an answer
streams stops that answer (what was shown stays in the conversation); Ctrl-C at the prompt clears
the line. Line editing and history come from ``readline`` where Python has it.
"""

from __future__ import annotations

import signal
import sys
from typing import Any, TextIO

PROMPT = "> "
STOPPED = "[stopped]"
HELP = "commands: /reset, /system TEXT, /exit (or Ctrl-D); Ctrl-C stops an answer"


class ChatSession:
    """One conversation: the messages so far and the system message, answered by ``generator``."""

    def __init__(self, generator: Any, system: str | None = None) -> None:
        self.generator = generator
        self.system = system
        self.history: list[dict[str, str]] = []

    def messages(self) -> list[dict[str, str]]:
        """What the model sees: the system message (if any), then the conversation."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        return [*head, *self.history]

    def reset(self) -> None:
        self.history = []


def run(generator: Any, *, system: str | None = None, stdin: TextIO | None = None, stdout: TextIO | None = None) -> int:
    """The read-answer loop until ``/exit`` or end of input; returns the exit code (0)."""
    stdin = stdin or sys.stdin
    stdout = stdout or sys.stdout
    interactive = stdin.isatty()
    if interactive:
        try:
            import readline  # noqa: F401 - importing it gives input() line editing and history
        except ImportError:
            pass
        print(f"kjarni chat with {generator.model_name}; {HELP}", file=sys.stderr, flush=True)
    session = ChatSession(generator, system)
    while True:
        try:
            line = _read_line(stdin, stdout, interactive)
        except KeyboardInterrupt:  # Ctrl-C at the prompt: a fresh line, as in other REPLs
            stdout.write("\n")
            continue
        if line is None:  # Ctrl-D / end of input
            if interactive:
                stdout.write("\n")
            stdout.flush()
            return 0
        text = line.strip()
        if not text:
            continue
        if text.startswith("/"):
            if not _command(session, text, stdout):
                return 0
            continue
        _answer(session, text, stdout)


def _read_line(stdin: TextIO, stdout: TextIO, interactive: bool) -> str | None:
    if interactive and stdin is sys.stdin and stdout is sys.stdout:
        try:
            return input(PROMPT)
        except EOFError:
            return None
    stdout.write(PROMPT)
    stdout.flush()
    line = stdin.readline()
    return None if line == "" else line.rstrip("\n")


def _command(session: ChatSession, text: str, stdout: TextIO) -> bool:
    """Run a /command; False means leave."""
    name, _, rest = text.partition(" ")
    if name in ("/exit", "/quit"):
        return False
    if name == "/reset":
        session.reset()
        print("[conversation cleared]", file=stdout, flush=True)
    elif name == "/system":
        session.system = rest.strip() or None
        print("[system message set]" if session.system else "[system message removed]", file=stdout, flush=True)
    else:
        print(f"[unknown command {name}; {HELP}]", file=stdout, flush=True)
    return True


def _answer(session: ChatSession, question: str, stdout: TextIO) -> None:
    """Stream the answer to ``question``; Ctrl-C ends it after the current token."""
    from kjarni.errors import KjarniError

    session.history.append({"role": "user", "content": question})
    interrupted = False

    def on_interrupt(signum: int, frame: Any) -> None:
        nonlocal interrupted
        interrupted = True

    pieces: list[str] = []
    previous = signal.signal(signal.SIGINT, on_interrupt) if _main_thread() else None
    try:
        stream = session.generator.stream_chat_tokens(session.messages())
        with stream:
            for token in stream:  # tokens, not text pieces: Ctrl-C is seen even while a token shows nothing
                if token.text:
                    pieces.append(token.text)
                    stdout.write(token.text)
                    stdout.flush()
                if interrupted:
                    break
    except KjarniError as error:
        session.history.pop()  # the question was not answered; leave the conversation as it was
        print(f"\n[error: {' '.join(str(error).split())}]", file=stdout, flush=True)
        return
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    answer = "".join(pieces)
    session.history.append({"role": "assistant", "content": answer})
    ending = f"\n{STOPPED}\n" if interrupted else ("" if answer.endswith("\n") else "\n")
    stdout.write(ending)
    stdout.flush()


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()
