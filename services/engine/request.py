"""A request's state inside the engine: the only object scheduler, runner and engine share."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from services.engine.logit_bias import LogitBias
from services.engine.structured.masks import GrammarState
from services.protocol.block_hash import AdapterKey, BlockHash, BlockHasher
from services.protocol.engine_api import TokenLogprobs
from services.protocol.sampling_params import SamplingParams


class Adapter(Protocol):
    """What the core reads of the adapter a request runs under (an adapter feature's weights,
    which the feature alone opens): its name, and the key that salts its block hashes."""

    name: str
    key: AdapterKey


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        # By value: an Enum member hashes in Python, a str in C (this runs per request per step).
        return self._value_ in _FINISHED


_FINISHED = frozenset(
    status.value
    for status in (
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH,
        RequestStatus.FINISHED_ABORTED,
    )
)


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    hasher: BlockHasher
    max_tokens: int  # resolved: params.max_tokens, or what the context leaves
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0  # vLLM's: with --scheduling-policy priority a lower value goes first
    # prompt + output; the runner reads slices of it, so it is one list appended in place.
    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    # Scheduled but not applied yet (``Scheduler.update`` clears them): tokens a step computes,
    # and the tokens those steps sample ("placeholders": with async scheduling the next step is
    # scheduled while they are on their way, assuming one token per sampling step, as vLLM).
    num_scheduled_tokens: int = 0
    num_placeholders: int = 0
    # Tokens proposed past its last one, which the next step verifies (set before each
    # schedule by ``spec_proposers``; the verifier holds their values). 0 while it is
    # not decoding.
    num_lookahead_tokens: int = 0
    block_hashes: list[BlockHash] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_cached_tokens: int = -1  # prompt tokens served by the prefix cache at first schedule
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    generator: torch.Generator | None = None
    logit_bias: LogitBias | None = None  # params.logit_bias on the device
    # params.prompt_logprobs: one entry per prompt token scored so far (the first is None)
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    grammar: GrammarState | None = None  # structured outputs: where the output is in its grammar
    adapter: Adapter | None = None  # the model's adapter it runs under (None: the base model)
    adapter_deferred_steps: int = 0  # steps its adapter did not fit (the scheduler's admission)
    # Its row in the runner's persistent input batch while it has one (-1: none); written by
    # ``InputBatch`` only.
    batch_row: int = -1
    # Tokens that may end it (EOS unless ignore_eos, and stop_token_ids): the scheduler's
    # one-lookup test of every new token before the exact rules (min_tokens, which kind).
    stop_token_set: frozenset[int] = field(init=False)
    # Its length once max_tokens are out: the scheduler's length test, one comparison.
    token_limit: int = field(init=False)
    # Timestamps (monotonic seconds) for metrics and traces.
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    # The client's params for the KV connector until it finishes, then what the connector
    # returned (P/D: where its blocks can be fetched).
    kv_transfer_params: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        eos = () if self.params.ignore_eos else self.eos_token_ids
        self.stop_token_set = frozenset((*eos, *self.params.stop_token_ids))
        self.token_limit = len(self.prompt_token_ids) + self.max_tokens
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]  # nothing predicts the first prompt token
        self.hasher.extend(self.block_hashes, self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """Its output so far, a copy: the tail of ``token_ids``, the one list a step appends
        to (a second list per request cost a step of 256 decodes tens of microseconds)."""
        return self.token_ids[len(self.prompt_token_ids):]

    def append_output_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.hash_full_blocks()

    def hash_full_blocks(self) -> None:
        """Hashes the blocks that the tokens appended since filled: a block is hashed as
        soon as it is full, so the block manager can cache it."""
        if len(self.token_ids) // self.hasher.block_size > len(self.block_hashes):
            self.hasher.extend(self.block_hashes, self.token_ids)

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.is_finished else None
