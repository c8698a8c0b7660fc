"""A worker node of an engine whose ranks span pods: what ``python -m
services.engine.serving.server`` runs when ``--node-rank`` (or ``LWS_WORKER_INDEX``) is not 0.

It serves no requests and joins no router: it asks the leader to admit it
(``parallel.node_join``, which refuses another model, weights, dtype, version or engine flags),
starts the pod's other ranks when it holds several (one pipeline stage of
``tensor_parallel_size`` ranks), joins the group and runs its shard of every step
(``parallel.worker_main.run_node_worker``). Its only HTTP route is ``GET /health``: 503 while
it joins and loads, 200 once its shard is ready. It exits non-zero when it is refused, when the
leader dies or hangs, or on any failure, so Kubernetes restarts it and a LeaderWorkerSet with
``RecreateGroupOnPodRestart`` recreates the whole group.
"""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from services.engine.config import EngineConfig
from services.engine.model_runner import TP_WORKER_MODULE, group_identity, node_group
from services.engine.parallel.group import Rendezvous
from services.engine.parallel.local_workers import rank_device
from services.engine.parallel.worker_main import WorkerArgs, run_node_worker
from services.engine.serving.server_config import ServerConfig
from services.engine.tp_worker import build

logger = logging.getLogger(__name__)


class _Health(BaseHTTPRequestHandler):
    ready = threading.Event()  # set on the class of one server (one per process)
    rank = 0

    def do_GET(self) -> None:  # noqa: N802 -- http.server's name
        if self.path.split("?")[0] != "/health":
            self._answer(404, {"error": "not found"})
        elif self.ready.is_set():
            self._answer(200, {"status": "ok", "role": "worker", "node_rank": self.rank})
        else:
            self._answer(503, {"status": "joining", "role": "worker", "node_rank": self.rank})

    def _answer(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 -- probes: quiet
        pass


def run(engine_config: EngineConfig, server_config: ServerConfig, model_path: str) -> None:
    """The worker node from start to a clean stop (any failure exits the process)."""
    nodes = node_group(engine_config)
    assert nodes is not None and not nodes.is_leader
    _Health.rank = nodes.node_rank
    health = ThreadingHTTPServer((server_config.host, server_config.port), _Health)
    threading.Thread(target=health.serve_forever, name="health", daemon=True).start()
    logger.info("worker node rank=%d of %d (ranks %d..%d): joining the leader at %s:%d "
                "(health on :%d)", nodes.node_rank, nodes.nnodes, nodes.first_rank,
                nodes.first_rank + nodes.ranks_per_node - 1, nodes.master_addr,
                nodes.master_port, server_config.port)
    device = rank_device(engine_config.torch_device(), 0)
    # the rendezvous is learnt at admission (run_node_worker)
    args = WorkerArgs(nodes.first_rank, engine_config.world_size, Rendezvous(0), 0,
                      str(device), logging.getLogger().getEffectiveLevel(),
                      (engine_config, model_path))
    run_node_worker(args, nodes, group_identity(engine_config, model_path), TP_WORKER_MODULE,
                    build, _Health.ready.set)
    health.shutdown()
    logger.info("worker node rank=%d stopped", nodes.node_rank)
