"""Models on the Hugging Face hub, named as people write them, fetched with huggingface_hub.

    Qwen/Qwen2.5-0.5B-Instruct                     config, tokenizer and safetensors (a snapshot)
    Qwen/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M         the repo's .gguf of that quantization
    Qwen/Qwen2.5-0.5B-Instruct-GGUF:qwen2.5-0.5b-instruct-q4_k_m.gguf   that file

(llama.cpp's ``-hf repo[:quant]`` convention; a ``-GGUF`` repo named without a tag means its
Q4_K_M, as in llama.cpp.) Files go into the standard Hugging Face cache (``$HF_HUB_CACHE``, else
``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``), so what another tool downloaded is reused
without a second download; ``HF_HUB_OFFLINE=1`` (or ``DownloadPolicy.NEVER``) uses only that cache.
``HF_ENDPOINT`` picks another hub (a mirror, or a test server).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from kjarni.errors import DownloadFailedError, HubUnreachableError, LoadFailedError, ModelNotDownloadedError

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

DEFAULT_GGUF_QUANT = "Q4_K_M"

# A hub repo id: one owner and one name of letters, digits, '-', '_', '.' (huggingface_hub's rule).
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*/[A-Za-z0-9][A-Za-z0-9_.\-]*$")
_SPLIT_GGUF = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)


@dataclass(frozen=True)
class HubReference:
    """A model on the hub: ``repo_id`` and, for a GGUF, a ``filename`` or a ``quant`` tag."""

    repo_id: str
    filename: str | None = None
    quant: str | None = None

    def __str__(self) -> str:
        tail = self.filename or self.quant
        return f"{self.repo_id}:{tail}" if tail else self.repo_id

    @property
    def wants_gguf(self) -> bool:
        return self.filename is not None or self.quant is not None


def parse_reference(text: str) -> HubReference | None:
    """``text`` as a hub reference (``org/name``, ``org/name:QUANT``, ``org/name:file.gguf``, each also
    written ``hf.co/org/name...`` as Ollama does, which is never read as a local path), or None."""
    repo_id, _, tail = _strip_hub_prefix(text.strip()).partition(":")
    if not _REPO_ID.match(repo_id) or ".." in repo_id or repo_id.endswith("."):
        return None
    if not tail:
        if repo_id.lower().endswith("-gguf"):
            return HubReference(repo_id, quant=DEFAULT_GGUF_QUANT)
        return HubReference(repo_id)
    if tail.lower().endswith(".gguf"):
        return HubReference(repo_id, filename=tail)
    if re.fullmatch(r"[A-Za-z0-9_.\-]+", tail):
        return HubReference(repo_id, quant=tail)
    return None


_HUB_PREFIXES = ("https://huggingface.co/", "https://hf.co/", "huggingface.co/", "hf.co/")


def _strip_hub_prefix(text: str) -> str:
    for prefix in _HUB_PREFIXES:
        if text.lower().startswith(prefix):
            return text[len(prefix):]
    return text


def has_hub_prefix(text: str) -> bool:
    """True for ``hf.co/...`` (or ``huggingface.co/...``): a hub reference by intent, never a path."""
    return _strip_hub_prefix(text.strip()) != text.strip()


def offline() -> bool:
    """True when ``HF_HUB_OFFLINE`` is set: nothing is fetched from the hub."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def cache_dir() -> Path:
    """The standard Hugging Face hub cache, read from the environment now (as huggingface_hub does)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "huggingface" / "hub"


def _endpoint() -> str | None:
    return os.environ.get("HF_ENDPOINT") or None


@contextlib.contextmanager
def _hub_quiet(quiet: bool) -> Iterator[None]:
    """When quiet, huggingface_hub shows no download bar and logs its retries ("Retrying in 8s
    [Retry 5/5]") only as errors; otherwise its own bar, on stderr, is the download's progress."""
    # Through its own switches: importing its logging module (lazily, on first use) resets the level.
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
    from huggingface_hub.utils import logging as hub_logging

    level, bars_were_off = hub_logging.get_verbosity(), are_progress_bars_disabled()
    if quiet:
        hub_logging.set_verbosity_error()
        disable_progress_bars()
    try:
        yield
    finally:
        hub_logging.set_verbosity(level)
        if not bars_were_off:
            enable_progress_bars()


# ---------------------------------------------------------------- reaching the hub


def _transport_errors() -> tuple[type[BaseException], ...]:
    """The HTTP clients' "no answer at all" errors (huggingface_hub >= 1.0 uses httpx2 or httpx,
    older ones requests), plus the socket's own (refused, reset, DNS, timeout); not other OS
    errors, which are the cache folder's."""
    found: list[type[BaseException]] = [ConnectionError, socket.gaierror, TimeoutError]
    for module, names in (("httpx2", ("TransportError",)), ("httpx", ("TransportError",)),
                          ("requests", ("ConnectionError", "Timeout"))):
        try:
            imported = __import__(module)
        except ImportError:
            continue
        found += [getattr(imported, name) for name in names if isinstance(getattr(imported, name, None), type)]
    return tuple(found)


def _transport_failure(error: BaseException) -> BaseException | None:
    """The innermost "no answer" error in ``error``'s chain (what it was raised from), or None."""
    transport = _transport_errors()
    found = None
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, transport):
            found = current
        current = current.__cause__ or current.__context__
    return found


