"""llama.cpp, the peer of issue 12, on tools/bench_gpu.py's random weights (``bench_gpu.py --peer``).

llama.cpp comes from the ``cyllama-vulkan`` wheel (a prebuilt llama.cpp with its Vulkan backend
and a Python API; ``pip install -e '.[peer]'``). For a shape and format, `write_gguf` writes the
very tensors bench_gpu builds kjarni's model from (``bench_gpu.RandomWeights``, seeded by name)
into a GGUF file as llama.cpp's converter lays them out, and `bench_llama_cpp` times llama.cpp on
that file the way ``llama-bench -p N -n M -d 0,N`` does: prefill of N random tokens into an empty
cache (pp), and M one-token decodes after N tokens of context (tg at depth N), each decode
synchronised and no logits read, medians over ``reps`` after one warm-up of each. kjarni's decode
figure in bench_gpu reads the argmax back (in bursts), so it does a little more work per token.

llama.cpp's Vulkan backend ignores CPU Vulkan devices (lavapipe); without a GPU it runs on its CPU
backend, and the result says so (``devices``): such figures are not the peer's GPU figures.

    python tools/peer_llama_cpp.py --model qwen2.5-0.5b --formats f16,q8_0,q4_k
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_gpu  # noqa: E402

# bench_gpu's format -> (how float matrices are stored, general.file_type as llama.cpp names it)
FILE_TYPES = {"f16": ("F16", "F16"), "q8_0": ("F32", "Q8_0"), "q4_k": ("F32", "Q4_K_M")}


class PeerUnavailable(RuntimeError):
    """llama.cpp (the cyllama-vulkan wheel) cannot be imported here."""


def write_gguf(path: str | Path, shape: str, fmt: str) -> Path:
    """bench_gpu's random weights for ``shape`` in ``fmt`` (f16, q8_0, q4_k) as a GGUF file at
    ``path``: 1-D tensors F32, matrices F16 or the same quant blocks, a padded byte-level vocabulary
    (tests/tiny_models.py's) of the shape's size."""
    from tests.tiny_models import save_gguf_model

    if fmt not in FILE_TYPES or shape not in bench_gpu.SHAPES:
        raise ValueError(f"{shape} {fmt}: the peer takes a shape of {sorted(bench_gpu.SHAPES)} "
                         f"and a format of {sorted(FILE_TYPES)}")
    config = bench_gpu.shape_config(shape)
    weights = bench_gpu.RandomWeights(config, fmt)
    tensors = {name: weights.raw(name) for name in weights.shapes}
    quant, file_type = FILE_TYPES[fmt]
    return save_gguf_model(path, config, tensors, quant=quant, file_type=file_type,
                           model_name=f"kjarni random {shape} {fmt}")


def _llama_cpp():
    try:
        import cyllama.llama.llama_cpp as llama
    except ImportError as exc:
        raise PeerUnavailable(f"llama.cpp is not importable ({exc}); pip install -e '.[peer]' "
                              "installs the cyllama-vulkan wheel") from None
    return llama


class LlamaCpp:
    """A GGUF file loaded by llama.cpp, every layer offloaded, one context of ``n_ctx`` positions."""

    def __init__(self, path: str | Path, n_ctx: int, *, flash_attn: int | None = None,
                 n_batch: int = 2048, n_ubatch: int = 512, embeddings: bool = False) -> None:
        llama = self.llama = _llama_cpp()
        llama.disable_logging()
        llama.llama_backend_init()
        llama.ggml_backend_load_all()
        self.devices = [f"{d['type']}: {d['description']}" for d in llama.ggml_backend_dev_info()]
        model_params = llama.LlamaModelParams()
        model_params.n_gpu_layers = 999
        self.model = llama.LlamaModel(str(path), model_params)
        params = llama.LlamaContextParams()
        params.n_ctx, params.n_batch, params.n_ubatch = n_ctx, n_batch, n_ubatch
        params.embeddings = embeddings
        if flash_attn is not None:
            params.flash_attn_type = flash_attn
        self.ctx = llama.LlamaContext(self.model, params)
        # as asked for: "auto" leaves the choice to llama.cpp (it does not say which it made)
        self.flash_attn = llama.llama_flash_attn_type_name(self.ctx.params.flash_attn_type)
        self.n_batch = n_batch

    def clear(self) -> None:
        self.ctx.kv_cache_clear()

    def feed(self, tokens, start: int) -> None:
        """Decode ``tokens`` at positions ``start`` .. in batches of n_batch, then wait for the GPU."""
        tokens = [int(t) for t in tokens]
        for i in range(0, len(tokens), self.n_batch):
            self.ctx.decode(self.llama.llama_batch_get_one(tokens[i : i + self.n_batch], start + i))
        self.ctx.synchronize()

    def hidden(self) -> np.ndarray:
        """The last fed token's final hidden state (after the output norm, before the LM head),
        llama.cpp's embeddings output: a context made with ``embeddings=True`` only."""
        return np.asarray(self.ctx.get_embeddings_ith(-1), dtype=np.float32)


def bench_llama_cpp(shape: str, fmt: str, context: int, steps: int, *, reps: int = 5,
                    flash_attn: int | None = None, folder: str | Path | None = None) -> dict:
    """llama-bench's pp``context`` and tg``steps`` at depth ``context`` on bench_gpu's weights."""
    _llama_cpp()  # fail before writing a large file
    with tempfile.TemporaryDirectory(dir=folder, prefix="kjarni-peer-") as tmp:
        t0 = time.perf_counter()
        path = write_gguf(Path(tmp) / f"{shape}-{fmt}.gguf", shape, fmt)
        write_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        peer = LlamaCpp(path, context + steps + 16, flash_attn=flash_attn)
        load_s = time.perf_counter() - t0
        rng = np.random.default_rng(0)
        vocab = bench_gpu.SHAPES[shape]["vocab_size"]
        prompt = rng.integers(0, vocab, context)

        def prefill() -> float:
            peer.clear()
            t0 = time.perf_counter()
            peer.feed(prompt, 0)
            return time.perf_counter() - t0

        def decode() -> float:
            peer.clear()
            peer.feed(prompt, 0)
            tokens = rng.integers(0, vocab, steps)
            t0 = time.perf_counter()
            for i, token in enumerate(tokens):
                peer.feed([token], context + i)
            return time.perf_counter() - t0

        prefill()  # warm-up, as llama-bench
        peer.clear()
        peer.feed(prompt[:1], 0)
        prefill_s = [prefill() for _ in range(reps)]
        decode_s = [decode() for _ in range(reps)]
        return {"shape": shape, "format": fmt, "backend": "llama.cpp", "devices": peer.devices,
                "gpu": any(d.startswith(("GPU", "iGPU")) for d in peer.devices),
                "llama_cpp": _version(peer.llama), "flash_attn": peer.flash_attn, "context": context,
                "steps": steps, "reps": reps,
                "prefill_tok_s": round(context / statistics.median(prefill_s), 1),
                "decode_tok_s": round(steps / statistics.median(decode_s), 1),
                "prefill_tok_s_reps": [round(context / s, 1) for s in prefill_s],
                "decode_tok_s_reps": [round(steps / s, 1) for s in decode_s],
                "gguf_write_s": round(write_s, 1), "load_s": round(load_s, 1)}


def _version(llama) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        wheel = f"cyllama-vulkan {version('cyllama-vulkan')}"
    except PackageNotFoundError:  # installed with --target and no metadata found on the path
        wheel = "cyllama"
    return f"{wheel}, ggml {llama.ggml_version()} ({llama.ggml_commit()})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-0.5b", help=f"one of {sorted(bench_gpu.SHAPES)}")
    parser.add_argument("--formats", default="f16,q8_0,q4_k", help=f"comma-separated: {', '.join(FILE_TYPES)}")
    parser.add_argument("--context", type=int, default=512, help="prompt length, and the depth of the decodes")
    parser.add_argument("--steps", type=int, default=64, help="one-token decodes timed")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--flash-attn", choices=("auto", "on", "off"), default=None,
                        help="llama.cpp's flash attention (default: llama.cpp's own default)")
    args = parser.parse_args()
    flash = {"auto": -1, "off": 0, "on": 1}.get(args.flash_attn)
    for fmt in args.formats.split(","):
        try:
            result = bench_llama_cpp(args.model, fmt.strip(), args.context, args.steps, reps=args.reps,
                                     flash_attn=flash)
        except (PeerUnavailable, ValueError) as exc:
            raise SystemExit(str(exc)) from None
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
