"""Tensor parallelism inside one engine: N model ranks over ``torch.distributed``.

The engine process is rank 0: it keeps the scheduler, the block manager and the sampler, and
runs its own shard of the model. Ranks 1..N-1 are worker processes (``workers``) that receive
each step's batch (``step_broadcast``) and run theirs. The model code shards itself Megatron
style through the layers of ``layers`` (``partition`` says which heads and rows each rank
holds); ``group`` is the process group those layers talk through.
"""
