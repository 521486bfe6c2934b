"""Step capture and replay: a decode step recorded once as a flat tape, then replayed without the model's Python.

Recording a decode step walks the model's forward (kjarni/model.py) through `WgpuOps`: some 20
Python calls per layer (linear.py's plans, attention.py's choices, step.py's pending fusions,
bind-group lookups, the scratch pool) to issue 5 dispatches, about 10 us a dispatch on the H200's
host. Step after step those calls produce the same dispatches: the same pipelines, bind groups and
grids, only the position (the step uniform) and the input ids differ. `StepTapes.forward` records
the first step of a kind with the model's forward while the context (`WgpuContext._capture`)
notes every dispatch, every scratch buffer handed out and every per-step buffer written; later
steps of the same kind replay that tape: write the step's position and ids, take a fresh output
buffer, and issue the dispatches in one loop (wgpu-native's C calls directly, or the public API on
Dawn), with no call into the model or the ops.

What a tape is keyed on (a step with another key records a new tape, keyed in ``kv_cache.tapes``):
the model (held weakly and compared), the KV cache (tapes live on it), the rope table the model
chose, the number of tokens (1 for decode, k + 1 for a speculative verify; at most
``tuning.matvec_max_tokens``), ``logits`` ("last" / "all"), whether the ids come from the GPU
(`GpuTokens`) or the CPU, and `Attention.position_class`: every choice of rope_store and
attention that depends on the position (fused attention_step with its split count, attention_single,
or flash-decoding with its split count), so a context growing past a bucket records a new tape.

What makes a tape stale (never replayed again; the next step of its key records a new one):
``tuning.revision`` moved (any `GpuTuning` field assigned, ``step_capture`` included), the
context's ``epoch`` moved (`WgpuContext.release` / ``close`` destroyed buffers: a model's weights
or KV caches), the model is gone, or a per-step buffer the tape binds was reallocated (a longer
prompt's ids). Never taped: prefills (more than ``matvec_max_tokens`` tokens), steps while
profiling, and a forward whose recording did anything but dispatch (a buffer copy; ``ops.rows``,
which keeps the last row of a few-token "last" forward, is a dispatch), bound a pooled buffer it
did not get during the step (other than its input ids), wrote a per-step buffer other than the
position and the ids of that forward, or did not return a fresh activation. Such a forward is marked and recorded normally from then on.

Buffers: every scratch buffer handed out while a tape is recorded stays the tape's own (not
reused within the step nor by anyone else) until the tape goes, so a replay writes only buffers
nobody else holds; the output (logits) is a fresh pooled buffer per replay, bound to the tape's
last dispatches with bind groups looked up per buffer, as the input ids' buffer is. A tape holds
one step's activations (a few MB for Qwen2.5-0.5B decode); at most `MAX_TAPES` per KV cache.

Replaying changes no dispatch, so no token or logit: the tests (tests/test_gpu_step_capture.py)
compare logits and tokens with ``step_capture`` on and off, bit for bit, across these cases.
``GpuTuning.step_capture = False`` turns it off.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Callable

from kjarni.gpu.params import STEP
from kjarni.gpu.step import GpuTensor, GpuTokens

if TYPE_CHECKING:
    from kjarni.gpu.ops import WgpuOps

MAX_TAPES = 8
"""Tapes kept per KV cache (the oldest goes first): decode, a few verify lengths, a bucket or two."""


class Recording:
    """What the context saw while one forward was recorded (``WgpuContext._capture``)."""

    __slots__ = ("calls", "pins", "values", "tables", "refused")

    def __init__(self) -> None:
        self.calls: list[tuple[Any, Any, tuple[int, int, int]]] = []  # (pipeline, bind group, grid)
        self.pins: list[Any] = []  # every Scratch handed out
        self.values: dict[str, tuple[bytes, Any]] = {}  # per-step buffer name -> (content, buffer)
        self.tables: dict[str, Any] = {}  # "ids:<table>" -> the embedding table (`WgpuOps.ids_buffer`)
        self.refused: str | None = None

    def step_value(self, name: str, data: bytes, buffer: Any) -> None:
        seen = self.values.get(name)
        if seen is not None and seen[0] != data:
            self.refuse(f"the per-step buffer {name!r} took two values in one forward")
        self.values[name] = (data, buffer)

    def refuse(self, why: str) -> None:
        if self.refused is None:
            self.refused = why


class Tape:
    """One forward's dispatches, ready to replay (or, with ``refused``, a note to record normally)."""

    __slots__ = ("model", "epoch", "revision", "refused", "calls", "raw_calls", "ports", "pins", "step", "ids",
                 "out_bytes", "out_shape", "last_pipeline", "replays")

    def __init__(self, model: Any, epoch: int, revision: int, refused: str | None = None) -> None:
        self.model = weakref.ref(model)
        self.epoch, self.revision, self.refused = epoch, revision, refused
        self.calls: list[tuple[Any, Any, tuple[int, int, int]]] = []
        self.raw_calls: list[tuple] = []  # (pipeline handle or None when unchanged, group handle, x, y, z)
        # Dispatches binding the input ids or the output: (index, pipeline, buffers, input slots, output slots).
        self.ports: list[tuple[int, Any, tuple, tuple[int, ...], tuple[int, ...]]] = []
        self.pins: list[Any] = []
        self.step: Any = None  # the position's step buffer
        self.ids: tuple[Any, Any] | None = None  # (embedding table, its ids step buffer) for CPU ids
        self.out_bytes = 0
        self.out_shape = (0, 0)
        self.last_pipeline: Any = None
        self.replays = 0


