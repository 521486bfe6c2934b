"""The ``kjarni`` command: generate text, list and fetch models, list presets.

    kjarni generate "Once upon a time" --max-tokens 50 --seed 1
    kjarni generate --chat "What is the capital of France?"
    kjarni chat --system "Answer in one sentence."
    kjarni serve --model smollm2-135m-instruct --port 8000
    echo "def fib(n):" | kjarni generate - --preset generator_code_v1
    kjarni generate "def quicksort(xs):" --model qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct --greedy
    kjarni models
    kjarni pull smollm2-135m-instruct
    kjarni presets
    kjarni parity --model smollm2-135m-instruct --prompt "The capital of France is" --json
    kjarni devices

Generated text goes to stdout, everything else (progress, notices, errors) to stderr. Exit codes:
0 success, 2 bad arguments, settings or an unknown model name, 1 any other failure, 130 interrupted. Errors are one line;
``--debug`` adds the traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import traceback
from typing import Any, Sequence

from kjarni import __version__
from kjarni.errors import InvalidConfigurationError, KjarniError, UnknownModelError
from kjarni.quiet import quiet_mesa

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class _UsageError(Exception):
    """Bad command-line arguments (exit code 2)."""


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of printing usage and exiting, so errors stay one line."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise _UsageError(f"{message} (see `{self.prog} --help`)")


def _parser() -> _Parser:
    parser = _Parser(prog="kjarni", description="Text generation for decoder language models (numpy CPU or WebGPU).")
    parser.add_argument("--version", action="version", version=f"kjarni {__version__}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--quiet", "-q", action="store_true", help="no progress or notices on stderr")
    common.add_argument("--debug", action="store_true", help="show the traceback of errors")
    common.add_argument("--cache-dir", metavar="DIR", help="model cache (default: $KJARNI_CACHE_DIR or ~/.cache/kjarni)")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    # Shared by every command that runs a model (generate, chat, serve).
    model_options = argparse.ArgumentParser(add_help=False)
    model_options.add_argument("--model", "-m", help="registry model name (default: the preset's, else smollm2-135m-instruct)")
    model_options.add_argument("--model-path", metavar="PATH", help="a local .gguf file or model folder instead of --model")
    add_device_options(model_options)  # --device, --gpu N, --runtime
    model_options.add_argument("--offline", action="store_true", help="never download; fail if the model is not cached")
    model_options.add_argument("--cpu-weights", choices=("f32", "f16"),
                               help="how the CPU backend holds weights: f32 (default, the reference) or f16 (half the memory)")
    sampling = argparse.ArgumentParser(add_help=False)
    sampling.add_argument("--max-tokens", type=int, metavar="N", help="most tokens to generate")
    sampling.add_argument("--temperature", type=float, metavar="T", help="sampling temperature (0: greedy)")
    sampling.add_argument("--top-k", type=int, metavar="K", help="keep the K most likely tokens (0: off)")
    sampling.add_argument("--top-p", type=float, metavar="P", help="nucleus sampling threshold in (0, 1]")
    sampling.add_argument("--min-p", type=float, metavar="P", help="min-p threshold in [0, 1]")
    sampling.add_argument("--repetition-penalty", type=float, metavar="R", help="penalty on repeated tokens (1: off)")
    sampling.add_argument("--seed", type=int, help="seed for reproducible sampling")
    sampling.add_argument("--stop", action="append", metavar="TEXT", help=r"stop before TEXT (repeatable; \n, \t and \\ are understood)")
    sampling.add_argument("--greedy", action="store_true", help="greedy decoding (same as --temperature 0)")

    gen = commands.add_parser("generate", parents=[common, model_options, sampling],
                              help="generate text from a prompt (streams to stdout)",
                              description="Generate text after PROMPT and stream it to stdout.")
    gen.add_argument("prompt", metavar="PROMPT", help="the prompt; '-' reads it from stdin (one trailing newline dropped)")
    gen.add_argument("--preset", help="a preset name from `kjarni presets` (model, device, temperature, max tokens)")
    gen.add_argument("--json", action="store_true", help="print one JSON object with the text and stats instead of streaming")
    gen.add_argument("--chat", action="store_true", help="PROMPT is a user message: answer it through the model's chat template")
    gen.add_argument("--system", metavar="TEXT", help="with --chat: a system message before PROMPT")
    gen.add_argument("--draft", metavar="NAME", help="speculative decoding with NAME (registry name or path) as the draft "
                                                    "model; it must share the model's vocabulary")
    gen.add_argument("--draft-tokens", type=int, metavar="K", help="tokens the draft proposes per round (default: chosen each round "
                     "from the measured acceptance and costs)")
    gen.add_argument("--draft-device", choices=("cpu", "gpu", "auto"), help="where the draft runs (default: the model's device)")
    gen.add_argument("--prefix-cache", action="store_true", help="allocate the prefix KV cache (reuse across calls; "
                                                                 "one call gains nothing from it)")

    chat = commands.add_parser(
        "chat", parents=[common, model_options, sampling], help="an interactive chat with a model (streams answers)",
        description="Chat with a model in the terminal through its chat template: /reset, /system TEXT, /exit; "
                    "Ctrl-C stops an answer, Ctrl-D leaves. The prefix cache is on, so each turn prefills only what is new.")
    chat.add_argument("--system", metavar="TEXT", help="the system message the conversation starts with")

    serve = commands.add_parser(
        "serve", parents=[common, model_options, sampling], help="an OpenAI-compatible HTTP server for a model",
        description="Serve one model over OpenAI's HTTP API (/v1/models, /v1/completions, /v1/chat/completions, "
                    "/health) with uvicorn; needs `pip install kjarni[serve]`. The sampling flags set the defaults "
                    "requests start from. See docs/serving.md.")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    serve.add_argument("--api-key", metavar="KEY", help="require 'Authorization: Bearer KEY' (default: $KJARNI_API_KEY, else none)")
    serve.add_argument("--max-queue", type=int, metavar="N", help="requests that may wait behind the running one before 429 (default 64)")
    serve.add_argument("--max-body-bytes", type=int, metavar="N", help="largest request body accepted (default 4 MiB)")
    serve.add_argument("--ray", action="store_true", help="run on Ray Serve, one model per replica (pip install kjarni[ray])")
    serve.add_argument("--replicas", type=int, metavar="N", help="with --ray: how many replicas (default 1)")

    commands.add_parser("models", parents=[common], help="list known models, their sizes and what is cached",
                        description="List the registry's models with sizes and whether each is in the cache.")
    pull = commands.add_parser("pull", parents=[common], help="download a model into the cache",
                               description="Download a registry model into the cache (with progress on stderr).")
    pull.add_argument("name", metavar="NAME", help="registry model name (see `kjarni models`)")
    commands.add_parser("presets", parents=[common], help="list generator presets",
                        description="List the generator presets usable with `kjarni generate --preset`.")
    parity = commands.add_parser(
        "parity", parents=[common], help="cross-check GPU logits against the numpy reference",
        description="Run one model on the numpy backend and on the GPU and compare their logits for a prompt: "
                    "max and mean difference, top-1 agreement and the first diverging greedy step.")
    parity.add_argument("--model", metavar="NAME", help="registry model name (default: the default model)")
    parity.add_argument("--model-path", metavar="PATH", help="a local .gguf file or model folder instead")
    parity.add_argument("--prompt", required=True, help="the prompt to compare on")
    parity.add_argument("--steps", type=int, default=16, help="greedy steps after the prompt (default 16)")
    parity.add_argument("--weight-format", choices=["f32", "f16"], default="f32",
                        help="GPU weight format (default f32, the tightest comparison)")
    parity.add_argument("--json", action="store_true", help="print the report as JSON")
    add_device_options(parity, device=False)
    devices = commands.add_parser(
        "devices", parents=[common], help="list WebGPU adapters and whether kjarni can use each",
        description="List the WebGPU adapters of a runtime with their index (for --gpu N and KJARNI_GPU_ADAPTER), "
                    "backend, type, memory limits and whether kjarni can use each; '*' marks the one it would open.")
    devices.add_argument("--runtime", choices=("wgpu", "dawn"),
                         help="WebGPU runtime (default: $KJARNI_WEBGPU_RUNTIME, else wgpu)")
    devices.add_argument("--json", action="store_true", help="print the adapters as JSON")
    return parser


# ---------------------------------------------------------------- device options (shared by commands)


def add_device_options(parser: argparse.ArgumentParser, *, device: bool = True) -> None:
    """Add ``--device cpu|gpu|auto`` (unless ``device=False``), ``--gpu N`` and ``--runtime wgpu|dawn``
    to a subcommand's parser; `apply_device_options` applies them to a ``GeneratorBuilder``.

    For every command that runs a model (``generate``, ``serve``, ``parity``), so they read alike.
    """
    if device:
        parser.add_argument("--device", choices=("cpu", "gpu", "auto"), help="where to run (default: auto, or the preset's)")
    parser.add_argument("--gpu", type=int, metavar="N", dest="gpu_index",
                        help="the GPU adapter to use, by its index in `kjarni devices` (implies --device gpu; "
                             "default: $KJARNI_GPU_ADAPTER, else the GPU in CUDA_VISIBLE_DEVICES, else the best)")
    parser.add_argument("--runtime", choices=("wgpu", "dawn"),
                        help="WebGPU runtime: wgpu (wgpu-py, the default) or dawn (pip install 'kjarni[dawn]'); "
                             "default: $KJARNI_WEBGPU_RUNTIME")


def device_options(args: argparse.Namespace) -> dict[str, object]:
    """The ``GeneratorBuilder.gpu(...)`` / ``WgpuContext(...)`` arguments of `add_device_options`' flags."""
    options: dict[str, object] = {}
    if getattr(args, "gpu_index", None) is not None:
        if args.gpu_index < 0:
            raise _UsageError(f"--gpu {args.gpu_index} must be an adapter index >= 0 (see `kjarni devices`)")
        options["adapter_index"] = args.gpu_index
    if getattr(args, "runtime", None) is not None:
        options["runtime"] = args.runtime
    return options


