"""Multi-tenant request traces with token-id prompts.

A trace is a list of sessions. A session is one or more turns; each turn's prompt plus its
output is a prefix of the next turn's prompt (an agent appends the model's answer and a tool
result; a chat user appends the answer and a new message). So one token list per session,
``tokens``, holds every turn: turn k is ``tokens[:prompt_len + output_len]``, its prompt
``tokens[:prompt_len]``. ``hashes`` is the block-hash chain of ``tokens``
(``services.protocol.block_hash``), computed once and shared by every turn and every policy.

Kinds of traffic (shares of requests; mean lengths in tokens):

    kind    prompt                                          turns  output
    ------  ----------------------------------------------  -----  ------
    agent   tenant system prompt (1-2k) + task, then every   4-14  50-400
            turn appends the answer + a tool result (100-600)
    chat    one of a few long system prompts (0.8-2k)        1-3   100-600
            + a user message (20-200)
    rag     instructions + one of a small set of documents    1    100-400
            (1.5-4k, Zipf popularity) + a question (20-60)
    short   a unique short prompt (10-80)                     1    20-150

Turn k+1 of a session arrives ``think_s`` after turn k finishes (closed loop), so sessions
keep their shape whatever the policy; first turns arrive as a Poisson process.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from services.protocol.block_hash import BlockHash, BlockHasher

MODEL = "sim-model"
KINDS = ("agent", "chat", "rag", "short")
# Token ids are drawn from one shared list, so equal ids share one int object (memory).
_VOCAB = list(range(32_000))


@dataclass(frozen=True, slots=True)
class Turn:
    prompt_len: int
    output_len: int
    think_s: float  # delay between the previous turn's end and this turn's arrival (0: first)


@dataclass(slots=True)
class Session:
    sid: int
    kind: str
    start_s: float
    tokens: list[int]
    hashes: list[BlockHash]
    turns: list[Turn]

    @property
    def num_requests(self) -> int:
        return len(self.turns)


@dataclass(frozen=True, slots=True)
class TraceConfig:
    """What a trace holds. Rates are per engine, so a fleet of any size runs at one load."""

    duration_s: float = 40.0  # first turns arrive in [0, duration_s)
    requests_per_engine_s: float = 2.0  # offered request rate per engine (all turns counted)
    mix: tuple[float, float, float, float] = (0.5, 0.25, 0.15, 0.10)  # agent, chat, rag, short
    agent_tenants: int = 24
    chat_prompts: int = 6
    rag_documents: int = 40
    block_size: int = 16
    max_context: int = 12_000  # a session stops growing here
    length_scale: float = 1.0  # multiplies every length (prompts, outputs) in the table above
    seed: int = 0

    def __post_init__(self) -> None:
        if self.duration_s <= 0 or self.requests_per_engine_s <= 0:
            raise ValueError("duration_s and requests_per_engine_s must be > 0")
        if not 0 < self.length_scale <= 4:
            raise ValueError(f"length_scale must be in (0, 4], got {self.length_scale}")
        if len(self.mix) != len(KINDS) or min(self.mix) < 0 or sum(self.mix) <= 0:
            raise ValueError(f"mix must be {len(KINDS)} non-negative shares, got {self.mix}")


@dataclass(slots=True)
class Trace:
    config: TraceConfig
    engines: int
    sessions: list[Session] = field(default_factory=list)

    @property
    def num_requests(self) -> int:
        return sum(s.num_requests for s in self.sessions)

    def summary(self) -> dict[str, int]:
        out = dict.fromkeys(KINDS, 0)
        for s in self.sessions:
            out[s.kind] += s.num_requests
        return out


class _Gen:
    """Random token content; shared prefixes are built once and reused by reference."""

    def __init__(self, cfg: TraceConfig) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.hasher = BlockHasher(MODEL, cfg.block_size)
        self.agent_sys = [self.prefix(self.n(1000, 2000)) for _ in range(cfg.agent_tenants)]
        self.chat_sys = [self.prefix(self.n(800, 2000)) for _ in range(cfg.chat_prompts)]
        rag_head = self.words(self.n(100, 100))
        self.docs = [
            self.prefix(0, rag_head + self.words(self.n(1500, 4000)))
            for _ in range(cfg.rag_documents)
        ]
        # Zipf-like popularity (weight 1/rank) for tenants and documents.
        self.agent_w = [1.0 / (i + 1) ** 0.6 for i in range(cfg.agent_tenants)]
        self.doc_w = [1.0 / (i + 1) for i in range(cfg.rag_documents)]

    def n(self, low: int, high: int) -> int:
        """A length drawn from [low, high], scaled by ``length_scale``."""
        return max(1, round(self.rng.randint(low, high) * self.cfg.length_scale))

    def words(self, n: int) -> list[int]:
        return [_VOCAB[self.rng.randrange(1000, len(_VOCAB))] for _ in range(n)]

    def prefix(self, n: int, tokens: list[int] | None = None) -> tuple[list[int], list[BlockHash]]:
        tokens = self.words(n) if tokens is None else tokens
        return tokens, self.hasher.chain(tokens)

    def session(self, sid: int, kind: str, start: float) -> Session:
        r = self.rng
        turns: list[Turn] = []
        if kind == "agent":
            base, chain = r.choices(self.agent_sys, self.agent_w)[0]
            tokens = base + self.words(self.n(100, 300))
            for k in range(r.randint(4, 14)):
                if k:
                    tokens += self.words(self.n(100, 600))  # tool result / observation
                if len(tokens) + 400 > self.cfg.max_context:
                    break
                out = self.n(50, 400)
                turns.append(Turn(len(tokens), out, r.expovariate(1 / 1.5) if k else 0.0))
                tokens += self.words(out)
        elif kind == "chat":
            base, chain = r.choice(self.chat_sys)
            tokens = list(base)
            for k in range(r.randint(1, 3)):
                tokens += self.words(self.n(20, 200))
                out = self.n(100, 600)
                turns.append(Turn(len(tokens), out, r.expovariate(1 / 5.0) if k else 0.0))
                tokens += self.words(out)
        elif kind == "rag":
            base, chain = r.choices(self.docs, self.doc_w)[0]
            tokens = base + self.words(self.n(20, 60))
            out = self.n(100, 400)
            turns.append(Turn(len(tokens), out, 0.0))
            tokens += self.words(out)
        else:
            chain = []
            tokens = self.words(self.n(10, 80))
            out = self.n(20, 150)
            turns.append(Turn(len(tokens), out, 0.0))
            tokens += self.words(out)
        hashes = self.hasher.extend(list(chain), tokens)
        return Session(sid, kind, start, tokens, hashes, turns)


_MEAN_TURNS = {"agent": 9.0, "chat": 2.0, "rag": 1.0, "short": 1.0}


def make_trace(cfg: TraceConfig, engines: int) -> Trace:
    """The mixed multi-tenant trace for a fleet of ``engines``."""
    if engines <= 0:
        raise ValueError(f"engines must be > 0, got {engines}")
    gen = _Gen(cfg)
    total = sum(cfg.mix)
    # Session arrival rate per kind, so that kind's requests make up its share of the load.
    rates = [
        cfg.requests_per_engine_s * engines * share / total / _MEAN_TURNS[kind]
        for kind, share in zip(KINDS, cfg.mix, strict=True)
    ]
    trace = Trace(cfg, engines)
    sid = 0
    for kind, rate in zip(KINDS, rates, strict=True):
        if rate <= 0:
            continue
        t = gen.rng.expovariate(rate)
        while t < cfg.duration_s:
            trace.sessions.append(gen.session(sid, kind, t))
            sid += 1
            t += gen.rng.expovariate(rate)
    trace.sessions.sort(key=lambda s: s.start_s)
    return trace
