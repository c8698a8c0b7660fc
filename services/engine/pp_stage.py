"""Pipeline parallelism in the engine: each rank's stage, and the loop of the ranks that are
not rank 0.

Rank 0 (the engine process, or the leader pod) runs the last stage and samples; it starts (or
admits) the other P x T - 1 ranks as tensor parallelism does (``parallel.workers``), then every
rank finds its stage (``join``: ``parallel.pipeline`` says which ranks form which stage) and
loads only that stage's layers (``models.pipeline_stage``). A step goes down the stages
(``launch``: rank 0 hands its batch to stage 0) and comes back to rank 0 as the hidden states
its own layers, the norm and the LM head finish (``last_stage_input``). The other ranks run
``StageLoop``: receive, run their layers, hand on; at ``stop`` the stop message goes down the
same way, after the batches in flight, and then the ranks leave as tensor-parallel workers do.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from services.engine.config import EngineConfig
from services.engine.models.config import ModelConfig
from services.engine.models.pipeline_stage import (
    IntermediateTensors,
    PipelineStage,
    layer_ranges,
    stage_of,
)
from services.engine.parallel.group import TPGroup
from services.engine.parallel.pipeline import (
    PipelineRank,
    StageLink,
    payload_limit,
    stage_group,
)
from services.engine.parallel.step_broadcast import StepBatch
from services.engine.parallel.worker_main import RankLoop

if TYPE_CHECKING:
    from services.engine.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def check_layers(config: EngineConfig, model_path: str) -> None:
    """Before any rank starts: every stage gets at least one layer (a ``ValueError``)."""
    layer_ranges(ModelConfig.from_hf_dir(model_path).num_layers, config.pipeline_parallel_size)


def join(world: TPGroup, config: EngineConfig, model_path: str) -> tuple[StageLink, TPGroup]:
    """This rank's link to its neighbour stages and its stage's tensor-parallel group (every
    rank calls it once the world's group stands)."""
    where = PipelineRank(world.rank, config.pipeline_parallel_size, config.tensor_parallel_size)
    mc = ModelConfig.from_hf_dir(model_path)
    max_len = config.max_model_len or mc.max_position_embeddings
    limit = payload_limit(config.max_num_batched_tokens, config.max_num_seqs,
                          -(-max_len // config.block_size))
    tp = stage_group(world, where, config.torch_device())
    return StageLink(where, world, mc.hidden_size, config.torch_dtype(), limit), tp


def stage_of_rank(link: StageLink, model_path: str) -> PipelineStage:
    num_layers = ModelConfig.from_hf_dir(model_path).num_layers
    return stage_of(num_layers, link.where.stage, link.where.pp)


def launch(runner: ModelRunner, batch: StepBatch) -> None:
    """Rank 0: ``batch`` goes to stage 0 now; its result comes back in order."""
    link = runner.pipeline
    assert link is not None and runner.workers is not None
    try:
        link.submit(batch)
    except RuntimeError as exc:  # a rank is gone (gloo says so): the group cannot go on
        runner.workers.abort(f"a pipeline step could not be sent ({type(exc).__name__}: {exc})")


def last_stage_input(link: StageLink, batch: StepBatch) -> IntermediateTensors:
    """Rank 0: the previous stage's output for ``batch`` (sent now if ``launch`` did not)."""
    if not link.submitted(batch):
        link.submit(batch)
    return IntermediateTensors(*link.receive_output(batch))


def stop(runner: ModelRunner) -> None:
    """Rank 0, at close: finishes the batches in flight (their results are dropped: the ranks
    of the last stage take part in their LM head) and sends the stop down the stages."""
    link = runner.pipeline
    assert link is not None
    try:
        while link.in_flight:
            runner.forward_logits(link.oldest)
        link.stop()
    except RuntimeError:  # a rank died meanwhile: the workers' close ends the rest
        logger.warning("could not tell the pipeline stages to stop")
    logger.info("%s", link.idle.describe(link.where))


class StageLoop(RankLoop):
    """A rank other than 0: runs its stage of every batch until the stop comes down."""

    def __init__(self, runner: ModelRunner) -> None:
        assert runner.pipeline is not None
        self.runner, self.link = runner, runner.pipeline

    def run(self) -> None:
        while (got := self.link.receive()) is not None:
            batch, received = got
            self.runner.run_stage(batch, None if received is None
                                  else IntermediateTensors(*received))
        self.link.close()
        logger.info("%s", self.link.idle.describe(self.link.where))


def worker(config: EngineConfig, model_path: str, world: TPGroup) -> StageLoop:
    """A pipeline rank's step loop (``tp_worker.build``), its stage loaded."""
    from services.engine.model_runner import ModelRunner  # the runner imports this module

    link, tp = join(world, config, model_path)
    return StageLoop(ModelRunner(config, model_path, tp=tp, pipeline=link))
