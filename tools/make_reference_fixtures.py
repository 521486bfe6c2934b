"""Write real-model reference fixtures (token ids, top-10 logits, greedy tokens) from transformers.

transformers dequantizes each GGUF to float32 and runs it on CPU in float32; that is the reference
kjarni's numpy and WebGPU backends are compared against (llama.cpp is not: it quantizes activations).
torch and transformers are needed only here, in a separate venv, never by kjarni or its tests:

    python3 -m venv /work/refvenv
    /work/refvenv/bin/pip install torch==2.13.0 transformers accelerate gguf numpy safetensors
    /work/refvenv/bin/python tools/make_reference_fixtures.py --models-dir /work/models \
        --dump-hf-state /work/models/smollm2-hf-f32

Each fixture holds, per prompt: the prompt as token ids (the truth; the text is informational),
the top-10 logits at a few prompt positions of one forward over the whole prompt, and exactly
32 greedy tokens from a KV-cached argmax loop, with the top-1/top-2 margin of every step so a
test can tell which steps a logit tolerance cannot decide.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

N_NEW_TOKENS = 32
TOP_K = 10
# A step whose top-1/top-2 margin is below this cannot be decided by a test that allows
# this much logit error; tests should only require greedy agreement up to the first such step.
TIE_MARGIN = 1e-3

LONG_PROMPT = (
    "The old lighthouse stood at the edge of the cliff, its white paint peeling after many "
    "winters of salt and wind. Every evening the keeper climbed the narrow spiral stairs, "
    "carrying a lamp and a small notebook in which he wrote down the ships he saw passing on "
    "the horizon. Some were fishing boats returning with their nets full, others were great "
    "cargo vessels bound for distant ports whose names he could barely pronounce. He had never "
    "left the island himself, but through those pages he felt he had travelled the whole world. "
    "One stormy night, as the waves crashed against the rocks below, he noticed a faint light "
    "flickering far out at sea, where no ship should have been. He picked up his pen and wrote"
)

# Digit-free on purpose: transformers' GGUF tokenizer converter gets SmolLM2's split-digits
# pre-tokenizer wrong, so the text -> ids step is trusted only where no digit occurs.
PROMPTS = [
    ("chat_haiku",
     "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n"),
    ("chat_system",
     "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
     "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"),
    ("plain_english", "The quick brown fox jumps over the lazy dog. Once upon a time, there was"),
    ("code_fibonacci", "def fibonacci(n):"),
    ("long_story", LONG_PROMPT),
]

IDS_FROM = "transformers GGUF tokenizer, digit-free text, round-trip checked"

MODELS = {
    "smollm2": ("SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2-135m-instruct.json"),
    "qwen05": ("qwen2.5-coder-0.5b-instruct.gguf", "qwen2.5-coder-0.5b-instruct.json"),
}


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            digest.update(chunk)
    return digest.hexdigest()


def prompt_ids(tokenizer, name: str, text: str) -> list[int]:
    """Token ids for a digit-free prompt, checked to decode back to the same text."""
    if any(c.isdigit() for c in text):
        raise SystemExit(f"prompt {name!r} contains a digit; give its ids by hand instead")
    ids = tokenizer(text, add_special_tokens=False).input_ids
    back = tokenizer.decode(ids, skip_special_tokens=False)
    if back != text:
        raise SystemExit(f"prompt {name!r} does not round-trip: {back!r}")
    return [int(i) for i in ids]


def top_k(row: torch.Tensor) -> dict:
    """Top-10 ids and float32 values (exact as Python floats) plus the row's max |logit|."""
    values, ids = torch.topk(row, TOP_K)
    return {
        "ids": [int(i) for i in ids],
        "values": [float(v) for v in values],
        "max_abs": float(row.abs().max()),
    }


def cache_names(model) -> tuple[str, str]:
    """The KV cache's keyword/output field: transformers 5.x renamed past_key_values to cache."""
    params = inspect.signature(model.forward).parameters
    return ("cache", "cache") if "cache" in params else ("past_key_values", "past_key_values")


