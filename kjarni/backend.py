"""The backend contract: what a model forward may ask of a backend.

A model is written once against `Ops`; `NumpyOps` (numpy_ops.py) is the executable
specification and `WgpuOps` (gpu/) must match it. The operations are the pieces of a
pre-norm decoder block, at the granularity where a GPU wants to fuse them:

    qkv  = norm_linear(x, input_norm, eps, qkv_weight, qkv_bias)   # rms_norm fused into the product
    q    = rope_store(qkv, rope, kv_cache, layer, start)         # RoPE on q and k, k/v into the cache
    attn = attention(q, kv_cache, layer, start)                   # causal, grouped-query
    x    = linear(attn, o_weight, residual=x)                      # residual add fused
    h    = norm_linear(x, post_norm, eps, gate_up_weight)
    x    = linear(silu_mul(h), down_weight, residual=x)

GPT-2 style blocks use the LayerNorm pieces instead (models/gpt2.py):

    x    = add(embed(wte, ids), embed(wpe, positions))           # learned absolute positions
    qkv  = linear(layer_norm(x, ln_1_weight, ln_1_bias, eps), c_attn_weight, c_attn_bias)
    q    = rope_store(qkv, None, kv_cache, layer, start)          # no rotation: k/v stored as they are
    x    = linear(attention(q, kv_cache, layer, start), c_proj_weight, c_proj_bias, residual=x)
    x    = linear(gelu(linear(layer_norm(x, ...), c_fc_weight, c_fc_bias)), proj_weight, proj_bias, residual=x)

Activations are opaque handles of shape ``[tokens, features]`` (a numpy array on the CPU, a
GPU buffer view on the GPU). A backend may record work lazily and run it when a result is read
(`read`, `argmax`, `top_k`), so callers must only look at results through those three.

A backend with ``decode_ahead > 1`` (the GPU) also lets greedy decoding run ahead of the CPU:
``argmax_ahead`` leaves the chosen ids on the device as `DeviceTokens`, which ``embed`` (and so a
model forward) accepts in place of ids, and ``read_tokens`` reads a batch of them back at once.
Sampled decoding runs ahead the same way where ``samples_ahead(sampler)`` says the backend can
draw on its device (``sample_ahead``, given the step's uniform draw).

Non-finite logits (NaN, +inf or -inf anywhere in a row) are flagged by the reductions a decode
loop already runs, never by an extra pass: ``argmax`` returns ``-1`` for such a row, ``top_k``
returns ``-1`` as every id of such a row (its values are then unspecified), and the ids
``read_tokens`` gives back for an ``argmax_ahead`` handle follow ``argmax``. Backends do not raise
for it; the loop (stream.py, ``checked_ids``) turns a ``-1`` into ``NonFiniteLogitsError``
naming the step (the prefill or decode step n). A GPU kernel folds the check into its reduction
(e.g. a per-row flag set when ``x != x`` or ``abs(x) == inf``, written as ``-1`` with the result). A
``DeviceTokens`` row holding ``-1`` may still be fed to ``embed`` before it is read back (a run-ahead
step): the backend must not fault on it (any row, or zeros, will do: the loop discards that work).

Conventions every backend follows:
- Weight matrices are ``[out_features, in_features]`` (Hugging Face layout); ``linear`` computes
  ``x @ W.T (+ bias) (+ residual)``.
- ``rms_norm(x) = x / sqrt(mean(x**2) + eps) * weight``, in float32.
- ``layer_norm(x) = (x - mean(x)) / sqrt(var(x) + eps) * weight + bias`` over each row, with the
  biased variance ``var(x) = mean((x - mean(x))**2)`` (torch's LayerNorm), in float32.
- ``gelu`` is the tanh approximation GPT-2 uses (transformers' ``gelu_new``,
  ``gelu_pytorch_tanh``): ``0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x**3)))``.
- RoPE is the Hugging Face "rotate half" form. The table passed to ``rope_store`` is
  ``[positions, rotary_dim]`` with ``rotary_dim <= head_dim`` and even: ``cos`` in the first
  ``rotary_dim // 2`` columns and ``sin`` in the rest (either may carry a constant factor, e.g.
  LongRoPE's attention scaling). For the pair ``(x1, x2) = (x[i], x[i + rotary_dim // 2])``,
  ``i < rotary_dim // 2``, at position ``p``: ``x1' = x1 cos - x2 sin`` and ``x2' = x2 cos + x1 sin``.
  Dimensions ``rotary_dim ..`` of each head pass through unchanged (partial rotary, Phi-3/Phi-4).
  Frequency scaling (linear, llama3, longrope) lives in the table, never in a kernel.
- A ``qkv`` activation holds, per token, ``num_heads * head_dim`` query values, then
  ``num_kv_heads * head_dim`` keys, then as many values; head ``h`` is the slice
  ``[h * head_dim, (h + 1) * head_dim)`` of its part.
- ``attention``: query row ``t`` sits at absolute position ``p = start + t`` and attends to cache
  positions ``0 ..= p`` with scale ``1 / sqrt(head_dim)``; query head ``h`` reads kv head
  ``h // (num_heads // num_kv_heads)``. Softmax in float32. With a sliding ``window`` ``w`` it
  attends to positions ``max(0, p - w + 1) ..= p`` only, i.e. key position ``k`` is seen when
  ``p - w < k <= p`` (transformers' ``sliding_window_overlay``: ``kv_idx > q_idx - sliding_window``),
  so a query sees itself and the ``w - 1`` positions before it.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence

import numpy as np

from kjarni.tensors import QuantTensor

Activation = Any
"""A backend's activation handle, shape ``[tokens, features]``."""

