"""Chat templates: a model's own Jinja template, rendered in a sandbox, tokenized safely.

    template = ChatTemplate.for_model(loaded, model_name)       # tokenizer.chat_template / tokenizer_config.json
    text = template.render(messages)                            # what transformers' apply_chat_template gives
    ids = template.encode(tokenizer, messages)                  # the same text as token ids
    template.end_of_turn                                        # "<|im_end|>": generation stops there

Templates are untrusted input (they come with downloaded model files), so they run in jinja2's
``ImmutableSandboxedEnvironment`` with the globals transformers gives them (``raise_exception``,
``strftime_now``, a ``tojson`` that keeps non-ASCII), a budget on ``range`` and on string or list
repetition, and every failure turned into a ``ChatTemplateError`` naming the model.

Special tokens: the template's own control tokens (``<|im_start|>``) become their single ids, while
the same text inside a message stays plain text, so a user cannot inject a control token through
content. ``encode`` does it by rendering with every special-token text in user data replaced by a
private placeholder, splitting the rendered text on the special tokens the template wrote, and
putting the placeholders' text back, as plain text, into the pieces between them.
"""

from __future__ import annotations

import datetime
import json
import re
from pathlib import Path
from typing import Any, Iterable, Sequence

from kjarni.errors import ChatTemplateError, InvalidConfigurationError

ROLES = ("system", "user", "assistant", "tool")

# Budgets of one render: enough for any real template (they loop over messages and tools), far
# below what would hang a server. A template that needs more is refused with ChatTemplateError.
MAX_RANGE_ITEMS = 100_000
MAX_REPEAT_LENGTH = 1_000_000

# Private-use characters (plane 15) mark placeholders; encode() picks a pair absent from its input.
_PLACEHOLDER_BASE = 0xF0000


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Messages checked and copied: a list of ``{"role", "content"}`` dicts, content a str or a
    list of ``{"type": "text", "text": ...}`` parts (joined into one string).

    An assistant message may carry ``tool_calls`` instead of content; other keys (``name``,
    ``tool_call_id``) are passed to the template untouched. ``InvalidConfigurationError`` names the
    first bad message and what is wrong with it.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise InvalidConfigurationError(
            f"messages must be a list of {{'role': ..., 'content': ...}} dicts, got {type(messages).__name__}"
        )
    if not messages:
        raise InvalidConfigurationError("messages is empty; pass at least one {'role': 'user', 'content': ...} message")
    out = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise InvalidConfigurationError(f"{where} must be a dict with 'role' and 'content', got {type(message).__name__}")
        role = message.get("role")
        if role not in ROLES:
            raise InvalidConfigurationError(f"{where}['role'] is {role!r}; it must be one of: {', '.join(ROLES)}")
        content = message.get("content")
        if content is None and role == "assistant" and message.get("tool_calls"):
            content = ""
        out.append({**message, "content": _content_text(content, where)})
    return out


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for k, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidConfigurationError(
                    f"{where}['content'][{k}] must be {{'type': 'text', 'text': str}} (only text parts are "
                    f"supported), got {part!r:.80}"
                )
            texts.append(part["text"])
        return "".join(texts)
    raise InvalidConfigurationError(
        f"{where}['content'] must be a str or a list of text parts, got {type(content).__name__}"
    )


def _sandbox() -> Any:
    """The jinja2 environment templates render in (built once per template)."""
    try:
        import jinja2
        from jinja2.exceptions import SecurityError
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as error:  # a dependency of kjarni; only a broken install lacks it
        raise ChatTemplateError(f"chat templates need jinja2 ({error}); pip install jinja2") from None

    class Sandbox(ImmutableSandboxedEnvironment):
        # "*" and "**" are checked so "x" * 10**9 cannot exhaust memory.
        intercepted_binops = frozenset({"*", "**"})

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            if operator == "**" and isinstance(right, int) and abs(right) > 64:
                raise SecurityError(f"the exponent {right} is larger than templates may use")
            if operator == "*":
                for seq, times in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(times, int) and len(seq) * times > MAX_REPEAT_LENGTH:
                        raise SecurityError(f"repeating a sequence to {len(seq) * times} items is more than templates may")
            return super().call_binop(context, operator, left, right)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        # transformers' tojson: no HTML escaping, non-ASCII kept.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.datetime.now().strftime(fmt)

    env = Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


