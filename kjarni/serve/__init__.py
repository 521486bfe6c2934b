"""``kjarni serve``: an OpenAI-compatible HTTP server for one model (``pip install kjarni[serve]``).

    from kjarni.serve import create_app, run
    app = create_app(generator)               # a Starlette ASGI app; or create_app(load=callable)
    run(app, host="127.0.0.1", port=8000)     # uvicorn

``kjarni.serve.ray`` runs the same app as a Ray Serve deployment, one model per replica
(``pip install kjarni[ray]``). See docs/serving.md.
"""

from __future__ import annotations

from typing import Any

from kjarni.errors import InvalidConfigurationError

_MISSING = "the server needs the serve extra: pip install 'kjarni[serve]' ({error})"

try:
    from kjarni.serve.app import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_QUEUE, create_app
except ImportError as _error:  # starlette / sse-starlette missing
    _import_error: ImportError | None = _error

    def create_app(*args: Any, **kwargs: Any) -> Any:  # type: ignore[misc]
        raise InvalidConfigurationError(_MISSING.format(error=_import_error))

    DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_QUEUE = 4 * 2**20, 64
else:
    _import_error = None


def run(app: Any, *, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Serve ``app`` with uvicorn until interrupted."""
    try:
        import uvicorn
    except ImportError as error:
        raise InvalidConfigurationError(_MISSING.format(error=error)) from None
    uvicorn.run(app, host=host, port=port, log_level=log_level)


__all__ = ["DEFAULT_MAX_BODY_BYTES", "DEFAULT_MAX_QUEUE", "create_app", "run"]
