"""tools/ab_attention_gpu.py: variants leave nothing behind, and the summary reads the rounds right."""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import ab_attention_gpu  # noqa: E402


def test_ab_attention_restores_every_field_a_variant_set_before_the_next():
    """A variant's fields, None-valued defaults included (matmul_dot_splits once leaked from one
    variant into every later one), are back to their defaults for the next."""
    from kjarni.gpu.tuning import GpuTuning

    ops = SimpleNamespace(tuning=GpuTuning())
    model = SimpleNamespace(blocks=[], lm_head=SimpleNamespace(plans={}))
    defaults = ab_attention_gpu._defaults(ops.tuning)
    ab_attention_gpu._apply(ops, model, "matmul_dot_splits=2,tc_tiles[1x2]=4,2,2,2,2,0,matmul_int_dot=0", defaults)
    assert (ops.tuning.matmul_dot_splits, ops.tuning.tc_tiles[(1, 2)], ops.tuning.matmul_int_dot) == (2, (4, 2, 2, 2, 2, 0), 0)
    ab_attention_gpu._apply(ops, model, "default", defaults)
    fresh = GpuTuning()
    assert ops.tuning.matmul_dot_splits is None and (1, 2) not in ops.tuning.tc_tiles
    assert {n: getattr(ops.tuning, n) for n in defaults} == {n: getattr(fresh, n) for n in defaults}


def test_summary_gives_each_variant_its_medians_and_its_ratio_to_the_default():
    """Three rounds of two decode variants (their medians: default 100 tok/s, a=1 110 at 9 µs) and
    two prefill variants without a "default"."""
    rows: list[dict] = []
    rounds = [[("default", 100.0, 10.0), ("a=1", 110.0, 9.0)],
              [("default", 90.0, 11.0), ("a=1", 121.0, 8.0)],
              [("default", 104.0, 9.5), ("a=1", 95.0, 12.0)]]
    for r, round_ in enumerate(rounds):
        rows += [{"kind": "decode", "variant": v, "round": r, "decode_tok_s": t, "gpu_us_per_step": g,
                  "kernels_us": {"attention_step": g / 2, **({"after_attention_step": 1.0} if r else {})}}
                 for v, t, g in round_]
    rows.append({"kind": "prefill", "variant": "b=2", "round": 0, "prefill_tok_s": 50.0, "gpu_ms": 3.0})
    rows.append({"kind": "prefill", "variant": "b=3", "round": 0, "prefill_tok_s": 75.0, "gpu_ms": 2.0})
    lines = {(s["kind"], s["variant"]): s for s in ab_attention_gpu.summary(rows)}
    assert set(lines) == {("decode_summary", "default"), ("decode_summary", "a=1"),
                          ("prefill_summary", "b=2"), ("prefill_summary", "b=3")}
    a = lines["decode_summary", "a=1"]
    assert (a["rounds"], a["median_decode_tok_s"], a["median_gpu_us_per_step"]) == (3, 110.0, 9.0)
    assert a["ratio_to_default"] == pytest.approx(110.0 / 100.0, abs=1e-4)
    assert a["median_attention_step_us"] == 4.5
    assert "median_after_attention_step_us" not in a  # round 0 did not profile it
    assert lines["decode_summary", "default"]["ratio_to_default"] == 1.0
    # No variant named "default": the first one is the baseline.
    assert lines["prefill_summary", "b=3"]["ratio_to_default"] == 1.5
    assert lines["prefill_summary", "b=2"]["median_gpu_ms"] == 3.0
