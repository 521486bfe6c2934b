"""Step capture and replay (kjarni/gpu/capture.py): a replayed step is the recorded one, bit for bit.

Each test runs the same tiny model twice on one GPU context, with ``GpuTuning.step_capture`` on
and off, and compares logits (exactly: a replay issues the same dispatches on the same inputs)
and tokens, across what must make a tape stale or a new one: the context growing past an
attention bucket, a prefix-cache trim, sampling on the GPU, a speculative round's verify, a tuning
change, destroyed buffers, a reallocated ids buffer. The counting test checks that a replayed step
calls nothing of the model or the ops and issues its dispatches through the raw C calls.
"""

from __future__ import annotations

import numpy as np
import pytest

from kjarni.model import DecoderModel
from kjarni.model_config import ModelConfig
from kjarni.weights import load_weights
from tests.tiny_models import random_state_dict, save_safetensors_model, tiny_config

pytestmark = pytest.mark.gpu

PROMPT = [5, 17, 3, 88, 42, 9, 61, 2, 30, 77, 14]


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    path = tmp_path_factory.mktemp("capture")
    config = tiny_config("qwen2", num_hidden_layers=3)
    save_safetensors_model(path, config, random_state_dict(config, seed=3))
    return ModelConfig.from_json(path / "config.json"), load_weights(path)


def _model(weights, context, capture: bool, **tuning) -> DecoderModel:
    from kjarni.gpu import WgpuOps
    from kjarni.gpu.tuning import GpuTuning

    config, loaded = weights
    return DecoderModel(config, loaded, WgpuOps(context, weight_format="f32", tuning=GpuTuning(step_capture=capture, **tuning)))


def _pair(weights, context, **tuning) -> tuple[DecoderModel, DecoderModel]:
    """(taped, untaped) models on the same weights and context."""
    return _model(weights, context, True, **tuning), _model(weights, context, False, **tuning)


def _decode(model, cache, token: int, steps: int) -> tuple[list[int], list[np.ndarray]]:
    """``steps`` greedy steps from ``token``, one readback each: (tokens, logits per step)."""
    tokens, logits = [], []
    for _ in range(steps):
        row = model.ops.read(model.forward([token], cache))
        token = int(np.argmax(row[0]))
        tokens.append(token)
        logits.append(row)
    return tokens, logits


def _assert_same(taped, untaped) -> None:
    assert len(taped) == len(untaped)
    for i, (a, b) in enumerate(zip(taped, untaped)):
        assert np.array_equal(a, b), f"step {i}: replayed logits differ from recorded ones"


def _decode_pair(weights, context, capacity: int, steps: int, **tuning) -> tuple[DecoderModel, DecoderModel]:
    """``steps`` greedy steps after PROMPT on a taped and an untaped model (a cache of ``capacity``
    each), asserting the same tokens and bit-identical logits; returns (taped, untaped)."""
    taped, untaped = _pair(weights, context, **tuning)
    results = []
    for model in (taped, untaped):
        cache = model.new_cache(capacity)
        first = int(model.ops.argmax(model.forward(PROMPT, cache))[0])
        results.append(_decode(model, cache, first, steps))
    assert results[0][0] == results[1][0]
    _assert_same(results[0][1], results[1][1])
    return taped, untaped


def test_replayed_steps_are_bit_identical_across_attention_buckets(weights, wgpu_context):
    # attention_step_max=16 and attention_single_max=16: positions up to 15 run the fused
    # attention_step, later ones flash-decoding with one split of 64 keys, then two past position
    # 63: three tapes.
    taped, untaped = _decode_pair(weights, wgpu_context, 96, 70, attention_step_max=16, attention_single_max=16)
    tapes = taped.ops.tapes
    assert tapes.captured == 3, "one tape per position class: fused, one split, two splits"
    assert tapes.replayed == 70 - 3
    assert untaped.ops.tapes.captured == untaped.ops.tapes.replayed == 0