def apply_device_options(builder: object, args: argparse.Namespace) -> None:
    """Apply `add_device_options`' flags to a ``GeneratorBuilder``: ``--gpu``/``--runtime`` mean the GPU."""
    options = device_options(args)
    device = getattr(args, "device", None)
    if options and device == "cpu":
        raise _UsageError(f"--device cpu contradicts {' and '.join('--' + k.replace('adapter_index', 'gpu') for k in options)}")
    if options:
        builder.gpu(**options)  # type: ignore[attr-defined]
    elif device:
        builder.device(device)  # type: ignore[attr-defined]


# ---------------------------------------------------------------- commands


def _model_builder(args: argparse.Namespace, preset: str | None = None) -> Any:
    """A ``GeneratorBuilder`` from the model, device and sampling options (checked before any download)."""
    from kjarni.generator import GenerationOverrides, GeneratorBuilder

    if args.greedy and args.temperature is not None:
        raise _UsageError("--greedy and --temperature contradict each other; pass one of them")
    if args.model and args.model_path:
        raise _UsageError("--model and --model-path both name a model; pass one of them")
    # Built before loading anything, so a bad value costs no download.
    overrides = GenerationOverrides(
        max_tokens=args.max_tokens,
        temperature=0.0 if args.greedy else args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        stop=tuple(_unescape(s) for s in args.stop) if args.stop else None,
    )
    builder = GeneratorBuilder(args.model)
    if preset:
        builder.preset(preset)
    if args.model_path:
        builder.model_path(args.model_path)
    apply_device_options(builder, args)
    if args.cache_dir:
        builder.cache_dir(args.cache_dir)
    if args.offline:
        builder.offline()
    if args.quiet:
        builder.quiet()
    if args.cpu_weights:
        builder.with_load_config(lambda c: c.cpu_weight_format(args.cpu_weights))
    return builder.generation_config(overrides)