class ChatTemplate:
    """One model's chat template, compiled once in the sandbox.

    ``render`` gives the prompt text; ``encode`` its token ids with special tokens handled safely;
    ``end_of_turn`` is the special token the template closes an assistant turn with (``None`` when
    it cannot be found, in which case generation stops at EOS only).
    """

    def __init__(self, source: str, *, model_name: str, special_tokens: dict[str, int],
                 bos_token: str | None = None, eos_token: str | None = None, origin: str = "") -> None:
        if not isinstance(source, str) or not source.strip():
            raise InvalidConfigurationError(f"the chat template for {model_name} must be a non-empty str")
        self.source = source
        self.model_name = model_name
        self.origin = origin or "the chat template"
        self._special_tokens = special_tokens
        # Longest first, as the tokenizer matches them (llama.cpp's tokenizer_st_partition).
        needles = sorted((t for t in special_tokens if t), key=len, reverse=True)
        self._special_pattern = re.compile("|".join(map(re.escape, needles))) if needles else None
        self._defaults = {"bos_token": bos_token or "", "eos_token": eos_token or ""}
        try:
            self._template = _sandbox().from_string(source)
        except ChatTemplateError:
            raise
        except Exception as error:  # noqa: BLE001 - jinja2 syntax errors and anything else
            raise ChatTemplateError(
                f"{self.origin} of {model_name} does not compile: {type(error).__name__}: {error}; pass a working "
                "one with Generator.builder(...).chat_template(TEXT)"
            ) from error
        self.end_of_turn = self._find_end_of_turn()

    @classmethod
    def for_model(cls, loaded: Any, model_name: str, override: str | None = None) -> ChatTemplate:
        """The template of a loaded model (``kjarni.loader.LoadedModel``), or ``override`` when given.

        Read from ``tokenizer.chat_template`` in a GGUF file, or from ``chat_template`` in
        ``tokenizer_config.json`` (or ``chat_template.jinja``) of a safetensors folder.
        """
        tokenizer = loaded.tokenizer
        if override is not None:
            source, origin = override, "the chat template given to the builder"
        else:
            source, origin = _read_template(Path(loaded.path)), f"the chat template in {loaded.path}"
            if source is None:
                raise ChatTemplateError(
                    f"{model_name} has no chat template ({loaded.path} has no tokenizer.chat_template / "
                    "chat_template), so it cannot chat; give one with Generator.builder(...).chat_template(TEXT), "
                    "or use generate() with a prompt you format yourself"
                )
        specials = {tokenizer.token_text(i): i for i in range(tokenizer.vocab_size) if tokenizer.is_special(i)}
        bos = tokenizer.token_text(tokenizer.bos_token_id) if tokenizer.bos_token_id is not None else None
        eos_ids = list(getattr(loaded.config, "eos_token_id", None) or []) or sorted(tokenizer.eos_token_ids)
        eos = tokenizer.token_text(eos_ids[0]) if eos_ids and 0 <= eos_ids[0] < tokenizer.vocab_size else None
        return cls(source, model_name=model_name, special_tokens=specials, bos_token=bos, eos_token=eos, origin=origin)

    @property
    def end_of_turn_id(self) -> int | None:
        """The token id of ``end_of_turn``, or ``None``."""
        return None if self.end_of_turn is None else self._special_tokens[self.end_of_turn]

    def render(self, messages: Any, *, add_generation_prompt: bool = True, tools: list[dict] | None = None,
               **template_vars: Any) -> str:
        """The template applied to ``messages`` (checked with ``normalize_messages``)."""
        return self._render(normalize_messages(messages), add_generation_prompt, tools, template_vars)

    def encode(self, tokenizer: Any, messages: Any, *, add_generation_prompt: bool = True,
               tools: list[dict] | None = None, **template_vars: Any) -> list[int]:
        """Token ids of ``render(...)``: special tokens the template wrote become their ids; the same
        text inside messages, tools or template variables is tokenized as plain text.

        A BOS token is prepended when the tokenizer adds one and the template did not write it.
        """
        messages = normalize_messages(messages)
        user_data = [messages, tools, template_vars]
        open_mark, close_mark = _free_marks(self.source, user_data)
        escaped: list[str] = []  # placeholder k stands for the special text escaped[k]

        def escape(text: str) -> str:
            if self._special_pattern is None:
                return text

            def mark(match: re.Match[str]) -> str:
                escaped.append(match.group(0))
                return f"{open_mark}{len(escaped) - 1}{close_mark}"

            return self._special_pattern.sub(mark, text)

        rendered = self._render(_map_strings(messages, escape), add_generation_prompt,
                                _map_strings(tools, escape), _map_strings(template_vars, escape))
        placeholder = re.compile(f"{re.escape(open_mark)}(\\d+){re.escape(close_mark)}")

        def plain(text: str) -> list[int]:
            text = placeholder.sub(lambda m: escaped[int(m.group(1))], text)
            return list(tokenizer.encode(text, add_bos=False, parse_special=False)) if text else []

        ids: list[int] = []
        start = 0
        for match in self._special_pattern.finditer(rendered) if self._special_pattern is not None else ():
            ids += plain(rendered[start:match.start()])
            ids.append(self._special_tokens[match.group(0)])
            start = match.end()
        ids += plain(rendered[start:])
        bos = tokenizer.bos_token_id
        if tokenizer.add_bos and bos is not None and ids[:1] != [bos]:
            ids.insert(0, bos)
        return ids

    def _render(self, messages: list[dict], add_generation_prompt: bool, tools: Any, template_vars: dict) -> str:
        budget = [MAX_RANGE_ITEMS]

        def budgeted_range(*args: int) -> range:
            items = range(*args)
            budget[0] -= len(items)
            if budget[0] < 0:
                raise OverflowError(f"the template asked range() for more than {MAX_RANGE_ITEMS} items in all")
            return items

        variables = {**self._defaults, **template_vars, "messages": messages,
                     "add_generation_prompt": bool(add_generation_prompt), "range": budgeted_range}
        if tools is not None:
            variables["tools"] = tools
        try:
            return self._template.render(**variables)
        except Exception as error:  # noqa: BLE001 - raise_exception, SecurityError, RecursionError, anything
            raise ChatTemplateError(
                f"{self.origin} of {self.model_name} failed on these messages: {type(error).__name__}: {error}"
            ) from error

    def _find_end_of_turn(self) -> str | None:
        """The special token right after an assistant message's content, found by rendering one."""
        sentinel = "\uf8ffkjarni-end-of-turn\uf8ff"
        conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": sentinel}]
        try:
            rendered = self._render(conversation, False, None, {})
        except ChatTemplateError:
            return None
        at = rendered.find(sentinel)
        if at < 0 or self._special_pattern is None:
            return None
        after = rendered[at + len(sentinel):]
        match = self._special_pattern.search(after)
        if match is None or after[:match.start()].strip():
            return None
        return match.group(0)


