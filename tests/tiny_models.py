"""Tiny random decoder models written to disk the way real ones are, for every test layer.

`tiny_config` gives a config.json dict with odd sizes, `random_state_dict` HF-named float32
tensors, and `save_safetensors_model` / `save_gguf_model` write them as a Hugging Face folder or as
a GGUF file the way llama.cpp's converter does (metadata keys, q/k permutation for llama, a minimal
byte-level gpt2 tokenizer).

Quantized GGUF types need in_features divisible by the block size (32 for Q4_0..Q8_0), which the
default odd sizes are not; use `quant_config` (hidden 64, intermediate 96) for those.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import safetensors.numpy

# ---------------------------------------------------------------- configs

_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}


def tiny_config(model_type: str = "llama", **overrides: Any) -> dict[str, Any]:
    """A config.json dict for a tiny decoder: vocab 97, hidden 48, 3 query heads / 1 KV head of 16, 2 layers.

    qwen2 gets its q/k/v biases the way real Qwen2 configs imply them (no attention_bias key).
    """
    if model_type not in _ARCHITECTURES:
        raise ValueError(f"tiny_config knows {sorted(_ARCHITECTURES)}, not {model_type!r}")
    config: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[model_type]],
        "model_type": model_type,
        "vocab_size": 97,
        "hidden_size": 48,
        "intermediate_size": 72,
        "num_hidden_layers": 2,
        "num_attention_heads": 3,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    if model_type == "llama":
        config["attention_bias"] = False
        config["mlp_bias"] = False
    elif model_type == "qwen2":
        config["use_sliding_window"] = False
        config["sliding_window"] = 256
        config["max_window_layers"] = 2
    config.update(overrides)
    return config


def quant_config(model_type: str = "llama", **overrides: Any) -> dict[str, Any]:
    """A tiny config whose matrices all have in_features divisible by 32 (Q4_0..Q8_0 blocks)."""
    sizes = {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16}
    return tiny_config(model_type, **{**sizes, **overrides})


def random_state_dict(config: dict[str, Any], seed: int = 0) -> dict[str, np.ndarray]:
    """Float32 tensors under HF names; weights ~N(0, 0.15-0.3) so logits are far from flat.

    No `lm_head.weight` when the config ties embeddings.
    """
    rng = np.random.default_rng(seed)
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or hidden // heads
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    bias = config["model_type"] == "qwen2" or config.get("attention_bias", False)

    def normal(shape: tuple[int, ...], scale: float) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def norm_weight() -> np.ndarray:
        return (1.0 + rng.standard_normal(hidden) * 0.1).astype(np.float32)

    tensors = {"model.embed_tokens.weight": normal((vocab, hidden), 0.3)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = norm_weight()
        tensors[p + "self_attn.q_proj.weight"] = normal((q_size, hidden), 0.2)
        tensors[p + "self_attn.k_proj.weight"] = normal((kv_size, hidden), 0.2)
        tensors[p + "self_attn.v_proj.weight"] = normal((kv_size, hidden), 0.2)
        if bias:
            tensors[p + "self_attn.q_proj.bias"] = normal((q_size,), 0.1)
            tensors[p + "self_attn.k_proj.bias"] = normal((kv_size,), 0.1)
            tensors[p + "self_attn.v_proj.bias"] = normal((kv_size,), 0.1)
        tensors[p + "self_attn.o_proj.weight"] = normal((hidden, q_size), 0.15)
        tensors[p + "post_attention_layernorm.weight"] = norm_weight()
        tensors[p + "mlp.gate_proj.weight"] = normal((inter, hidden), 0.2)
        tensors[p + "mlp.up_proj.weight"] = normal((inter, hidden), 0.2)
        tensors[p + "mlp.down_proj.weight"] = normal((hidden, inter), 0.15)
    tensors["model.norm.weight"] = norm_weight()
    if not config.get("tie_word_embeddings", False):
        tensors["lm_head.weight"] = normal((vocab, hidden), 0.3)
    return tensors


# ---------------------------------------------------------------- safetensors


def f32_to_bf16_bits(values: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (nearest, ties to even) as uint16 bit patterns, as torch does."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)


def bf16_round(values: np.ndarray) -> np.ndarray:
    """What a float32 tensor becomes after a bf16 round trip (float32)."""
    return (f32_to_bf16_bits(values).astype(np.uint32) << 16).view(np.float32)


def write_safetensors(path: Path, tensors: dict[str, np.ndarray], dtype: str = "f32") -> None:
    """Write one safetensors file; f32/f16 through the safetensors package, bf16 by hand (numpy has no bf16)."""
    path = Path(path)
    if dtype in ("f32", "f16"):
        np_dtype = np.float32 if dtype == "f32" else np.float16
        safetensors.numpy.save_file({k: np.ascontiguousarray(v, dtype=np_dtype) for k, v in tensors.items()}, str(path))
        return
    if dtype != "bf16":
        raise ValueError(f"dtype must be f32, f16 or bf16, not {dtype!r}")
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    blobs, offset = [], 0
    for name, value in tensors.items():
        blob = f32_to_bf16_bits(value).tobytes()
        header[name] = {"dtype": "BF16", "shape": list(value.shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    header_bytes = json.dumps(header).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)  # the format pads the header to 8 bytes
    with open(path, "wb") as f:
        f.write(len(header_bytes).to_bytes(8, "little"))
        f.write(header_bytes)
        for blob in blobs:
            f.write(blob)


def save_safetensors_model(directory: str | Path, config: dict[str, Any], tensors: dict[str, np.ndarray],
                           dtype: str = "f32", shards: int = 1,
                           generation_config: dict[str, Any] | None = None) -> Path:
    """Write a Hugging Face model folder: config.json, model.safetensors or shards + index. Returns the folder."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    if generation_config is not None:
        (directory / "generation_config.json").write_text(json.dumps(generation_config, indent=2))
    names = list(tensors)
    if shards == 1:
        write_safetensors(directory / "model.safetensors", tensors, dtype)
        return directory
    groups = [names[i::shards] for i in range(shards)]  # interleaved, so every shard mixes layers
    weight_map, itemsize = {}, {"f32": 4, "f16": 2, "bf16": 2}[dtype]
    for i, group in enumerate(groups):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        write_safetensors(directory / file, {n: tensors[n] for n in group}, dtype)
        weight_map.update({n: file for n in group})
    total = sum(t.size * itemsize for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return directory


# ---------------------------------------------------------------- GGUF

HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
HF_BLOCK_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(hf: str) -> str:
    """llama.cpp's tensor name for an HF name."""
    if hf in HF_TO_GGUF:
        return HF_TO_GGUF[hf]
    _, _, layer, rest = hf.split(".", 3)  # model.layers.{i}.{rest}
    return f"blk.{layer}.{HF_BLOCK_TO_GGUF[rest]}"


def llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, verbatim: interleave each head's rotary halves."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2)
            .reshape(weights.shape))


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable bytes stand for themselves, the rest are shifted past 255."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# ChatML, as SmolLM2 writes it (a default system message when the conversation has none).
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a tiny test model.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def write_chat_template(folder: str | Path, template: str = CHAT_TEMPLATE) -> None:
    """Add ``chat_template`` to a model folder's tokenizer_config.json, as transformers saves it."""
    config_file = Path(folder) / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    config["chat_template"] = template
    config_file.write_text(json.dumps(config))