def _generate(args: argparse.Namespace) -> int:

    if args.draft is None and (args.draft_tokens is not None or args.draft_device is not None):
        raise _UsageError("--draft-tokens and --draft-device need --draft NAME")
    if args.system is not None and not args.chat:
        raise _UsageError("--system needs --chat")
    builder = _model_builder(args, args.preset)
    prompt = args.prompt
    if prompt == "-":
        prompt = sys.stdin.read()
        if prompt.endswith("\n"):
            prompt = prompt[:-1]
    if args.draft:
        builder.draft(args.draft, args.draft_tokens, device=args.draft_device)
    if args.prefix_cache:
        builder.prefix_cache(True)
    generator = builder.build()

    if args.chat:
        system = [{"role": "system", "content": args.system}] if args.system is not None else []
        stream = generator.stream_chat([*system, {"role": "user", "content": prompt}])
    else:
        stream = generator.stream_text(prompt)
    with stream:
        if args.json:
            text = "".join(stream)
        else:
            text = ""
            for piece in stream:
                text += piece
                sys.stdout.write(piece)
                sys.stdout.flush()
    stats = generator.last_stats
    if args.json:
        result = {
            "model": generator.model_name,
            "device": generator.device.value,
            "draft_model": generator.draft_model_name,
            "num_draft_tokens": generator.num_draft_tokens,
            "text": text,
            "finish_reason": stream.finish_reason,
            "stats": dataclasses.asdict(stats) if dataclasses.is_dataclass(stats) else None,
            "config": {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(stream.config).items()},
        }
        sys.stdout.write(json.dumps(result, ensure_ascii=False) + "\n")
    elif not text.endswith("\n"):
        sys.stdout.write("\n")
    sys.stdout.flush()
    if not args.json and not args.quiet and generator.draft_model_name is not None and stats is not None and stats.rounds:
        plain = f", {stats.plain_tokens} tokens without the draft" if stats.plain_tokens else ""
        print(f"kjarni: draft {generator.draft_model_name}: {stats.acceptance_rate:.0%} of drafted tokens accepted, "
              f"{stats.draft_length:.2f} drafted and {stats.tokens_per_round:.2f} tokens per round{plain}",
              file=sys.stderr)
    elif not args.json and not args.quiet and generator.draft_model_name is not None and stats is not None:
        why = ("the tokens asked for could not repay its prefill and a first round"
               if "plain: budget" in stats.draft_decisions else "no room to draft")
        print(f"kjarni: draft {generator.draft_model_name}: not used, {why}: "
              f"{stats.plain_tokens} tokens decoded without it", file=sys.stderr)
    if not args.json and not args.quiet and stats is not None:
        print(f"kjarni: {summary_line(stats, generator)}", file=sys.stderr)
    return EXIT_OK


