"""Timing recorded GPU work for the tools: record what a function dispatches, replay it, and time
lists of dispatches back to back on a warm GPU with timestamp queries (tools/ablate_gpu.py,
tools/sweep_sgmat.py)."""

from __future__ import annotations

import numpy as np


def record(ctx, run) -> tuple[list, object]:
    """The dispatches (pipeline, group, grid) that ``run()`` records, in order, and what it returned
    (read back, so the recorded work ran)."""
    calls = []
    original = ctx.dispatch_group

    def recording(pipeline, group, grid):
        calls.append((pipeline, group, tuple(grid)))
        original(pipeline, group, grid)

    ctx.dispatch_group = recording
    try:
        result = run()
    finally:
        del ctx.dispatch_group  # the bound method again
    return calls, result


def replay(ctx, calls: list) -> None:
    """Record ``calls`` into the context's open pass, as the forward did."""
    for pipeline, group, grid in calls:
        ctx.dispatch_group(pipeline, group, grid)


def time_lists(ctx, lists: dict[str, list], passes: int, reps: int, warm_s: float) -> dict[str, float]:
    """Median seconds of one run of each list of dispatches (pipeline, bind group, grid):
    ``passes`` rounds, each one timestamped compute pass per list holding ``reps`` runs of it back
    to back, all in one command buffer after about ``warm_s`` of the first list, so every list
    runs at the clock a busy GPU keeps (an H100 idles at 345 MHz and takes a while to reach its
    1,980: a product timed right after an idle spell, such as a compile, runs several times slower)."""
    import wgpu

    names = list(lists)
    n = len(names)
    qs = ctx.device.create_query_set(type=wgpu.QueryType.timestamp, count=2 * n * passes)
    encoder = ctx.device.create_command_encoder()

    def run_pass(calls, count, writes=None):
        cp = encoder.begin_compute_pass(timestamp_writes=writes) if writes else encoder.begin_compute_pass()
        for _ in range(count):
            for pipeline, group, grid in calls:
                cp.set_pipeline(pipeline)
                cp.set_bind_group(0, group)
                cp.dispatch_workgroups(*grid)
        cp.end()

    if warm_s > 0:
        first = lists[names[0]]
        run_pass(first, max(1, int(warm_s / max(time_once(ctx, first), 1e-6))))
    for p in range(passes):
        for v, name in enumerate(names):
            q = 2 * (p * n + v)
            run_pass(lists[name], reps, {"query_set": qs, "beginning_of_pass_write_index": q, "end_of_pass_write_index": q + 1})
    resolve = ctx.device.create_buffer(size=16 * n * passes, usage=wgpu.BufferUsage.QUERY_RESOLVE | wgpu.BufferUsage.COPY_SRC)
    encoder.resolve_query_set(qs, 0, 2 * n * passes, resolve, 0)
    ctx.queue.submit([encoder.finish()])
    ticks = np.frombuffer(ctx.queue.read_buffer(resolve), dtype=np.uint64).astype(np.float64)
    per = (ticks[1::2] - ticks[0::2]).reshape(passes, n) * 1e-9 / reps
    resolve.destroy()
    qs.destroy()
    return dict(zip(names, (float(t) for t in np.median(per, axis=0))))


def time_once(ctx, calls: list) -> float:
    """Seconds of one timestamped run of ``calls``, now, without a warm-up."""
    return time_lists(ctx, {"once": calls}, 1, 1, 0.0)["once"]


EMPTY_WGSL = """
@group(0) @binding(0) var<storage, read_write> out: array<u32>;
@compute @workgroup_size(32)
fn main(@builtin(local_invocation_index) i: u32) {
    out[i] = out[i] + 1u;
}
"""
"""One workgroup that reads and writes a word per thread: a chain of its dispatches, each waiting
for the previous, is the floor of a chain of kernels (tools/sweep_matvec.py, tools/ablate_gpu.py)."""


