"""`kjarni.serve.ray`: two CPU replicas of a tiny model on a local Ray instance answer 16 requests (slow).

Ray is not in the test extra (a large install and a slow start for CI); without it this skips.
"""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="Ray Serve is not installed (pip install -e '.[ray]')")
serve = pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")

from kjarni.generator import GenerationOverrides, Generator  # noqa: E402
from kjarni.serve.ray import deployment  # noqa: E402
from tests.test_api import make_tiny_model  # noqa: E402


@pytest.mark.slow
def test_two_ray_replicas_share_sixteen_requests(tmp_path: Path) -> None:
    tiny = make_tiny_model(tmp_path / "tiny-ray")
    reference = Generator.builder().model_path(tiny).cpu().quiet().build()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=100 * 2**20, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(deployment(model_path=str(tiny), device="cpu", replicas=2,
                             ray_actor_options={"num_cpus": 1}), name="kjarni-test")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=300)

        def ask(i: int) -> tuple[str, str]:
            raw = client.completions.with_raw_response.create(model=tiny.name, prompt=f"Request {i}:", max_tokens=6, seed=i)
            return raw.headers["x-kjarni-replica"], raw.parse().choices[0].text

        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(ask, range(16)))
    finally:
        serve.shutdown()
        ray.shutdown()
    served = {tag: sum(1 for t, _ in answers if t == tag) for tag, _ in answers}
    print(f"requests per replica: {served}")
    assert len(served) == 2, f"one replica answered everything: {served}"
    expected = [reference.generate_with_config(f"Request {i}:", GenerationOverrides(max_tokens=6, seed=i)) for i in range(16)]
    assert [text for _, text in answers] == expected