def summary_line(stats: Any, generator: Any) -> str:
    """llama.cpp-style one-line summary of a generation: token counts, speeds, where it ran."""
    prefill = stats.prompt_tokens / stats.prefill_seconds if stats.prefill_seconds > 0 else 0.0
    if generator.gpu_context is not None:
        backend = f"gpu ({generator.gpu_context.description})"
    else:
        backend = "cpu (numpy)"
    return (
        f"{stats.prompt_tokens} prompt tokens, {stats.generated_tokens} generated ({stats.finish_reason}); "
        f"prefill {prefill:.1f} tok/s, decode {stats.tokens_per_second:.1f} tok/s; {backend}"
    )


_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}


def _unescape(text: str) -> str:
    r"""``\n``, ``\t``, ``\r`` and ``\\`` as typed in a shell (``--stop "\n\n"``); anything else stays as is."""
    out, i = [], 0
    while i < len(text):
        if text[i] == "\\" and i + 1 < len(text) and text[i + 1] in _ESCAPES:
            out.append(_ESCAPES[text[i + 1]])
            i += 2
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def _chat(args: argparse.Namespace) -> int:
    from kjarni import chat_repl

    generator = _model_builder(args).prefix_cache(True).build()
    return chat_repl.run(generator, system=args.system)


def _serve(args: argparse.Namespace) -> int:
    from kjarni import serve

    if args.replicas is not None and not args.ray:
        raise _UsageError("--replicas needs --ray")
    if args.replicas is not None and args.replicas < 1:
        raise _UsageError(f"--replicas {args.replicas} must be >= 1")
    if not 0 < args.port < 65536:
        raise _UsageError(f"--port {args.port} is not a port number (1-65535)")
    options = {
        "api_key": args.api_key or os.environ.get("KJARNI_API_KEY") or None,
        "max_queue": serve.DEFAULT_MAX_QUEUE if args.max_queue is None else args.max_queue,
        "max_body_bytes": serve.DEFAULT_MAX_BODY_BYTES if args.max_body_bytes is None else args.max_body_bytes,
    }
    if options["max_queue"] < 0 or options["max_body_bytes"] < 1:
        raise _UsageError("--max-queue must be >= 0 and --max-body-bytes >= 1")
    builder = _model_builder(args).prefix_cache(True)
    if args.ray:
        from kjarni.serve import ray as ray_serve

        ray_serve.run(builder, device=args.device or "auto", replicas=args.replicas or 1, host=args.host, port=args.port,
                      **options)
        return EXIT_OK
    app = serve.create_app(load=builder.build, **options)
    serve.run(app, host=args.host, port=args.port, log_level="warning" if args.quiet else "info")
    return EXIT_OK


