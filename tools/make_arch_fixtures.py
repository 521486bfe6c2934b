"""Make the tiny per-architecture fixtures in tests/fixtures/arch/ with transformers (reference only).

Run with a Python that has torch and transformers (never a kjarni dependency):

    /work/refvenv/bin/python tools/make_arch_fixtures.py

For each case a tiny random model (2-3 layers, odd sizes, a small vocab, float32) is built from a
config, its weights redrawn with a large spread so logits are far from flat (greedy choices then
have clear margins), and saved as ``model.safetensors`` + ``config.json`` (Hugging Face hub style:
``rope_scaling``/``rope_theta`` as real checkpoints ship them) + ``generation_config.json``. transformers
5 writes configs with ``rope_parameters`` instead; that form is kept beside as
``config.transformers5.json`` so the config reader is tested on both.

``reference.json`` holds, per prompt of token ids: the logits of the last ``LAST_ROWS`` positions
(full rows: the vocab is small), 16 greedy tokens decoded through transformers' KV cache (eager attention)
and, for the cases whose feature is scaled RoPE or a sliding window, the same logits with the
feature switched off, so a test can assert the feature changes the result.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "arch"
LAST_ROWS = 4
NEW_TOKENS = 16


MIN_MARGIN = 0.01  # smallest top-2 logit gap allowed along a greedy run, so 1e-3 errors cannot flip it


def draw_prompt(vocab: int, length: int, rng: np.random.Generator) -> list[int]:
    return [int(t) for t in rng.integers(3, vocab, size=length)]


CASES: dict[str, dict] = {
    # GPT-2: LayerNorm with bias, gelu_new, learned positions, fused c_attn in Conv1D layout, tied output.
    "gpt2": dict(
        config={
            "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 103, "n_positions": 64,
            "n_ctx": 64, "n_embd": 36, "n_layer": 3, "n_head": 3, "n_inner": None,
            "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5, "resid_pdrop": 0.0,
            "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": 0, "eos_token_id": 0,
            "scale_attn_weights": True, "tie_word_embeddings": True,
        },
        lengths=[7, 19, 30],
        off=None,
    ),
    # Phi-3 with LongRoPE: original context 32, prompts beyond it (long factors), one that crosses
    # it while generating (short factors for the prompt's keys, long ones after) and one that stays short.
    "phi3": dict(
        config={
            "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "vocab_size": 101, "hidden_size": 48,
            "intermediate_size": 80, "num_hidden_layers": 2, "num_attention_heads": 3,
            "num_key_value_heads": 1, "max_position_embeddings": 128, "original_max_position_embeddings": 32,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu", "sliding_window": None,
            "rope_scaling": {
                "type": "longrope",
                "short_factor": [1.0, 1.02, 1.05, 1.1, 1.3, 1.6, 2.1, 2.9],
                "long_factor": [1.0, 1.3, 2.2, 3.5, 6.0, 9.5, 14.0, 21.0],
            },
            "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
        },
        lengths=[40, 20, 9],
        off={"rope_scaling": None},
    ),
    # Phi-3 with a partial rotary factor (Phi-4-mini style): only the first half of each head rotates.
    "phi3_partial": dict(
        config={
            "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "vocab_size": 101, "hidden_size": 48,
            "intermediate_size": 80, "num_hidden_layers": 2, "num_attention_heads": 3,
            "num_key_value_heads": 3, "max_position_embeddings": 128, "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0, "partial_rotary_factor": 0.5, "hidden_act": "silu", "sliding_window": None,
            "rope_scaling": None, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
            "pad_token_id": 0,
        },
        lengths=[13, 27],
        off=None,
    ),
    # Llama 3 RoPE scaling: original context 16, so low, medium and high frequencies all occur.
    "llama3": dict(
        config={
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 97, "hidden_size": 48,
            "intermediate_size": 72, "num_hidden_layers": 2, "num_attention_heads": 3,
            "num_key_value_heads": 1, "head_dim": 16, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
            "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
        },
        lengths=[24, 40],
        off={"rope_scaling": None},
    ),
    # Mistral with a sliding window of 8 and prompts of 24 and 30 tokens.
    "mistral": dict(
        config={
            "architectures": ["MistralForCausalLM"], "model_type": "mistral", "vocab_size": 97,
            "hidden_size": 44, "intermediate_size": 72, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 12, "max_position_embeddings": 128, "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0, "hidden_act": "silu", "sliding_window": 8,
            "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
        },
        lengths=[24, 30],
        off={"sliding_window": None},
    ),
}


def redraw(model: torch.nn.Module, seed: int) -> None:
    """Weights with a large spread (transformers' init is too flat for clear greedy margins)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and ("norm" in name or ".ln_" in name or name.startswith("transformer.ln_f")) and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif p.ndim == 1:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.25 * torch.randn(p.shape, generator=gen))


def build(config: dict, attn: str = "eager") -> torch.nn.Module:
    cfg = transformers.AutoConfig.for_model(**config)
    cfg._attn_implementation = attn
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.float32).eval()


