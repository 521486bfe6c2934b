"""The server on Ray Serve: the same ASGI app, one model per replica (``pip install kjarni[ray]``).

    from kjarni.serve.ray import deployment
    from ray import serve

    serve.run(deployment("smollm2-135m-instruct", device="gpu", replicas=4))   # on your Ray cluster

Each replica builds its own Generator when Ray starts it and serves OpenAI's API as
``kjarni serve`` does; Ray's proxy spreads requests over the replicas. On the GPU each replica
asks Ray for one GPU (``ray_actor_options={"num_gpus": 1}``), on the CPU for none. Every response
carries ``x-kjarni-replica``, the replica's Ray tag. See docs/serving.md.
"""

from __future__ import annotations

from typing import Any

from kjarni.errors import InvalidConfigurationError
from kjarni.generator.config import KjarniDevice


def _ray_serve() -> Any:
    try:
        from ray import serve
    except ImportError as error:
        raise InvalidConfigurationError(f"Ray Serve is not installed ({error}); pip install 'kjarni[ray]'") from None
    return serve


def deployment(
    model: str | None = None,
    *,
    model_path: str | None = None,
    device: str = "auto",
    replicas: int = 1,
    builder: Any = None,
    api_key: str | None = None,
    max_queue: int | None = None,
    max_body_bytes: int | None = None,
    ray_actor_options: dict[str, Any] | None = None,
    name: str = "kjarni",
) -> Any:
    """A Ray Serve application (``serve.run`` it) of ``replicas`` replicas, each serving one model.

    The model is ``model`` (a registry name) or ``model_path`` with the model's default settings,
    or whatever ``builder`` (a ``GeneratorBuilder``, for every other setting) builds, on ``device``
    (``"cpu"``, ``"gpu"``, ``"auto"``; it overrides the builder's); the prefix cache is turned on. ``ray_actor_options`` replaces the default
    request of one GPU per replica on ``device="gpu"`` and none otherwise (``"auto"`` falls back
    to the CPU where Ray gave no GPU, so ask for ``"gpu"`` to reserve one). The remaining options
    are ``kjarni serve``'s.
    """
    from kjarni.generator import GeneratorBuilder
    from kjarni.serve import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_QUEUE

    serve = _ray_serve()
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise InvalidConfigurationError(f"replicas={replicas!r} must be an integer >= 1")
    if builder is None:
        builder = GeneratorBuilder(model)
        if model_path is not None:
            builder.model_path(model_path)
    elif model is not None or model_path is not None:
        raise InvalidConfigurationError("pass a model (or model_path) or a builder, not both")
    builder.device(device).prefix_cache(True)
    on_gpu = KjarniDevice.parse(device) is KjarniDevice.GPU
    options = ray_actor_options if ray_actor_options is not None else {"num_gpus": 1 if on_gpu else 0}
    settings = {
        "api_key": api_key,
        "max_queue": DEFAULT_MAX_QUEUE if max_queue is None else max_queue,
        "max_body_bytes": DEFAULT_MAX_BODY_BYTES if max_body_bytes is None else max_body_bytes,
    }

    def build_app() -> Any:
        # Runs inside each replica when Ray starts it: the model loads there, once per replica,
        # and Ray routes no request to the replica before it has.
        from ray import serve as replica_serve

        from kjarni.serve.app import create_app

        tag = replica_serve.get_replica_context().replica_tag
        return create_app(builder.build(), replica=tag, **settings)

    @serve.deployment(name=name, num_replicas=replicas, ray_actor_options=options)
    @serve.ingress(build_app)
    class KjarniReplica:
        """One replica: the kjarni server app around its own Generator."""

    return KjarniReplica.bind()


def run(builder: Any, *, device: str = "auto", replicas: int = 1, host: str = "127.0.0.1", port: int = 8000,
        **options: Any) -> None:
    """``kjarni serve --ray``: start (or join, with ``RAY_ADDRESS``) Ray, serve until Ctrl-C, shut down."""
    import ray

    serve = _ray_serve()
    ray.init(ignore_reinit_error=True)
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(deployment(builder=builder, device=device, replicas=replicas, **options), blocking=True)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
