"""``PartsBuilder``: every setting of a Generator, chainable, checked before any work, and the
resolving, loading and wiring of the parts a Generator runs on (``GeneratorParts``).

    generator = (Generator.builder("smollm2-135m-instruct")
                 .cpu().temperature(0.8).max_tokens(100).build())

Sampling setters check their value at once (``InvalidConfigurationError`` names it and its
range); ``build_parts()`` checks the rest before it downloads or loads anything. The public
``GeneratorBuilder`` (generator.py) is this class plus ``build()``, which turns the parts into a
``Generator``: so imports run one way, generator.py -> builder.py, never back.

Over 500 lines because it is one class: about thirty chainable setters, each the public API with its
docstring and its own check, and the few steps that turn them into parts. Splitting the setters from
the wiring would split one object's state over two files.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Self

from kjarni import registry, sources
from kjarni.errors import (
    DownloadFailedError,
    GpuUnavailableError,
    HostOutOfMemoryError,
    InvalidConfigurationError,
    KjarniError,
    LoadFailedError,
    ModelNotDownloadedError,
    ModelPathNotFoundError,
    UnknownModelError,
)
from kjarni.generator.config import (
    KJARNI_DEFAULTS,
    GenerationOverrides,
    KjarniDevice,
    LoadConfig,
    LoadConfigBuilder,
    ResolvedGenerationConfig,
)
from kjarni.generator.presets import GeneratorPreset, GeneratorTier, find_preset, list_presets
from kjarni.prefix_cache import DEFAULT_PREFIX_CACHE_TOKENS, PrefixCache
from kjarni.quiet import notice, quiet_mesa
from kjarni.sources import DownloadPolicy


# Settings of creative() and precise(): a builder layer, so later setters still override them.
CREATIVE = GenerationOverrides(temperature=1.0, top_p=0.95, top_k=0, min_p=0.05)
PRECISE = GenerationOverrides(temperature=0.2, top_p=0.9, top_k=20)

# Models larger than this run slowly on the numpy backend; build() says so unless allow_warnings().
_CPU_WARN_PARAMS = 1.0e9


def _gpu_ops(load_config: LoadConfig, context: Any, options: dict[str, Any] | None = None) -> tuple[Any, Any]:
    """The WebGPU backend for ``load_config`` on ``context`` (a new ``WgpuContext(**options)`` when None).

    Returns ``(ops, context)``; raises ``GpuUnavailableError`` saying why when there is no GPU.
    The one place the GPU backend is wired in.
    """
    quiet_mesa()
    try:
        from kjarni.gpu import WgpuContext, WgpuOps
    except ImportError as error:
        raise GpuUnavailableError(
            f"the WebGPU backend is not available in this kjarni build ({error}); use device='cpu' (cpu())"
        ) from None
    weight_format = load_config.weight_format
    if weight_format == "quantized":
        # WgpuOps keeps GGUF quantized blocks as stored wherever it has a kernel for them; the
        # remaining tensors (norms, unsupported types) are held as f16.
        weight_format = "f16"
    if context is None:
        context = WgpuContext(**(options or {}))
    ops = WgpuOps(context, weight_format=weight_format, kv_format=load_config.kv_dtype)
    return ops, context


def _software_adapter() -> str | None:
    """For ``AUTO``: a description of the best adapter when it is a software one (llvmpipe), else None.

    A CPU-emulated WebGPU adapter is slower than the numpy backend, so ``AUTO`` does not take it;
    ``gpu()`` still does. Raises ``GpuUnavailableError`` when there is no adapter at all.
    """
    quiet_mesa()
    try:
        from kjarni.gpu import find_adapter
    except ImportError:
        return None  # _gpu_ops reports the missing backend
    adapter = find_adapter()
    info = adapter.info
    if str(info.get("adapter_type")) == "CPU":
        return str(info.get("device") or info.get("description") or "a software adapter")
    return None


def _parse_params(params: str) -> float | None:
    """``"135M"`` -> 1.35e8, ``"1.5B"`` -> 1.5e9 (registry ``params``); None if unreadable."""
    scale = {"K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}
    text = params.strip().upper()
    try:
        return float(text[:-1]) * scale[text[-1]]
    except (KeyError, ValueError, IndexError):
        return None


@dataclass(frozen=True)
class LoadedDraft:
    """The draft model of speculative decoding, as the builder loaded it."""

    name: str
    loaded: Any  # kjarni.loader.LoadedModel
    device: KjarniDevice
    num_tokens: int | None  # None: chosen each round (speculative.DraftLength)


@dataclass(frozen=True)
class GeneratorParts:
    """What a Generator runs on, resolved, loaded and wired by ``PartsBuilder.build_parts``."""

    loaded: Any  # kjarni.loader.LoadedModel
    model_name: str
    entry: registry.ModelEntry | None
    device: KjarniDevice
    gpu_context: Any
    generation_config: ResolvedGenerationConfig
    context_size: int
    load_config: LoadConfig
    draft: LoadedDraft | None = None
    prefix_cache: PrefixCache | None = None
    draft_prefix_cache: PrefixCache | None = None
    chat_template: str | None = None
    owns_gpu_context: bool = False  # made here (not with_context): Generator.close() closes it


class PartsBuilder:
    """The settings of a Generator and their wiring; every setter returns the builder."""

    def __init__(self, model: str | os.PathLike[str] | None = None) -> None:
        self._model = os.fspath(model) if model is not None else None
        self._model_path: Path | None = None
        self._device = KjarniDevice.AUTO
        self._context: Any = None
        self._gpu_options: dict[str, Any] = {}  # WgpuContext arguments from gpu(...)
        self._preset: GeneratorPreset | None = None
        self._overrides = GenerationOverrides()
        self._load_config = LoadConfig()
        self._load_config_set = False
        self._cache_dir: Path | None = None
        self._download_policy = DownloadPolicy.IF_MISSING
        self._quiet = False
        self._allow_warnings = False
        self._draft: tuple[str, int | None, KjarniDevice | None] | None = None  # name, tokens per round, device
        self._prefix_cache_tokens: int | None = None
        self._chat_template: str | None = None

    def __repr__(self) -> str:
        return (
            f"GeneratorBuilder(model={self._model!r}, model_path={self._model_path}, device={self._device.value!r}, "
            f"preset={self._preset.name if self._preset else None!r}, overrides={self._overrides})"
        )

    # ------------------------------------------------------------ model and device

    @classmethod
    def new(cls, model: str | os.PathLike[str] | None = None) -> Self:
        """A builder for ``model`` (a registry name or a local path; None: the default model)."""
        return cls(model)

    def model_path(self, path: str | os.PathLike[str]) -> Self:
        """Load the model from a local ``.gguf`` file or model folder instead of the registry."""
        self._model_path = Path(path).expanduser()
        return self

    def device(self, device: KjarniDevice | str) -> Self:
        """Set the device: ``KjarniDevice.CPU``, ``GPU`` or ``AUTO`` (or ``"cpu"``, ``"gpu"``, ``"auto"``)."""
        self._device = KjarniDevice.parse(device)
        return self

    def cpu(self) -> Self:
        """Use the CPU (numpy) for inference."""
        return self.device(KjarniDevice.CPU)

    def gpu(
        self,
        device: Any = None,
        adapter: Any = None,
        *,
        adapter_index: int | None = None,
        adapter_name: str | None = None,
        power_preference: str | None = None,
        runtime: str | None = None,
    ) -> Self:
        """Use the GPU (WebGPU); ``build()`` raises ``GpuUnavailableError`` when there is none.

        ``device`` / ``adapter``: an application's own wgpu-py or wgpudawn GPUDevice / GPUAdapter,
        shared with kjarni (checked up front: ``UnsuitableDeviceError`` names missing limits;
        kjarni never destroys or reconfigures it, and ``Generator.close()`` frees only the
        Generator's buffers). Otherwise kjarni picks an adapter: ``adapter_index`` (as numbered by
        ``kjarni devices``; default ``KJARNI_GPU_ADAPTER``, else the GPU in
        ``CUDA_VISIBLE_DEVICES`` / Ray), ``adapter_name`` (a substring, e.g. ``"Intel"``) and
        ``power_preference`` (``"high-performance"`` or ``"low-power"``). ``runtime``: ``"wgpu"``
        (default, or ``KJARNI_WEBGPU_RUNTIME``) or ``"dawn"`` (``pip install 'kjarni[dawn]'``).
        """
        options = {
            "device": device, "adapter": adapter, "adapter_index": adapter_index, "adapter_name": adapter_name,
            "power_preference": power_preference, "runtime": runtime,
        }
        if power_preference is not None and power_preference not in ("high-performance", "low-power"):
            raise InvalidConfigurationError(
                f"power_preference={power_preference!r}; use 'high-performance' or 'low-power'"
            )
        if adapter_index is not None and (isinstance(adapter_index, bool) or not isinstance(adapter_index, int) or adapter_index < 0):
            raise InvalidConfigurationError(f"adapter_index={adapter_index!r} must be an integer >= 0 (see `kjarni devices`)")
        if (device is not None or adapter is not None) and (adapter_index is not None or adapter_name is not None or power_preference is not None):
            raise InvalidConfigurationError(
                "gpu(device=/adapter=) gives the application's own GPU; adapter_index, adapter_name and "
                "power_preference choose one for kjarni: pass one or the other"
            )
        self._gpu_options = {k: v for k, v in options.items() if v is not None}
        return self.device(KjarniDevice.GPU)

    def with_context(self, context: Any) -> Self:
        """Run on a pre-created ``WgpuContext`` (shared between Generators); implies the GPU."""
        self._context = context
        return self.device(KjarniDevice.GPU)

    # ------------------------------------------------------------ presets

    @classmethod
    def from_preset(cls, preset: GeneratorPreset | GeneratorTier | str) -> Self:
        """A builder for a preset's model, device and sampling defaults (a preset, tier or preset name)."""
        return cls().preset(preset)

    def preset(self, preset: GeneratorPreset | GeneratorTier | str) -> Self:
        """Apply a preset: its temperature and max tokens (below builder settings), its device, and its
        model unless this builder already names one. A preset recommending the GPU uses ``AUTO``, so it
        still runs where there is none."""
        if isinstance(preset, GeneratorTier):
            preset = preset.resolve()
        elif isinstance(preset, str):
            found = find_preset(preset)
            if found is None:
                raise InvalidConfigurationError(
                    f"unknown preset {preset!r}; presets: {', '.join(list_presets())}"
                )
            preset = found
        if not isinstance(preset, GeneratorPreset):
            raise InvalidConfigurationError(f"preset must be a GeneratorPreset, GeneratorTier or name, got {preset!r}")
        self._preset = preset
        if self._model is None and self._model_path is None:
            self._model = preset.model
        self._device = KjarniDevice.CPU if preset.recommended_device is KjarniDevice.CPU else KjarniDevice.AUTO
        return self

    def creative(self) -> Self:
        """Creative generation: temperature 1.0, top-p 0.95, min-p 0.05, no top-k."""
        return self.generation_config(CREATIVE)

    def precise(self) -> Self:
        """Precise generation: temperature 0.2, top-p 0.9, top-k 20."""
        return self.generation_config(PRECISE)

    # ------------------------------------------------------------ speculative decoding and the prefix cache

    def draft(
        self, name: str | os.PathLike[str], num_tokens: int | None = None, *, device: KjarniDevice | str | None = None
    ) -> Self:
        """Speculative decoding: ``name`` (a registry name or local path) proposes ``num_tokens`` per round.

        ``num_tokens=None`` (the default) lets kjarni choose each round's length, up to
        ``speculative.MAX_DRAFT_TOKENS``, from the acceptance and the costs it measures, and decode
        without the draft while speculation does not pay; an int fixes the length.

        The draft must share this model's vocabulary (qwen2.5-coder-0.5b-instruct drafting for
        qwen2.5-coder-1.5b-instruct); ``build()`` checks it. It resolves and loads like the model
        (same cache folder, download policy, load config and quiet setting), on ``device`` (default:
        wherever the model runs; a GPU draft shares the model's ``WgpuContext``). Greedy output is
        the model's own greedy output; sampled output follows the model's distribution.
        """
        if isinstance(name, os.PathLike):
            name = os.fspath(name)
        if not isinstance(name, str) or not name:
            raise InvalidConfigurationError(f"draft model name {name!r} must be a non-empty str")
        if num_tokens is not None and (not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens < 1):
            raise InvalidConfigurationError(
                f"draft num_tokens={num_tokens!r} is out of range: it must be an integer >= 1, or None to let "
                "kjarni choose each round's length (the default)"
            )
        self._draft = (name, num_tokens, None if device is None else KjarniDevice.parse(device))
        return self

    def prefix_cache(self, enabled: bool = True) -> Self:
        """Reuse the KV cache across calls (``DEFAULT_PREFIX_CACHE_TOKENS`` positions; off by default).

        A prompt sharing its head with the previous call's prompt and output prefills only the rest.
        """
        self._prefix_cache_tokens = DEFAULT_PREFIX_CACHE_TOKENS if enabled else None
        return self

    def prefix_cache_tokens(self, tokens: int) -> Self:
        """Enable the prefix cache with a capacity of ``tokens`` (clamped to the model's context).

        The cache is allocated at ``build()``. A prompt plus ``max_tokens`` longer than it still
        works: that call prefills from scratch in a cache of its own.
        """
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
            raise InvalidConfigurationError(f"prefix_cache_tokens={tokens!r} is out of range: it must be an integer >= 1")
        self._prefix_cache_tokens = tokens
        return self

    def chat_template(self, template: str) -> Self:
        """The Jinja chat template ``chat`` and ``apply_chat_template`` use, instead of the model's own.

        For models that ship without one, or to change how a conversation is formatted; it is
        compiled (in the sandbox) at ``build()``, so a broken one fails there.
        """
        if not isinstance(template, str) or not template.strip():
            raise InvalidConfigurationError(f"chat_template must be a non-empty str (a Jinja template), got {template!r:.60}")
        self._chat_template = template
        return self

    # ------------------------------------------------------------ sampling

    def _set(self, **fields: Any) -> Self:
        self._overrides = self._overrides.merged(GenerationOverrides(**fields))
        return self

    def temperature(self, temp: float) -> Self:
        """Sampling temperature (>= 0; 0 is greedy)."""
        return self._set(temperature=temp)

    def max_tokens(self, max: int) -> Self:  # noqa: A002 - the seed's name
        """Maximum number of tokens to generate (>= 1)."""
        return self._set(max_tokens=max)

    def top_p(self, p: float) -> Self:
        """Nucleus sampling threshold, in (0, 1] (1 is off)."""
        return self._set(top_p=p)

    def top_k(self, k: int) -> Self:
        """Keep only the ``k`` most likely tokens (0 is off)."""
        return self._set(top_k=k)

    def min_p(self, p: float) -> Self:
        """Drop tokens less likely than ``p`` times the most likely one, in [0, 1] (0 is off)."""
        return self._set(min_p=p)

    def repetition_penalty(self, penalty: float) -> Self:
        """Penalty on tokens already in the prompt or output (> 0; 1 is off)."""
        return self._set(repetition_penalty=penalty)

    def greedy(self) -> Self:
        """Greedy decoding: temperature 0, always the most likely token (deterministic)."""
        return self._set(temperature=0.0)

    def seed(self, seed: int) -> Self:
        """Make sampling reproducible: the same seed gives the same text (>= 0)."""
        return self._set(seed=seed)

    def stop(self, strings: str | Iterable[str]) -> Self:
        """Stop strings: the text ends before the first of them (a str is one stop string)."""
        return self._set(stop=strings)

    def generation_config(self, overrides: GenerationOverrides) -> Self:
        """Set many generation settings at once; fields left None keep what earlier calls set."""
        if not isinstance(overrides, GenerationOverrides):
            raise InvalidConfigurationError(
                f"generation_config takes a GenerationOverrides, got {type(overrides).__name__}"
            )
        self._overrides = self._overrides.merged(overrides)
        return self

    # ------------------------------------------------------------ loading

    def with_load_config(self, configure: Callable[[LoadConfigBuilder], LoadConfigBuilder]) -> Self:
        """Configure loading: ``configure`` gets a ``LoadConfigBuilder`` and returns it.

        Example: ``.with_load_config(lambda c: c.quantized().kv_dtype("f16").max_context(4096))``.
        """
        result = configure(LoadConfigBuilder(self._load_config))
        if not isinstance(result, LoadConfigBuilder):
            raise InvalidConfigurationError(
                f"with_load_config's function must return the LoadConfigBuilder it was given, got {type(result).__name__}"
            )
        self._load_config = result.build()
        self._load_config_set = True
        return self

    def cache_dir(self, path: str | os.PathLike[str]) -> Self:
        """The cache folder for model files (default: ``$KJARNI_CACHE_DIR`` or ``~/.cache/kjarni``)."""
        self._cache_dir = Path(path).expanduser()
        return self

    def download_policy(self, policy: DownloadPolicy) -> Self:
        """Whether missing models are downloaded: ``DownloadPolicy.IF_MISSING`` or ``NEVER``."""
        if not isinstance(policy, DownloadPolicy):
            raise InvalidConfigurationError(f"download_policy takes a DownloadPolicy, got {policy!r}")
        self._download_policy = policy
        return self

    def offline(self) -> Self:
        """Never download: a model missing from the cache raises ``ModelNotDownloadedError``."""
        return self.download_policy(DownloadPolicy.NEVER)

    def quiet(self) -> Self:
        """Nothing on stderr: no progress, notices or warnings (the large-model one included), and
        no XDG_RUNTIME_DIR complaint from Mesa. Errors are still raised."""
        self._quiet = True
        return self

    def allow_warnings(self) -> Self:
        """Allow suboptimal choices (a large model on the CPU, GPU settings on the CPU) without warnings."""
        self._allow_warnings = True
        return self

    # ------------------------------------------------------------ build

    def _check(self) -> None:
        """What can be refused before touching any file."""
        if self._context is not None and self._device is not KjarniDevice.GPU:
            raise InvalidConfigurationError(
                f"with_context() gives a GPU context but the device is {self._device.value}; drop one of them"
            )
        if self._context is not None and self._gpu_options:
            raise InvalidConfigurationError(
                f"with_context() gives a GPU context, and gpu({', '.join(self._gpu_options)}=...) asks for another; "
                "drop one of them"
            )
        if self._gpu_options and self._device is not KjarniDevice.GPU:
            raise InvalidConfigurationError(
                f"gpu({', '.join(self._gpu_options)}=...) was set but the device is {self._device.value}; drop one of them"
            )

    def _source(self) -> sources.ModelSource:
        if self._model_path is not None:
            if not self._model_path.exists():
                raise ModelPathNotFoundError(
                    f"No such file or folder: {self._model_path.expanduser().absolute()} (model_path "
                    f"{str(self._model_path)!r} does not exist); pass a .gguf file or a folder "
                    f"with config.json, tokenizer.json and *.safetensors"
                )
            return sources.resolve(self._model_path, quiet=self._quiet)
        return self._resolve(self._model or registry.DEFAULT_MODEL)

    def _resolve(self, name: str) -> sources.ModelSource:
        return sources.resolve(
            name,
            cache_dir=self._cache_dir,
            policy=self._download_policy,
            quiet=self._quiet,
            prefer=self._load_config.prefer,  # None: reuse whichever form is cached
        )

    def _resolve_draft(self) -> sources.ModelSource:
        assert self._draft is not None
        try:
            return self._resolve(self._draft[0])
        except (UnknownModelError, ModelNotDownloadedError, DownloadFailedError, LoadFailedError) as error:
            raise type(error)(f"the draft model: {error}") from error  # say which of the two it is about

    def _ops(self, device: KjarniDevice, context: Any) -> tuple[Any, Any, KjarniDevice]:
        """``(ops, gpu context or None, resolved device)`` for ``device``; a GPU uses ``context`` if given."""
        from kjarni.numpy_ops import NumpyOps

        if device is KjarniDevice.CPU:
            return NumpyOps(weight_format=self._load_config.cpu_weight_format), None, KjarniDevice.CPU
        if device is KjarniDevice.GPU or context is not None:
            # Two arguments unless gpu(...) set options (tests stand in for _gpu_ops with two).
            ops, context = _gpu_ops(self._load_config, context, *([self._gpu_options] if self._gpu_options else []))
            return ops, context, KjarniDevice.GPU
        try:
            software = _software_adapter()
            if software is None:
                ops, context = _gpu_ops(self._load_config, None)
                return ops, context, KjarniDevice.GPU
            reason = (f"the only WebGPU adapter is {software}, a software one slower than numpy "
                      f"(gpu() or --device gpu would still use it)")
        except GpuUnavailableError as error:
            reason = f"no usable GPU: {error}"
        notice(f"{reason}. Running on the CPU (device='cpu' or --device cpu chooses it without this notice).",
               self._quiet)
        return NumpyOps(weight_format=self._load_config.cpu_weight_format), None, KjarniDevice.CPU

    def _load(self, source: sources.ModelSource, ops: Any, device: KjarniDevice) -> Any:
        from kjarni.loader import load_model

        started = time.monotonic()
        estimates: list[Any] = []  # filled by the GPU memory check, for the out-of-memory message
        notice(f"loading {source.name} from {source.path} on the {device.value}", self._quiet)
        try:
            loaded = load_model(
                source.path, ops=ops, prefer=self._load_config.prefer or "safetensors", quiet=self._quiet,
                max_context=self._load_config.max_context,
                check=self._gpu_memory_check(ops, estimates, source.name) if device is KjarniDevice.GPU else None,
            )
        except KjarniError:
            raise
        except MemoryError as error:  # wgpu's GPUOutOfMemoryError is one; a plain one is the host's RAM
            if type(error).__name__ != "GPUOutOfMemoryError":
                raise HostOutOfMemoryError(
                    f"the machine's memory (RAM, not GPU memory) ran out loading {source.name} on the "
                    f"{device.value}: {error or 'MemoryError'}; close other programs, use a smaller or more "
                    "quantized model (a Q4 GGUF), or a machine with more RAM"
                ) from error
            where = f" (estimated {estimates[0].describe()})" if estimates else ""
            raise GpuUnavailableError(
                f"the GPU ran out of memory loading {source.name}{where}: {error}; try "
                "with_load_config(lambda c: c.q8_0()), a smaller max_context, or cpu()"
            ) from error
        except Exception as error:  # noqa: BLE001 - unreadable files surface as a typed error
            raise LoadFailedError(f"loading {source.path} failed: {type(error).__name__}: {error}") from error
        notice(f"loaded {source.name} in {time.monotonic() - started:.1f} s", self._quiet)
        if device is KjarniDevice.CPU:
            params = _parse_params(source.entry.params) if source.entry is not None else None
            if params is not None and params > _CPU_WARN_PARAMS:
                self._warn(f"{source.name} has {source.entry.params} parameters; the numpy CPU backend runs it slowly, gpu() is faster")
        return loaded

    def _gpu_memory_check(self, ops: Any, estimates: list[Any], name: str) -> Callable[[Any, Any], None]:
        """Refuse a model whose GPU estimate exceeds the context's memory budget, before upload."""
        from kjarni.gpu.memory import estimate

        def check(weights: Any, config: Any) -> None:
            context = min(config.max_position_embeddings, self._load_config.max_context or config.max_position_embeddings)
            found = estimate(weights, config, weight_format=ops.weight_format, kv_format=ops.kv_format, context=context)
            estimates.append(found)
            budget = ops.context.memory_budget
            if budget is not None and found.total_bytes > budget:
                raise GpuUnavailableError(
                    f"{name} needs {found.describe()} on the GPU, more than its budget of "
                    f"{budget / 2**30:.2f} GiB (KJARNI_GPU_MEMORY_MB); try with_load_config(lambda c: c.q8_0()), "
                    "a smaller max_context, or cpu()"
                )

        return check

    def _resolve_config(self, loaded: Any) -> ResolvedGenerationConfig:
        """kjarni defaults < the model's generation_config < preset < builder."""
        eos = tuple(
            dict.fromkeys(
                [*sorted(loaded.tokenizer.eos_token_ids), *loaded.generation_defaults.eos_token_ids, *loaded.config.eos_token_id]
            )
        )
        layers = model_overrides(loaded.generation_defaults)
        if self._preset is not None:
            layers = layers.merged(self._preset.overrides())
        return layers.merged(self._overrides).resolve(dataclasses.replace(KJARNI_DEFAULTS, eos_token_ids=eos))

    def _warn(self, message: str) -> None:
        if not (self._allow_warnings or self._quiet):
            print(f"kjarni: warning: {message} (allow_warnings() silences this)", file=sys.stderr, flush=True)

    def build_parts(self) -> GeneratorParts:
        """Resolve, download (per the policy), load, and wire what the Generator runs on.

        With ``draft()`` the draft model is resolved and loaded the same way and checked against
        the model's vocabulary; with ``prefix_cache()`` its KV cache is allocated here.
        """
        self._check()
        source = self._source()
        draft_source = self._resolve_draft() if self._draft is not None else None  # fail before loading
        ops, context, device = self._ops(self._device, self._context)
        loaded = self._load(source, ops, device)
        context_size = loaded.model.context_size
        if self._load_config.max_context is not None:
            context_size = min(context_size, self._load_config.max_context)
        if device is KjarniDevice.CPU and self._load_config_set and (
            self._load_config.weight_format != "f16" or self._load_config.kv_dtype is not None
        ):
            self._warn("weight_format and kv_dtype apply to the GPU; the CPU backend always computes in float32")

        draft = None
        if self._draft is not None and draft_source is not None:
            from kjarni.speculative import check_draft_compatible

            _, num_tokens, draft_device = self._draft
            # Default: the model's device; a GPU draft shares the model's context (one device, one queue).
            draft_ops, _, draft_device = self._ops(draft_device or device, context if device is KjarniDevice.GPU else None)
            draft_loaded = self._load(draft_source, draft_ops, draft_device)
            check_draft_compatible(loaded, draft_loaded, target_name=source.name, draft_name=draft_source.name)
            draft = LoadedDraft(draft_source.name, draft_loaded, draft_device, num_tokens)

        prefix_caches: tuple[Any, Any] = (None, None)
        if self._prefix_cache_tokens is not None:
            # Allocated now, each clamped to the context it serves (PrefixCache clamps to context_size).
            tokens = self._prefix_cache_tokens
            prefix_caches = (
                PrefixCache(loaded.model, tokens, context_size=context_size),
                None if draft is None else PrefixCache(draft.loaded.model, tokens, context_size=context_size),
            )
        return GeneratorParts(
            loaded=loaded,
            model_name=source.name,
            entry=source.entry,
            device=device,
            gpu_context=context,
            generation_config=self._resolve_config(loaded),
            context_size=context_size,
            load_config=self._load_config,
            draft=draft,
            prefix_cache=prefix_caches[0],
            draft_prefix_cache=prefix_caches[1],
            chat_template=self._chat_template,
            owns_gpu_context=context is not None and self._context is None,
        )


def model_overrides(defaults: Any) -> GenerationOverrides:
    """The model author's defaults (``GenerationDefaults``) as an overrides layer.

    ``do_sample: false`` means greedy, as in Hugging Face. Values out of range are left out (a
    model file's quirk should not stop it from running).
    """
    candidates = {
        "temperature": defaults.temperature,
        "top_p": defaults.top_p,
        "top_k": defaults.top_k,
        "repetition_penalty": defaults.repetition_penalty,
        "max_tokens": defaults.max_new_tokens,
    }
    if defaults.do_sample is False:
        candidates["temperature"] = 0.0
    layer = GenerationOverrides()
    for name, value in candidates.items():
        if value is None:
            continue
        try:
            layer = layer.merged(GenerationOverrides(**{name: value}))
        except InvalidConfigurationError:
            continue
    return layer