def test_a_split_count_doubling_records_one_new_tape_and_replays_exactly(weights, wgpu_context):
    # attention_step's splits double from 2 past 16 keys (8 a split) to the cap of 4: positions 12
    # to 16 run 2 splits, later ones 4: two tapes, every other step replayed.
    if not wgpu_context.has_subgroups:
        pytest.skip("a split attention_step needs subgroups (the o_proj merge); this adapter has none")
    taped, _ = _decode_pair(weights, wgpu_context, 64, 30,
                            attention_step_splits=2, attention_step_split_keys=8, attention_step_max_splits=4)
    assert taped.ops.tapes.captured == 2, "one tape per split count"
    assert taped.ops.tapes.replayed == 30 - 2


OPS = ("embed", "rms_norm", "linear", "norm_linear", "rope_store", "attention", "silu_mul", "add", "rows")


def test_a_replayed_step_calls_nothing_of_the_model_and_dispatches_through_the_raw_calls(weights, wgpu_context, monkeypatch):
    taped, untaped = _pair(weights, wgpu_context)
    ctx = wgpu_context
    caches = {m: m.new_cache(64) for m in (taped, untaped)}
    for model in (taped, untaped):
        token = int(model.ops.argmax(model.forward(PROMPT, caches[model]))[0])
        token = int(model.ops.argmax(model.forward([token], caches[model]))[0])  # the taped one records its tape
    calls = {"ops": 0, "set_pipeline": 0, "set_bind_group": 0, "dispatch": 0}

    def counted(name, function):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return function(*args, **kwargs)
        return wrapper

    for model in (taped, untaped):
        for name in OPS:
            monkeypatch.setattr(model.ops, name, counted("ops", getattr(model.ops, name)))
    if ctx._raw is not None:
        set_pipeline, set_bind_group, dispatch, null = ctx._raw
        monkeypatch.setattr(ctx, "_raw", (counted("set_pipeline", set_pipeline), counted("set_bind_group", set_bind_group),
                                          counted("dispatch", dispatch), null))
    (tape,) = caches[taped].tapes.values()
    before = ctx.stats.dispatches
    replayed = taped.forward([token], caches[taped])
    issued = ctx.stats.dispatches - before
    raw_calls = dict(calls)
    recorded = untaped.forward([token], caches[untaped])
    untaped_ops_calls = calls["ops"]
    monkeypatch.undo()
    assert raw_calls["ops"] == 0, "a replayed step calls no op of the backend"
    assert issued == len(tape.calls) == 1 + 5 * 3 + 1  # embed, 5 per layer, final norm + LM head
    if ctx._raw is not None:
        assert raw_calls["dispatch"] == raw_calls["set_bind_group"] == issued
        changes = 1 + sum(1 for (p, _, _), (q, _, _) in zip(tape.calls[1:], tape.calls[:-1]) if p is not q)
        assert raw_calls["set_pipeline"] == changes
    # The counters count: the untaped forward calls embed, 7 ops per layer, rows and norm_linear.
    assert untaped_ops_calls == 1 + 7 * 3 + 2
    assert np.array_equal(taped.ops.read(replayed), untaped.ops.read(recorded))


def test_tapes_go_stale_on_a_tuning_change_destroyed_buffers_and_a_reallocated_ids_buffer(weights, wgpu_context):
    taped, untaped = _pair(weights, wgpu_context)
    caches = {m: m.new_cache(64) for m in (taped, untaped)}
    steps: dict = {taped: [], untaped: []}

    def run(count: int) -> None:
        for model in (taped, untaped):
            cache = caches[model]
            token = steps[model][-1][1] if steps[model] else PROMPT[0]
            for _ in range(count):
                row = model.ops.read(model.forward([token], cache))
                token = int(np.argmax(row[0]))
                steps[model].append((row, token))

    for model in (taped, untaped):
        model.ops.argmax(model.forward(PROMPT, caches[model]))
    run(3)
    assert (taped.ops.tapes.captured, taped.ops.tapes.replayed) == (1, 2)
    taped.ops.tuning.finite_check = taped.ops.tuning.finite_check  # any assignment: a new revision
    run(2)
    assert (taped.ops.tapes.captured, taped.ops.tapes.replayed) == (2, 3)
    other = _model(weights, wgpu_context, True)
    other.ops.close()  # destroys buffers on the shared context: every tape there is stale
    run(2)
    assert (taped.ops.tapes.captured, taped.ops.tapes.replayed) == (3, 4)
    ids = "ids:" + taped.embed_tokens.name  # a longer write reallocates the step's ids buffer
    wgpu_context.step_buffer(ids, bytes(64 * 1024), usage=wgpu_context._step_buffers[ids].usage)
    run(2)
    assert (taped.ops.tapes.captured, taped.ops.tapes.replayed) == (4, 5)
    _assert_same([r for r, _ in steps[taped]], [r for r, _ in steps[untaped]])


