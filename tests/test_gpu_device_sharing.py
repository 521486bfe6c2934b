"""An application's own wgpu device shared with kjarni: both keep working, kjarni frees only its own."""

from __future__ import annotations

import numpy as np
import pytest

from kjarni.errors import GenerationFailedError, InvalidConfigurationError, UnsuitableDeviceError

pytestmark = pytest.mark.gpu

# The application's own work: y = 2 * x + 1 over 1024 floats.
APP_SHADER = """
@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read_write> y: array<f32>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) id: vec3<u32>) {
    if (id.x < arrayLength(&x)) { y[id.x] = 2.0 * x[id.x] + 1.0; }
}
"""


class App:
    """What an application that renders or computes with wgpu holds: its device, pipeline, buffers."""

    def __init__(self, wgpu_module, device):
        self.wgpu, self.device = wgpu_module, device
        usage = wgpu_module.BufferUsage
        self.x = np.arange(1024, dtype=np.float32)
        self.in_buf = device.create_buffer_with_data(data=self.x, usage=usage.STORAGE)
        self.out_buf = device.create_buffer(size=self.x.nbytes, usage=usage.STORAGE | usage.COPY_SRC)
        module = device.create_shader_module(code=APP_SHADER)
        self.pipeline = device.create_compute_pipeline(layout="auto", compute={"module": module, "entry_point": "main"})
        self.group = device.create_bind_group(
            layout=self.pipeline.get_bind_group_layout(0),
            entries=[{"binding": 0, "resource": {"buffer": self.in_buf}}, {"binding": 1, "resource": {"buffer": self.out_buf}}],
        )

    def compute(self) -> np.ndarray:
        encoder = self.device.create_command_encoder()
        compute = encoder.begin_compute_pass()
        compute.set_pipeline(self.pipeline)
        compute.set_bind_group(0, self.group)
        compute.dispatch_workgroups(1024 // 64)
        compute.end()
        self.device.queue.submit([encoder.finish()])
        return np.frombuffer(self.device.queue.read_buffer(self.out_buf), dtype=np.float32)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from tests.test_api import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-shared"))


def _app_device(wgpu_context):
    """The application's own adapter and device (on the runtime the session runs), asked for
    with what kjarni needs."""
    from kjarni.gpu import device_request

    adapter = _fresh_adapter(wgpu_context)
    return adapter, adapter.request_device_sync(**device_request(adapter))


def _fresh_adapter(wgpu_context):
    """An adapter of the session's runtime that has no device yet (Dawn's adapters make one device
    each: the session context's is taken)."""
    return wgpu_context.runtime.module.gpu.request_adapter_sync(power_preference="high-performance")


def _builder(tiny_dir):
    from kjarni.generator import Generator

    return Generator.builder().model_path(tiny_dir).quiet().greedy().max_tokens(12).with_load_config(lambda c: c.f32())


def test_kjarni_and_the_application_share_one_device(wgpu_context, tiny_dir):
    adapter, device = _app_device(wgpu_context)
    app = App(wgpu_context.runtime.module, device)
    expected = 2 * app.x + 1
    np.testing.assert_array_equal(app.compute(), expected)

    cpu = _builder(tiny_dir).cpu().build()
    prompt = "hello world"
    reference = cpu.generate(prompt)
    first = _builder(tiny_dir).gpu(device=device).build()
    second = _builder(tiny_dir).gpu(device=device, adapter=adapter).build()
    context = first.gpu_context
    assert context.device is device and second.gpu_context.device is device
    assert not context.owns_device and context.adapter_choice == "given by the application"

    assert first.generate(prompt) == reference
    np.testing.assert_array_equal(app.compute(), expected)  # the application's work after kjarni's

    model_bytes = first.decoder.model.ops.weight_bytes
    dispatches = context.stats.dispatches
    first.close()  # frees the first Generator's weights, KV cache and context buffers: nothing else
    first.close()  # idempotent
    assert context.closed and context.stats.dispatches == dispatches and model_bytes > 0
    with pytest.raises(GenerationFailedError, match="is closed"):
        first.generate(prompt)
    np.testing.assert_array_equal(app.compute(), expected)  # the device survived, its buffers too
    assert second.generate(prompt) == reference  # and the other Generator on it
    second.close()
    np.testing.assert_array_equal(app.compute(), expected)
    # The application can still make new things on its device.
    app2 = App(wgpu_context.runtime.module, device)
    np.testing.assert_array_equal(app2.compute(), expected)


def test_closing_frees_exactly_the_generators_own_buffers(wgpu_context, tiny_dir):
    _, device = _app_device(wgpu_context)
    generator = _builder(tiny_dir).gpu(device=device).build()
    generator.generate("abc")
    ops = generator.decoder.model.ops
    context = generator.gpu_context
    caches = list(ops._kv_caches)
    assert ops._weights and caches
    own = [ops._ring.buffer, *(b for c in caches for b in (*c.keys, *c.values))]
    own += [b for w in ops._weights for b in (w.buffer, *(x for s in w.segments for x in (s.w_a, s.w_b)))]
    unique = {id(b): b for b in own if b is not None and b is not context.dummy}
    pooled = context.stats.pooled_bytes
    # Every weight, KV and token-ring buffer, each once; not the context's pool or the dummy binding.
    assert ops.close() == sum(int(b.size) for b in unique.values()) > sum(c.nbytes for c in caches)
    assert context.stats.pooled_bytes == pooled and not context.closed
    context.close()


def test_an_application_device_without_kjarnis_limits_is_refused_up_front(wgpu_context, tiny_dir):
    from kjarni.gpu import WgpuContext

    device = _fresh_adapter(wgpu_context).request_device_sync(
        required_limits={"max-compute-invocations-per-workgroup": 256, "max-compute-workgroup-size-x": 256}
    )
    with pytest.raises(UnsuitableDeviceError) as info:
        WgpuContext(device=device)
    assert "max-compute-invocations-per-workgroup: have 256, need 512" in info.value.missing_limits
    assert "max-compute-workgroup-size-x: have 256, need 512" in info.value.missing_limits
    with pytest.raises(UnsuitableDeviceError, match="max-compute-invocations-per-workgroup"):
        _builder(tiny_dir).gpu(device=device).build()


def test_a_device_and_a_choice_of_adapter_contradict(wgpu_context, tiny_dir):
    _, device = _app_device(wgpu_context)
    with pytest.raises(InvalidConfigurationError, match="pass one or the other"):
        _builder(tiny_dir).gpu(device=device, adapter_index=0)
    other = "dawn" if wgpu_context.runtime.name == "wgpu" else "wgpu"
    from kjarni.gpu import WgpuContext

    with pytest.raises(InvalidConfigurationError, match="drop runtime"):
        WgpuContext(device=device, runtime=other)


def test_a_generator_closes_the_context_it_made_but_not_one_given_with_context(wgpu_context, tiny_dir):
    from kjarni.gpu import WgpuContext

    own = _builder(tiny_dir).gpu().build()
    own.generate("abc")
    own.close()
    assert own.gpu_context.closed
    shared = WgpuContext()
    a = _builder(tiny_dir).with_context(shared).build()
    b = _builder(tiny_dir).with_context(shared).build()
    reference = b.generate("abc")
    a.close()
    assert not shared.closed and b.generate("abc") == reference
    b.close()
    shared.close()
