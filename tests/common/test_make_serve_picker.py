"""`make serve EXT_PROC_PORT=N` (issue 35): the variable becomes serve's --ext-proc-port, and serve
starts the router with the picker on that port, on loopback, with the model's tokenizer; the
router's own parser reads the flags back. ``make -n`` runs nothing."""

from __future__ import annotations

from pathlib import Path

from services.router.config import RouterConfig, tokenizer_dirs
from services.serve import args_from, router_flags
from tests.common.test_make_serve_lora import _serve_argv


def test_make_serve_starts_the_picker() -> None:
    config, _ = args_from(_serve_argv("EXT_PROC_PORT=9002"))
    assert config.ext_proc_port == 9002
    flags = router_flags(config, 8100, "redis://127.0.0.1:6390/0", ["http://127.0.0.1:8201"],
                         "SmolLM2", Path("/models/SmolLM2"))
    router = RouterConfig.from_args(flags)
    assert (router.host, router.ext_proc_port) == ("127.0.0.1", 9002)
    assert tokenizer_dirs(router.tokenizer) == {"SmolLM2": "/models/SmolLM2"}


def test_without_the_variable_the_picker_is_off() -> None:
    config, _ = args_from(_serve_argv())
    assert config.ext_proc_port == 0
    flags = router_flags(config, 8100, "redis://127.0.0.1:6390/0", [], "m", Path("/m"))
    assert RouterConfig.from_args(flags).ext_proc_port == 0
