"""Model configuration with Hugging Face config.json names, filled from config.json or GGUF metadata.

`ModelConfig` is what the model code reads; it never knows which file format it came from.
`GenerationDefaults` holds the model author's sampling defaults (generation_config.json or GGUF).

A little over 500 lines: two sources (config.json, GGUF metadata) translated into one dataclass, and
RoPE scaling in its four spellings, each refused with a precise message when inconsistent. What is
specific to one family lives in kjarni/models/.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import numpy as np

from kjarni.errors import InvalidModelError, LoadFailedError
from kjarni.models import ARCHITECTURES, find_architecture, supported
from kjarni.models.architecture import SWIGLU_ACTIVATIONS

# rope_scaling types the RoPE tables implement (model.rope_table); "su" is Phi-3's old name of longrope.
# "freq_factors" is llama.cpp's form of llama3 scaling in GGUF files: a `rope_freqs` tensor of
# per-frequency divisors, already computed by the converter.
ROPE_SCALING_TYPES = ("linear", "llama3", "longrope", "freq_factors")
_ROPE_REQUIRED = {
    "freq_factors": ("factors",),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
}

# Encoders and encoder-decoders people are likely to point us at; anything whose `architectures`
# do not end in ForCausalLM is refused the same way.
_NOT_DECODERS = frozenset({
    "bert", "roberta", "xlm-roberta", "distilbert", "albert", "electra", "deberta", "deberta-v2",
    "mpnet", "camembert", "modernbert", "nomic_bert", "t5", "mt5", "umt5", "bart", "mbart",
    "pegasus", "marian", "whisper", "encoder-decoder", "longt5", "led", "clip", "vit",
})


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
    `attention_bias` is True where the model has q/k/v biases; `sliding_window` is None unless the
    model really uses one, and then applies to layers ``max_window_layers ..`` (0 unless its family
    says otherwise: all layers), see `layer_window`.

    `rope_scaling` is normalized: None for plain RoPE, else a dict with ``rope_type`` one of
    ``ROPE_SCALING_TYPES`` and that type's keys (``original_max_position_embeddings`` included for
    llama3 and longrope, also taken from the top level of the config where a family stores it there).
    `partial_rotary_factor` < 1 rotates only the first ``rotary_dim`` dims of each head.
    A family's own config names are translated by its module (kjarni/models/); `layer_norm_epsilon`
    is the epsilon of LayerNorm families.
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
    partial_rotary_factor: float = 1.0
    max_window_layers: int = 0
    layer_norm_epsilon: float = 1e-5
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
    def rotary_dim(self) -> int:
        """Dimensions of each head that RoPE rotates (``head_dim`` unless a partial rotary factor says less)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def layer_window(self, layer: int) -> int | None:
        """The sliding attention window of ``layer`` (None: the layer attends to every earlier position)."""
        if self.sliding_window is None or layer < self.max_window_layers:
            return None
        return self.sliding_window

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
        family = ARCHITECTURES.get(self.model_type)
        if (family is None or family.rotary) and (self.rotary_dim % 2 or not 0 < self.partial_rotary_factor <= 1):
            raise LoadFailedError(
                f"{src}: head_dim {self.head_dim} x partial_rotary_factor {self.partial_rotary_factor} gives "
                f"{self.rotary_dim} rotary dims; rotary embeddings need an even number between 2 and head_dim"
            )
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or self.sliding_window <= 0):
            raise LoadFailedError(f"{src}: sliding_window must be a positive integer or null, got {self.sliding_window!r}")
        self._validate_rope_scaling()
        if not self.rms_norm_eps > 0 or not self.rope_theta > 0:
            raise LoadFailedError(
                f"{src}: rms_norm_eps ({self.rms_norm_eps}) and rope_theta ({self.rope_theta}) must be positive"
            )
        self.rms_norm_eps = float(self.rms_norm_eps)
        self.rope_theta = float(self.rope_theta)
        allowed = family.activations if family is not None else SWIGLU_ACTIVATIONS
        if self.hidden_act not in allowed:
            raise InvalidModelError(
                f"{src}: hidden_act {self.hidden_act!r} is not supported for {self.model_type} "
                f"(kjarni runs {', '.join(allowed)})"
            )

    def _validate_rope_scaling(self) -> None:
        src, scaling = self.source, self.rope_scaling
        if scaling is None:
            return
        if not isinstance(scaling, dict):
            raise LoadFailedError(f"{src}: rope_scaling must be an object or null, got {scaling!r}")
        kind = scaling.get("rope_type")
        if kind not in ROPE_SCALING_TYPES:
            raise InvalidModelError(
                f"{src}: rope_scaling type {kind!r} is not supported; supported: default, "
                f"{', '.join(ROPE_SCALING_TYPES)}"
            )
        missing = [k for k in _ROPE_REQUIRED[kind] if scaling.get(k) is None]
        if missing:
            raise LoadFailedError(f"{src}: rope_scaling of type {kind} lacks {', '.join(missing)}; the config is incomplete")
        if kind in ("longrope", "freq_factors"):
            for key in ("short_factor", "long_factor") if kind == "longrope" else ("factors",):
                factors = scaling[key]
                if not isinstance(factors, (list, tuple)) or len(factors) != self.rotary_dim // 2:
                    raise LoadFailedError(
                        f"{src}: rope_scaling.{key} must list rotary_dim / 2 = {self.rotary_dim // 2} numbers, "
                        f"got {factors!r:.80}"
                    )
        elif kind == "llama3" and not scaling["high_freq_factor"] > scaling["low_freq_factor"]:
            raise LoadFailedError(f"{src}: rope_scaling high_freq_factor must exceed low_freq_factor, got {scaling!r}")

    # ------------------------------------------------------------------ config.json

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, source: str = "config.json") -> ModelConfig:
        """Build from a config.json dict; unknown keys are dropped, non-decoders refused with InvalidModelError."""
        if not isinstance(d, dict):
            raise LoadFailedError(f"{source}: expected a JSON object, got {type(d).__name__}")
        model_type = str(d.get("model_type") or "")
        architectures = [str(a) for a in (d.get("architectures") or [])]
        # GPT-2's head class is GPT2LMHeadModel, everyone else's *ForCausalLM.
        is_decoder = all(a.endswith(("ForCausalLM", "LMHeadModel")) for a in architectures) and model_type not in _NOT_DECODERS
        if not is_decoder or d.get("is_encoder_decoder"):
            what = model_type or ", ".join(architectures) or "unknown"
            raise InvalidModelError(
                f"{source}: {what} ({', '.join(architectures) or 'no architectures listed'}) is not a decoder "
                f"language model; kjarni only runs decoder-only causal LMs: {supported()}"
            )
        d = find_architecture(model_type, source).config_json(d, source)
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        missing = [k for k in required if d.get(k) is None]
        if missing:
            raise LoadFailedError(f"{source}: missing required key(s) {', '.join(missing)}; the config is incomplete")

        names = {f.name for f in dataclasses.fields(cls)} - {"source"}
        kwargs = {k: v for k, v in d.items() if k in names and v is not None}
        kwargs.update(_rope_settings(d, source))
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
        """Read a config.json file (hub style, or transformers 5's with ``rope_parameters``)."""
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
                f"{supported()}"
            )
        family = find_architecture(arch, source)

        tensor_shapes = {t.name: tuple(int(x) for x in t.shape) for t in reader.tensors}
        hidden = meta.count(f"{arch}.embedding_length")
        heads = meta.count(f"{arch}.attention.head_count")
        kv_heads = meta.count(f"{arch}.attention.head_count_kv", default=heads)
        head_dim = meta.count(f"{arch}.attention.key_length", default=hidden // heads or None)
        layers = meta.count(f"{arch}.block_count")
        _check_block_count(layers, tensor_shapes, source, f"{arch}.block_count")
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
        rope_scaling = _gguf_rope_tensors(reader, meta, arch) or rope_scaling
        rope_dims = meta.get(f"{arch}.rope.dimension_count")

        eps = meta.get(f"{arch}.attention.layer_norm_rms_epsilon")
        theta = meta.get(f"{arch}.rope.freq_base")
        d: dict[str, Any] = {
            "model_type": arch,
            "vocab_size": int(vocab),
            "hidden_size": hidden,
            "intermediate_size": meta.count(f"{arch}.feed_forward_length"),
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": head_dim,
            "max_position_embeddings": meta.count(f"{arch}.context_length", default=2048),
            "rms_norm_eps": _f32_round(eps) if eps is not None else 1e-6,
            "rope_theta": _f32_round(theta) if theta is not None else 10000.0,
            "rope_scaling": rope_scaling,
            "tie_word_embeddings": "output.weight" not in tensor_shapes,
            "attention_bias": "blk.0.attn_q.bias" in tensor_shapes,
            "sliding_window": meta.get(f"{arch}.attention.sliding_window"),
            "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
            "hidden_act": "silu",
            "partial_rotary_factor": rope_dims / head_dim if rope_dims else None,
        }
        d = family.gguf_config(d, meta, tensor_shapes)
        kwargs = {k: v for k, v in d.items() if v is not None}
        for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "max_position_embeddings", "bos_token_id", "sliding_window"):
            if k in kwargs:
                kwargs[k] = int(kwargs[k])
        return cls(**kwargs, source=source)


