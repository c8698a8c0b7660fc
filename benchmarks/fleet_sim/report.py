"""Markdown tables and PNG plots of fleet-routing runs."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from benchmarks.fleet_sim.routing import ORACLE
from benchmarks.fleet_sim.simulator import RunResult

_COLORS = {
    "prefix": "tab:green",
    "least-loaded": "tab:orange",
    "round-robin": "tab:blue",
    ORACLE: "tab:gray",
}


def _ms(seconds: float) -> str:
    return "n/a" if math.isnan(seconds) else f"{seconds * 1000:.0f}"


def _num(value: float, fmt: str) -> str:
    return "n/a" if math.isnan(value) else format(value, fmt)


def markdown_table(results: Sequence[RunResult]) -> str:
    """One row per policy; ``vs oracle`` is the hit rate over the oracle's (same fleet)."""
    head = (
        "| engines | policy | requests | hit rate | vs oracle | TTFT mean ms | TTFT p99 ms "
        "| agent TTFT mean ms | vs RR (agent) | load max/mean | requests max/mean "
        "| utilization | wall s |"
    )
    lines = [head, "|" + "|".join("---" for _ in range(head.count("|") - 1)) + "|"]
    peers = {(r.engines, r.policy): r for r in results}  # compare within one fleet size
    for r in results:
        oracle = peers.get((r.engines, ORACLE))
        rr = peers.get((r.engines, "round-robin"))
        vs_oracle = f"{r.hit_rate / oracle.hit_rate:.1%}" if oracle and oracle.hit_rate else "n/a"
        agent = r.by_kind.get("agent")
        rr_agent = rr.by_kind.get("agent") if rr else None
        speedup = (
            f"{rr_agent.ttft_mean_s / agent.ttft_mean_s:.1f}x"
            if agent and rr_agent and agent.ttft_mean_s > 0
            else "n/a"
        )
        lines.append(
            f"| {r.engines} | {r.policy} | {r.requests} | {r.hit_rate:.1%} | {vs_oracle} "
            f"| {_ms(r.ttft_mean_s)} | {_ms(r.ttft_p99_s)} "
            f"| {_ms(agent.ttft_mean_s) if agent else 'n/a'} | {speedup} "
            f"| {_num(r.imbalance_load, '.2f')} | {r.imbalance_requests:.2f} "
            f"| {_num(r.utilization, '.0%')} | {r.wall_s:.0f} |"
        )
    return "\n".join(lines)


def kind_table(results: Sequence[RunResult]) -> str:
    """Hit rate and mean TTFT per kind of traffic."""
    kinds = sorted({k for r in results for k in r.by_kind})
    head = "| engines | policy | " + " | ".join(f"{k} hit / TTFT ms" for k in kinds) + " |"
    lines = [head, "|" + "|".join("---" for _ in range(head.count("|") - 1)) + "|"]
    for r in results:
        cells = []
        for k in kinds:
            s = r.by_kind.get(k)
            cells.append(f"{s.hit_rate:.0%} / {_ms(s.ttft_mean_s)}" if s else "n/a")
        lines.append(f"| {r.engines} | {r.policy} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results: Sequence[RunResult], path: Path, title: str) -> Path:
    """Four panels: hit rate, TTFT mean/p99, TTFT CDF, per-engine requests (sorted)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    names = [r.policy for r in results]
    colors = [_COLORS.get(n, "tab:purple") for n in names]
    x = list(range(len(results)))

    ax = axes[0][0]
    ax.bar(x, [r.hit_rate * 100 for r in results], color=colors)
    for i, r in enumerate(results):
        ax.text(i, r.hit_rate * 100 + 1, f"{r.hit_rate:.1%}", ha="center", fontsize=9)
    ax.set_xticks(x, names)
    ax.set_ylim(0, 105)
    ax.set_ylabel("prefix-cache hit rate (% of prompt tokens)")
    ax.set_title("fleet prefix-cache hit rate")

    ax = axes[0][1]
    w = 0.38
    ax.bar(
        [i - w / 2 for i in x],
        [r.ttft_mean_s * 1000 for r in results],
        w,
        color=colors,
        label="mean",
    )
    ax.bar(
        [i + w / 2 for i in x],
        [r.ttft_p99_s * 1000 for r in results],
        w,
        color=colors,
        alpha=0.45,
        hatch="//",
        label="p99",
    )
    ax.set_xticks(x, names)
    ax.set_ylabel("time to first token (ms)")
    ax.set_title("TTFT: mean (solid) and p99 (hatched)")

    ax = axes[1][0]
    for r, c in zip(results, colors, strict=False):
        n = len(r.ttfts)
        ax.plot(
            [t * 1000 for t in r.ttfts], [(i + 1) / n for i in range(n)], color=c, label=r.policy
        )
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (ms, log)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT distribution")
    ax.grid(alpha=0.3)
    ax.legend()

    ax = axes[1][1]
    for r, c in zip(results, colors, strict=False):
        loads = sorted(r.loads, reverse=True)
        mean = sum(loads) / len(loads) if loads else 0.0
        if mean > 0:
            ax.plot(
                range(len(loads)),
                [v / mean for v in loads],
                color=c,
                label=f"{r.policy} (max/mean {max(loads) / mean:.2f})",
            )
    ax.axhline(1.5, color="red", lw=0.8, ls="--")
    ax.set_xlabel("engine (sorted by load)")
    ax.set_ylabel("load / fleet mean")
    ax.set_title("load balance (time-averaged running + waiting per engine)")
    ax.legend(fontsize=8)

    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