def is_unreachable(error: BaseException) -> bool:
    """True when ``error`` (or what it was raised from) means no answer came from the hub."""
    return _transport_failure(error) is not None


def unreachable_message(name: str, error: BaseException, cache: Path) -> str:
    """The hub could not be reached for ``name``: why, and the ways to run without it."""
    endpoint = _endpoint() or "https://huggingface.co"
    root = _transport_failure(error) or error
    detail = str(root).strip().splitlines()[0] if str(root).strip() else type(root).__name__
    return (
        f"The Hugging Face hub ({endpoint}) could not be reached to fetch {name} "
        f"({type(root).__name__}: {detail}). Without network: set HF_HUB_OFFLINE=1 to use what is already "
        f"in the Hugging Face cache ({cache}), or pass the path of a local .gguf file or model folder, or a "
        f"registry model that is downloaded (`kjarni models`)."
    )


def check_reachable(repo_id: str, name: str, cache: Path) -> None:
    """Raise `HubUnreachableError` at once when the hub gives no answer for ``repo_id``.

    huggingface_hub retries a network error five times with back-off (about 24 s) in its file
    listing and downloads, and has no setting for that; its repo-info call (``HfApi.model_info``)
    makes one request, with the ``HF_HUB_ETAG_TIMEOUT`` timeout. Any answer (even 404 or 401)
    means the hub is there: the download that follows reports it.
    """
    from huggingface_hub import HfApi, constants

    try:
        HfApi(endpoint=_endpoint()).model_info(repo_id, timeout=constants.HF_HUB_ETAG_TIMEOUT)
    except Exception as error:  # noqa: BLE001 - HTTP answers are the download's to report
        if is_unreachable(error):
            raise HubUnreachableError(unreachable_message(name, error, cache)) from error


def download_error(name: str, repo_id: str, error: Exception, cache: Path) -> DownloadFailedError:
    """The typed error for a failed hub download: unreachable, or `failure_message`'s."""
    if is_unreachable(error) and not offline():
        return HubUnreachableError(unreachable_message(name, error, cache))
    return DownloadFailedError(failure_message(name, repo_id, error))


# ---------------------------------------------------------------- snapshots (safetensors)


def cached_snapshot(repo_id: str, cache: Path) -> Path | None:
    """The cached snapshot of ``repo_id`` in ``cache`` when it is complete, else None (no network)."""
    from huggingface_hub import snapshot_download

    try:
        folder = Path(
            snapshot_download(repo_id, cache_dir=cache, allow_patterns=list(HF_ALLOW_PATTERNS), local_files_only=True)
        )
    except Exception:  # noqa: BLE001 - any failure here just means "not cached"
        return None
    return folder if snapshot_complete(folder) else None


def snapshot_complete(folder: Path) -> bool:
    """True when ``folder`` has config.json and every safetensors shard its index names."""
    if not (folder / "config.json").is_file():
        return False
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError):
            return False
        return all((folder / shard).is_file() for shard in shards)
    return any(folder.glob("model*.safetensors"))


def fetch_snapshot(repo_id: str, cache: Path, *, quiet: bool = False, what: str | None = None) -> Path:
    """Download ``repo_id``'s config, tokenizer and safetensors into ``cache`` (``HF_HUB_OFFLINE``: cache only)."""
    from huggingface_hub import snapshot_download

    kwargs: dict[str, object] = {}
    if _endpoint():
        kwargs["endpoint"] = _endpoint()
    try:
        with _hub_quiet(quiet):
            folder = Path(
                snapshot_download(
                    repo_id, cache_dir=cache, allow_patterns=list(HF_ALLOW_PATTERNS), local_files_only=offline(), **kwargs
                )
            )
    except Exception as error:  # noqa: BLE001 - hub, HTTP and OS errors all mean the same to the caller
        # Its first request (repo info) is not retried, so an unreachable hub fails at once here.
        raise download_error(what or repo_id, repo_id, error, cache) from error
    if not snapshot_complete(folder):
        raise DownloadFailedError(
            f"The Hugging Face snapshot of {repo_id} in {folder} lacks config.json or safetensors weights "
            f"(a GGUF repo? name a file or quantization: {repo_id}:Q4_K_M). Delete that folder and retry."
        )
    return folder


