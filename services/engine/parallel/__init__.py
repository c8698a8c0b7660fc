"""Tensor parallelism inside one engine: N model ranks over ``torch.distributed``.

The engine process is rank 0: it keeps the scheduler, the block manager and the sampler, and
runs its own shard of the model. Ranks 1..N-1 are worker processes (``local_workers`` starts
and watches them, ``workers`` is rank 0's view of the group; ``worker_main`` is their life
around the model) that receive each step's batch
(``step_broadcast``) and run theirs. The models shard themselves Megatron style through their
parallel layers (``models.parallel_layers``, ``models.partition``); ``group`` is the process
group those layers talk through.

When the ranks span pods (a LeaderWorkerSet), rank 0 starts only its own pod's: ``node_group``
says where each pod stands and which ranks it holds (one, or one pipeline stage), each pod's
process starts the rest of its pod's ranks, ``node_join`` is the leader's door (the join
handshake) and ``heartbeat`` the heartbeat links that turn a lost or hung pod, or a hung local
rank, into the group's end, as the pidfd watch does for a local rank's death.

Pipeline parallelism (``pipeline``) reuses all of this for P x T ranks: which ranks form which
stage, and the point-to-point hand-offs that carry a step from stage to stage.

This package imports nothing else of the engine: the models and the core build on it, and the
core names its workers' entry module (``services.engine.tp_worker``) when it starts them.
"""
