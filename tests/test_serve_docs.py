"""The serving examples of README.md and docs/serving.md run against a real server on a tiny model.

Their ```py blocks (the openai client) and curl lines talk to 127.0.0.1:8000; here that address is
rewritten to the test server's port. `python` blocks are left to tests/test_docs.py, which has no
server, so the client examples are fenced as `py`. The Ray example of docs/serving.md asks for GPUs
and is not run here (tests/test_serve_ray.py runs Ray itself).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("openai", reason="the serve tests need the openai client (pip install -e '.[test]')")
pytest.importorskip("sse_starlette", reason="the server needs the serve extra (pip install -e '.[serve]')")

from kjarni import registry, sources  # noqa: E402
from kjarni.generator import Generator  # noqa: E402
from kjarni.serve import create_app  # noqa: E402
from tests.serve_fixtures import running_server  # noqa: E402
from tests.test_api import make_tiny_model  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ADDRESS = "127.0.0.1:8000"


def serving_text(path: Path) -> str:
    text = path.read_text(encoding="utf-8")
    return text.split("## Serve\n", 1)[1].split("\n## ", 1)[0] if path.name == "README.md" else text


def examples(path: Path) -> tuple[list[str], list[str]]:
    """(``py`` blocks without Ray, curl commands) of the serving part of ``path``."""
    text = serving_text(path)
    blocks = [b for b in re.findall(r"^```py\n(.*?)^```", text, re.DOTALL | re.MULTILINE) if "ray" not in b]
    bash = re.findall(r"^```bash\n(.*?)^```", text, re.DOTALL | re.MULTILINE)
    curls = [c for block in bash for c in block.replace("\\\n", " ").splitlines() if c.startswith("curl ")]
    return blocks, curls


@pytest.fixture(scope="module")
def server_url(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    tiny = make_tiny_model(tmp_path_factory.mktemp("docs-serve"))
    original = sources.resolve

    def resolve_to_tiny(name_or_path, **kwargs):  # noqa: ANN001, ANN003, ANN202
        entry = registry.find_entry(str(name_or_path))
        return sources.ModelSource(entry.name, tiny, entry)

    sources.resolve = resolve_to_tiny
    try:
        generator = Generator.builder(registry.DEFAULT_MODEL).cpu().quiet().build()
    finally:
        sources.resolve = original
    with running_server(create_app(generator)) as url:
        yield url


@pytest.mark.parametrize("path", [REPO / "README.md", REPO / "docs" / "serving.md"], ids=lambda p: p.name)
def test_the_client_examples_run(path: Path, server_url: str) -> None:
    blocks, curls = examples(path)
    assert blocks and curls, f"{path.name} lost its client examples"
    address = server_url.removeprefix("http://")
    for number, block in enumerate(blocks, 1):
        assert ADDRESS in block
        exec(compile(block.replace(ADDRESS, address), f"{path.name} py block {number}", "exec"), {"__name__": "__docs__"})  # noqa: S102
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed; the py examples ran")
    for line in curls:
        assert ADDRESS in line
        result = subprocess.run(["bash", "-c", line.replace(ADDRESS, address)], capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        reply = json.loads(result.stdout)
        assert reply["object"] == "chat.completion" and reply["choices"][0]["finish_reason"] in ("stop", "length")
