"""Mistral: Llama with a sliding attention window over every layer (``sliding_window``).

Its GGUFs carry llama.cpp's q/k row permutation, as llama's do.
"""

from __future__ import annotations

from kjarni.model import DecoderModel
from kjarni.models.architecture import Architecture

ARCHITECTURE = Architecture("mistral", DecoderModel, gguf_permuted_qk=True)
