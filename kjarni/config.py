"""Model configuration with Hugging Face config.json names, filled from config.json or GGUF metadata.

`ModelConfig` is what the model code reads; it never knows which file format it came from.
`GenerationDefaults` holds the model author's sampling defaults (generation_config.json or GGUF).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

from kjarni.errors import InvalidModelError, LoadFailedError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")

# Encoders and encoder-decoders people are likely to point us at; anything whose `architectures`
# do not end in ForCausalLM is refused the same way.
_NOT_DECODERS = frozenset({
    "bert", "roberta", "xlm-roberta", "distilbert", "albert", "electra", "deberta", "deberta-v2",
    "mpnet", "camembert", "modernbert", "nomic_bert", "t5", "mt5", "umt5", "bart", "mbart",
    "pegasus", "marian", "whisper", "encoder-decoder", "longt5", "led", "clip", "vit",
})

# GGUF architectures whose attn_q/attn_k rows llama.cpp's converter permuted (see weights.py).
GGUF_PERMUTED_ARCHS = frozenset({"llama", "mistral"})


def _supported_list() -> str:
    return ", ".join(SUPPORTED_MODEL_TYPES)


def _eos_tuple(value: Any, source: str) -> tuple[int, ...]:
    """eos_token_id is an int, a list of ints or absent in the wild; keep one shape."""
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        items = value
    else:
        items = [value]
    try:
        ids = [int(v) for v in items if v is not None]
    except (TypeError, ValueError):
        raise LoadFailedError(f"{source}: eos_token_id {value!r} is not an int or a list of ints") from None
    return tuple(dict.fromkeys(ids))  # de-duplicate, keep order


def _f32_round(value: float) -> float:
    """GGUF stores floats as float32; give back the shortest decimal that float32 value means (1e-05, not 9.99e-06)."""
    return float(str(np.float32(value)))


@dataclasses.dataclass
class ModelConfig:
    """A decoder's hyperparameters under Hugging Face config.json names.

    `head_dim` defaults to ``hidden_size // num_attention_heads``; `num_key_value_groups` (query heads
    per KV head) is derived. `eos_token_id` is always a tuple of ints (possibly empty).
    `attention_bias` is True for qwen2 (q/k/v biases); `sliding_window` is None unless the model
    really uses one.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    hidden_act: str = "silu"
    source: str = dataclasses.field(default="<dict>", compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None and self.num_attention_heads:
            self.head_dim = self.hidden_size // self.num_attention_heads
        self.eos_token_id = _eos_tuple(self.eos_token_id, self.source)
        self._validate()

    @property
    def num_key_value_groups(self) -> int:
        """Query heads sharing one K/V head (1 for plain multi-head attention)."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def q_size(self) -> int:
        """Rows of q_proj: num_attention_heads * head_dim."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Rows of k_proj and v_proj: num_key_value_heads * head_dim."""
        return self.num_key_value_heads * self.head_dim

    def _validate(self) -> None:
        src = self.source
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value <= 0:
                raise LoadFailedError(f"{src}: {name} must be a positive integer, got {value!r}")
            setattr(self, name, int(value))
        if self.num_attention_heads % self.num_key_value_heads:
            raise LoadFailedError(
                f"{src}: num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads}); the config is inconsistent"
            )
        if self.head_dim % 2:
            raise LoadFailedError(f"{src}: head_dim {self.head_dim} is odd; rotary embeddings need an even head_dim")
        if not self.rms_norm_eps > 0 or not self.rope_theta > 0:
            raise LoadFailedError(
                f"{src}: rms_norm_eps ({self.rms_norm_eps}) and rope_theta ({self.rope_theta}) must be positive"
            )
        self.rms_norm_eps = float(self.rms_norm_eps)
        self.rope_theta = float(self.rope_theta)
        if self.hidden_act not in ("silu", "swish"):
            raise InvalidModelError(
                f"{src}: hidden_act {self.hidden_act!r} is not supported (kjarni runs SwiGLU MLPs with silu)"
            )

    # ------------------------------------------------------------------ config.json

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, source: str = "config.json") -> ModelConfig:
        """Build from a config.json dict; unknown keys are dropped, non-decoders refused with InvalidModelError."""
        if not isinstance(d, dict):
            raise LoadFailedError(f"{source}: expected a JSON object, got {type(d).__name__}")
        model_type = str(d.get("model_type") or "")
        architectures = [str(a) for a in (d.get("architectures") or [])]
        is_decoder = all(a.endswith("ForCausalLM") for a in architectures) and model_type not in _NOT_DECODERS
        if not is_decoder or d.get("is_encoder_decoder"):
            what = model_type or ", ".join(architectures) or "unknown"
            raise InvalidModelError(
                f"{source}: {what} ({', '.join(architectures) or 'no architectures listed'}) is not a decoder "
                f"language model; kjarni only runs decoder-only causal LMs: {_supported_list()}"
            )
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise InvalidModelError(
                f"{source}: architecture {model_type or '(no model_type)'!s} is not supported; "
                f"supported: {_supported_list()}"
            )
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        missing = [k for k in required if d.get(k) is None]
        if missing:
            raise LoadFailedError(f"{source}: missing required key(s) {', '.join(missing)}; the config is incomplete")

        names = {f.name for f in dataclasses.fields(cls)} - {"source"}
        kwargs = {k: v for k, v in d.items() if k in names and v is not None}
        if model_type == "qwen2":
            # Qwen2 is llama plus q/k/v biases; its config has no attention_bias key.
            kwargs["attention_bias"] = True
            kwargs["sliding_window"] = d.get("sliding_window") if d.get("use_sliding_window") else None
        elif model_type == "llama":
            kwargs["sliding_window"] = None
        kwargs["attention_bias"] = bool(kwargs.get("attention_bias", False))
        kwargs["tie_word_embeddings"] = bool(kwargs.get("tie_word_embeddings", False))
        if "hidden_act" not in kwargs and d.get("hidden_activation"):
            kwargs["hidden_act"] = d["hidden_activation"]
        try:
            return cls(**kwargs, source=source)
        except TypeError as exc:
            raise LoadFailedError(f"{source}: a value has the wrong type ({exc})") from None

    @classmethod
    def from_json(cls, path: str | Path) -> ModelConfig:
        """Read a config.json file."""
        return cls.from_dict(_read_json(path), source=str(path))

    # ------------------------------------------------------------------ GGUF metadata

    @classmethod
    def from_gguf(cls, reader: Any, *, path: str | Path | None = None) -> ModelConfig:
        """Translate GGUF metadata (a `gguf.GGUFReader`) into config.json names; `path` names the file in errors."""
        source = str(path) if path is not None else gguf_source(reader)
        meta = _GgufMeta(reader, source)
        arch = meta.get("general.architecture")
        if arch is None:
            raise LoadFailedError(f"{source}: GGUF metadata has no general.architecture; the file is incomplete")
        arch = str(arch)
        if arch in _NOT_DECODERS:
            raise InvalidModelError(
                f"{source}: {arch} is not a decoder language model; kjarni only runs decoder-only causal LMs: "
                f"{_supported_list()}"
            )
        if arch not in SUPPORTED_MODEL_TYPES:
            raise InvalidModelError(f"{source}: architecture {arch} is not supported; supported: {_supported_list()}")

        tensor_shapes = {t.name: tuple(int(x) for x in t.shape) for t in reader.tensors}
        hidden = meta.require(f"{arch}.embedding_length")
        heads = meta.require(f"{arch}.attention.head_count")
        vocab = None
        if "token_embd.weight" in tensor_shapes:
            vocab = tensor_shapes["token_embd.weight"][-1]  # GGUF shapes are (cols, rows)
        if vocab is None:
            vocab = meta.get(f"{arch}.vocab_size")
        if vocab is None and "tokenizer.ggml.tokens" in reader.fields:
            vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
        if vocab is None:
            raise LoadFailedError(f"{source}: cannot tell the vocabulary size (no token_embd.weight, no tokens)")

        rope_scaling = None
        scaling_type = meta.get(f"{arch}.rope.scaling.type")
        if scaling_type and scaling_type != "none":
            rope_scaling = {"rope_type": str(scaling_type)}
            factor = meta.get(f"{arch}.rope.scaling.factor")
            if factor is not None:
                rope_scaling["factor"] = _f32_round(factor)
            original = meta.get(f"{arch}.rope.scaling.original_context_length")
            if original is not None:
                rope_scaling["original_max_position_embeddings"] = int(original)

        eps = meta.get(f"{arch}.attention.layer_norm_rms_epsilon")
        theta = meta.get(f"{arch}.rope.freq_base")
        d: dict[str, Any] = {
            "model_type": arch,
            "vocab_size": int(vocab),
            "hidden_size": hidden,
            "intermediate_size": meta.require(f"{arch}.feed_forward_length"),
            "num_hidden_layers": meta.require(f"{arch}.block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": meta.get(f"{arch}.attention.head_count_kv") or heads,
            "head_dim": meta.get(f"{arch}.attention.key_length"),
            "max_position_embeddings": meta.get(f"{arch}.context_length") or 2048,
            "rms_norm_eps": _f32_round(eps) if eps is not None else 1e-6,
            "rope_theta": _f32_round(theta) if theta is not None else 10000.0,
            "rope_scaling": rope_scaling,
            "tie_word_embeddings": "output.weight" not in tensor_shapes,
            "attention_bias": arch == "qwen2" or "blk.0.attn_q.bias" in tensor_shapes,
            "sliding_window": meta.get(f"{arch}.attention.sliding_window") if arch != "llama" else None,
            "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
            "hidden_act": "silu",
        }
        kwargs = {k: v for k, v in d.items() if v is not None}
        for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "max_position_embeddings", "bos_token_id", "sliding_window"):
            if k in kwargs:
                kwargs[k] = int(kwargs[k])
        return cls(**kwargs, source=source)