def last_logits(model: torch.nn.Module, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        out = model(torch.tensor([ids]))
    return out.logits[0, -LAST_ROWS:].numpy().astype(np.float32)


def greedy(model: torch.nn.Module, ids: list[int]) -> tuple[list[int], float]:
    """16 greedy tokens through the KV cache (prefill, then one token per step; no EOS rules, so an
    EOS id is just a token) and the smallest top-2 logit gap along the way."""
    tokens, gaps = [], []
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
        for _ in range(NEW_TOKENS):
            top = torch.topk(out.logits[0, -1], 2)
            gaps.append(float(top.values[0] - top.values[1]))
            tokens.append(int(top.indices[0]))
            out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens, min(gaps)


def make(name: str, case: dict, seed: int) -> None:
    folder = OUT / name
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    torch.manual_seed(seed)
    model = build(case["config"])
    redraw(model, seed)
    model.save_pretrained(folder, safe_serialization=True)
    shutil.move(folder / "config.json", folder / "config.transformers5.json")
    hub = dict(case["config"], torch_dtype="float32")
    (folder / "config.json").write_text(json.dumps(hub, indent=2) + "\n")

    state = model.state_dict()
    rng = np.random.default_rng(seed)
    reference: dict = {"transformers": transformers.__version__, "torch": torch.__version__,
                       "attn_implementation": "eager", "last_rows": LAST_ROWS, "prompts": []}
    off_model = None
    if case["off"] is not None:
        off_model = build({**case["config"], **case["off"]})
        off_model.load_state_dict(state)
    sdpa = build(case["config"], "sdpa")
    sdpa.load_state_dict(state)
    for length in case["lengths"]:
        for _ in range(50):  # redraw the prompt until every greedy choice has a clear margin
            ids = draw_prompt(case["config"]["vocab_size"], length, rng)
            tokens, gap = greedy(model, ids)
            if gap >= MIN_MARGIN:
                break
        else:
            raise SystemExit(f"{name}: no prompt of {length} tokens with greedy margins >= {MIN_MARGIN}")
        logits = last_logits(model, ids)
        entry = {"ids": ids, "logits": logits.tolist(), "greedy": tokens, "min_greedy_margin": gap}
        sdpa_diff = float(np.abs(last_logits(sdpa, ids) - logits).max())
        entry["sdpa_max_abs_diff"] = sdpa_diff
        if off_model is not None:
            off = last_logits(off_model, ids)
            entry["feature_off"] = {"change": case["off"], "logits": off.tolist(),
                                    "max_abs_diff": float(np.abs(off - logits).max())}
        reference["prompts"].append(entry)
        print(f"{name}: prompt {len(ids)} tokens, greedy margin {gap:.4f}, sdpa vs eager {sdpa_diff:.2e}"
              + (f", feature on vs off {entry['feature_off']['max_abs_diff']:.3f}" if off_model else ""))
    (folder / "reference.json").write_text(json.dumps(reference) + "\n")
    size = sum(p.stat().st_size for p in folder.iterdir())
    print(f"{name}: {size / 1024:.0f} KB in {folder}")


def main(names: list[str]) -> None:
    for i, (name, case) in enumerate(CASES.items()):
        if not names or name in names:
            make(name, case, seed=100 + i)


if __name__ == "__main__":
    main(sys.argv[1:])
