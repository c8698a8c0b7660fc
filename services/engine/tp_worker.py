"""``python -m services.engine.tp_worker``: a tensor-parallel worker rank (1..N-1).

Rank 0's ``ModelRunner`` starts it by this module's name through ``parallel.workers`` (which
never imports it: the engine's core depends on ``parallel``, not the other way round). The
process around the model (its arguments, the group, the step loop, failure) is
``parallel.worker_main``; here a rank builds its shard with the same ``ModelRunner`` as rank 0.
"""

from __future__ import annotations

from dataclasses import replace

from services.engine import pp_stage
from services.engine.config import EngineConfig
from services.engine.model_runner import ModelRunner
from services.engine.parallel.group import TPGroup
from services.engine.parallel.worker_main import StepFn, WorkerArgs, run_worker


def build(args: WorkerArgs, tp: TPGroup) -> StepFn:
    """This rank's runner, on its own device; its steps are rank 0's batches (a pipeline
    stage's come down the pipeline instead: ``pp_stage``)."""
    config, model_path = args.payload
    assert isinstance(config, EngineConfig)
    config = replace(config, device=args.device)
    if config.pipeline_parallel_size > 1:
        return pp_stage.worker(config, model_path, tp)
    runner = ModelRunner(config, model_path, tp=tp)
    return runner.forward_logits


if __name__ == "__main__":
    run_worker(build)
