"""The OpenAI wire format: request bodies checked into ``CompletionRequest``, responses and chunks built.

Only what the OpenAI API defines and kjarni can honour is accepted; a field kjarni cannot honour
(``n`` > 1, ``logprobs``, ``tools``, penalties, ``logit_bias``, ...) is refused with a 400 naming it
rather than silently ignored. Fields that do not change the output (``user``, ``metadata``,
``store``) are accepted and ignored, as are fields OpenAI does not define.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass
from typing import Any

from kjarni.chat import normalize_messages
from kjarni.errors import InvalidConfigurationError

# finish_reason in kjarni -> OpenAI's.
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}


class ApiError(Exception):
    """An error answered as OpenAI does: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",  # noqa: A002 - OpenAI's name
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


@dataclass(frozen=True)
class CompletionRequest:
    """One checked request of either endpoint: ``prompt`` (completions) or ``messages`` (chat)."""

    model: str
    prompt: str | None
    messages: list[dict] | None
    settings: dict[str, Any]  # GenerationOverrides fields the client set
    stream: bool
    include_usage: bool
    echo: bool = False

    @property
    def chat(self) -> bool:
        return self.messages is not None


# Fields refused unless they have the value that means "off".
_OFF_VALUES: dict[str, tuple[Any, ...]] = {
    "n": (None, 1), "best_of": (None, 1), "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}), "logprobs": (None, False, 0), "top_logprobs": (None, 0), "suffix": (None, ""),
    "tools": (None, []), "functions": (None, []), "tool_choice": (None, "none", "auto"), "audio": (None,),
    "modalities": (None, ["text"]), "prediction": (None,),
}
_WHY = {
    "n": "one choice per request is supported (n=1)",
    "best_of": "best_of=1 only",
    "logprobs": "this server does not return log-probabilities yet",
    "top_logprobs": "this server does not return log-probabilities yet",
    "tools": "tool calling is not supported",
    "functions": "function calling is not supported",
}


def parse_request(body: Any, *, chat: bool, served_model: str) -> CompletionRequest:
    """Check a decoded JSON body of ``/v1/chat/completions`` (``chat``) or ``/v1/completions``."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("'model' is required: the name from GET /v1/models", "model")
    if model != served_model:
        raise bad(f"the model {model!r} does not exist here; this server serves {served_model!r}", "model", "model_not_found")
    for field, allowed in _OFF_VALUES.items():
        if field in body and body[field] not in allowed:
            why = _WHY.get(field, "kjarni does not support it")
            raise bad(f"{field}={body[field]!r} is not supported: {why}", field, "unsupported_parameter")
    response_format = body.get("response_format")
    if response_format is not None and (not isinstance(response_format, dict) or response_format.get("type") != "text"):
        raise bad("response_format other than {'type': 'text'} is not supported", "response_format", "unsupported_parameter")

    prompt = messages = None
    if chat:
        if "messages" not in body:
            raise bad("'messages' is required: a list of {'role', 'content'} objects", "messages")
        try:
            messages = normalize_messages(body["messages"])
        except InvalidConfigurationError as error:
            raise bad(str(error), "messages") from None
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise bad("'prompt' must be a string (one prompt per request; token-id prompts are not supported)", "prompt")

    settings: dict[str, Any] = {}
    max_tokens = body.get("max_completion_tokens") if chat and body.get("max_completion_tokens") is not None else body.get("max_tokens")
    if max_tokens is not None:
        name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
        settings["max_tokens"] = _integer(max_tokens, name, minimum=1)
    if body.get("temperature") is not None:
        settings["temperature"] = _number(body["temperature"], "temperature", 0.0, 2.0)
    if body.get("top_p") is not None:
        top_p = _number(body["top_p"], "top_p", 0.0, 1.0)
        if top_p == 0.0:
            raise bad("top_p=0 keeps no token; pass a value in (0, 1]", "top_p")
        settings["top_p"] = top_p
    if body.get("seed") is not None:
        settings["seed"] = _integer(body["seed"], "seed", minimum=0)
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
            raise bad("'stop' must be a non-empty string or a list of up to 4 non-empty strings", "stop")
        if stops:
            settings["stop"] = tuple(stops)
    stream = body.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise bad("'stream' must be true or false", "stream")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or not stream):
        raise bad("'stream_options' is an object and only allowed with stream: true", "stream_options")
    echo = body.get("echo", False)
    if chat and "echo" in body:
        raise bad("'echo' is a /v1/completions field", "echo")
    if not isinstance(echo, bool):
        raise bad("'echo' must be true or false", "echo")
    return CompletionRequest(
        model=model, prompt=prompt, messages=messages, settings=settings, stream=bool(stream),
        include_usage=bool((options or {}).get("include_usage", False)), echo=echo,
    )


def _integer(value: Any, name: str, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise bad(f"{name}={value!r} must be an integer >= {minimum}", name)
    return value


def _number(value: Any, name: str, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not low <= value <= high:
        raise bad(f"{name}={value!r} must be a number in [{low:g}, {high:g}]", name)
    return float(value)


# ---------------------------------------------------------------- responses


def new_id(chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion(request: CompletionRequest, response_id: str, text: str, finish_reason: str | None,
               prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """The whole (non-streamed) response body."""
    reason = FINISH_REASONS.get(finish_reason or "", "stop")
    if request.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": reason}
        kind = "chat.completion"
    else:
        choice = {"index": 0, "text": (request.prompt or "") + text if request.echo else text, "logprobs": None,
                  "finish_reason": reason}
        kind = "text_completion"
    return {"id": response_id, "object": kind, "created": int(time.time()), "model": request.model,
            "choices": [choice], "usage": usage(prompt_tokens, completion_tokens)}


def chunk(request: CompletionRequest, response_id: str, *, text: str | None = None, role: bool = False,
          finish_reason: str | None = None) -> dict[str, Any]:
    """One streamed chunk: a text delta, the opening role delta (chat), or the final one with its reason."""
    reason = FINISH_REASONS.get(finish_reason, "stop") if finish_reason is not None else None
    if request.chat:
        delta: dict[str, Any] = {}
        if role:
            delta = {"role": "assistant", "content": ""}
        elif text is not None:
            delta = {"content": text}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
        kind = "text_completion"
    body = {"id": response_id, "object": kind, "created": int(time.time()), "model": request.model, "choices": [choice]}
    if request.include_usage:
        body["usage"] = None
    return body


def usage_chunk(request: CompletionRequest, response_id: str, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """The last chunk with ``stream_options.include_usage``: no choices, the usage."""
    kind = "chat.completion.chunk" if request.chat else "text_completion"
    return {"id": response_id, "object": kind, "created": int(time.time()), "model": request.model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens)}