def failure_message(name: str, repo_id: str, error: Exception) -> str:
    """What went wrong downloading ``name`` from ``repo_id`` and what to do next."""
    kind = type(error).__name__
    hint = "Check your network, then retry"
    if kind == "GatedRepoError" or "401" in str(error) or "403" in str(error):
        hint = (f"{repo_id} is gated: accept its licence on huggingface.co, log in with "
                f"`hf auth login` (or set HF_TOKEN), then retry")
    elif kind == "RepositoryNotFoundError" or "404" in str(error):
        hint = f"Check the repo id {repo_id!r} (it is case-sensitive on the hub), then retry"
    elif offline():
        hint = "HF_HUB_OFFLINE is set, so nothing can be downloaded; unset it, then retry"
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else kind
    return (
        f"Downloading {name} from Hugging Face ({repo_id}) failed: {kind}: {first_line}. "
        f"{hint} `kjarni pull {name}`, or download the files into a folder and pass its path."
    )


# ---------------------------------------------------------------- GGUF files


def _cached_repo_files(repo_id: str, cache: Path) -> list[str]:
    """The files of ``repo_id``'s cached snapshots (relative paths), newest snapshot first."""
    snapshots = cache / ("models--" + repo_id.replace("/", "--")) / "snapshots"
    if not snapshots.is_dir():
        return []
    found: list[str] = []
    for snapshot in sorted(snapshots.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True):
        for path in snapshot.rglob("*"):
            name = path.relative_to(snapshot).as_posix()
            if path.is_file() and name not in found:
                found.append(name)
    return found


def choose_gguf(ref: HubReference, files: list[str]) -> str:
    """The one .gguf in ``files`` that ``ref`` names (its file, or its quant tag, any case)."""
    ggufs = [f for f in files if f.lower().endswith(".gguf")]
    if ref.filename is not None:
        if ref.filename in files:
            return ref.filename
        raise LoadFailedError(
            f"{ref.repo_id} has no file {ref.filename!r}. Its .gguf files: {', '.join(ggufs) or 'none'}."
        )
    assert ref.quant is not None
    tag = ref.quant.lower()
    matches = [f for f in ggufs if re.search(rf"(^|[-_.]){re.escape(tag)}([-_.]|$)", Path(f).stem.lower())]
    if not matches:
        raise LoadFailedError(
            f"{ref.repo_id} has no .gguf file for {ref.quant}. Its .gguf files: {', '.join(ggufs) or 'none'}; "
            f"name one as {ref.repo_id}:FILE.gguf or pick another quantization."
        )
    whole = [f for f in matches if not _SPLIT_GGUF.search(f)]
    if len(whole) == 1:
        return whole[0]
    if not whole:
        raise LoadFailedError(
            f"{ref.repo_id}'s {ref.quant} is split into {len(matches)} files ({matches[0]}, ...); kjarni reads "
            f"single-file GGUFs: merge them with llama.cpp's `llama-gguf-split --merge` and pass the file."
        )
    raise LoadFailedError(
        f"{ref.repo_id} has {len(whole)} .gguf files for {ref.quant}: {', '.join(whole)}; name one as {ref.repo_id}:FILE.gguf."
    )


def fetch_gguf(ref: HubReference, cache: Path, *, local_only: bool, quiet: bool = False) -> Path:
    """The .gguf ``ref`` names, from ``cache`` or (unless ``local_only`` or offline) the hub."""
    local_only = local_only or offline()
    with _hub_quiet(quiet):
        return _fetch_gguf(ref, cache, local_only)


def _fetch_gguf(ref: HubReference, cache: Path, local_only: bool) -> Path:
    from huggingface_hub import HfApi, hf_hub_download

    try:
        if not local_only:
            check_reachable(ref.repo_id, str(ref), cache)
        if ref.filename is not None:
            filename = ref.filename
        elif local_only:
            filename = choose_gguf(ref, _cached_repo_files(ref.repo_id, cache))
        else:
            filename = choose_gguf(ref, HfApi(endpoint=_endpoint()).list_repo_files(ref.repo_id))
        kwargs: dict[str, object] = {}
        if _endpoint():
            kwargs["endpoint"] = _endpoint()
        return Path(hf_hub_download(ref.repo_id, filename, cache_dir=cache, local_files_only=local_only, **kwargs))
    except HubUnreachableError:
        raise
    except LoadFailedError as error:
        if local_only:
            raise ModelNotDownloadedError(_not_cached_message(ref, cache, str(error))) from None
        raise
    except Exception as error:  # noqa: BLE001 - hub, HTTP and OS errors all mean the same to the caller
        if local_only and type(error).__name__ in ("LocalEntryNotFoundError", "EntryNotFoundError"):
            raise ModelNotDownloadedError(_not_cached_message(ref, cache, "")) from None
        raise download_error(str(ref), ref.repo_id, error, cache) from error


def _not_cached_message(ref: HubReference, cache: Path, detail: str) -> str:
    why = "HF_HUB_OFFLINE is set" if offline() else "downloads are off (DownloadPolicy.NEVER)"
    extra = f" ({detail})" if detail else ""
    return (
        f"{ref} is not in the Hugging Face cache ({cache}){extra} and {why}. "
        f"Download it once with network (`kjarni pull {ref}`), or pass the path of a local .gguf file."
    )
