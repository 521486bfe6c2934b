"""A toy architecture family, kept in one module as a family of kjarni/models/ would be: Llama whose
MLP is ``up_proj -> GELU (tanh) -> down_proj``, with no gate. tests/test_new_architecture.py
registers ``ARCHITECTURE`` into ``kjarni.models.ARCHITECTURES``; no kjarni module changes for it.
"""

from __future__ import annotations

from functools import partial

from kjarni.model import DecoderModel
from kjarni.models.architecture import Architecture, decoder_shapes, no_window

MODEL_TYPE = "gelu_llama"


def gelu_mlp(ops, up):
    """The MLP's activation: the tanh GELU of ``up`` (there is no gate to multiply by)."""
    return ops.gelu(up)


ARCHITECTURE = Architecture(
    MODEL_TYPE,
    partial(DecoderModel, mlp_inputs=("up_proj",), mlp_activation=gelu_mlp),
    activations=("gelu_pytorch_tanh",),
    config_json=no_window,
    expected_shapes=partial(decoder_shapes, mlp_inputs=("up_proj",)),
)