def test_a_few_token_forward_with_last_logits_is_taped_and_replays_exactly(weights, wgpu_context):
    # ops.rows takes the last row with a dispatch (rows.wgsl), not a buffer copy, so a speculative
    # draft's catch-up (a 2-3 token forward, logits "last") replays like a decode step.
    taped, untaped = _pair(weights, wgpu_context)
    out, caches = [], []
    for model in (taped, untaped):
        cache = model.new_cache(64)
        model.ops.argmax(model.forward(PROMPT, cache))
        out.append([model.ops.read(model.forward([4, 8, 15], cache)) for _ in range(3)])
        caches.append(cache)
    assert [o.shape[0] for o in out[0]] == [1, 1, 1]  # the last row's logits only
    _assert_same(out[0], out[1])
    assert taped.ops.tapes.replayed == 2
    assert [t.refused for t in caches[0].tapes.values()] == [None]


def test_a_prefix_cache_trim_then_new_tokens_replays_exactly(weights, wgpu_context):
    from kjarni.decode import generate_step
    from kjarni.sampler import make_sampler

    taped, untaped = _pair(weights, wgpu_context)
    results = []
    for model in (taped, untaped):
        cache = model.new_cache(96)
        first = generate_step(model, PROMPT, make_sampler(0.0), np.random.default_rng(0), cache, max_tokens=20)
        tokens = [next(first)[0] for _ in range(20)]
        first.close()
        shared = 6  # a prefix cache keeps the common prefix and trims the rest
        cache.trim(cache.offset - shared)
        second = generate_step(model, PROMPT[:shared] + [44, 45, 46], make_sampler(0.0), np.random.default_rng(0),
                               cache, max_tokens=20)
        tokens += [next(second)[0] for _ in range(20)]
        second.close()
        results.append(tokens)
    assert results[0] == results[1]
    assert taped.ops.tapes.replayed > 20


def test_sampling_on_the_gpu_gives_the_same_tokens_with_replay(weights, wgpu_context):
    from kjarni.decode import generate_step
    from kjarni.sampler import make_sampler

    taped, untaped = _pair(weights, wgpu_context)
    results = []
    for model in (taped, untaped):
        assert model.ops.samples_ahead(make_sampler(0.8, top_k=20, top_p=0.9))
        tokens = generate_step(model, PROMPT, make_sampler(0.8, top_k=20, top_p=0.9), np.random.default_rng(7),
                               model.new_cache(96), max_tokens=40)
        results.append([next(tokens)[0] for _ in range(40)])
        tokens.close()
    assert results[0] == results[1]
    assert taped.ops.tapes.replayed > 30, "the ids come from the GPU: the input port is rebound per step"


def test_a_speculative_round_replays_the_drafts_and_the_verify(weights, wgpu_context):
    from kjarni.sampler import make_sampler
    from kjarni.speculative import speculative_step

    results, caches = [], []
    for capture in (True, False):
        target = _model(weights, wgpu_context, capture)
        draft = _model(weights, wgpu_context, capture)
        caches.append((target.new_cache(128), draft.new_cache(128)))
        tokens = speculative_step(target, draft, PROMPT, make_sampler(0.0), np.random.default_rng(0),
                                  *caches[-1], max_tokens=40, num_draft_tokens=3)
        results.append([next(tokens)[0] for _ in range(40)])
        tokens.close()
    assert results[0] == results[1]
    (target_cache, draft_cache), _ = caches
    replays = lambda cache, n: sum(t.replays for key, t in cache.tapes.items() if key[2] == n)  # key[2]: tokens
    assert replays(draft_cache, 1) > 0
    assert replays(target_cache, 4) > 0, "the verify of the last token and 3 drafts replays its tape"
