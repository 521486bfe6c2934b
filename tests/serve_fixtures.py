"""A real uvicorn server on 127.0.0.1 (a random free port) in a thread, for the serve tests."""

from __future__ import annotations

import contextlib
import socket
import threading
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from tests.test_api import write_tiny_tokenizer
from tests.tiny_models import random_state_dict, save_safetensors_model, tiny_config


@contextlib.contextmanager
def running_server(app: Any) -> Iterator[str]:
    """Serve ``app`` until the block ends; yields the base URL (``http://127.0.0.1:PORT``).

    The socket is bound and listening before uvicorn starts, so clients can connect at once
    (the kernel queues them) without waiting for a readiness signal.
    """
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn-test", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        sock.close()


def make_endless_model(folder: Path) -> Path:
    """A model that never ends a turn: its only non-zero logits are +h and -h on the letters a and b
    (h the first component of the final hidden state), so greedy writes a or b until max_tokens."""
    from tokenizers import Tokenizer

    config = tiny_config(vocab_size=300, max_position_embeddings=8192)
    tensors = random_state_dict(config, seed=3)
    norm = np.zeros_like(tensors["model.norm.weight"])
    norm[0] = 1.0
    tensors["model.norm.weight"] = norm
    folder.mkdir(parents=True, exist_ok=True)
    write_tiny_tokenizer(folder)  # with the tiny ChatML template
    ids = Tokenizer.from_file(str(folder / "tokenizer.json"))
    head = np.zeros_like(tensors["lm_head.weight"])
    head[ids.token_to_id("a"), 0], head[ids.token_to_id("b"), 0] = 1.0, -1.0
    tensors["lm_head.weight"] = head
    return save_safetensors_model(folder, config, tensors)
