"""The HorizontalPodAutoscaler's replica calculation, in pure Python, to replay an autoscaling
policy on metrics scraped from a real stack.

For a metric of target type AverageValue (what KEDA's Prometheus trigger gives the HPA), the
controller (kubernetes pkg/controller/podautoscaler, ``GetMetricReplicas``) computes

    usage_ratio = (metric_total / current_replicas) / target_per_replica
    desired     = current_replicas                        if |usage_ratio - 1| <= tolerance
                  ceil(usage_ratio * current_replicas)    otherwise

with the default tolerance 0.1, then clamps to [min, max] (not modelled: the tests compare
whether a policy asks for more replicas at all).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DEFAULT_TOLERANCE = 0.1


@dataclass(frozen=True, slots=True)
class AverageValuePolicy:
    """Scale on ``metric_total`` with ``target`` per replica."""

    name: str
    target: float
    tolerance: float = DEFAULT_TOLERANCE

    def desired(self, current: int, metric_total: float) -> int:
        assert current > 0 and self.target > 0
        ratio = metric_total / current / self.target
        if abs(ratio - 1.0) <= self.tolerance:
            return current
        return math.ceil(ratio * current)

    def wants_more(self, current: int, metric_total: float) -> bool:
        return self.desired(current, metric_total) > current
