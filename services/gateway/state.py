"""The gateway app's typed state: built in ``server.create_app``'s cleanup context."""

from __future__ import annotations

from concurrent.futures import Executor
from dataclasses import dataclass, field

from aiohttp import web

from services.common.flow_control import FlowController
from services.gateway.config import GatewayConfig
from services.gateway.generation import Generation, Upstreams
from services.gateway.metrics import GatewayMetrics
from services.gateway.models import ModelRegistry
from services.gateway.router_client import Routing


@dataclass(slots=True)
class GatewayState:
    config: GatewayConfig
    models: ModelRegistry
    router: Routing  # the router, or one pinned engine (--engine-url)
    upstreams: Upstreams
    metrics: GatewayMetrics
    tokenize_pool: Executor
    flow: FlowController
    generations: set[Generation] = field(default_factory=set)  # open ones, for shutdown


STATE = web.AppKey("state", GatewayState)
# request[MODEL_LABEL]: the served model a request was for, as the metrics label.
MODEL_LABEL = web.RequestKey("model_label", str)