_GGUF_BLOCK = re.compile(r"blk\.(\d+)\.")


def _check_block_count(layers: int, tensor_shapes: dict[str, Any], source: str, key: str) -> None:
    """The layer count must match the blocks the file has tensors for (llama.cpp refuses a
    tensor count mismatch too): checked against the tensors present, before anything is sized by it."""
    blocks = {int(m.group(1)) for name in tensor_shapes if (m := _GGUF_BLOCK.match(name))}
    if len(blocks) != layers or (blocks and max(blocks) != layers - 1):  # never range(layers): it may be 2**32
        found = f"blk.0 .. blk.{max(blocks)}" if blocks and max(blocks) == len(blocks) - 1 else (
            f"{len(blocks)} blocks numbered {sorted(blocks)[:4]}{' ...' if len(blocks) > 4 else ''}")
        raise LoadFailedError(
            f"{source}: GGUF metadata {key} = {layers} but the file has tensors for {found}; the metadata "
            "and the tensors disagree. Re-download or re-convert the file"
        )


def _gguf_rope_tensors(reader: Any, meta: _GgufMeta, arch: str) -> dict[str, Any] | None:
    """RoPE scaling that llama.cpp's converters store as tensors rather than metadata.

    Llama 3.x: ``rope_freqs.weight`` holds the per-frequency divisors of llama3 scaling. Phi-3:
    ``rope_factors_long/short.weight`` hold LongRoPE's factors, with the original context and the
    attention factor in metadata.
    """
    tensors = {t.name: t for t in reader.tensors}

    def values(name: str) -> list[float]:
        return [float(v) for v in np.asarray(tensors[name].data, dtype=np.float32).reshape(-1)]

    if "rope_factors_long.weight" in tensors and "rope_factors_short.weight" in tensors:
        scaling: dict[str, Any] = {
            "rope_type": "longrope",
            "long_factor": values("rope_factors_long.weight"),
            "short_factor": values("rope_factors_short.weight"),
            "original_max_position_embeddings": meta.get(f"{arch}.rope.scaling.original_context_length"),
        }
        attn_factor = meta.get(f"{arch}.rope.scaling.attn_factor")
        if attn_factor is not None:
            scaling["attention_factor"] = float(attn_factor)
        return scaling
    if "rope_freqs.weight" in tensors:
        return {"rope_type": "freq_factors", "factors": values("rope_freqs.weight")}
    return None