Weight = Any
"""A backend's weight handle, uploaded once."""

WeightSource = np.ndarray | QuantTensor


UNDECIDED = -2
"""The id ``read_tokens`` gives for a draw the device left to the CPU (a tie at the top-k boundary)."""


class DeviceTokens:
    """Token ids a backend chose and kept on its device (`argmax_ahead`), not read back yet.

    Feeding one to a forward lets a greedy decode loop record the next step before the CPU knows
    the token; ``read_tokens`` returns the ids. ``len()`` is the number of tokens (one per row).
    """

    __slots__ = ("count",)

    def __init__(self, count: int) -> None:
        self.count = count

    def __len__(self) -> int:
        return self.count


class KVCache(Protocol):
    """Keys and values of every layer, allocated once for ``capacity`` positions.

    ``offset`` is the number of positions filled; the model writes new positions at
    ``offset`` and then advances it. ``trim(n)`` forgets the last ``n`` positions (speculative
    rollback, prefix reuse) without touching memory.
    """

    capacity: int
    offset: int

    @property
    def nbytes(self) -> int: ...

    def trim(self, n: int) -> int: ...


class Ops(Protocol):
    """Backend operations a decoder forward is written against."""

    name: str
    """``"cpu"`` or ``"gpu"``."""

    decode_ahead: int
    """Greedy tokens a decode loop may choose before reading any back (1: no `argmax_ahead`)."""

    def weight(self, parts: WeightSource | Sequence[WeightSource], *, name: str) -> Weight:
        """Upload a weight once. A sequence is stacked along rows (fused q/k/v, gate/up).

        Parts may be of different stored formats; the backend chooses how to keep them.
        A 1-D array is a vector (norm weight, bias); a 2-D one is ``[rows, cols]``.
        """
        ...

    def new_kv_cache(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int) -> KVCache:
        """Allocate the KV cache for ``capacity`` positions, once per generation (or reuse)."""
        ...

    def embed(self, table: Weight, token_ids: np.ndarray | DeviceTokens) -> Activation:
        """Rows of ``table`` for ``token_ids`` (int32, shape ``[tokens]``, or `DeviceTokens` where
        the backend has ``decode_ahead > 1``)."""
        ...

    def rms_norm(self, x: Activation, weight: Weight, eps: float) -> Activation: ...

    def layer_norm(self, x: Activation, weight: Weight, bias: Weight, eps: float) -> Activation:
        """LayerNorm of each row: ``(x - mean) / sqrt(var + eps) * weight + bias`` (biased variance)."""
        ...

    def linear(
        self, x: Activation, weight: Weight, bias: Weight | None = None, residual: Activation | None = None
    ) -> Activation:
        """``x @ weight.T + bias + residual`` (bias and residual optional)."""
        ...

    def norm_linear(
        self, x: Activation, norm_weight: Weight, eps: float, weight: Weight, bias: Weight | None = None
    ) -> Activation:
        """``linear(rms_norm(x, norm_weight, eps), weight, bias)``, fused where the backend can."""
        ...

    def rope_store(
        self, qkv: Activation, rope: Weight | None, kv_cache: KVCache, layer: int, start: int
    ) -> Activation:
        """Rotate q and k of ``qkv`` for positions ``start ..``, store k and v in the cache; return q.

        ``rope`` is a ``[positions, rotary_dim]`` table (see above); ``None`` stores k and v and
        returns q without any rotation (models with learned absolute positions, GPT-2).
        """
        ...

    def attention(
        self, q: Activation, kv_cache: KVCache, layer: int, start: int, window: int | None = None
    ) -> Activation:
        """Causal grouped-query attention of ``q`` against cache positions ``0 .. start + tokens``.

        ``window`` (a sliding window of ``w`` positions, Mistral/Phi-3): query position ``p`` sees
        only cache positions ``p - w + 1 ..= p``. ``None``: every earlier position.
        """
        ...

    def swiglu_mlp(
        self, x: Activation, norm_weight: Weight, eps: float, gate_up: Weight, down: Weight, residual: Activation | None = None
    ) -> Activation:
        """The SwiGLU MLP: ``linear(silu_mul(norm_linear(x, norm_weight, eps, gate_up)), down,
        residual=residual)``, fused where the backend can."""
        ...

    def silu_mul(self, x: Activation) -> Activation:
        """``silu(x[:, :n]) * x[:, n:]`` for ``x`` of width ``2n`` (fused gate and up)."""
        ...

    def gelu(self, x: Activation) -> Activation:
        """GELU, tanh approximation: ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``, elementwise."""
        ...

    def add(self, a: Activation, b: Activation) -> Activation:
        """``a + b``, elementwise, for two activations of the same shape."""
        ...

    def rows(self, x: Activation, first: int, count: int) -> Activation:
        """Rows ``first .. first + count`` of ``x``."""
        ...

    def read(self, x: Activation) -> np.ndarray:
        """The values of ``x`` as a float32 numpy array (runs pending work)."""
        ...

    def argmax(self, x: Activation) -> np.ndarray:
        """Index of the largest value of each row, int64 ``[tokens]``; the lowest index wins ties.

        ``-1`` for a row holding any NaN or inf (see "Non-finite logits" above)."""
        ...

    def top_k(self, x: Activation, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The ``k`` largest values of each row and their indices, sorted descending.

        Every id of a row holding any NaN or inf is ``-1`` (see "Non-finite logits" above)."""
        ...

    # Only where decode_ahead > 1:

    def argmax_ahead(self, x: Activation) -> DeviceTokens:
        """`argmax` of each row, left on the device and started (nothing read back)."""
        ...

    def read_tokens_later(self, handles: Sequence[DeviceTokens]) -> Callable[[], list[np.ndarray]]:
        """`read_tokens` started now; the returned function waits for the ids (once), and steps
        recorded before it is called run on the device meanwhile."""
        ...

    def read_tokens(self, handles: Sequence[DeviceTokens]) -> list[np.ndarray]:
        """The ids of each handle (int64 ``[tokens]``), in one readback; ``-1`` as `argmax` gives it, and
        ``UNDECIDED`` for a ``sample_ahead`` draw the device left to the CPU (the handles after it
        were fed a placeholder)."""
        ...

    def samples_ahead(self, sampler) -> bool:
        """Whether ``sample_ahead`` can draw for this `Sampler` on the device (absent: never)."""
        ...

    def sample_ahead(self, x: Activation, sampler, draw: float) -> DeviceTokens:
        """A token drawn from ``x`` ``[1, vocab]`` with ``sampler`` and the uniform ``draw`` in
        [0, 1), left on the device and started: the token ``sampler.sample`` draws from the same
        logits with a generator whose next ``random()`` is ``draw`` (up to float32 rounding); it
        reads back as ``-1`` where the logits hold NaN or inf, as for `argmax_ahead`."""
        ...
