"""Quiet means quiet, and the CLI's one-line summary.

Each check runs kjarni in a subprocess and reads its stdout and stderr file descriptors, so output
written from C (Mesa) or by child processes (pip) is caught too, not only Python's sys.stderr.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kjarni import registry, sources
from kjarni.generator import Generator
from kjarni.generator import builder as builder_module
from tests.test_api import make_tiny_model

REPO = Path(__file__).resolve().parents[1]
SUMMARY = re.compile(
    r"^kjarni: (\d+) prompt tokens, (\d+) generated \((\w+)\); prefill [\d.]+ tok/s, decode [\d.]+ tok/s; "
    r"(cpu \(numpy\)|gpu \(.+\))$"
)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-quiet"))


@pytest.fixture
def wgpu_or_skip(request: pytest.FixtureRequest) -> None:
    """For tests (or parameters) marked gpu: skip, with the reason, where no adapter exists."""
    if request.node.get_closest_marker("gpu") is not None:
        request.getfixturevalue("wgpu_context")


def run(args: list[str], *, headless: bool = True) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    if headless:  # as over ssh or in a container: Mesa complains unless kjarni prevents it
        env.pop("XDG_RUNTIME_DIR", None)
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, encoding="utf-8", cwd=REPO, timeout=300, env=env
    )


API_SCRIPT = """
import sys
from kjarni.generator import Generator
g = Generator.builder().model_path(sys.argv[1]).device(sys.argv[2]).quiet().build()
g.generate("the", max_tokens=3)
"""


@pytest.mark.parametrize("device", ["cpu", "auto", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_the_python_api_with_quiet_prints_nothing_at_all(tiny_dir: Path, device: str, wgpu_or_skip: None) -> None:
    done = run(["-c", API_SCRIPT, str(tiny_dir), device])
    assert done.returncode == 0, done.stderr
    assert done.stdout == "" and done.stderr == ""


@pytest.mark.parametrize("device", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_the_cli_with_q_prints_only_the_text(tiny_dir: Path, device: str, wgpu_or_skip: None) -> None:
    done = run(["-m", "kjarni", "generate", "the", "-q", "--model-path", str(tiny_dir), "--device", device,
                "--max-tokens", "4", "--greedy"])
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    expected = Generator.builder().model_path(tiny_dir).cpu().quiet().build().generate("the", max_tokens=4, temperature=0)
    assert done.stdout == expected + ("" if expected.endswith("\n") else "\n")


def test_generate_ends_with_a_one_line_summary_on_stderr_matching_the_json_stats(tiny_dir: Path) -> None:
    common = ["-m", "kjarni", "generate", "the cat", "--model-path", str(tiny_dir), "--device", "cpu",
              "--max-tokens", "6", "--greedy"]
    done = run(common)
    assert done.returncode == 0, done.stderr
    match = SUMMARY.match(done.stderr.splitlines()[-1])
    assert match, done.stderr
    as_json = run([*common, "--json"])
    stats = json.loads(as_json.stdout)["stats"]
    assert (int(match[1]), int(match[2]), match[3]) == (stats["prompt_tokens"], stats["generated_tokens"], stats["finish_reason"])
    assert match[4] == "cpu (numpy)"
    assert not any(SUMMARY.match(line) for line in as_json.stderr.splitlines())  # --json keeps its own schema
    assert set(json.loads(as_json.stdout)) == {"model", "device", "draft_model", "num_draft_tokens", "text",
                                               "finish_reason", "stats", "config"}


def test_quiet_silences_the_large_model_warning(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capfd: pytest.CaptureFixture[str]) -> None:
    big = registry.find_entry("qwen2.5-7b-instruct")  # 7.6B parameters: warned about on the CPU
    monkeypatch.setattr(builder_module.sources, "resolve",
                        lambda *_a, **_k: sources.ModelSource(big.name, tiny_dir, big))
    Generator.builder(big.name).cpu().build()
    assert "7.6B parameters" in capfd.readouterr().err
    Generator.builder(big.name).cpu().quiet().build()
    assert capfd.readouterr() == ("", "")


def test_an_unknown_model_exits_with_status_2_as_documented() -> None:
    done = run(["-m", "kjarni", "generate", "x", "--model", "no-such-model", "--device", "cpu"])
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "Unknown model 'no-such-model'" in done.stderr
    assert "2 bad arguments, settings or an unknown model name" in (REPO / "kjarni" / "cli.py").read_text()


@pytest.mark.gpu
def test_parity_says_what_it_is_doing_and_q_silences_it(tiny_dir: Path, wgpu_or_skip: None) -> None:
    args = ["-m", "kjarni", "parity", "--model-path", str(tiny_dir), "--prompt", "hi", "--steps", "3"]
    done = run(args)
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert any("parity: loading" in line and "on the CPU" in line for line in lines)
    assert any("parity: loading" in line and "on the GPU" in line for line in lines)
    assert any(re.search(r"parity: prompt of \d+ tokens \+ 3 greedy steps on both .*4 steps in", line) for line in lines)
    quiet = run([*args, "-q"])
    assert quiet.returncode == 0 and quiet.stderr == ""
    assert "max |logit diff|" in quiet.stdout


@pytest.mark.gpu
def test_a_wgpu_context_made_directly_keeps_mesa_quiet(wgpu_or_skip: None) -> None:
    script = "from kjarni.gpu import WgpuContext\nWgpuContext().close()\nprint('made')\n"
    done = run(["-c", script])
    assert done.returncode == 0, done.stderr
    assert (done.stdout, done.stderr) == ("made\n", "")