def tiny_vocab(vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) for a byte-level gpt2 vocabulary of exactly `vocab_size` tokens.

    Ids 0-2 are the specials, then two merged tokens ("Ġt", "he"), then bytes from space upward; a
    small vocab (97) drops the rarest bytes, a large one is padded with <unused_i>.
    """
    byte_chars = _byte_to_unicode()
    merged = ["Ġt", "he"]
    order = [*range(32, 256), *range(0, 32)]
    tokens = [*SPECIAL_TOKENS, *merged, *(byte_chars[b] for b in order)]
    tokens += [f"<unused_{i}>" for i in range(max(0, vocab_size - len(tokens)))]
    tokens = tokens[:vocab_size]
    present = set(tokens)
    merges = [f"{m[0]} {m[1:]}" for m in merged if m in present and m[0] in present and m[1:] in present]
    types = [gguf.TokenType.CONTROL if t in SPECIAL_TOKENS
             else gguf.TokenType.UNUSED if t.startswith("<unused_") else gguf.TokenType.NORMAL for t in tokens]
    return tokens, [int(t) for t in types], merges


def save_gguf_model(path: str | Path, config: dict[str, Any], tensors: dict[str, Any],
                    quant: str = "F32", chat_template: str | None = None, file_type: str | None = None,
                    model_name: str = "kjarni tiny test model") -> Path:
    """Write a GGUF file as llama.cpp's converter would, with 2-D tensors stored as `quant`.

    `quant` is any type `gguf.quants.quantize` supports (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1,
    Q8_0); a matrix whose in_features is not a multiple of the block size stays F32, like 1-D tensors.
    A `kjarni.tensors.QuantTensor` value is written as its blocks, whatever `quant` says.
    llama q_proj/k_proj (weights and biases, and the rows of stored blocks) are permuted as the
    converter does. ``chat_template`` is stored as ``tokenizer.chat_template`` (none by default);
    ``file_type`` names the ``general.file_type`` (a `gguf.LlamaFileType` member without
    ``MOSTLY_``, e.g. ``Q4_K_M``; default: `quant`'s).
    """
    from kjarni.tensors import QuantTensor

    path = Path(path)
    model_type = config["model_type"]
    arch = "llama" if model_type == "mistral" else model_type
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    qtype = gguf.GGMLQuantizationType[quant]

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(model_name)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(float(config["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    if head_dim != config["hidden_size"] // heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "llama":
        writer.add_vocab_size(config["vocab_size"])
        writer.add_rope_dimension_count(head_dim)
    file_type = (gguf.LlamaFileType.ALL_F32 if (file_type or quant) == "F32"
                 else gguf.LlamaFileType[f"MOSTLY_{file_type or quant}"])
    writer.add_file_type(int(file_type))

    tokens, token_types, merges = tiny_vocab(config["vocab_size"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2" if arch == "qwen2" else "gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(int(config.get("bos_token_id", 1)))
    eos = config.get("eos_token_id", 2)
    writer.add_eos_token_id(int(eos[0] if isinstance(eos, list) else eos))
    writer.add_add_bos_token(False)
    if chat_template is not None:
        writer.add_chat_template(chat_template)

    block_size = gguf.GGML_QUANT_SIZES[qtype][0]
    for name, value in tensors.items():
        permuted = arch == "llama" and (".self_attn.q_proj." in name or ".self_attn.k_proj." in name)
        group = None if ".q_proj." in name else kv_heads  # llama_cpp_permute's n_head_kv
        if isinstance(value, QuantTensor):
            data = value.data
            if permuted:  # the same row order, through the stored blocks' rows
                data = data[llama_cpp_permute(np.arange(data.shape[0]), heads, group)]
            writer.add_tensor(gguf_name(name), np.ascontiguousarray(data), raw_dtype=value.ggml_type)
            continue
        data = np.ascontiguousarray(value, dtype=np.float32)
        if permuted:
            data = llama_cpp_permute(data, heads, group)
        target = gguf.GGMLQuantizationType.F32
        if data.ndim == 2 and data.shape[-1] % block_size == 0:
            target = qtype
        if target == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name(name), data)
        elif target == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(gguf_name(name), data.astype(np.float16))
        else:
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(data, target), raw_dtype=target)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def gguf_roundtrip(values: np.ndarray, quant: str) -> np.ndarray:
    """What a float32 matrix becomes after quantizing to `quant` and dequantizing with gguf."""
    qtype = gguf.GGMLQuantizationType[quant]
    data = np.ascontiguousarray(values, dtype=np.float32)
    if qtype == gguf.GGMLQuantizationType.F32 or data.ndim != 2 or data.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
        return data
    if qtype == gguf.GGMLQuantizationType.F16:
        return data.astype(np.float16).astype(np.float32)
    return gguf.quants.dequantize(gguf.quants.quantize(data, qtype), qtype).astype(np.float32)
