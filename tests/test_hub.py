"""Models by Hugging Face id, through huggingface_hub against a fake hub on 127.0.0.1 (tests/fake_hub.py).

The hub is unreachable from CI, so every test points HF_ENDPOINT at the fake one and HF_HUB_CACHE
at a fresh folder; the fake logs each request, so "no second download" is a count.
"""

from __future__ import annotations

import re
import socket
import threading
from pathlib import Path

import pytest

from kjarni import hub, sources
from kjarni.errors import (
    DownloadFailedError,
    HubUnreachableError,
    LoadFailedError,
    ModelNotDownloadedError,
    ModelPathNotFoundError,
)
from kjarni.generator import Generator
from kjarni.sources import DownloadPolicy, resolve
from tests.fake_hub import FakeHub
from tests.test_api import make_tiny_model
from tests.tiny_models import random_state_dict, save_gguf_model, tiny_config


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    folder = make_tiny_model(tmp_path_factory.mktemp("tiny-hub"))
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    config = tiny_config("llama")
    path = save_gguf_model(tmp_path_factory.mktemp("tiny-gguf") / "t.gguf", config, random_state_dict(config, seed=4))
    return path.read_bytes()


@pytest.fixture
def fake_hub(tiny_files, tiny_gguf, tmp_path, monkeypatch):
    repos = {
        "test-org/Tiny-Chat": {**tiny_files, "README.md": b"# tiny"},
        "test-org/Tiny-Chat-GGUF": {
            "tiny-chat-q4_k_m.gguf": tiny_gguf,
            "tiny-chat-q8_0.gguf": tiny_gguf,
            "tiny-chat-q6_k-00001-of-00002.gguf": b"GGUF",
            "README.md": b"# tiny",
        },
    }
    with FakeHub(repos) as fake:
        monkeypatch.setenv("HF_ENDPOINT", fake.url)
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.setenv("KJARNI_CACHE_DIR", str(tmp_path / "kjarni-cache"))
        monkeypatch.chdir(tmp_path)
        yield fake


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Qwen/Qwen2.5-0.5B-Instruct", hub.HubReference("Qwen/Qwen2.5-0.5B-Instruct")),
        ("Qwen/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M", hub.HubReference("Qwen/Qwen2.5-0.5B-Instruct-GGUF", quant="Q4_K_M")),
        ("Qwen/Qwen2.5-0.5B-Instruct-GGUF", hub.HubReference("Qwen/Qwen2.5-0.5B-Instruct-GGUF", quant="Q4_K_M")),
        ("org/repo:model-q8_0.gguf", hub.HubReference("org/repo", filename="model-q8_0.gguf")),
        ("smollm2", None),
        ("a/b/c", None),
        ("./org/name", None),
        ("org/na me", None),
        ("org/..", None),
    ],
)
def test_hub_references_are_read_as_llama_cpp_writes_them(text, expected):
    assert hub.parse_reference(text) == expected


def test_a_repo_id_downloads_into_the_standard_hf_cache_once_and_runs(fake_hub, tmp_path, tiny_files):
    generator = Generator.builder("test-org/Tiny-Chat").cpu().quiet().build()
    source = resolve("test-org/Tiny-Chat", quiet=True)
    assert source.path.is_relative_to(tmp_path / "hf-cache" / "models--test-org--Tiny-Chat")
    assert source.entry is None and source.name == "test-org/Tiny-Chat"
    assert sorted(fake_hub.downloads()) == sorted(n for n in tiny_files)  # README.md not fetched
    expected = Generator.builder().model_path(source.path).cpu().quiet().build().generate("the", max_tokens=8, temperature=0)
    assert generator.generate("the", max_tokens=8, temperature=0) == expected
    downloads = len(fake_hub.downloads())
    Generator.builder("test-org/Tiny-Chat").cpu().quiet().build()
    assert len(fake_hub.downloads()) == downloads  # the second build downloads nothing


def test_a_model_another_tool_downloaded_is_reused_offline(fake_hub, tmp_path, monkeypatch):
    import huggingface_hub

    # "Another tool": huggingface_hub itself, into the standard cache.
    folder = huggingface_hub.snapshot_download("test-org/Tiny-Chat", cache_dir=tmp_path / "hf-cache", endpoint=fake_hub.url)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    before = len(fake_hub.requests)
    source = resolve("test-org/Tiny-Chat", quiet=True)
    assert source.path == Path(folder)
    assert len(fake_hub.requests) == before  # offline means no request at all


def test_offline_with_nothing_cached_says_so(fake_hub, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotDownloadedError, match="HF_HUB_OFFLINE"):
        resolve("test-org/Tiny-Chat", quiet=True)
    with pytest.raises(ModelNotDownloadedError, match="HF_HUB_OFFLINE"):
        resolve("test-org/Tiny-Chat-GGUF:Q4_K_M", quiet=True)
    with pytest.raises(ModelNotDownloadedError, match="DownloadPolicy.NEVER"):
        monkeypatch.delenv("HF_HUB_OFFLINE")
        resolve("test-org/Tiny-Chat", policy=DownloadPolicy.NEVER, quiet=True)
    assert fake_hub.requests == []


def test_a_gguf_repo_with_a_quant_tag_fetches_only_that_file(fake_hub, tiny_gguf):
    source = resolve("test-org/Tiny-Chat-GGUF:q4_k_m", quiet=True)
    assert source.path.name == "tiny-chat-q4_k_m.gguf" and source.path.read_bytes() == tiny_gguf
    assert fake_hub.downloads() == ["tiny-chat-q4_k_m.gguf"]
    generator = Generator.builder("test-org/Tiny-Chat-GGUF:Q4_K_M").cpu().quiet().build()
    assert generator.model_name == "test-org/Tiny-Chat-GGUF:Q4_K_M"
    assert fake_hub.downloads() == ["tiny-chat-q4_k_m.gguf"]  # reused


