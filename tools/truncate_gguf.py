"""Write a GGUF file that keeps a real model's first N layers, for GPU parity runs on the H200.

Only 64 MiB travels to the lent GPU, so a whole real model (SmolLM2-135M's Q4_1 GGUF is 98 MB)
cannot go there. This keeps every tensor outside the layers (embedding, final norm, output)
and the tensors of layers 0..N-1 byte for byte, copies every metadata key, and sets
``<arch>.block_count`` to N. The result is a smaller model made of real weights: the GPU
against numpy on it checks the kernels on real weight values and real tokenizer input.

    python3 tools/truncate_gguf.py ~/.cache/kjarni/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf \
        --layers 8 --out /tmp/smollm2-8layers.gguf

Prints a JSON line with the layers kept and the file's size.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import gguf

_LAYER = re.compile(r"^blk\.(\d+)\.")
_HEADER_KEYS = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}


def truncate(source: Path, layers: int, out: Path) -> dict[str, object]:
    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    total = int(reader.fields[f"{arch}.block_count"].contents())
    if not 1 <= layers <= total:
        raise SystemExit(f"--layers {layers}: {source} has {total} layers; pick 1..{total}")
    writer = gguf.GGUFWriter(out, arch)
    for name, field in reader.fields.items():
        if name in _HEADER_KEYS or name == "general.architecture":
            continue
        value = layers if name == f"{arch}.block_count" else field.contents()
        sub_type = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(name, value, field.types[0], sub_type=sub_type)
    kept = 0
    for tensor in reader.tensors:
        match = _LAYER.match(tensor.name)
        if match and int(match.group(1)) >= layers:
            continue
        writer.add_tensor(tensor.name, tensor.data, raw_shape=tensor.data.shape, raw_dtype=tensor.tensor_type)
        kept += 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {"source": str(source), "out": str(out), "layers": layers, "of": total,
            "tensors": kept, "bytes": out.stat().st_size}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="the real model's .gguf file")
    parser.add_argument("--layers", type=int, required=True, help="how many leading layers to keep")
    parser.add_argument("--out", type=Path, required=True, help="where to write the smaller .gguf")
    args = parser.parse_args(argv)
    print(json.dumps(truncate(args.source, args.layers, args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
