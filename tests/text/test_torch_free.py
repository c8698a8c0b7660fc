"""The gateway and the router load tokenizers without torch (``services.text.torch_free``):
the same tokens and chat prompts as with it, and the running processes never map libtorch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from services.text.tokenizer import Tokenizer
from tests.support.redis_server import RedisServer
from tests.support.services import ServiceProcess

MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Héllo, wörld! 你好 🚀 " * 3}]
TEXT = "The quick brown fox — naïve café, 12345 tokens\n\tindented"

_CHILD = """
import json, sys
from services.text.torch_free import hide_torch
hide_torch()
from services.text.tokenizer import Tokenizer
tok = Tokenizer(sys.argv[1])
messages, text = json.loads(sys.argv[2]), sys.argv[3]
ids = tok.encode(text)
try:
    import torch  # noqa: F401
    imported = True
except ImportError:
    imported = False
print(json.dumps({"encode": ids, "decode": tok.decode(ids), "chat": tok.encode_chat(messages),
                  "vocab": tok.vocab_size, "eos": sorted(tok.eos_token_ids),
                  "torch": imported}))
"""


def test_tokenizer_without_torch_is_the_same(default_model_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(default_model_path), json.dumps(MESSAGES), TEXT],
        capture_output=True, text=True, timeout=120, check=True,
    )
    child = json.loads(out.stdout)
    tok = Tokenizer(default_model_path)  # this process has torch
    ids = tok.encode(TEXT)
    assert child == {"encode": ids, "decode": tok.decode(ids), "chat": tok.encode_chat(MESSAGES),
                     "vocab": tok.vocab_size, "eos": sorted(tok.eos_token_ids), "torch": False}


def _maps_torch(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def test_gateway_and_picker_processes_never_load_torch(default_model_path: Path) -> None:
    tokenizer = f"SmolLM2-135M-Instruct={default_model_path}"
    with RedisServer() as redis:
        router = ServiceProcess("services.router", [
            "--redis-url", redis.url, "--ext-proc-port", "0", "--tokenizer", tokenizer]).start()
        gateway = ServiceProcess("services.gateway", [
            "--router-url", router.url, "--model", tokenizer]).start()
        try:
            assert not _maps_torch(router.proc.pid)
            assert not _maps_torch(gateway.proc.pid)
        finally:
            gateway.stop()
            router.stop()