@dataclasses.dataclass
class GenerationDefaults:
    """The model author's generation defaults; every field is optional (None: use kjarni's own default).

    `eos_token_ids` lists every id that ends a turn (eos and, from GGUF, eot), without duplicates.
    """

    eos_token_ids: tuple[int, ...] = ()
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None
    do_sample: bool | None = None
    max_new_tokens: int | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, source: str = "generation_config.json") -> GenerationDefaults:
        """Build from a generation_config.json dict; unknown keys are dropped."""
        if not isinstance(d, dict):
            raise LoadFailedError(f"{source}: expected a JSON object, got {type(d).__name__}")

        def typed(key: str, kind: type) -> Any:
            value = d.get(key)
            if value is None:
                return None
            try:
                return kind(value)
            except (TypeError, ValueError):
                raise LoadFailedError(f"{source}: {key} = {value!r} is not a {kind.__name__}") from None

        return cls(
            eos_token_ids=_eos_tuple(d.get("eos_token_id"), source),
            temperature=typed("temperature", float),
            top_p=typed("top_p", float),
            top_k=typed("top_k", int),
            repetition_penalty=typed("repetition_penalty", float),
            do_sample=typed("do_sample", bool),
            max_new_tokens=typed("max_new_tokens", int),
        )

    @classmethod
    def from_json(cls, path: str | Path) -> GenerationDefaults:
        """Read a generation_config.json file."""
        return cls.from_dict(_read_json(path), source=str(path))

    @classmethod
    def from_gguf(cls, reader: Any, *, path: str | Path | None = None) -> GenerationDefaults:
        """eos and eot ids from GGUF tokenizer metadata; GGUF carries no sampling defaults."""
        meta = _GgufMeta(reader, str(path) if path is not None else gguf_source(reader))
        ids = [meta.get("tokenizer.ggml.eos_token_id"), meta.get("tokenizer.ggml.eot_token_id")]
        return cls(eos_token_ids=_eos_tuple([i for i in ids if i is not None], meta.source))


