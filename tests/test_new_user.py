"""What a new user trips over first: bad names and paths, the draft model, quiet device listings.

Each check goes through the CLI's `main` (its exit code and its one line on stderr) or the
builder, as a new user would, with tiny models only.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kjarni import cli
from kjarni.errors import ModelPathNotFoundError, UnknownModelError
from kjarni.generator import Generator
from tests.test_api import make_tiny_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-new-user"))


def test_a_missing_model_path_is_no_such_file_or_folder_with_its_absolute_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelPathNotFoundError, match=f"No such file or folder: {tmp_path / 'nowhere'} "):
        Generator.builder().model_path("nowhere").cpu().quiet().build()
    assert cli.main(["generate", "hi", "--model-path", "nowhere", "-q"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith(f"kjarni: error: No such file or folder: {tmp_path / 'nowhere'} ")


def test_an_unknown_draft_model_says_it_is_the_draft(tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(UnknownModelError, match="^the draft model: Unknown model 'no-such-draft'"):
        Generator.builder().model_path(tiny_dir).cpu().draft("no-such-draft").quiet().build()
    assert cli.main(["generate", "hi", "--model-path", str(tiny_dir), "--device", "cpu",
                     "--draft", "no-such-draft", "-q"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kjarni: error: the draft model: Unknown model 'no-such-draft'") and err.count("\n") == 1


@pytest.mark.gpu
def test_devices_with_q_prints_the_table_and_nothing_on_stderr(wgpu_context, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["devices"]) == 0
    loud = capsys.readouterr()
    assert "kjarni would open" in loud.err
    assert cli.main(["devices", "-q"]) == 0
    quiet = capsys.readouterr()
    assert quiet.err == "" and quiet.out == loud.out


@pytest.mark.gpu
def test_a_gpu_index_with_no_adapter_points_at_kjarni_devices(
    wgpu_context, tiny_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from kjarni.gpu.adapters import list_adapters
    from kjarni.gpu.runtime import load_runtime

    monkeypatch.delenv("KJARNI_GPU_ADAPTER", raising=False)
    count = len(list_adapters(load_runtime("wgpu")))
    assert cli.main(["generate", "hi", "--model-path", str(tiny_dir), "--gpu", str(count), "--runtime", "wgpu", "-q"]) == 1
    err = capsys.readouterr().err
    assert f"there is no adapter {count}" in err and "`kjarni devices` lists them" in err and err.count("\n") == 1
