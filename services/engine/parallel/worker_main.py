"""A tensor-parallel worker process (ranks 1..N-1): join the group, load the shard, run each
step rank 0 sends until told to stop. Started by ``workers.WorkerGroup``."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from services.common.child_process import die_with_parent
from services.engine.config import EngineConfig
from services.engine.parallel import group as tp_group
from services.engine.parallel.step_broadcast import receive_step

logger = logging.getLogger(__name__)

EXIT_CODE = 1  # a worker that fails, or whose engine is gone


@dataclass(frozen=True, slots=True)
class WorkerArgs:
    rank: int
    size: int
    port: int
    config: EngineConfig
    model_path: str
    log_level: int


def worker_main(args: WorkerArgs) -> None:
    """A worker process: join the group, load the shard, run steps until told to stop."""
    die_with_parent()
    from services.common.logs import setup_logging
    setup_logging(args.log_level, f"engine-tp{args.rank}")
    if os.getppid() == 1:  # the engine died before the death signal was armed
        os._exit(EXIT_CODE)
    from services.engine.model_runner import ModelRunner  # the worker's heavy imports

    try:
        store = tp_group.connect_store(args.port, args.size)
        device = args.config.torch_device()
        if device.type == "cuda":
            torch.cuda.set_device(device)
        tp = tp_group.join(args.rank, args.size, store, device)
        runner = ModelRunner(args.config, args.model_path, tp=tp)
        while (batch := receive_step(tp)) is not None:
            runner.forward_logits(batch)
        tp_group.leave()
    except BaseException:
        logger.exception("tensor-parallel worker rank %d failed", args.rank)
        logging.shutdown()
        os._exit(EXIT_CODE)
