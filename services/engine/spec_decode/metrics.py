"""Speculative decoding's counters, under vLLM's metric names (``vllm:spec_decode_*``).

Per step, for each request that had drafts verified: one draft (``num_drafts``), its draft
tokens (``num_draft_tokens``), how many the target accepted (``num_accepted_tokens``), and at
each draft position whether it was accepted (``num_accepted_tokens_per_pos``, labelled
``position``). Counted from the rejection sampler's verdicts, before stop checks cut a run.
Invariants: the per-position counts sum to the accepted total and never increase with the
position; the mean acceptance length is ``1 + accepted / drafts``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily


@dataclass(slots=True)
class SpecDecodeStats:
    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.accepted_per_position:
            self.accepted_per_position = [0] * self.num_speculative_tokens

    def observe(self, num_drafts: Sequence[int], num_accepted: Sequence[int]) -> None:
        """One step: each verified request's draft count and accepted count."""
        per_pos = self.accepted_per_position
        for k, a in zip(num_drafts, num_accepted, strict=True):
            if not k:
                continue
            self.num_drafts += 1
            self.num_draft_tokens += k
            self.num_accepted_tokens += a
            for j in range(a):
                per_pos[j] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verified request-step: ``1 + accepted / drafts`` (1.0 before any)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def snapshot(self) -> SpecDecodeStats:
        return SpecDecodeStats(self.num_speculative_tokens, self.num_drafts,
                               self.num_draft_tokens, self.num_accepted_tokens,
                               list(self.accepted_per_position))


def metric_families(model: str, engine: str, spec: SpecDecodeStats) -> Iterator:
    """vLLM's speculative-decoding counters (names, documentation, labels) for a Prometheus
    collector."""
    labels, values = ["model_name", "engine"], [model, engine]
    for name, doc, value in (
        ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", spec.num_drafts),
        ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", spec.num_draft_tokens),
        ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
         spec.num_accepted_tokens),
    ):
        c = CounterMetricFamily(name, doc, labels=labels)
        c.add_metric(values, value)
        yield c
    c = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                            "Accepted tokens per draft position.", labels=[*labels, "position"])
    for position, value in enumerate(spec.accepted_per_position):
        c.add_metric([*values, str(position)], value)
    yield c