def test_a_gguf_repo_without_a_tag_means_q4_k_m_and_a_file_can_be_named(fake_hub):
    assert resolve("test-org/Tiny-Chat-GGUF", quiet=True).path.name == "tiny-chat-q4_k_m.gguf"
    assert resolve("test-org/Tiny-Chat-GGUF:tiny-chat-q8_0.gguf", quiet=True).path.name == "tiny-chat-q8_0.gguf"


def test_a_quant_the_repo_lacks_or_splits_is_refused_naming_the_files(fake_hub):
    with pytest.raises(LoadFailedError, match="no .gguf file for Q2_K.*tiny-chat-q4_k_m.gguf"):
        resolve("test-org/Tiny-Chat-GGUF:Q2_K", quiet=True)
    with pytest.raises(LoadFailedError, match="split into 1 files.*llama-gguf-split"):
        resolve("test-org/Tiny-Chat-GGUF:Q6_K", quiet=True)
    assert fake_hub.downloads() == []


def test_a_repo_the_hub_does_not_have_is_a_download_failure_naming_the_id(fake_hub):
    with pytest.raises(DownloadFailedError, match="no local file or folder.*Hugging Face repo id.*test-org/Nothing"):
        resolve("test-org/Nothing", quiet=True)


def test_registry_snapshots_go_to_the_standard_hf_cache_without_an_explicit_cache_dir(fake_hub, tmp_path):
    assert sources.hf_cache_dir() == tmp_path / "hf-cache"
    assert sources.hf_cache_dir(tmp_path / "mine") == tmp_path / "mine" / "hf"


class DroppingEndpoint:
    """A hub that accepts each connection and closes it unanswered; counts the connections."""

    def __init__(self) -> None:
        self.attempts = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        while True:
            try:
                connection, _ = self._listener.accept()
            except OSError:  # closed
                return
            self.attempts += 1
            connection.close()

    def __enter__(self) -> DroppingEndpoint:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept (close alone does not)
        self._listener.close()
        self._thread.join()


@pytest.mark.parametrize("name", ["test-org/Tiny-Chat", "test-org/Tiny-Chat-GGUF:Q4_K_M", "test-org/Tiny:t.gguf"])
def test_an_unreachable_hub_fails_after_one_attempt_naming_the_id_and_the_way_out(name, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.chdir(tmp_path)
    with DroppingEndpoint() as endpoint:
        monkeypatch.setenv("HF_ENDPOINT", endpoint.url)
        with pytest.raises(HubUnreachableError) as info:
            resolve(name, quiet=True)
    assert endpoint.attempts == 1  # huggingface_hub alone would retry five times, sleeping 1+2+4+8+8 s
    message = str(info.value)
    assert f"could not be reached to fetch {name}" in message and endpoint.url in message
    assert "HF_HUB_OFFLINE=1" in message and "local .gguf file or model folder" in message
    assert f"no local file or folder ({tmp_path / name} does not exist)" in message


def test_a_refused_connection_is_unreachable_too_and_quiet_prints_nothing(tmp_path, monkeypatch, capfd):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")  # nothing listens there now
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with pytest.raises(HubUnreachableError, match="hf.co/test-org/Tiny-Chat-GGUF|test-org/Tiny-Chat-GGUF:Q4_K_M"):
        resolve("hf.co/test-org/Tiny-Chat-GGUF", quiet=True)
    assert capfd.readouterr() == ("", "")


@pytest.mark.parametrize("missing", ["./gone", "gone.gguf", "models/gone.gguf", "a/b/c", "~/no-such-kjarni-dir/x"])
def test_a_missing_path_is_no_such_file_or_folder_without_asking_the_hub(missing, fake_hub, tmp_path):
    with pytest.raises(ModelPathNotFoundError, match="No such file or folder") as info:
        resolve(missing, quiet=True)
    assert str(Path(missing).expanduser().absolute()) in str(info.value)
    assert fake_hub.requests == []


def test_owner_name_is_a_path_when_the_owner_folder_exists_and_hf_co_forces_the_hub(fake_hub, tmp_path):
    (tmp_path / "test-org").mkdir()  # the fixture's working folder
    with pytest.raises(ModelPathNotFoundError, match="hf.co/test-org/Tiny-Chat for the Hugging Face repo"):
        resolve("test-org/Tiny-Chat", quiet=True)
    assert fake_hub.requests == []
    assert resolve("hf.co/test-org/Tiny-Chat", quiet=True).name == "test-org/Tiny-Chat"


def test_pull_of_an_unreachable_repo_reports_the_network_failure_not_the_registry_miss(tmp_path, monkeypatch, capsys):
    from kjarni import cli

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with DroppingEndpoint() as endpoint:
        monkeypatch.setenv("HF_ENDPOINT", endpoint.url)
        assert cli.main(["pull", "test-org/Tiny-Chat-GGUF:Q4_K_M", "-q"]) == 1
    err = capsys.readouterr().err
    assert endpoint.attempts == 1 and err.count("\n") == 1
    prefix = f"kjarni: error: The Hugging Face hub ({endpoint.url}) could not be reached to fetch test-org/Tiny-Chat-GGUF:Q4_K_M ("
    assert err.startswith(prefix)
    assert re.match(r"\w*(Protocol|Connect|Connection|Read)\w*Error: ", err[len(prefix):])  # the client's own error
    assert "Unknown model" not in err