def _models(args: argparse.Namespace) -> int:
    from kjarni import registry, sources
    from kjarni.progress import format_bytes

    cache = sources.cache_dir(args.cache_dir)
    rows = [("NAME", "PARAMS", "SIZE", "CONTEXT", "CACHED", "DESCRIPTION")]
    for entry in registry.entries():
        cached = sources.cached_path(entry, cache)
        name = entry.name + (" (default)" if entry.name == registry.DEFAULT_MODEL else "")
        rows.append((
            name, entry.params, format_bytes(entry.size_mb * 1e6), str(entry.context),
            "yes" if cached is not None else "no", entry.description,
        ))
    _table(rows)
    print(f"\ncache: {cache}", file=sys.stderr)
    return EXIT_OK


def _pull(args: argparse.Namespace) -> int:
    from kjarni import sources

    source = sources.pull(args.name, cache_dir=args.cache_dir, quiet=args.quiet)
    print(source.path)
    return EXIT_OK


def _presets(args: argparse.Namespace) -> int:
    from kjarni.generator.presets import ALL_V1_PRESETS

    rows = [("NAME", "MODEL", "DEVICE", "TEMPERATURE", "MAX TOKENS", "MEMORY", "DESCRIPTION")]
    for p in ALL_V1_PRESETS:
        temperature = "-" if p.temperature is None else f"{p.temperature:g}"
        rows.append((p.name, p.model, p.recommended_device.value, temperature, str(p.default_max_tokens),
                     f"{p.memory_mb} MB", p.description))
    _table(rows)
    return EXIT_OK


def _table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        cells = [cell.ljust(width) for cell, width in zip(row, widths)]
        print("  ".join([*cells, row[-1]]))


def _parity(args: argparse.Namespace) -> int:
    from kjarni import registry, sources
    from kjarni.parity import run_parity

    if args.model and args.model_path:
        raise _UsageError("--model and --model-path both name a model; pass one of them")
    if args.steps < 0:
        raise _UsageError(f"--steps {args.steps} must be >= 0")
    if args.model_path:
        path, name = args.model_path, args.model_path
    else:
        source = sources.resolve(args.model or registry.DEFAULT_MODEL, cache_dir=args.cache_dir,
                                 quiet=args.quiet)
        path, name = source.path, source.name
    from kjarni.gpu import WgpuContext

    context = WgpuContext(**device_options(args))  # type: ignore[arg-type]
    report = run_parity(path, args.prompt, steps=args.steps, weight_format=args.weight_format, name=name,
                        quiet=args.quiet, context=context)
    print(json.dumps(dataclasses.asdict(report), indent=2) if args.json else report.to_text())
    return EXIT_OK


