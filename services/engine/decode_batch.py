"""The running set as arrays while it does nothing but decode, one step after another.

The common step is a step of decodes: every running request computes its last token and
samples the next. Between two such steps (synchronous stepping) nothing changes but one token
per request, so what the scheduler's decode path reads and writes of each request (where it
starts, how long it is, how far its blocks reach, when its length ends it) follows from the
last step by array arithmetic. ``DecodeBatch`` keeps that, with the requests' own token lists,
so that scheduling the next step and applying its tokens are array operations and C-level
maps rather than Python passes reading a dozen attributes of every request: at 256 requests
those passes were most of the scheduler's share of a step, and most of it cache misses on the
request objects that the model's forward had evicted.

Every step of decodes is applied through one (``Scheduler._apply_decodes``). It belongs to one
running set, in its order. The scheduler keeps the one it built for the first step of decodes
after the set changed, drops the requests that finish from it, and throws it away on
anything else: an admission, a preemption, an abort, a step built by the general path, a step
still in flight (async scheduling), or a feature that sets lookahead tokens before schedules.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from services.engine.request import Request


@dataclass(slots=True, eq=False)
class DecodeBatch:
    requests: list[Request]
    # Per request: the position its last step computed (it computes ``starts + 1`` next),
    # its length (``len(token_ids)``), the length that ends it whatever the token
    # (``min(token_limit, max_model_len)``) and the tokens its blocks hold.
    starts: np.ndarray
    lengths: np.ndarray
    limits: np.ndarray
    capacity: np.ndarray
    token_lists: list[list[int]]  # each request's ``token_ids`` (appended in place)
    block_ids: list[list[int]]  # each request's block ids, the block manager's own list
    # Every request's stop tokens together: a token among them is checked by the exact rules
    # of its own request (the others' stop tokens do not end it).
    stop_ids: np.ndarray
    grammar_rows: list[int]  # the indices of requests with a grammar to advance
    last_tokens: list[int]  # the tokens the last step applied: the next step's inputs

    @classmethod
    def of(cls, requests: list[Request], starts: Sequence[int],
           block_ids: list[list[int]], max_model_len: int, block_size: int) -> DecodeBatch:
        """The requests of a step of decodes that computes ``starts``, before its tokens are
        applied (``append``)."""
        token_lists = [r.token_ids for r in requests]
        stop_ids = set().union(*(r.stop_token_set for r in requests))
        return cls(
            requests=requests,
            starts=np.array(starts, dtype=np.int64),
            lengths=np.fromiter(map(len, token_lists), dtype=np.int64, count=len(requests)),
            limits=np.minimum(np.array([r.token_limit for r in requests], dtype=np.int64),
                              max_model_len),
            capacity=np.fromiter(map(len, block_ids), dtype=np.int64,
                                 count=len(requests)) * block_size,
            token_lists=token_lists,
            block_ids=block_ids,
            stop_ids=np.array(sorted(stop_ids), dtype=np.int64),
            grammar_rows=[i for i, r in enumerate(requests) if r.grammar is not None],
            last_tokens=[],
        )

    def append(self, tokens: list[int]) -> np.ndarray:
        """Appends one token to each request's tokens; the indices whose new token or length
        may end them (the scheduler's exact rules decide)."""
        deque(map(list.append, self.token_lists, tokens), maxlen=0)
        self.last_tokens = tokens
        self.lengths += 1
        hit = self.lengths >= self.limits
        if len(self.stop_ids):
            arr = np.array(tokens, dtype=np.int64)
            if len(self.stop_ids) <= 4:
                for s in self.stop_ids:
                    hit |= arr == s
            else:
                hit |= np.isin(arr, self.stop_ids)
        return np.flatnonzero(hit)

    def keep(self, kept: Sequence[int]) -> None:
        """Only the requests at ``kept`` (in order) go on: the others finished."""
        idx = np.asarray(kept, dtype=np.int64)
        self.requests = [self.requests[i] for i in kept]
        self.token_lists = [self.token_lists[i] for i in kept]
        self.block_ids = [self.block_ids[i] for i in kept]
        self.last_tokens = [self.last_tokens[i] for i in kept]
        self.starts, self.lengths = self.starts[idx], self.lengths[idx]
        self.limits, self.capacity = self.limits[idx], self.capacity[idx]
        self.grammar_rows = [i for i, r in enumerate(self.requests) if r.grammar is not None]