def _read_json(path: str | Path) -> Any:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise LoadFailedError(f"{path} does not exist; the model folder needs it next to the weights") from None
    except OSError as exc:
        raise LoadFailedError(f"{path} cannot be read: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise LoadFailedError(f"{path} is not UTF-8 text; the file is corrupted") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise LoadFailedError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno}); the file is corrupted") from None


def gguf_source(reader: Any) -> str:
    """The file a GGUF reader was opened on, for error messages."""
    path = getattr(reader, "path", None) or getattr(getattr(reader, "data", None), "filename", None)
    return str(path) if path else "GGUF file"


class _GgufMeta:
    """Scalar GGUF metadata values as Python values."""

    def __init__(self, reader: Any, source: str) -> None:
        self.fields = reader.fields
        self.source = source

    def get(self, key: str) -> Any:
        field = self.fields.get(key)
        if field is None:
            return None
        try:
            value = field.contents()
        except Exception as exc:  # gguf raises assorted errors on malformed fields
            raise LoadFailedError(f"{self.source}: GGUF metadata {key} cannot be read ({exc}); the file is corrupted") from None
        if isinstance(value, np.generic):
            value = value.item()
        return value

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise LoadFailedError(f"{self.source}: GGUF metadata lacks {key}; the file is incomplete or not a model")
        return value