def _devices(args: argparse.Namespace) -> int:
    from kjarni.gpu.adapters import assigned_gpu, choose_adapter, env_adapter_index, list_adapters
    from kjarni.gpu.runtime import load_runtime
    from kjarni.progress import format_bytes

    runtime = load_runtime(args.runtime)
    adapters = list_adapters(runtime)
    chosen, reason = None, "no adapter"
    try:
        index = env_adapter_index()
        choice = choose_adapter(
            adapters, index=index, backend=os.environ.get("WGPU_BACKEND_TYPE", "").strip() or None,
            assignment=assigned_gpu() if index is None else None, index_source="KJARNI_GPU_ADAPTER",
        )
        chosen, reason = choice.adapter.index, choice.reason
    except KjarniError as error:
        reason = str(error)
    if args.json:
        print(json.dumps({"runtime": runtime.description, "default": chosen, "default_reason": reason,
                          "adapters": [a.as_dict() for a in adapters]}, indent=2))
        return EXIT_OK
    print(f"runtime: {runtime.description}")
    if not adapters:
        print(f"no WebGPU adapter{' (Dawn needs a full Vulkan 1.1 driver; lavapipe of Mesa 22 is not one)' if runtime.name == 'dawn' else ''}; "
              "install a Vulkan/Metal/D3D12 driver (on Linux without a GPU: mesa-vulkan-drivers)")
        return EXIT_OK
    rows = [("", "INDEX", "NAME", "BACKEND", "TYPE", "MAX BUFFER", "MAX BINDING", "WG MEMORY", "KJARNI")]
    for a in adapters:
        usable = "usable" + (" (subgroups)" if "subgroup" in a.features else "") if a.usable else "no: " + "; ".join(a.problems)
        limits = a.limits
        rows.append((
            "*" if a.index == chosen else "", str(a.index), a.name, a.backend, a.adapter_type,
            format_bytes(limits.get("max-buffer-size", 0)), format_bytes(limits.get("max-storage-buffer-binding-size", 0)),
            format_bytes(limits.get("max-compute-workgroup-storage-size", 0)), usable,
        ))
    _table(rows)
    if not args.quiet:
        print(f"\n* kjarni would open: {reason}. Choose with --gpu N or KJARNI_GPU_ADAPTER=N.", file=sys.stderr)
    return EXIT_OK


_COMMANDS = {"generate": _generate, "chat": _chat, "serve": _serve, "models": _models, "pull": _pull,
             "presets": _presets, "parity": _parity, "devices": _devices}


# ---------------------------------------------------------------- entry point


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    try:  # generated text is Unicode: never die on a console that cannot show a character
        sys.stdout.reconfigure(errors="replace")  # type: ignore[union-attr]
    except (AttributeError, ValueError):
        pass
    debug = "--debug" in (sys.argv[1:] if argv is None else argv)
    quiet_mesa()
    try:
        args = _parser().parse_args(argv)
        debug = args.debug if hasattr(args, "debug") else debug
        if args.command is None:
            raise _UsageError("a command is needed: generate, chat, serve, models, pull, presets, parity or devices (see `kjarni --help`)")
        return _COMMANDS[args.command](args)
    except _UsageError as error:
        return _fail(f"error: {error}", EXIT_USAGE, debug)
    except (InvalidConfigurationError, UnknownModelError) as error:  # a bad setting or model name
        return _fail(f"error: {error}", EXIT_USAGE, debug)
    except KjarniError as error:
        return _fail(f"error: {error}", EXIT_ERROR, debug)
    except KeyboardInterrupt:
        return _fail("interrupted", EXIT_INTERRUPTED, debug)
    except BrokenPipeError:
        # The reader went away (`| head`): stop quietly, and keep Python from complaining at exit.
        try:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115
        except OSError:
            pass
        return EXIT_ERROR
    except Exception as error:  # noqa: BLE001 - a one-line message, the traceback with --debug
        return _fail(f"internal error: {type(error).__name__}: {error}", EXIT_ERROR, debug)


def _fail(message: str, code: int, debug: bool) -> int:
    if debug:
        traceback.print_exc(file=sys.stderr)
    # Messages stay on one line so scripts can show or grep them.
    print(f"kjarni: {' '.join(message.split())}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
