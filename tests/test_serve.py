"""`kjarni serve`: a real uvicorn server on 127.0.0.1 driven with the official `openai` client."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

openai = pytest.importorskip("openai", reason="the serve tests need the openai client (pip install -e '.[test]')")
httpx = pytest.importorskip("httpx")
pytest.importorskip("sse_starlette", reason="the server needs the serve extra (pip install -e '.[serve]')")

from kjarni.generator import GenerationOverrides, Generator  # noqa: E402
from kjarni.serve import create_app  # noqa: E402
from tests.real_models import SMOLLM2, real_model_path  # noqa: E402
from tests.serve_fixtures import make_endless_model, running_server  # noqa: E402
from tests.test_api import make_tiny_model  # noqa: E402

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("serve-tiny"))


def build(folder: Path) -> Generator:
    return Generator.builder().model_path(folder).cpu().max_tokens(12).prefix_cache(True).quiet().build()


@pytest.fixture(scope="module")
def reference(tiny_dir: Path) -> Generator:
    """A second Generator on the same files: what the server's answers must equal."""
    return build(tiny_dir)


@pytest.fixture(scope="module")
def server(tiny_dir: Path):  # noqa: ANN201
    app = create_app(build(tiny_dir), max_queue=16, max_body_bytes=64 * 1024)
    with running_server(app) as url:
        yield url, app


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:  # noqa: ANN001
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def name(tiny_dir: Path) -> str:
    return tiny_dir.name


def test_models_lists_the_served_model(client: openai.OpenAI, name: str, server) -> None:  # noqa: ANN001
    assert [m.id for m in client.models.list().data] == [name]
    assert client.models.retrieve(name).id == name
    assert httpx.get(f"{server[0]}/health").json()["status"] == "ok"


def test_completion_equals_generate(client: openai.OpenAI, reference: Generator, name: str) -> None:
    result = client.completions.create(model=name, prompt="Once upon a time", max_tokens=7, seed=3, temperature=0.8)
    expected = reference.generate_with_config("Once upon a time", GenerationOverrides(max_tokens=7, seed=3, temperature=0.8))
    stats = reference.last_stats
    assert result.choices[0].text == expected
    assert result.choices[0].finish_reason == {"eos": "stop", "length": "length"}[stats.finish_reason]
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (stats.prompt_tokens, stats.generated_tokens)
    assert result.usage.total_tokens == stats.prompt_tokens + stats.generated_tokens


def test_chat_completion_equals_chat(client: openai.OpenAI, reference: Generator, name: str) -> None:
    result = client.chat.completions.create(model=name, messages=QUESTION, max_completion_tokens=6, seed=5)
    assert result.choices[0].message.role == "assistant"
    assert result.choices[0].message.content == reference.chat(QUESTION, max_tokens=6, seed=5)
    assert result.usage.prompt_tokens == reference.last_stats.prompt_tokens
    assert result.object == "chat.completion" and result.id.startswith("chatcmpl-")