@torch.inference_mode()
def reference_for_prompt(model, ids: list[int]) -> dict:
    """Prompt logits from one forward, then exactly N_NEW_TOKENS KV-cached argmax steps."""
    cache_kw, cache_field = cache_names(model)
    input_ids = torch.tensor([ids], dtype=torch.long)
    out = model(input_ids=input_ids, use_cache=True)
    logits = out.logits[0].float()
    n = len(ids)
    positions = sorted({0, n // 2, n - 1})
    prompt_logits = [{"position": p, **top_k(logits[p])} for p in positions]

    past = getattr(out, cache_field)
    row = logits[-1]
    steps, decode_logits, rows = [], [], []
    for step in range(N_NEW_TOKENS):
        two, two_ids = torch.topk(row, 2)
        token = int(torch.argmax(row))
        assert token == int(two_ids[0])
        rows.append(row)
        steps.append({
            "token": token,
            "top1": float(two[0]),
            "top2_id": int(two_ids[1]),
            "top2": float(two[1]),
            "margin": float(two[0] - two[1]),
            "max_abs": float(row.abs().max()),
        })
        # Top-10 of a couple of decode steps checks the cached path, not only its argmax.
        if step in (1, N_NEW_TOKENS - 1):
            decode_logits.append({"step": step, "position": n + step - 1, **top_k(row)})
        if step == N_NEW_TOKENS - 1:
            break
        out = model(input_ids=torch.tensor([[token]]), use_cache=True, **{cache_kw: past})
        past = getattr(out, cache_field)
        row = out.logits[0, -1].float()

    # The reference's own float32 noise floor: cached decode vs one uncached forward over
    # prompt + generated tokens. A test tolerance tighter than this cannot be met by anyone.
    tokens = [s["token"] for s in steps]
    full = model(input_ids=torch.tensor([ids + tokens[:-1]]), use_cache=False).logits[0, n - 1:].float()
    cache_vs_full = float((full - torch.stack(rows)).abs().max())

    near_ties = [i for i, s in enumerate(steps) if s["margin"] < TIE_MARGIN]
    return {
        "prompt_logits": prompt_logits,
        "greedy_tokens": tokens,
        "greedy_steps": steps,
        "decode_logits": decode_logits,
        "min_margin": min(s["margin"] for s in steps),
        "near_tie_steps": near_ties,
        "greedy_decidable_prefix": near_ties[0] if near_ties else N_NEW_TOKENS,
        "cache_vs_full_max_abs_diff": cache_vs_full,
    }


def dump_hf_state(model, out_dir: Path) -> None:
    """Save transformers' dequantized float32 weights (HF names) and config for tensor-by-tensor checks."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().float() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # shares memory with embed_tokens; safetensors refuses aliases
    tmp = out_dir / "model.safetensors.tmp"
    save_file(state, str(tmp), metadata={"format": "pt"})
    tmp.chmod(0o644)
    tmp.rename(out_dir / "model.safetensors")
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # these are plain float32 weights, not a GGUF
    config["architectures"] = [type(model).__name__]
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    print(f"wrote {out_dir}/model.safetensors ({len(state)} tensors) and config.json")


def check_qk_unpermuted(model, gguf_path: Path) -> dict:
    """Does transformers undo llama.cpp's q/k row permutation? Compare layer 0 with the raw GGUF."""
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    tensors = {t.name: t for t in reader.tensors}
    cfg = model.config
    attn = model.model.layers[0].self_attn
    result = {}
    for name, hf, heads in (("attn_q", attn.q_proj.weight, cfg.num_attention_heads),
                            ("attn_k", attn.k_proj.weight, cfg.num_key_value_heads)):
        t = tensors[f"blk.0.{name}.weight"]
        raw = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        rows, cols = raw.shape
        unpermuted = raw.reshape(heads, rows // heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)
        hf = hf.detach().numpy()
        result[name] = {"equals_raw_gguf": bool(np.array_equal(hf, raw)),
                        "equals_unpermuted_gguf": bool(np.array_equal(hf, unpermuted))}
    return result


def format_json(obj, indent: int = 0) -> str:
    """JSON with lists of scalars on one line, so fixtures stay small and diffable."""
    pad, inner = " " * indent, " " * (indent + 1)
    if isinstance(obj, dict):
        items = [f"{inner}{json.dumps(k)}: {format_json(v, indent + 1)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(obj, list) and any(isinstance(v, (dict, list)) for v in obj):
        return "[\n" + ",\n".join(inner + format_json(v, indent + 1) for v in obj) + "\n" + pad + "]"
    return json.dumps(obj)


def make_fixture(key: str, models_dir: Path, out_dir: Path, dump_dir: Path | None) -> None:
    gguf_name, fixture_name = MODELS[key]
    gguf_path = models_dir / gguf_name
    start = time.time()
    model = AutoModelForCausalLM.from_pretrained(models_dir, gguf_file=gguf_name, dtype=torch.float32)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(models_dir, gguf_file=gguf_name)
    load_s = time.time() - start

    fixture = {
        "model": gguf_name,
        "gguf_sha256": sha256_of(gguf_path),
        "gguf_bytes": gguf_path.stat().st_size,
        "generated_by": "tools/make_reference_fixtures.py",
        "reference": "transformers GGUF loader, dequantized to float32, CPU, float32 forward",
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__, "numpy": np.__version__},
        "attn_implementation": model.config._attn_implementation,
        "torch_threads": torch.get_num_threads(),
        "n_new_tokens": N_NEW_TOKENS,
        "tie_margin": TIE_MARGIN,
        "notes": ("Prompt ids are the input (text is informational). prompt_logits come from one "
                  "forward over the whole prompt; greedy tokens from a KV-cached argmax loop whose "
                  "first step uses the last prompt position. A test with logit tolerance tol can "
                  "only require greedy agreement on steps whose margin exceeds ~2*tol; "
                  "greedy_decidable_prefix is the count of steps before the first margin < tie_margin."),
    }
    if model.config.model_type == "llama":
        fixture["hf_qk_check_layer0"] = check_qk_unpermuted(model, gguf_path)
    if dump_dir is not None:
        dump_hf_state(model, dump_dir)

    prompts = []
    for name, text in PROMPTS:
        ids = prompt_ids(tokenizer, name, text)
        t = time.time()
        ref = reference_for_prompt(model, ids)
        text_out = tokenizer.decode(ref["greedy_tokens"], skip_special_tokens=False)
        prompts.append({"name": name, "text": text, "ids_from": IDS_FROM, "ids": ids,
                        "greedy_text": text_out, **ref})
        print(f"{key} {name}: {len(ids)} prompt tokens, min margin {ref['min_margin']:.3g}, "
              f"near ties {ref['near_tie_steps']}, "
              f"cache vs full {ref['cache_vs_full_max_abs_diff']:.2g}, {time.time() - t:.1f} s; {text_out!r}")
    fixture["prompts"] = prompts

    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / fixture_name
    out.write_text(format_json(fixture) + "\n")
    # Runtimes are printed, not stored, so a rerun leaves the fixture byte-identical.
    print(f"wrote {out} ({out.stat().st_size} bytes); load {load_s:.1f} s, total {time.time() - start:.1f} s")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models-dir", type=Path, default=Path("/work/models"),
                        help="folder holding the GGUF files (transformers wants a folder plus a file name)")
    parser.add_argument("--out-dir", type=Path,
                        default=Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "reference")
    parser.add_argument("--only", choices=sorted(MODELS), action="append",
                        help="model(s) to do; default all")
    parser.add_argument("--dump-hf-state", type=Path, default=None, metavar="DIR",
                        help="also save SmolLM2's dequantized float32 state dict + config.json to DIR")
    args = parser.parse_args(argv)
    for key in args.only or list(MODELS):
        dump_dir = args.dump_hf_state if key == "smollm2" else None
        make_fixture(key, args.models_dir, args.out_dir, dump_dir)
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, transformers {transformers.__version__}")


if __name__ == "__main__":
    main()