def empty_calls(ctx, n: int) -> list:
    """``n`` dispatches of `EMPTY_WGSL`, each reading what the previous wrote."""
    import wgpu

    buf = ctx.device.create_buffer(size=256, usage=wgpu.BufferUsage.STORAGE)
    module = ctx.device.create_shader_module(code=EMPTY_WGSL, label="empty")
    pipeline = ctx.device.create_compute_pipeline(layout="auto", compute={"module": module, "entry_point": "main"})
    pipeline.kjarni_name = "empty:main"
    group = ctx.device.create_bind_group(layout=pipeline.get_bind_group_layout(0),
                                         entries=[{"binding": 0, "resource": {"buffer": buf, "offset": 0, "size": 256}}])
    return [(pipeline, group, (1, 1, 1))] * n


FMA_WGSL = """
@group(0) @binding(0) var<storage, read_write> out: array<f32>;
@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    var a = f32(gid.x) * 1e-9;
    var b = a + 0.5;
    var c = a + 0.25;
    var d = a + 0.125;
    for (var i = 0u; i < ITERSu; i++) {
        a = fma(a, 0.9999, 1e-4);
        b = fma(b, 0.9999, 1e-4);
        c = fma(c, 0.9999, 1e-4);
        d = fma(d, 0.9999, 1e-4);
    }
    out[gid.x] = a + b + c + d;
}
"""
FMA_GROUPS = 1024
FMA_ITERS = 4096  # 4 chains a thread: 2^32 FMAs in all


class FmaProbe:
    """A fixed f32 FMA kernel (2^32 FMAs over 262,144 threads), compiled once; calling it times it
    alone, right now, in microseconds: the GPU's clock at this moment, for comparing runs within
    one call (an H100 at its idle 345 MHz takes several times as long as at 1,980). Not a peak
    rate: its chains are short of that. Build it before a benchmark's warm-up, so that no compile
    idles the GPU between the warm-up and the timed part."""

    def __init__(self, ctx) -> None:
        import wgpu

        self.ctx = ctx
        buf = ctx.device.create_buffer(size=FMA_GROUPS * 256 * 4, usage=wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC)
        self.buf = buf
        module = ctx.device.create_shader_module(code=FMA_WGSL.replace("ITERS", str(FMA_ITERS)), label="fma_probe")
        pipeline = ctx.device.create_compute_pipeline(layout="auto", compute={"module": module, "entry_point": "main"})
        group = ctx.device.create_bind_group(layout=pipeline.get_bind_group_layout(0),
                                             entries=[{"binding": 0, "resource": {"buffer": buf, "offset": 0, "size": buf.size}}])
        self.calls = [(pipeline, group, (FMA_GROUPS, 1, 1))]

    def __call__(self) -> float:
        return round(1e6 * time_once(self.ctx, self.calls), 1)

    def spin(self, seconds: float) -> int:
        """Keeps the GPU busy with the kernel for about ``seconds`` of wall time (command buffers of
        1, 2, 4 .. 64 dispatches, each waited for, growing while one takes under 20 ms) and returns
        the dispatches run: the clock a benchmark's timed part starts at. Prefills alone did not
        always raise it (their recording leaves the GPU idle in between: eighteenth session,
        docs/benchmarks.md)."""
        import time

        pipeline, group, grid = self.calls[0]
        t0, n, batch = time.perf_counter(), 0, 1
        while n == 0 or time.perf_counter() - t0 < seconds:
            t1 = time.perf_counter()
            encoder = self.ctx.device.create_command_encoder()
            cp = encoder.begin_compute_pass()
            cp.set_pipeline(pipeline)
            cp.set_bind_group(0, group)
            for _ in range(batch):
                cp.dispatch_workgroups(*grid)
            cp.end()
            self.ctx.queue.submit([encoder.finish()])
            self.ctx.queue.read_buffer(self.buf, 0, 4)  # waits for the batch
            n += batch
            if time.perf_counter() - t1 < 0.02:
                batch = min(64, 2 * batch)
        return n
