"""A Hugging Face hub on 127.0.0.1 serving the few API routes huggingface_hub calls, for tests.

    with FakeHub({"org/repo": {"config.json": b"{}", ...}}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)

Routes: ``GET /api/models/<repo>[/revision/<rev>]`` (repo info with its files), ``GET
/api/models/<repo>/tree/<rev>`` (file listing), ``HEAD``/``GET /<repo>/resolve/<rev>/<file>``.
Every request is logged in ``requests`` as ``(method, path)``, so tests count downloads.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    def __init__(self, repos: dict[str, dict[str, bytes]]) -> None:
        self.repos = repos
        self.requests: list[tuple[str, str]] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:  # keep test output clean
                pass

            def do_HEAD(self) -> None:  # noqa: N802 - http.server's names
                hub._serve(self, body=False)

            def do_GET(self) -> None:  # noqa: N802
                hub._serve(self, body=True)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def downloads(self) -> list[str]:
        """The files whose bytes were sent (GET on a resolve URL)."""
        return [path.rsplit("/", 1)[-1] for method, path in self.requests if method == "GET" and "/resolve/" in path]

    def _serve(self, handler: BaseHTTPRequestHandler, *, body: bool) -> None:
        path = unquote(urlparse(handler.path).path)
        self.requests.append((handler.command, path))
        api = re.fullmatch(r"/api/models/([^/]+/[^/]+?)(?:/revision/[^/]+)?", path)
        tree = re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/[^/]+(?:/.*)?", path)
        resolve = re.fullmatch(r"/([^/]+/[^/]+)/resolve/[^/]+/(.+)", path)
        if tree and tree.group(1) in self.repos:
            files = self.repos[tree.group(1)]
            listing = [{"type": "file", "path": n, "size": len(d), "oid": _etag(d)} for n, d in files.items()]
            return self._send(handler, 200, json.dumps(listing).encode(), "application/json", body=body)
        if api and api.group(1) in self.repos:
            files = self.repos[api.group(1)]
            info = {"id": api.group(1), "modelId": api.group(1), "sha": COMMIT, "private": False,
                    "siblings": [{"rfilename": name} for name in files]}
            return self._send(handler, 200, json.dumps(info).encode(), "application/json", body=body)
        if resolve and resolve.group(1) in self.repos and resolve.group(2) in self.repos[resolve.group(1)]:
            data = self.repos[resolve.group(1)][resolve.group(2)]
            return self._send(handler, 200, data, "application/octet-stream", body=body,
                              headers={"X-Repo-Commit": COMMIT, "ETag": f'"{_etag(data)}"'})
        error = b'{"error": "Repository not found"}'
        return self._send(handler, 404, error, "application/json", body=body,
                          headers={"X-Error-Code": "RepoNotFound" if not resolve else "EntryNotFound"})

    @staticmethod
    def _send(handler: BaseHTTPRequestHandler, status: int, data: bytes, kind: str, *, body: bool,
              headers: dict[str, str] | None = None) -> None:
        handler.send_response(status)
        handler.send_header("Content-Type", kind)
        handler.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            handler.send_header(name, value)
        handler.end_headers()
        if body:
            handler.wfile.write(data)


def _etag(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
