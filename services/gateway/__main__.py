"""``python -m services.gateway [--help]``: serves the OpenAI-compatible API."""

from __future__ import annotations

import dataclasses
import logging
import sys
from collections.abc import Sequence

from aiohttp import web

from services.common.default_model import DEFAULT_MODEL_NAME, converted_default_model
from services.common.internal_auth import MissingCredential
from services.common.logs import setup_logging
from services.gateway.config import GatewayConfig, ModelSpec
from services.gateway.server import create_app
from services.text.torch_free import hide_torch

logger = logging.getLogger("services.gateway")

_GRACE_AFTER_DRAIN_S = 5.0  # for handlers ended by the drain to write their last event


def _with_default_model(config: GatewayConfig) -> GatewayConfig:
    if config.models:
        return config
    spec = ModelSpec(DEFAULT_MODEL_NAME, str(converted_default_model()))
    return dataclasses.replace(config, models=(spec,))


def main(argv: Sequence[str] | None = None) -> int:
    hide_torch()  # tokenizers only: a faster start, a smaller process
    config = GatewayConfig.from_args(argv)
    setup_logging(config.log_level, "gateway")
    try:
        config = _with_default_model(config)
    except FileNotFoundError as exc:
        logger.error("%s", exc)
        return 2
    try:
        app = create_app(config)
    except MissingCredential as exc:
        logger.error("%s", exc)
        return 2
    web.run_app(
        app,
        host=config.host,
        port=config.port,
        handler_cancellation=True,
        keepalive_timeout=config.keepalive_timeout,
        shutdown_timeout=_GRACE_AFTER_DRAIN_S,
        print=None,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