class StepTapes:
    """The tapes of one `WgpuOps` (``ops.tapes``): `forward` replays or records a forward.

    ``captured`` / ``replayed`` count tapes recorded and steps replayed (tests, benchmarks)."""

    def __init__(self, ops: WgpuOps) -> None:
        self.ops = ops
        self.context = ops.context
        self.tuning = ops.tuning
        self.captured = 0
        self.replayed = 0

    def forward(self, model: Any, ids: Any, kv_cache: Any, logits: str, rope: Any, windows: list,
                record: Callable[[Any, Any, str, Any], GpuTensor]) -> GpuTensor:
        """``record(ids, kv_cache, logits, rope)`` (the model's forward past its checks), or its
        tape replayed when one of this step's key is valid."""
        ctx, tuning = self.context, self.tuning
        tokens, start = len(ids), kv_cache.offset
        tapes = getattr(kv_cache, "tapes", None)
        if (not tuning.step_capture or tokens > tuning.matvec_max_tokens or tapes is None
                or ctx._profile is not None or ctx._capture is not None):
            return record(ids, kv_cache, logits, rope)
        on_device = type(ids) is GpuTokens
        key = (id(model), id(rope), tokens, logits, on_device, self.ops._attention.position_class(tokens, start, windows))
        tape = tapes.get(key)
        if tape is not None:
            if tape.epoch == ctx.epoch and tape.revision == tuning.revision and tape.model() is model:
                if tape.refused is not None:
                    return record(ids, kv_cache, logits, rope)
                out = self._replay(tape, ids, kv_cache, start, tokens)
                if out is not None:
                    return out
            del tapes[key]  # stale: its pinned buffers go back to the pool
        return self._capture(key, tapes, model, ids, kv_cache, logits, rope, record)

    # ------------------------------------------------------------------ capture

    def _capture(self, key: tuple, tapes: dict, model: Any, ids: Any, kv_cache: Any, logits: str, rope: Any,
                 record: Callable) -> GpuTensor:
        ctx = self.context
        start = kv_cache.offset
        recording = ctx._capture = Recording()
        try:
            out = record(ids, kv_cache, logits, rope)
        finally:
            ctx._capture = None
        tape = self._tape(recording, model, ids, out, start)
        while len(tapes) >= MAX_TAPES:
            del tapes[next(iter(tapes))]
        tapes[key] = tape
        self.captured += 1
        return out

    def _tape(self, recording: Recording, model: Any, ids: Any, out: Any, start: int) -> Tape:
        ctx = self.context
        tape = Tape(model, ctx.epoch, self.tuning.revision)
        if type(out) is not GpuTensor or not any(s is out.scratch for s in recording.pins):  # (a pending
            # handle's ``scratch`` would record more)
            recording.refuse("the forward did not return a fresh activation")
        input_buffer = ids.buffer if type(ids) is GpuTokens else None
        if input_buffer is None:
            expected = {name: (table, bytes(ids.astype("uint32").tobytes())) for name, table in recording.tables.items()}
        else:
            expected = {}
        written: set[int] = set()
        for name, (data, buffer) in recording.values.items():
            written.add(id(buffer))
            if name == "start" and data == STEP.pack(start=start):
                tape.step = buffer
            elif name in expected and data == expected[name][1] and tape.ids is None:
                tape.ids = (expected[name][0], buffer)
            else:
                recording.refuse(f"the per-step buffer {name!r} holds something a replay would not write")
        out_scratch = out.scratch if type(out) is GpuTensor else None
        out_buffer = out_scratch.buffer if out_scratch is not None else None
        pinned = {id(s.buffer) for s in recording.pins if s is not out_scratch}
        step_buffers = {id(b) for b in ctx._step_buffers.values()}
        for index, (pipeline, group, grid) in enumerate(recording.calls):
            buffers = getattr(group, "kjarni_buffers", None)
            if buffers is None:
                recording.refuse("a bind group not made by WgpuContext.bind_group")
                break
            ins, outs = [], []
            for slot, buffer in enumerate(buffers):
                if buffer is input_buffer:
                    ins.append(slot)
                elif buffer is out_buffer:
                    outs.append(slot)
                elif id(buffer) in pinned:
                    continue
                elif id(buffer) in ctx._scratch_ids:
                    recording.refuse("a pooled buffer the step did not get itself")
                elif id(buffer) in step_buffers and id(buffer) not in written:
                    recording.refuse("a per-step buffer the step did not write")
            if ins or outs:
                tape.ports.append((index, pipeline, buffers, tuple(ins), tuple(outs)))
        if recording.refused is not None:
            tape.refused = recording.refused
            return tape  # its buffers go back to the pool with the recording
        tape.calls = recording.calls
        tape.pins = [s for s in recording.pins if s is not out_scratch]
        tape.out_bytes = out.shape[0] * out.shape[1] * 4
        tape.out_shape = out.shape
        tape.last_pipeline = recording.calls[-1][0] if recording.calls else None
        if ctx._raw is not None:
            last = None
            for pipeline, group, (x, y, z) in recording.calls:
                tape.raw_calls.append((pipeline._internal if pipeline is not last else None, group._internal, x, y, z))
                last = pipeline
        return tape

    # ------------------------------------------------------------------ replay

    def _replay(self, tape: Tape, ids: Any, kv_cache: Any, start: int, tokens: int) -> GpuTensor | None:
        """The tape's dispatches for this step, or None when a per-step buffer it binds was reallocated."""
        ctx, ops = self.context, self.ops
        if tape.step is not None and ops._step.buffer(start) is not tape.step:
            return None
        if tape.ids is not None and ops.ids_buffer(tape.ids[0], ids) is not tape.ids[1]:
            return None
        out = ctx.scratch(tape.out_bytes)
        input_buffer = ids.buffer if type(ids) is GpuTokens else None
        raw = ctx._raw
        fast = raw is not None and not ctx.submit_every
        calls = list(tape.raw_calls if fast else tape.calls)
        for index, pipeline, buffers, ins, outs in tape.ports:
            bound = list(buffers)
            for slot in ins:
                bound[slot] = input_buffer
            for slot in outs:
                bound[slot] = out.buffer
            group = ctx.bind_group(pipeline, bound)
            if fast:
                calls[index] = (calls[index][0], group._internal, *calls[index][2:])
            else:
                calls[index] = (pipeline, group, calls[index][2])
        if fast:
            ctx.open_pass()
            set_pipeline, set_bind_group, dispatch, null = raw
            handle = ctx._pass_handle
            for pipeline, group, x, y, z in calls:
                if pipeline is not None:
                    set_pipeline(handle, pipeline)
                set_bind_group(handle, 0, group, 0, null)
                dispatch(handle, x, y, z)
            ctx._pipeline_in_pass = tape.last_pipeline
            stats = ctx.stats
            stats.dispatches += len(calls)
            stats.pending_dispatches += len(calls)
        else:  # the public API (Dawn, raw_recording=False) or submits every N dispatches
            dispatch_group = ctx.dispatch_group
            for pipeline, group, grid in calls:
                dispatch_group(pipeline, group, grid)
        kv_cache.offset = start + tokens
        tape.replays += 1
        self.replayed += 1
        return GpuTensor(out, tape.out_shape)
