"""`kjarni parity`: the GPU-vs-numpy cross-check, on a tiny model (lavapipe in CI)."""

from __future__ import annotations

import json

import pytest

from kjarni.cli import main
from kjarni.parity import run_parity
from tests.test_api import make_tiny_model

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("parity"))


def test_f32_gpu_matches_numpy_on_every_step(tiny_model, wgpu_context):
    report = run_parity(tiny_model, "hello there", steps=8, context=wgpu_context)
    assert report.steps == 8 and len(report.cpu_tokens) == 9
    assert report.max_abs_diff < 1e-3
    assert 0 < report.mean_abs_diff <= report.max_abs_diff
    assert report.top1_agreement == 1.0 and report.first_divergence is None
    assert report.gpu_tokens == report.cpu_tokens


def test_parity_command_prints_json(tiny_model, wgpu_context, capsys):
    assert main(["parity", "--model-path", str(tiny_model), "--prompt", "hello", "--steps", "3", "--json", "-q"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["steps"] == 3 and report["first_divergence"] is None
    assert report["max_abs_diff"] < 1e-3 and report["weight_format"] == "f32"


def test_parity_command_prints_text_and_refuses_bad_steps(tiny_model, wgpu_context, capsys):
    assert main(["parity", "--model-path", str(tiny_model), "--prompt", "hi", "--steps", "2", "-q"]) == 0
    out = capsys.readouterr().out
    assert "max |logit diff|" in out and "first divergence none" in out
    assert main(["parity", "--model-path", str(tiny_model), "--prompt", "hi", "--steps", "-1"]) == 2
    assert "--steps" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("prompt", ["The capital of France is", "def fibonacci(n):"])
def test_real_smollm2_greedy_tokens_on_the_gpu_equal_numpy_for_16_steps(prompt, wgpu_context):
    from tests.real_models import SMOLLM2, real_model_path

    report = run_parity(real_model_path(SMOLLM2), prompt, steps=15, weight_format="f16", context=wgpu_context)
    assert len(report.cpu_tokens) == 16
    assert report.first_divergence is None, report
    assert report.gpu_tokens == report.cpu_tokens


def test_q8_0_parity_reports_the_int8_activation_reference_beside_float32(tmp_path, wgpu_context):
    """The GPU's Q8_0 decode products round x to int8 blocks (matvec_int_dot): against numpy with
    the same rounding its logits agree to float32 tolerance; against plain float32 numpy they move
    by that rounding, which the report keeps as max_abs_diff."""
    from tests.tiny_models import quant_config, random_state_dict, save_gguf_model

    config = quant_config()
    path = save_gguf_model(tmp_path / "tiny-q8.gguf", config, random_state_dict(config, seed=5), quant="Q8_0")
    report = run_parity(path, "hello there", steps=6, context=wgpu_context, quiet=True)
    assert report.max_abs_diff_matched is not None and report.mean_abs_diff_matched is not None
    assert report.max_abs_diff_matched < 1e-3
    assert report.max_abs_diff > 10 * report.max_abs_diff_matched  # the rounding shows against f32
    assert "inputs rounded to int8 where the GPU" in report.to_text()


def test_float_weights_have_no_int8_reference(tiny_model, wgpu_context):
    report = run_parity(tiny_model, "hi", steps=2, context=wgpu_context, quiet=True)
    assert report.max_abs_diff_matched is None and "int8" not in report.to_text()
