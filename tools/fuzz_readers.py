"""A larger mutation campaign over both readers; prints JSON counts of the outcomes.

    python tools/fuzz_readers.py --cases 1000 --seed 0

Each case is one mutated GGUF or safetensors file drawn from the strategies of
tests/test_fuzz_readers.py (seeded, so a run is reproducible) and loaded by `load_outcome`
(tests/bad_files.py): ``typed`` (a KjarniError naming the problem), ``accepted`` (loads into the
model the file describes and generates), ``other`` (anything else; the first few are listed).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import warnings
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hypothesis import HealthCheck, given, seed, settings  # noqa: E402

from tests.bad_files import load_outcome, write_safetensors_folder  # noqa: E402
from tests.test_fuzz_readers import gguf_mutation, safetensors_mutation  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=1000, help="cases per reader (hypothesis may stop earlier once it runs out of distinct ones)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    report: dict = {"seed": args.seed}
    with tempfile.TemporaryDirectory() as tmp:
        for reader, strategy in (("gguf", gguf_mutation()), ("safetensors", safetensors_mutation())):
            counts: Counter = Counter()
            others: list[str] = []

            @seed(args.seed)
            @settings(max_examples=args.cases, database=None, deadline=None, suppress_health_check=list(HealthCheck))
            @given(data=strategy)
            def run(data: bytes) -> None:
                folder = Path(tmp) / f"{reader}{sum(counts.values())}"
                folder.mkdir()
                if reader == "gguf":
                    path = folder / "m.gguf"
                    path.write_bytes(data)
                else:
                    path = write_safetensors_folder(folder, data)
                outcome, detail = load_outcome(path)
                counts[outcome] += 1
                if outcome == "other" and len(others) < 10:
                    others.append(detail[:300])

            run()
            report[reader] = {"tried": sum(counts.values()), "typed": counts["typed"],
                              "accepted_and_correct": counts["accepted"], "other": counts["other"],
                              "other_examples": others}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
