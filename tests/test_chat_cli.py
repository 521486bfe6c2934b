"""`kjarni generate --chat` and the README's chat commands, on a tiny model (and the real one, slow)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from kjarni import cli, registry, sources
from kjarni.generator import Generator
from tests.real_models import cache_with_default_model
from tests.test_api import make_tiny_model
from tests.test_cli import run_kjarni

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("chat-cli-tiny"))


def tiny_answer(tiny_dir: Path, messages: list[dict], **settings: object) -> str:
    generator = Generator.builder().model_path(tiny_dir).cpu().quiet().build()
    return generator.chat(messages, **settings)


def test_generate_chat_answers_through_the_template(tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["generate", "--chat", "Hi there", "--model-path", str(tiny_dir), "--device", "cpu", "--greedy",
                     "--max-tokens", "6", "--quiet", "--system", "Be brief."])
    assert code == 0
    expected = tiny_answer(tiny_dir, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}],
                           temperature=0.0, max_tokens=6)
    assert capsys.readouterr().out == expected + ("" if expected.endswith("\n") else "\n")


def test_system_without_chat_is_a_usage_error(tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["generate", "x", "--system", "s", "--model-path", str(tiny_dir)]) == 2
    assert "--system needs --chat" in capsys.readouterr().err


def readme_section_commands(title: str) -> list[str]:
    """The `kjarni ...` lines of the ```bash blocks under the README heading ``title``."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"^```bash\n(.*?)^```", section, re.DOTALL | re.MULTILINE)
    return [line for block in blocks for line in block.splitlines() if line.startswith("kjarni ")]


def test_the_readmes_chat_commands_run(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    lines = readme_section_commands("Chat")
    assert lines, "the README's Chat section has no kjarni command"
    reference = Generator.builder().model_path(tiny_dir).cpu().quiet().build()
    monkeypatch.setattr(sources, "resolve", lambda name, **_: sources.ModelSource(name, tiny_dir, registry.find_entry(name)))
    for line in lines:
        argv = [*shlex.split(line)[1:], "--device", "cpu", "--quiet", "--max-tokens", "6"]
        assert cli.main(argv) == 0, line
        args = cli._parser().parse_args(argv)
        system = [{"role": "system", "content": args.system}] if args.system else []
        expected = reference.chat([*system, {"role": "user", "content": args.prompt}], max_tokens=6,
                                  **({"temperature": 0.0} if args.greedy else {}))
        assert capsys.readouterr().out.rstrip("\n") == expected.rstrip("\n"), line


@pytest.mark.slow
def test_the_first_readme_command_answers_the_question(tmp_path: Path) -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    first = re.search(r"&& \.venv/bin/kjarni (generate --chat .*)$", readme, re.MULTILINE)
    assert first is not None, "the README's first command no longer asks the model a question"
    cache = cache_with_default_model(tmp_path / "cache")
    result = run_kjarni(*shlex.split(first.group(1)), "--device", "cpu", "--greedy", env={"KJARNI_CACHE_DIR": str(cache)})
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