def _read_template(path: Path) -> str | None:
    """The chat template stored with a model file or folder, or ``None``."""
    from kjarni.tokenizer import _read_gguf_metadata

    if path.is_file() and path.suffix == ".gguf":
        value = _read_gguf_metadata(path, ["tokenizer.chat_template"]).get("tokenizer.chat_template")
        return value if isinstance(value, str) and value.strip() else None
    folder = path if path.is_dir() else path.parent
    config_file = folder / "tokenizer_config.json"
    if config_file.is_file():
        try:
            value = json.loads(config_file.read_text(encoding="utf-8")).get("chat_template")
        except (OSError, ValueError, AttributeError):
            value = None
        if isinstance(value, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
            named = {item.get("name"): item.get("template") for item in value if isinstance(item, dict)}
            value = named.get("default")
        if isinstance(value, str) and value.strip():
            return value
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    return None


def _strings(value: Any) -> Iterable[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _strings(key)
            yield from _strings(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _strings(item)


def _map_strings(value: Any, change: Any) -> Any:
    """``value`` with ``change`` applied to every string inside it (dicts, lists, tuples)."""
    if isinstance(value, str):
        return change(value)
    if isinstance(value, dict):
        return {key: _map_strings(item, change) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_map_strings(item, change) for item in value)
    return value


def _free_marks(source: str, user_data: Any) -> tuple[str, str]:
    """Two private-use characters that appear neither in the template nor in any user string."""
    used = set(source)
    for text in _strings(user_data):
        used.update(text)
    free = (chr(code) for code in range(_PLACEHOLDER_BASE, _PLACEHOLDER_BASE + 65534) if chr(code) not in used)
    return next(free), next(free)