def _rope_settings(d: dict[str, Any], source: str) -> dict[str, Any]:
    """rope_theta, partial_rotary_factor and a normalized rope_scaling from a config.json dict.

    Reads hub-style configs (``rope_theta``, ``rope_scaling`` with ``type`` or ``rope_type``, Phi-3's
    top-level ``original_max_position_embeddings``) and transformers 5's ``rope_parameters``.
    """
    params = d.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" not in params and any(isinstance(v, dict) for v in params.values()):
        raise InvalidModelError(f"{source}: per-layer-type rope_parameters are not supported")
    scaling = dict(params) if isinstance(params, dict) else d.get("rope_scaling")
    out: dict[str, Any] = {}
    theta = (scaling or {}).get("rope_theta") if isinstance(scaling, dict) else None
    theta = theta if theta is not None else d.get("rope_theta")
    if theta is not None:
        out["rope_theta"] = theta
    partial = (scaling or {}).get("partial_rotary_factor") if isinstance(scaling, dict) else None
    partial = partial if partial is not None else d.get("partial_rotary_factor")
    if partial is not None:
        out["partial_rotary_factor"] = float(partial)
    if scaling is None:
        out["rope_scaling"] = None
        return out
    if not isinstance(scaling, dict):
        raise LoadFailedError(f"{source}: rope_scaling must be an object or null, got {scaling!r}")
    kind = str(scaling.get("rope_type") or scaling.get("type") or "default")
    kind = {"su": "longrope"}.get(kind, kind)
    scaling = {k: v for k, v in scaling.items() if k not in ("rope_theta", "partial_rotary_factor", "type")}
    if kind == "default":
        out["rope_scaling"] = None
        return out
    scaling["rope_type"] = kind
    if kind in ("llama3", "longrope"):
        # Phi-3 keeps the pretraining context at the top level, and it wins there (as in transformers).
        if d.get("original_max_position_embeddings") is not None:
            scaling["original_max_position_embeddings"] = d["original_max_position_embeddings"]
        scaling.setdefault("original_max_position_embeddings", d.get("max_position_embeddings"))
    out["rope_scaling"] = scaling
    return out


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

    def count(self, key: str, *, default: int | None = None) -> int:
        """A positive integer: a size or count. Absent: ``default`` (None: required). 0, a negative
        number or a non-integer is refused naming the key: ``or default`` would hide a 0."""
        value = self.get(key)
        if value is None and default is not None:
            return default
        if value is None:
            raise LoadFailedError(f"{self.source}: GGUF metadata lacks {key}; the file is incomplete or not a model")
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise LoadFailedError(
                f"{self.source}: GGUF metadata {key} = {value!r:.80} is not a positive integer; the file is "
                "corrupted or badly converted. Re-download or re-convert it"
            )
        return value

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise LoadFailedError(f"{self.source}: GGUF metadata lacks {key}; the file is incomplete or not a model")
        return value
