"""tools/ablate_gpu.py: the leave-one-out profile records a forward's dispatches and replays them faithfully."""

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import ablate_gpu  # noqa: E402
import gputime  # noqa: E402
import bench_gpu  # noqa: E402


def test_recorded_decode_step_replays_to_the_same_logits_and_every_label_is_left_out_once(wgpu_context):
    from kjarni.gpu import WgpuOps
    from kjarni.gpu.tuning import GpuTuning

    ctx = wgpu_context
    ops = WgpuOps(ctx, weight_format="f16", tuning=GpuTuning(step_capture=False))
    model = bench_gpu.build("small", "f16", ops)
    prompt = (np.arange(40, dtype=np.int32) * 7919) % model.config.vocab_size
    cache = model.new_cache(48)
    token = int(ops.argmax(model.forward(prompt, cache))[0])
    before = ctx.stats.dispatches
    calls, out = gputime.record(ctx, lambda: model.forward([token], cache))
    logits = ops.read(out)
    assert len(calls) == ctx.stats.dispatches - before > 0
    assert "dispatch_group" not in vars(ctx)  # the recorder is gone again

    # The same kernels on the same inputs and buffers, none of them with atomics or a CPU BLAS in
    # between: bit for bit by construction, on any machine (as tests/test_gpu_step_capture.py's replays).
    ctx.queue.write_buffer(out.buffer, 0, np.zeros(logits.size, np.float32))
    gputime.replay(ctx, calls)
    assert np.array_equal(ops.read(out), logits)

    lists = ablate_gpu.variants(calls)
    labels = [ablate_gpu.label(p, g) for p, _, g in calls]
    assert list(lists) == ["full", *dict.fromkeys(labels)]
    assert any(name.startswith("attention_step:main ") for name in lists)
    for name, kept in list(lists.items())[1:]:
        assert len(kept) == len(calls) - labels.count(name)
        assert all(ablate_gpu.label(p, g) != name for p, _, g in kept)
        it = iter(calls)  # the rest keep their order
        assert all(any(c is k for c in it) for k in kept)
