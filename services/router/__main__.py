"""``python -m services.router --help``"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from aiohttp import web

from services.common.internal_auth import MissingCredential
from services.common.logs import setup_logging
from services.router.config import RouterConfig
from services.router.server import create_app
from services.text.torch_free import hide_torch


def main(argv: Sequence[str] | None = None) -> int:
    hide_torch()  # tokenizers only: a faster start, a smaller process
    config = RouterConfig.from_args(argv)
    setup_logging(config.log_level, "router")
    try:
        app = create_app(config)
    except MissingCredential as exc:
        logging.getLogger("services.router").error("%s", exc)
        return 2
    # run_app handles SIGINT/SIGTERM: stop accepting, finish running handlers, run cleanup_ctx.
    web.run_app(app, host=config.host, port=config.port, print=None, shutdown_timeout=10.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
