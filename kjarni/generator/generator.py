"""``Generator``: raw text generation from a prompt, with streams (streams.py) and awaitable twins.

One Generator runs one generation at a time: a stream holds the Generator's lock from its
creation until it is exhausted or closed (``close()``, leaving a ``for`` loop over it early,
garbage collection, the exit of the thread that opened it, a cancelled asyncio task). Other
threads wait for it; the thread holding it gets an error instead of a deadlock. The async twins
run the blocking loop in a worker thread that checks for cancellation between tokens.

``Generator.cancel()`` may be called from any thread: every generation started before it ends
before its next decode step, returning what it had with finish reason ``"cancelled"``.

A little over 500 lines because it is one public class: each method of the contract (generate,
stream, chat and their async twins, cancel, close) is short and documented where it is defined,
and splitting the class across modules would hide which methods share the lock.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import weakref
from typing import TYPE_CHECKING, Any, Iterator, Mapping

from kjarni.errors import ContextOverflowError, GenerationFailedError, InvalidConfigurationError
from kjarni.generator.builder import LoadedDraft, PartsBuilder
from kjarni.generator.config import (
    GenerationOverrides,
    KjarniDevice,
    LoadConfig,
    ResolvedGenerationConfig,
    call_changes,
)
from kjarni.generator.streams import AsyncTokenStream, TokenStream, _thread_token, _ThreadToken

if TYPE_CHECKING:
    from kjarni.loader import LoadedModel
    from kjarni.chat import ChatTemplate
    from kjarni.prefix_cache import PrefixCache
    from kjarni.registry import ModelEntry


class Generator:
    """Raw text generator for decoder language models.

    Direct access to text generation, without chat templates, system prompts or conversation
    management. Make one with ``Generator.new(model)`` or ``Generator.builder(model)...build()``.
    """

    def __init__(
        self,
        *,
        loaded: LoadedModel,
        model_name: str,
        entry: ModelEntry | None,
        device: KjarniDevice,
        gpu_context: Any,
        generation_config: ResolvedGenerationConfig,
        context_size: int,
        load_config: LoadConfig,
        draft: LoadedDraft | None = None,
        prefix_cache: PrefixCache | None = None,
        draft_prefix_cache: PrefixCache | None = None,
        chat_template: str | None = None,
        owns_gpu_context: bool = False,
    ) -> None:
        self._loaded = loaded
        self._model_name = model_name
        self._entry = entry
        self._device = device
        self._gpu_context = gpu_context
        self._config = generation_config
        self._context_size = context_size
        self._load_config = load_config
        self._lock = threading.Lock()
        # The thread holding the lock, by a token that dies with the thread (never by thread id,
        # which a new thread may reuse); weak, so the token's death can release an orphaned stream.
        self._owner: weakref.ref[_ThreadToken] | None = None
        self._cancel_epoch = 0  # bumped by cancel(); a stream started under an older one ends
        self._cancel_lock = threading.Lock()
        self._kv_cache: Any = None
        self._draft = draft
        self._draft_kv_cache: Any = None
        self._prefix_cache = prefix_cache
        self._draft_prefix_cache = draft_prefix_cache
        self._chat_template_source = chat_template  # the builder's override, else the model's own
        self._chat_template: ChatTemplate | None = None
        self._owns_gpu_context = owns_gpu_context  # made by the builder (not with_context): close() closes it
        self._closed = False
        self.last_stats: Any = None
        """Statistics of the most recent finished generation (``kjarni.stream.GenerationStats``)."""

    # ------------------------------------------------------------ construction

    @staticmethod
    def builder(model: str | None = None) -> GeneratorBuilder:
        """A builder for custom configuration (``model``: a registry name or a local path)."""
        return GeneratorBuilder(model)

    @classmethod
    def new(cls, model: str | None = None) -> Generator:
        """A Generator for ``model`` with default settings (``None``: the default model)."""
        return cls.builder(model).build()

    @classmethod
    async def anew(cls, model: str | None = None) -> Generator:
        """``new`` in a worker thread, for asyncio code."""
        return await cls.builder(model).abuild()

    # ------------------------------------------------------------ read-only facts

    @property
    def model_type(self) -> str:
        """The architecture, config.json's ``model_type`` (``"llama"``, ``"qwen2"``, ``"mistral"``)."""
        return self._loaded.config.model_type

    @property
    def model_name(self) -> str:
        """The registry name, or the file or folder name of a local model."""
        return self._model_name

    @property
    def device(self) -> KjarniDevice:
        """Where the model runs: ``KjarniDevice.CPU`` or ``KjarniDevice.GPU``."""
        return self._device

    @property
    def context_size(self) -> int:
        """The most tokens (prompt plus generated) one generation can hold."""
        return self._context_size

    @property
    def vocab_size(self) -> int:
        """The number of logits the model produces per token."""
        return self._loaded.config.vocab_size

    @property
    def generation_config(self) -> ResolvedGenerationConfig:
        """The resolved generation settings every call starts from."""
        return self._config

    @property
    def load_config(self) -> LoadConfig:
        """How the model was loaded."""
        return self._load_config

    @property
    def decoder(self) -> LoadedModel:
        """The loaded model: ``config``, ``tokenizer``, ``weights`` and the ``model`` (``DecoderModel``)."""
        return self._loaded

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (``kjarni.tokenizer.Tokenizer``)."""
        return self._loaded.tokenizer

    @property
    def gpu_context(self) -> Any:
        """The ``WgpuContext`` the model runs on, or ``None`` on the CPU."""
        return self._gpu_context

    @property
    def draft_model_name(self) -> str | None:
        """The draft model's name when speculative decoding is on (``builder.draft``), else ``None``."""
        return None if self._draft is None else self._draft.name

    @property
    def draft_device(self) -> KjarniDevice | None:
        """Where the draft model runs, or ``None`` without one."""
        return None if self._draft is None else self._draft.device

    @property
    def num_draft_tokens(self) -> int | None:
        """Tokens the draft proposes per round: ``None`` when kjarni chooses each round's length (the
        default; ``last_stats.draft_length`` reports what it chose), 0 without a draft."""
        return 0 if self._draft is None else self._draft.num_tokens

    @property
    def draft_decoder(self) -> LoadedModel | None:
        """The loaded draft model (like ``decoder``), or ``None`` without one."""
        return None if self._draft is None else self._draft.loaded

    @property
    def prefix_cache(self) -> PrefixCache | None:
        """The model's prefix cache (``capacity``, ``tokens``, ``nbytes``), or ``None`` when it is off.

        Read it freely; to empty it use ``clear_prefix_cache()``, which waits for a running generation.
        """
        return self._prefix_cache

    @property
    def prefix_cache_nbytes(self) -> int:
        """Bytes allocated for the prefix cache: the model's, plus the draft's when there is one (0 when off)."""
        return sum(c.nbytes for c in (self._prefix_cache, self._draft_prefix_cache) if c is not None)

    def clear_prefix_cache(self) -> None:
        """Forget what the prefix cache holds (its memory stays allocated); waits for a running generation."""
        self._acquire()
        try:
            for cache in (self._prefix_cache, self._draft_prefix_cache):
                if cache is not None:
                    cache.clear()
        finally:
            self._release()

    def cancel(self) -> None:
        """Stop every generation started before this call; safe to call from any thread.

        The running generation (blocking, streaming or async) ends before its next decode step:
        ``generate`` returns the text it had, a stream simply ends, and both report finish reason
        ``"cancelled"`` (``last_stats.finish_reason``, ``stream.finish_reason``). Generations
        waiting their turn end as soon as they get it, with no tokens; generations started after
        this call are not affected. A prefill already running is finished first (the first token
        comes out of it). Returns at once; does nothing when no generation is running.
        """
        with self._cancel_lock:
            self._cancel_epoch += 1

    def close(self) -> None:
        """Free this Generator's memory: on the GPU its weights and KV caches (and the draft's), and
        the GPU context when the builder made it (an application's device is never destroyed, and a
        context from ``with_context`` keeps serving its other Generators). Waits for a running
        generation; idempotent; generating afterwards raises ``GenerationFailedError``."""
        if self._closed:
            return
        self._acquire()
        try:
            self._closed = True
            self._kv_cache = self._draft_kv_cache = None
            self._prefix_cache = self._draft_prefix_cache = None
            models = [self._loaded.model] + ([self._draft.loaded.model] if self._draft is not None else [])
            for model in models:
                close = getattr(model.ops, "close", None)  # WgpuOps; the numpy backend has nothing to free
                if close is not None:
                    close()
            if self._owns_gpu_context and self._gpu_context is not None:
                self._gpu_context.close()
        finally:
            self._release()

    def __repr__(self) -> str:
        draft = f", draft={self._draft.name!r}" if self._draft is not None else ""
        prefix = f", prefix_cache={self._prefix_cache.capacity}" if self._prefix_cache is not None else ""
        return (
            f"Generator(model_name={self._model_name!r}, device={self._device.value!r}, "
            f"context_size={self._context_size}{draft}{prefix})"
        )

    # ------------------------------------------------------------ blocking API
    #
    # Every call takes the per-call settings either as a GenerationOverrides (the *_with_config
    # forms) or as keyword arguments (``generate(prompt, max_tokens=64, temperature=0)``), as in
    # llama-cpp-python and mlx-lm; ``config.call_changes`` turns them into the
    # settings the call changes, applied to the resolved config in one step (validated once).

    def generate(self, prompt: str, **settings: Any) -> str:
        """The text generated after ``prompt``.

        Keyword ``settings`` apply to this call only: ``max_tokens``, ``temperature``, ``top_p``,
        ``top_k``, ``min_p``, ``repetition_penalty``, ``seed``, ``stop`` (``None`` leaves one to
        the builder's settings).
        """
        return self.generate_with_config(prompt, None, **settings)

    def generate_with_config(
        self, prompt: str, runtime_overrides: GenerationOverrides | None, **settings: Any
    ) -> str:
        """``generate`` with ``runtime_overrides`` (or keyword ``settings``, not both) for this call only."""
        return "".join(self.stream_text_with_config(prompt, runtime_overrides, **settings))

    def stream(self, prompt: str, **settings: Any) -> TokenStream:
        """An iterator of ``GeneratedToken``; holds this Generator until exhausted or closed.

        Takes the keyword ``settings`` of ``generate``.
        """
        return self.stream_with_config(prompt, None, **settings)

    def stream_with_config(
        self, prompt: str, runtime_overrides: GenerationOverrides | None, **settings: Any
    ) -> TokenStream:
        """``stream`` with ``runtime_overrides`` (or keyword ``settings``, not both) for this call only."""
        prompt_ids, config = self._prepare(prompt, runtime_overrides, settings)
        return TokenStream(self, prompt_ids, config, text_only=False)

    def stream_text(self, prompt: str, **settings: Any) -> TokenStream:
        """An iterator of text pieces whose concatenation is ``generate``'s result (same keyword ``settings``)."""
        return self.stream_text_with_config(prompt, None, **settings)

    def stream_text_with_config(
        self, prompt: str, runtime_overrides: GenerationOverrides | None, **settings: Any
    ) -> TokenStream:
        """``stream_text`` with ``runtime_overrides`` (or keyword ``settings``, not both) for this call only."""
        prompt_ids, config = self._prepare(prompt, runtime_overrides, settings)
        return TokenStream(self, prompt_ids, config, text_only=True)

    # ------------------------------------------------------------ awaitable twins

    async def agenerate(self, prompt: str, **settings: Any) -> str:
        """``generate`` for asyncio: runs in a worker thread; cancelling stops it between tokens."""
        return await self.agenerate_with_config(prompt, None, **settings)

    async def agenerate_with_config(
        self, prompt: str, runtime_overrides: GenerationOverrides | None, **settings: Any
    ) -> str:
        """``generate_with_config`` for asyncio."""
        pieces = []
        async with self.astream_text_with_config(prompt, runtime_overrides, **settings) as stream:
            async for piece in stream:
                pieces.append(piece)
        return "".join(pieces)

    def astream(self, prompt: str, **settings: Any) -> AsyncTokenStream:
        """An async iterator of ``GeneratedToken`` (``async for``; ``await`` also gives it back)."""
        return self.astream_with_config(prompt, None, **settings)

    def astream_with_config(
        self, prompt: str, runtime_overrides: GenerationOverrides | None, **settings: Any
    ) -> AsyncTokenStream:
        """``astream`` with ``runtime_overrides`` (or keyword ``settings``, not both) for this call only."""
        prompt_ids, config = self._prepare(prompt, runtime_overrides, settings)
        return AsyncTokenStream(self, prompt_ids, config, text_only=False)

    def astream_text(self, prompt: str, **settings: Any) -> AsyncTokenStream:
        """An async iterator of text pieces."""
        return self.astream_text_with_config(prompt, None, **settings)

    def astream_text_with_config(
        self, prompt: str, runtime_overrides: GenerationOverrides | None, **settings: Any
    ) -> AsyncTokenStream:
        """``astream_text`` with ``runtime_overrides`` (or keyword ``settings``, not both) for this call only."""
        prompt_ids, config = self._prepare(prompt, runtime_overrides, settings)
        return AsyncTokenStream(self, prompt_ids, config, text_only=True)

    # ------------------------------------------------------------ chat (templates: kjarni/chat.py)

    def apply_chat_template(
        self, messages: list[dict], *, add_generation_prompt: bool = True, tools: list[dict] | None = None,
        **template_vars: Any,
    ) -> str:
        """``messages`` rendered with the model's chat template (transformers' name and semantics).

        ``messages`` is a list of ``{"role", "content"}`` dicts (content a str or a list of
        ``{"type": "text", "text": ...}`` parts); ``add_generation_prompt`` ends the text with the
        opening of an assistant turn. Raises ``ChatTemplateError`` when the model has no template
        (give one with the builder's ``chat_template``) or the template fails.
        """
        return self.chat_template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools, **template_vars)

    @property
    def chat_template(self) -> ChatTemplate:
        """The model's ``kjarni.chat.ChatTemplate`` (the builder's ``chat_template`` when given), loaded on first use."""
        if self._chat_template is None:
            from kjarni.chat import ChatTemplate

            self._chat_template = ChatTemplate.for_model(self._loaded, self._model_name, self._chat_template_source)
        return self._chat_template

    def chat(self, messages: list[dict], overrides: GenerationOverrides | None = None, **settings: Any) -> str:
        """The assistant's answer to ``messages``: ``generate`` on the chat template's rendering.

        ``settings`` are per-call generation settings (``max_tokens=``, ``temperature=``, ... as for
        ``generate``), or pass them as ``overrides``, not both. Generation stops at the
        template's end-of-turn token (``<|im_end|>``) as well as EOS; neither appears in the answer.
        """
        return "".join(self.stream_chat(messages, overrides, **settings))

    def stream_chat(self, messages: list[dict], overrides: GenerationOverrides | None = None, **settings: Any) -> TokenStream:
        """``chat`` as a stream of text pieces (like ``stream_text``)."""
        prompt_ids, config = self._prepare_chat(messages, overrides, settings)
        return TokenStream(self, prompt_ids, config, text_only=True)

    def stream_chat_tokens(
        self, messages: list[dict], overrides: GenerationOverrides | None = None, **settings: Any
    ) -> TokenStream:
        """``chat`` as a stream of ``GeneratedToken`` (like ``stream``)."""
        prompt_ids, config = self._prepare_chat(messages, overrides, settings)
        return TokenStream(self, prompt_ids, config, text_only=False)

    async def achat(self, messages: list[dict], overrides: GenerationOverrides | None = None, **settings: Any) -> str:
        """``chat`` for asyncio: runs in a worker thread; cancelling stops it between tokens."""
        async with self.astream_chat(messages, overrides, **settings) as stream:
            return await stream.text()

    def astream_chat(
        self, messages: list[dict], overrides: GenerationOverrides | None = None, **settings: Any
    ) -> AsyncTokenStream:
        """``stream_chat`` for asyncio: an async iterator of text pieces."""
        prompt_ids, config = self._prepare_chat(messages, overrides, settings)
        return AsyncTokenStream(self, prompt_ids, config, text_only=True)

    def _prepare_chat(
        self, messages: list[dict], overrides: GenerationOverrides | None, settings: dict[str, Any]
    ) -> tuple[list[int], ResolvedGenerationConfig]:
        """Token ids of the rendered conversation and the settings, end of turn added to the end ids."""
        changes = call_changes(overrides, settings)
        template = self.chat_template
        end = template.end_of_turn_id
        if end is not None and end not in self._config.eos_token_ids:
            changes["eos_token_ids"] = (*self._config.eos_token_ids, end)
        config = dataclasses.replace(self._config, **changes) if changes else self._config
        prompt_ids = template.encode(self._loaded.tokenizer, messages)
        self._check_fits(prompt_ids)
        return prompt_ids, config

    # ------------------------------------------------------------ internals

    def _prepare(
        self, prompt: str, overrides: GenerationOverrides | None, settings: Mapping[str, Any] | None = None
    ) -> tuple[list[int], ResolvedGenerationConfig]:
        """Validate settings and tokenize the prompt: every error before any model work."""
        if not isinstance(prompt, str):
            raise InvalidConfigurationError(f"prompt must be a str, got {type(prompt).__name__}")
        changes = call_changes(overrides, settings or {})
        config = dataclasses.replace(self._config, **changes) if changes else self._config
        tokenizer = self._loaded.tokenizer
        prompt_ids = list(tokenizer.encode(prompt))
        if not prompt_ids:
            if tokenizer.bos_token_id is None:
                raise InvalidConfigurationError(
                    f"the prompt is empty and {self._model_name} has no BOS token to start from; pass some text"
                )
            prompt_ids = [tokenizer.bos_token_id]
        self._check_fits(prompt_ids)
        return prompt_ids, config

    def _check_fits(self, prompt_ids: list[int]) -> None:
        if len(prompt_ids) >= self._context_size:
            # Equal does not fit either: the context must hold at least one generated token too.
            raise ContextOverflowError(
                f"the prompt is {len(prompt_ids)} tokens but {self._model_name}'s context holds {self._context_size} "
                f"(prompt plus at least one generated token); shorten the prompt (nothing is truncated silently)",
                tokens=len(prompt_ids),
                context=self._context_size,
            )

    def _acquire(self, stop: threading.Event | None = None) -> _ThreadToken | None:
        """Take the one-generation-at-a-time lock and return the calling thread's token; None if
        ``stop`` was set while waiting."""
        me = _thread_token()
        owner = self._owner
        if owner is not None and owner() is me:
            raise GenerationFailedError(
                f"this thread already has an open stream on this Generator ({self._model_name}); "
                f"finish or close() it before starting another generation"
            )
        if stop is None:
            self._lock.acquire()
        else:
            # An async worker waiting its turn must notice cancellation without getting the lock.
            while not self._lock.acquire(timeout=0.05):
                if stop.is_set():
                    return None
        self._owner = weakref.ref(me)
        if self._closed:
            self._release()
            raise GenerationFailedError(f"this Generator ({self._model_name}) is closed; build a new one")
        return me

    def _release(self) -> None:
        self._owner = None
        self._lock.release()

    def _kv_cache_for(self, tokens: int) -> Any:
        """A KV cache of at least ``tokens`` positions, reused across generations (allocated once)."""
        capacity = _grown_capacity(self._kv_cache, tokens, self._context_size)
        if capacity is not None:
            self._kv_cache = None  # let the old one go before allocating the new one
            self._kv_cache = self._loaded.model.new_cache(capacity)
        self._kv_cache.offset = 0
        return self._kv_cache

    def _draft_cache_for(self, tokens: int) -> Any:
        """The draft model's ``_kv_cache_for``."""
        assert self._draft is not None
        model = self._draft.loaded.model
        capacity = _grown_capacity(self._draft_kv_cache, tokens, min(self._context_size, model.context_size))
        if capacity is not None:
            self._draft_kv_cache = None
            self._draft_kv_cache = model.new_cache(capacity)
        self._draft_kv_cache.offset = 0
        return self._draft_kv_cache

    def _events(self, prompt_ids: list[int], config: ResolvedGenerationConfig) -> tuple[Iterator[Any], Any]:
        """The generation loop of ``kjarni.stream`` for one call, and its stats object."""
        from kjarni.stream import GenerationStats, stream_generate

        stats = GenerationStats()
        needed = min(len(prompt_ids) + config.max_tokens, self._context_size)
        caches: dict[str, Any] = {}
        if self._prefix_cache is None:
            caches["kv_cache"] = self._kv_cache_for(needed)
        elif needed <= self._prefix_cache.capacity:
            caches["prefix_cache"] = self._prefix_cache
        else:
            # Too long for the prefix cache: a cache for this call only (bounded by max_context, which
            # stream_generate's own fallback would not know), leaving the prefix cache as it was.
            caches["kv_cache"] = self._loaded.model.new_cache(needed)
        if self._draft is not None:
            caches["draft"] = self._draft.loaded.model
            caches["num_draft_tokens"] = self._draft.num_tokens
            if self._draft_prefix_cache is not None:
                caches["draft_prefix_cache"] = self._draft_prefix_cache
            else:
                caches["draft_cache"] = self._draft_cache_for(needed)
        events = stream_generate(self._loaded.model, self._loaded.tokenizer, prompt_ids, config, stats=stats, **caches)
        return events, stats


def _grown_capacity(cache: Any, tokens: int, context: int) -> int | None:
    """The capacity to reallocate ``cache`` with to hold ``tokens`` (at most ``context``), or None if it does."""
    capacity = min(tokens, context)
    if cache is not None and cache.capacity >= capacity:
        return None
    # Grow to at least double so a run of slightly longer prompts does not reallocate each time.
    return capacity if cache is None else min(max(capacity, 2 * cache.capacity), context)


class GeneratorBuilder(PartsBuilder):
    """Builder for configuring a Generator; every method returns the builder (setters: builder.py)."""

    def build(self) -> Generator:
        """Resolve, download (per the policy), load, and return the Generator.

        With ``draft()`` the draft model is resolved and loaded the same way and checked against
        the model's vocabulary; with ``prefix_cache()`` its KV cache is allocated here.
        """
        parts = self.build_parts()
        generator = Generator(**vars(parts))  # the parts are the Generator's keyword arguments
        if parts.chat_template is not None:
            _ = generator.chat_template  # compile it now: a broken template fails the build, not the first chat
        return generator

    async def abuild(self) -> Generator:
        """``build`` in a worker thread, for asyncio code."""
        return await asyncio.to_thread(self.build)