def test_streamed_deltas_equal_the_whole_answer(client: openai.OpenAI, name: str) -> None:
    whole = client.chat.completions.create(model=name, messages=QUESTION, max_tokens=10, seed=11)
    chunks = list(client.chat.completions.create(model=name, messages=QUESTION, max_tokens=10, seed=11, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens

    plain = client.completions.create(model=name, prompt="Hello", max_tokens=9, seed=2)
    pieces = list(client.completions.create(model=name, prompt="Hello", max_tokens=9, seed=2, stream=True))
    assert "".join(p.choices[0].text for p in pieces) == plain.choices[0].text
    assert pieces[-1].choices[0].finish_reason == plain.choices[0].finish_reason


def test_the_stream_ends_with_done(server, name: str) -> None:  # noqa: ANN001
    body = {"model": name, "prompt": "Hi", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{server[0]}/v1/completions", json=body, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        data = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]" and all(json.loads(d)["object"] == "text_completion" for d in data[:-1])


def test_stop_strings_end_the_text_before_them(client: openai.OpenAI, reference: Generator, name: str) -> None:
    full = reference.generate_with_config("The", GenerationOverrides(max_tokens=12, temperature=0.0))
    stop = full[4:6]
    assert stop.strip(), f"pick another stop: {full!r}"
    for value in (stop, [stop, "never appears"]):
        result = client.completions.create(model=name, prompt="The", max_tokens=12, temperature=0, stop=value)
        assert result.choices[0].text == full[:full.index(stop)]
        assert result.choices[0].finish_reason == "stop"


def test_greedy_and_echo(client: openai.OpenAI, reference: Generator, name: str) -> None:
    result = client.completions.create(model=name, prompt="Echo", max_tokens=4, temperature=0, echo=True)
    assert result.choices[0].text == "Echo" + reference.generate_with_config("Echo", GenerationOverrides(max_tokens=4, temperature=0.0))


@pytest.mark.parametrize(
    ("call", "param", "code"),
    [
        (lambda c, n: c.completions.create(model="gpt-4", prompt="x"), "model", "model_not_found"),
        (lambda c, n: c.completions.create(model=n, prompt="x", n=2), "n", "unsupported_parameter"),
        (lambda c, n: c.completions.create(model=n, prompt="x", temperature=5), "temperature", None),
        (lambda c, n: c.completions.create(model=n, prompt="x", max_tokens=0), "max_tokens", None),
        (lambda c, n: c.completions.create(model=n, prompt="x", top_p=0), "top_p", None),
        (lambda c, n: c.completions.create(model=n, prompt="x", stop=[""]), "stop", None),
        (lambda c, n: c.completions.create(model=n, prompt="x", seed=-1), "seed", None),
        (lambda c, n: c.completions.create(model=n, prompt="word " * 400), "prompt", "context_length_exceeded"),
        (lambda c, n: c.completions.create(model=n, prompt=[1, 2, 3]), "prompt", None),
        (lambda c, n: c.chat.completions.create(model=n, messages=[{"role": "wizard", "content": "x"}]), "messages", None),
        (lambda c, n: c.chat.completions.create(model=n, messages=[]), "messages", None),
        (lambda c, n: c.chat.completions.create(model=n, messages=QUESTION, logprobs=True), "logprobs", "unsupported_parameter"),
        (lambda c, n: c.chat.completions.create(model=n, messages=QUESTION, presence_penalty=1), "presence_penalty", "unsupported_parameter"),
        (lambda c, n: c.chat.completions.create(
            model=n, messages=QUESTION, tools=[{"type": "function", "function": {"name": "f"}}]), "tools", "unsupported_parameter"),
    ],
)
def test_bad_requests_get_openai_shaped_400s(client: openai.OpenAI, name: str, call, param: str, code: str | None) -> None:  # noqa: ANN001
    with pytest.raises(openai.BadRequestError) as caught:
        call(client, name)
    error = caught.value.body
    assert caught.value.status_code == 400
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["code"] == code
    assert error["message"]


def test_malformed_bodies_and_unknown_routes(server, name: str) -> None:  # noqa: ANN001
    url = server[0]
    not_json = httpx.post(f"{url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert not_json.status_code == 400 and "not valid JSON" in not_json.json()["error"]["message"]
    assert httpx.post(f"{url}/v1/completions", json=[1, 2]).status_code == 400
    assert httpx.post(f"{url}/v1/completions", json={"model": name, "prompt": "x", "stream": "yes"}).status_code == 400
    missing = httpx.get(f"{url}/v1/nothing-here")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    assert httpx.get(f"{url}/v1/models/not-this-one").json()["error"]["code"] == "model_not_found"
    assert httpx.get(f"{url}/v1/completions").status_code == 405
    big = httpx.post(f"{url}/v1/completions", json={"model": name, "prompt": "x" * 70_000})
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"


def test_eight_concurrent_streaming_clients_each_get_their_own_answer(client: openai.OpenAI, reference: Generator, name: str) -> None:
    prompts = [f"Story number {i}:" for i in range(8)]

    def stream(i: int) -> str:
        chunks = client.completions.create(model=name, prompt=prompts[i], max_tokens=8, seed=i, stream=True)
        return "".join(c.choices[0].text for c in chunks)

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(stream, range(8)))
    expected = [reference.generate_with_config(p, GenerationOverrides(max_tokens=8, seed=i)) for i, p in enumerate(prompts)]
    assert answers == expected


def test_an_api_key_is_required_when_set(tiny_dir: Path) -> None:
    with running_server(create_app(build(tiny_dir), api_key="sesame")) as url:
        wrong = openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as caught:
            wrong.models.list()
        assert caught.value.body["code"] == "invalid_api_key"
        assert httpx.post(f"{url}/v1/completions", json={}).status_code == 401
        right = openai.OpenAI(base_url=f"{url}/v1", api_key="sesame", max_retries=0)
        assert [m.id for m in right.models.list().data] == [tiny_dir.name]
        assert httpx.get(f"{url}/health").status_code == 200  # for load balancers: no key


def test_503_while_the_model_loads(tiny_dir: Path) -> None:
    release = threading.Event()

    def load() -> Generator:
        release.wait(timeout=300)
        return build(tiny_dir)

    app = create_app(load=load)
    with running_server(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        assert httpx.get(f"{url}/health").status_code == 503
        with pytest.raises(openai.InternalServerError) as caught:
            client.completions.create(model=tiny_dir.name, prompt="x")
        assert caught.value.status_code == 503 and caught.value.body["code"] == "model_loading"
        release.set()
        while app.state.kjarni["engine"] is None:  # the loader thread finishing; then it answers
            threading.Event().wait(0.01)
        assert client.completions.create(model=tiny_dir.name, prompt="x", max_tokens=2).usage.completion_tokens >= 1


@pytest.fixture(scope="module")
def endless_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_endless_model(tmp_path_factory.mktemp("serve-endless") / "endless")


def test_a_disconnect_mid_stream_cancels_within_one_decode_step(endless_dir: Path) -> None:
    generator = Generator.builder().model_path(endless_dir).cpu().greedy().quiet().build()
    app = create_app(generator)
    with running_server(app) as url:
        engine = app.state.kjarni["engine"]
        body = {"model": "endless", "messages": QUESTION, "max_tokens": 6000, "stream": True}
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as response:
            seen = 0
            for line in response.iter_lines():
                seen += line.startswith("data: ") and '"content": "' in line and '"content": ""' not in line
                if seen == 2:  # two letters of the answer arrived: leave, closing the connection
                    break
        assert seen == 2
        assert engine.cancelled.wait(timeout=120), "the server never noticed the disconnect"
        noticed, stopped = engine.cancellations[0]
        assert stopped - noticed <= 1 and stopped < 6000
        # The slot is free: the next request runs to its end.
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        done = client.chat.completions.create(model="endless", messages=QUESTION, max_tokens=5)
        assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 5


def test_a_client_leaving_a_whole_answer_request_cancels_it(endless_dir: Path) -> None:
    import socket

    generator = Generator.builder().model_path(endless_dir).cpu().greedy().quiet().build()
    app = create_app(generator)
    with running_server(app) as url:
        engine = app.state.kjarni["engine"]
        body = json.dumps({"model": "endless", "prompt": "Go", "max_tokens": 6000}).encode()
        host, port = url.removeprefix("http://").split(":")
        request = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                   f"Content-Length: {len(body)}\r\n\r\n").encode() + body
        with socket.create_connection((host, int(port))) as connection:
            connection.sendall(request)
            while not generator._lock.locked():  # until its generation runs (then the client leaves)
                threading.Event().wait(0.005)
        assert engine.cancelled.wait(timeout=120), "the server never noticed the client leave"
        noticed, stopped = engine.cancellations[0]
        assert stopped - noticed <= 1 and stopped < 6000
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        assert client.completions.create(model="endless", prompt="Go", max_tokens=3).usage.completion_tokens == 3


def test_a_full_queue_answers_429(endless_dir: Path) -> None:
    generator = Generator.builder().model_path(endless_dir).cpu().greedy().quiet().build()
    app = create_app(generator, max_queue=0)
    with running_server(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        running = client.chat.completions.create(model="endless", messages=QUESTION, max_tokens=6000, stream=True)
        next(iter(running))  # admitted and streaming
        with pytest.raises(openai.RateLimitError) as caught:
            client.chat.completions.create(model="endless", messages=QUESTION, max_tokens=2)
        assert caught.value.status_code == 429 and caught.value.body["code"] == "queue_full"
        running.close()
        engine = app.state.kjarni["engine"]
        assert engine.cancelled.wait(timeout=120)
        assert client.chat.completions.create(model="endless", messages=QUESTION, max_tokens=2).usage.completion_tokens == 2


@pytest.mark.slow
def test_the_real_model_answers_paris_through_the_server() -> None:
    generator = Generator.builder().model_path(real_model_path(SMOLLM2)).cpu().quiet().build()
    with running_server(create_app(generator)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        name = client.models.list().data[0].id
        answer = client.chat.completions.create(model=name, messages=QUESTION, temperature=0, max_tokens=30)
    assert "Paris" in answer.choices[0].message.content


def test_the_kjarni_serve_command(tiny_dir: Path) -> None:
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as probe:  # a free port for the child (it binds it itself)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    child = subprocess.Popen(
        [sys.executable, "-m", "kjarni", "serve", "--model-path", str(tiny_dir), "--device", "cpu", "--port", str(port),
         "--quiet", "--max-tokens", "3"],
        env={**os.environ, "KJARNI_API_KEY": "from-env"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="from-env", max_retries=0)
        while True:  # until it listens and has loaded the model (the test's own timeout bounds this)
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                assert child.poll() is None, child.communicate()[1]
            threading.Event().wait(0.05)
        result = client.completions.create(model=tiny_dir.name, prompt="Hi")
        assert result.usage.completion_tokens <= 3  # --max-tokens is the requests' default
        child.send_signal(__import__("signal").SIGINT)
        assert child.wait(timeout=60) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_serve_flags_are_checked_before_loading(capsys: pytest.CaptureFixture[str]) -> None:
    from kjarni import cli

    assert cli.main(["serve", "--replicas", "2"]) == 2
    assert "--replicas needs --ray" in capsys.readouterr().err
    assert cli.main(["serve", "--port", "0"]) == 2
