"""The ASGI app: OpenAI's HTTP API on Starlette, streamed with sse-starlette.

    GET  /health                 {"status": "ok"} (503 {"status": "loading"} until the model is loaded)
    GET  /v1/models              the one model served
    GET  /v1/models/{id}
    POST /v1/completions         prompt -> text
    POST /v1/chat/completions    messages -> the assistant's answer, through the chat template

Every error is OpenAI-shaped JSON (``protocol.ApiError``). With ``api_key`` every request but
``/health`` needs ``Authorization: Bearer <key>``. Bodies larger than ``max_body_bytes`` get 413.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from typing import Any, Callable

from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kjarni.errors import KjarniError
from kjarni.serve import protocol
from kjarni.serve.engine import Engine, Finished
from kjarni.serve.protocol import ApiError

DEFAULT_MAX_BODY_BYTES = 4 * 2**20
DEFAULT_MAX_QUEUE = 64


def create_app(
    generator: Any = None,
    *,
    load: Callable[[], Any] | None = None,
    api_key: str | None = None,
    max_queue: int = DEFAULT_MAX_QUEUE,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    replica: str | None = None,
) -> Starlette:
    """The server app for ``generator``, or for what ``load()`` returns (called in a thread at startup;
    requests get 503 until it has returned). ``app.state.kjarni["engine"]`` is the ``Engine`` once
    loaded. ``replica`` names this process in an ``x-kjarni-replica`` header on every response
    (Ray Serve sets it, so clients can tell replicas apart)."""
    if (generator is None) == (load is None):
        raise ValueError("create_app takes a generator or a load function, one of them")
    state: dict[str, Any] = {"engine": Engine(generator, max_queue=max_queue) if generator is not None else None,
                             "error": None, "created": int(time.time())}

    def engine() -> Engine:
        if state["engine"] is None:
            detail = f" (loading failed: {state['error']})" if state["error"] else ""
            raise ApiError(503, f"the model is still loading{detail}; retry shortly", type="server_error",
                           code="model_loading")
        return state["engine"]

    def check_key(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if given != f"Bearer {api_key}":
            raise ApiError(401, "a valid API key is needed: send 'Authorization: Bearer <key>'",
                           type="invalid_request_error", code="invalid_api_key")

    async def read_json(request: Request) -> Any:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
            raise ApiError(413, f"the request body is {declared} bytes; the limit is {max_body_bytes}",
                           code="request_too_large")
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > max_body_bytes:
                raise ApiError(413, f"the request body is over the limit of {max_body_bytes} bytes",
                               code="request_too_large")
        try:
            return json.loads(body)
        except ValueError as error:
            raise protocol.bad(f"the request body is not valid JSON: {error}") from None

    async def health(request: Request) -> Response:
        if state["engine"] is None:
            return JSONResponse({"status": "loading", "error": state["error"]}, status_code=503)
        current = state["engine"]
        return JSONResponse({"status": "ok", "model": current.model_name, "queued": current.admitted,
                             "served": current.served})

    def model_card(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": state["created"], "owned_by": "kjarni"}

    async def models(request: Request) -> Response:
        check_key(request)
        return JSONResponse({"object": "list", "data": [model_card(engine().model_name)]})

    async def model(request: Request) -> Response:
        check_key(request)
        name = request.path_params["model"]
        if name != engine().model_name:
            raise ApiError(404, f"the model {name!r} does not exist here", code="model_not_found", param="model")
        return JSONResponse(model_card(name))

    async def completions(request: Request) -> Response:
        return await answer(request, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await answer(request, chat=True)

    async def answer(request: Request, *, chat: bool) -> Response:
        check_key(request)
        current = engine()
        parsed = protocol.parse_request(await read_json(request), chat=chat, served_model=current.model_name)
        ticket = current.admit()
        try:
            stream = current.open(parsed)
        except BaseException:
            ticket.release()
            raise
        response_id = protocol.new_id(chat)
        if parsed.stream:
            return _event_stream(current, parsed, stream, ticket, response_id)
        try:
            finished = Finished()
            text = await _until_disconnected(request, _collect(current.run(stream, finished, ticket)))
        finally:
            ticket.release()
        return JSONResponse(protocol.completion(parsed, response_id, text, finished.finish_reason,
                                                finished.prompt_tokens, finished.completion_tokens))

    def load_in_background() -> None:
        try:
            state["engine"] = Engine(load(), max_queue=max_queue)
        except KjarniError as error:
            state["error"] = " ".join(str(error).split())
        except Exception as error:  # noqa: BLE001 - reported on /health and in 503s, the server stays up
            state["error"] = f"{type(error).__name__}: {error}"

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):  # noqa: ANN202
        if load is not None:
            threading.Thread(target=load_in_background, name="kjarni-serve-load", daemon=True).start()
        yield

    async def api_error(request: Request, error: ApiError) -> Response:
        return JSONResponse(error.body(), status_code=error.status)

    async def http_error(request: Request, error: HTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code)
        message = f"{request.method} {request.url.path}: {error.detail}"
        return JSONResponse(ApiError(error.status_code, message, code=code).body(), status_code=error.status_code)

    async def internal_error(request: Request, error: Exception) -> Response:
        body = ApiError(500, f"internal error: {type(error).__name__}: {error}", type="server_error").body()
        return JSONResponse(body, status_code=500)

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", model, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    ]
    middleware = [Middleware(_ReplicaHeader, replica=replica)] if replica is not None else []
    app = Starlette(
        routes=routes, lifespan=lifespan, middleware=middleware,
        exception_handlers={ApiError: api_error, HTTPException: http_error, Exception: internal_error},
    )
    app.state.kjarni = state
    return app


class _ReplicaHeader:
    """ASGI middleware adding ``x-kjarni-replica`` to every response (streamed ones included)."""

    def __init__(self, app: Any, replica: str) -> None:
        self.app = app
        self.header = (b"x-kjarni-replica", replica.encode())

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def send_with_header(message: Any) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, send_with_header if scope["type"] == "http" else send)


async def _collect(pieces: Any) -> str:
    return "".join([piece async for piece in pieces])


async def _until_disconnected(request: Request, work: Any) -> Any:
    """Await ``work``; cancel it if the client disconnects first (its generation stops then)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return ""  # nobody is listening any more
    return task.result()


def _event_stream(engine: Engine, request: protocol.CompletionRequest, stream: Any, ticket: Any, response_id: str) -> Response:
    from sse_starlette.sse import EventSourceResponse

    async def events() -> Any:
        finished = Finished()
        try:
            if request.chat:
                yield {"data": json.dumps(protocol.chunk(request, response_id, role=True))}
            elif request.echo and request.prompt:
                yield {"data": json.dumps(protocol.chunk(request, response_id, text=request.prompt))}
            async for piece in engine.run(stream, finished, ticket):
                yield {"data": json.dumps(protocol.chunk(request, response_id, text=piece), ensure_ascii=False)}
            yield {"data": json.dumps(protocol.chunk(request, response_id, finish_reason=finished.finish_reason or "stop"))}
            if request.include_usage:
                body = protocol.usage_chunk(request, response_id, finished.prompt_tokens, finished.completion_tokens)
                yield {"data": json.dumps(body)}
            yield {"data": "[DONE]"}
        except KjarniError as error:  # mid-stream: the status is sent already, so an error event
            yield {"data": json.dumps(ApiError(500, str(error), type="server_error").body())}
        finally:
            ticket.release()

    return EventSourceResponse(events(), background=BackgroundTask(ticket.release), ping=15)
