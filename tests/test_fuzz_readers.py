"""Mutation fuzz of both readers: every mutated file is refused with a typed error or loads correctly.

The regression cases of issue 15 (section 3) are explicit tests; the hypothesis tests mutate one
slot of a tiny GGUF (tests/bad_files.py) or one field of a safetensors header, derandomized and
bounded (tools/fuzz_readers.py runs a larger campaign).
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.bad_files import (
    GgufLayout,
    base_gguf,
    base_safetensors,
    gguf_array_count,
    gguf_with,
    join_safetensors,
    load_outcome,
    put,
    split_safetensors,
    write_safetensors_folder,
)

FUZZ = settings(max_examples=150, derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def _gguf(tmp_path, data: bytes):
    path = tmp_path / "m.gguf"
    path.write_bytes(data)
    return load_outcome(path)


def _typed(outcome, *fragments):
    kind, detail = outcome
    assert kind == "typed", detail
    for fragment in fragments:
        assert fragment in detail, detail


def test_the_unmutated_files_load_and_generate(tmp_path):
    assert _gguf(tmp_path, base_gguf())[0] == "accepted"
    weights, _, _ = base_safetensors()
    assert load_outcome(write_safetensors_folder(tmp_path / "st", weights))[0] == "accepted"


# ---------------------------------------------------------------- GGUF regressions


@pytest.mark.parametrize("key", ["llama.attention.head_count", "llama.attention.head_count_kv", "llama.embedding_length",
                                 "llama.feed_forward_length", "llama.block_count", "llama.context_length"])
def test_zero_counts_are_refused_naming_the_key(tmp_path, key):
    # head_count 0 was a ZeroDivisionError; context_length 0 silently became 2048.
    outcome = _gguf(tmp_path, gguf_with(**{key: 0}))
    _typed(outcome)
    assert "0" in outcome[1]


def test_context_length_zero_is_refused(tmp_path):
    _typed(_gguf(tmp_path, gguf_with(**{"llama.context_length": 0})), "llama.context_length = 0 is not a positive integer")


def test_huge_block_count_is_refused_against_the_tensors_present(tmp_path):
    _typed(_gguf(tmp_path, gguf_with(**{"llama.block_count": 2**32 - 1})),
           "block_count = 4294967295 but the file has tensors for blk.0 .. blk.1")


def test_block_count_one_with_two_layers_of_tensors_is_refused(tmp_path):
    _typed(_gguf(tmp_path, gguf_with(**{"llama.block_count": 1})), "block_count = 1 but the file has tensors for blk.0 .. blk.1")


def test_context_length_of_2_32_is_refused_naming_max_context_not_allocated(tmp_path):
    _typed(_gguf(tmp_path, gguf_with(**{"llama.context_length": 2**32 - 1})), "4294967295 positions", "max_context")


def test_max_context_caps_the_context_a_huge_context_length_builds(tmp_path):
    from kjarni.loader import load_model

    path = tmp_path / "m.gguf"
    path.write_bytes(gguf_with(**{"llama.context_length": 2**32 - 1}))
    loaded = load_model(path, max_context=128)
    assert loaded.model.context_size == 128


@pytest.mark.parametrize("key,count", [("tokenizer.ggml.token_type", 2**40), ("tokenizer.ggml.merges", 2**40),
                                       ("tokenizer.ggml.tokens", 2**62), ("tokenizer.ggml.token_type", 98)])
def test_lying_array_counts_are_refused_against_the_file_size(tmp_path, key, count):
    _typed(_gguf(tmp_path, gguf_array_count(key, count)), "the file has only")


@pytest.mark.parametrize("key", ["general.name", "general.architecture", "tokenizer.ggml.pre"])
def test_invalid_utf8_metadata_is_refused_saying_so(tmp_path, key):
    data = bytearray(base_gguf())
    slot = [s for s in GgufLayout(bytes(data)).fields[key] if s.what == "bytes"][-1]
    data[slot.offset] = 0xFF
    _typed(_gguf(tmp_path, bytes(data)), "not valid UTF-8")


def test_tensor_dims_that_do_not_fit_their_bytes_are_refused(tmp_path):
    data = bytearray(base_gguf())
    layout = GgufLayout(bytes(data))
    put(data, layout.slot("blk.0.attn_norm.weight", "dims"), 47)  # 48 floats stored
    outcome = _gguf(tmp_path, bytes(data))
    _typed(outcome)


# ---------------------------------------------------------------- safetensors regressions


def _st(tmp_path, header=None, body=None, raw_header=None):
    weights, _, _ = base_safetensors()
    base_header, base_body = split_safetensors(weights)
    data = join_safetensors(base_header if header is None else header, base_body if body is None else body,
                            raw_header=raw_header)
    return load_outcome(write_safetensors_folder(tmp_path / "st", data))


def _header():
    return split_safetensors(base_safetensors()[0])[0]


def _two_tensors(header):
    names = sorted((n for n in header if n != "__metadata__"), key=lambda n: header[n]["data_offsets"][0])
    return names[0], names[1]


def test_overlapping_data_offsets_are_refused(tmp_path):
    header = _header()
    first, second = _two_tensors(header)
    begin, end = header[second]["data_offsets"]
    header[second]["data_offsets"] = [begin - 4, end - 4]
    _typed(_st(tmp_path, header), "overlaps the tensor before it")


def test_gapped_data_offsets_are_refused(tmp_path):
    header = _header()
    first, _ = _two_tensors(header)
    header[first]["data_offsets"] = [4, header[first]["data_offsets"][1] + 4]
    _typed(_st(tmp_path, header), "leaves a gap of 4 bytes")


def test_deeply_nested_header_is_refused_not_a_recursion_error(tmp_path):
    _typed(_st(tmp_path, raw_header=b'{"__metadata__": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"), "nested too deeply")


@pytest.mark.parametrize("entry", [{"dtype": ["F32"], "shape": [48], "data_offsets": [0, 192]},
                                   {"dtype": "F32", "shape": [48.0], "data_offsets": [0, 192]},
                                   {"dtype": "F32", "shape": [48], "data_offsets": {"a": 1}},
                                   [1, 2, 3]])
def test_malformed_entries_are_refused_not_a_type_error(tmp_path, entry):
    header = _header()
    first, _ = _two_tensors(header)
    header[first] = entry
    _typed(_st(tmp_path, header), "bad entry for tensor")


def test_config_json_claiming_huge_layer_count_is_refused_against_the_tensors(tmp_path):
    weights, config, _ = base_safetensors()
    config = json.loads(config)
    config["num_hidden_layers"] = 2**32 - 1
    outcome = load_outcome(write_safetensors_folder(tmp_path / "st", weights, json.dumps(config)))
    _typed(outcome, "num_hidden_layers = 4294967295 but the tensors hold layers 0 .. 1")


# ---------------------------------------------------------------- the fuzz

EXTREMES = [0, 1, 2, 3, 7, 47, 48, 97, 255, 2**16, 2**31 - 1, 2**31, 2**32 - 1, 2**63, 2**64 - 1]
FLOATS = [0.0, -1.0, float("nan"), float("inf"), -float("inf"), 1e38, 1e-45]


@st.composite
def gguf_mutation(draw):
    data = bytearray(base_gguf())
    layout = GgufLayout(bytes(data))
    slots = [s for s in layout.slots if s.what != "name"]
    kind = draw(st.sampled_from(["slot", "slot", "slot", "truncate", "flip"]))
    if kind == "truncate":
        return bytes(data[: draw(st.integers(0, len(data) - 1))])
    if kind == "flip":
        header_end = layout.data_start
        offset = draw(st.integers(0, header_end - 1))
        data[offset] ^= 1 << draw(st.integers(0, 7))
        return bytes(data)
    slot = draw(st.sampled_from(slots))
    if slot.what == "bytes":
        data[slot.offset] = draw(st.sampled_from([0x00, 0x80, 0xC0, 0xFF, 0x20]))
    elif slot.dtype.kind == "f":
        put(data, slot, draw(st.sampled_from(FLOATS)))
    else:
        put(data, slot, draw(st.sampled_from(EXTREMES) | st.integers(0, 2 ** (slot.dtype.itemsize * 8) - 1)))
    return bytes(data)


@FUZZ
@given(data=gguf_mutation())
def test_fuzz_gguf_every_mutation_is_typed_or_loads_correctly(tmp_path_factory, data):
    outcome = _gguf(tmp_path_factory.mktemp("fuzz"), data)
    assert outcome[0] in ("typed", "accepted"), outcome[1]


@st.composite
def safetensors_mutation(draw):
    header, body = split_safetensors(base_safetensors()[0])
    names = [n for n in header if n != "__metadata__"]
    name = draw(st.sampled_from(names))
    field = draw(st.sampled_from(["dtype", "shape", "data_offsets", "entry", "drop", "truncate", "length"]))
    values = st.sampled_from([None, -1, 0, 2**64, 1.5, "F32", "I8", [], [0], [1, 2, 3], {"a": 1}, True])
    if field == "drop":
        del header[name]
    elif field == "entry":
        header[name] = draw(values)
    elif field == "shape":
        header[name]["shape"] = draw(st.lists(st.sampled_from([-1, 0, 1, 48, 97, 2**40, 1.0]), max_size=3))
    elif field == "data_offsets":
        begin, end = header[name]["data_offsets"]
        delta = draw(st.sampled_from([-8, -4, -1, 1, 4, 8, 2**40]))
        header[name]["data_offsets"] = draw(st.sampled_from([[begin + delta, end + delta], [begin, end + delta],
                                                              [end, begin]]))
    elif field == "dtype":
        header[name]["dtype"] = draw(st.sampled_from(["F16", "BF16", "I64", "f32", "", 3]))
    data = join_safetensors(header, body)
    if field == "truncate":
        data = data[: draw(st.integers(0, len(data) - 1))]
    elif field == "length":
        data = draw(st.sampled_from([0, 7, 2**40, 2**64 - 1])).to_bytes(8, "little") + data[8:]
    return data


@FUZZ
@given(data=safetensors_mutation())
def test_fuzz_safetensors_every_mutation_is_typed_or_loads_correctly(tmp_path_factory, data):
    outcome = load_outcome(write_safetensors_folder(tmp_path_factory.mktemp("fuzz"), data))
    assert outcome[0] in ("typed", "accepted"), outcome[1]
