"""Runs the load test headless against a running stack and writes CSVs and a PNG report.

    .venv/bin/python loadtest/run.py [--host http://127.0.0.1:8000] [--run-time 60s] [--users 8]

Start the stack first (``make serve``, or ``.venv/bin/python -m services.serve --port 8000``).
Output in ``--out`` (default loadtest/results/, git-ignored):

    locust_stats.csv, locust_stats_history.csv, locust_failures.csv, locust_exceptions.csv
                    locust's own CSVs (--csv --csv-full-history): the HTTP requests plus the
                    custom TTFT / ITL / E2E / CACHE% rows of every scenario
    requests.jsonl  one line per finished request (scenario, TTFT, ITLs, tokens, cached tokens)
    report.png      throughput, TTFT p50/p90/p99 and the cache-hit ratio over time
    summary.md      the per-scenario table printed at the end

Exits with locust's exit code (1 when any request failed).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import urllib.request
from collections import defaultdict
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
USER_CLASSES = ("ChatUser", "AgentUser", "RAGUser", "CompletionUser")


def parse_seconds(text: str) -> int:
    """'90', '90s', '2m', '1h30m' -> seconds (locust's --run-time syntax)."""
    if text.isdigit():
        return int(text)
    parts = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?", text.strip())
    if not parts or not any(parts.groups()):
        raise argparse.ArgumentTypeError(f"bad duration {text!r}: use e.g. 60s, 2m, 1h30m")
    h, m, s = (int(g or 0) for g in parts.groups())
    return h * 3600 + m * 60 + s


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="http://127.0.0.1:8000", help="the gateway's base URL")
    p.add_argument("--run-time", type=parse_seconds, default=60, help="e.g. 60s, 5m")
    p.add_argument("--users", type=int, default=8, help="concurrent users (spread over classes)")
    p.add_argument("--spawn-rate", type=float, default=None, help="users started per second")
    p.add_argument("--model", default=os.environ.get("PAGODA_MODEL", "SmolLM2-135M-Instruct"))
    p.add_argument("--max-tokens", type=int, default=32, help="max_tokens of every request")
    p.add_argument("--prompt-scale", type=float, default=1.0, help="multiplies long prompts")
    p.add_argument("--agent-turns", type=int, default=8, help="turns per agent session")
    p.add_argument("--user-classes", nargs="+", choices=USER_CLASSES, default=list(USER_CLASSES))
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer key")
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--stop-timeout", type=int, default=60, help="seconds to let streams finish")
    p.add_argument("--report-only", action="store_true", help="remake the report from --out")
    return p


def check_stack(host: str, model: str, api_key: str | None) -> None:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with urllib.request.urlopen(f"{host}/health", timeout=5) as r:
            if r.status != 200:
                raise SystemExit(f"{host}/health answered {r.status}")
        req = urllib.request.Request(f"{host}/v1/models", headers=headers)
        with urllib.request.urlopen(req, timeout=5) as r:
            ids = [m.get("id") for m in json.load(r).get("data", [])]
    except OSError as exc:
        raise SystemExit(f"no stack at {host} ({exc}); start one with `make serve`") from None
    if model not in ids:
        raise SystemExit(f"model {model!r} is not served at {host}; it serves {ids}")


def run_locust(args: argparse.Namespace, log: Path) -> int:
    spawn = args.spawn_rate or max(1.0, args.users / 5)
    cmd = [
        sys.executable, "-m", "locust",
        "-f", str(HERE / "locustfile.py"),
        "--headless",
        "--host", args.host,
        "--users", str(args.users),
        "--spawn-rate", str(spawn),
        "--run-time", f"{args.run_time}s",
        "--stop-timeout", str(args.stop_timeout),
        "--csv", str(args.out / "locust"),
        "--csv-full-history",
        "--only-summary",
        *args.user_classes,
    ]  # fmt: skip
    env = {
        **os.environ,
        "PAGODA_MODEL": args.model,
        "PAGODA_MAX_TOKENS": str(args.max_tokens),
        "PAGODA_PROMPT_SCALE": str(args.prompt_scale),
        "PAGODA_AGENT_TURNS": str(args.agent_turns),
        "PAGODA_LOADTEST_LOG": str(log),
    }
    if args.api_key:
        # locust's HttpSession sends no auth by itself; the locustfile reads this header.
        env["PAGODA_LOADTEST_AUTH"] = f"Bearer {args.api_key}"
    print("$", " ".join(cmd), flush=True)
    return subprocess.call(cmd, env=env)


# -- report ---------------------------------------------------------------------------------------


def _pct(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def load_rows(log: Path) -> list[dict[str, Any]]:
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def summary_table(rows: list[dict[str, Any]], run_s: float) -> str:
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        groups[r["scenario"]].append(r)
    groups["all"] = rows
    head = (
        "| scenario | requests | req/s | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | ITL p50 ms "
        "| ITL p99 ms | output tok/s | cache hit |"
    )
    lines = [head, "|" + "|".join("---" for _ in range(head.count("|") - 1)) + "|"]
    for name, rs in groups.items():
        ttft = [r["ttft_s"] * 1000 for r in rs if r["ttft_s"] is not None]
        itl = [g * 1000 for r in rs for g in r["itl_s"]]
        prompt = sum(r["prompt_tokens"] for r in rs)
        cached = sum(r["cached_tokens"] for r in rs)
        out = sum(r["completion_tokens"] for r in rs)
        lines.append(
            f"| {name} | {len(rs)} | {len(rs) / run_s:.2f} | {_pct(ttft, 0.5):.0f} "
            f"| {_pct(ttft, 0.9):.0f} | {_pct(ttft, 0.99):.0f} | {_pct(itl, 0.5):.1f} "
            f"| {_pct(itl, 0.99):.1f} | {out / run_s:.1f} "
            f"| {cached / prompt if prompt else math.nan:.1%} |"
        )
    return "\n".join(lines)


def plot_report(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """Three panels over time: throughput, TTFT percentiles, cache-hit ratio, each over a
    sliding window (a tenth of the run, at least 5 s) sampled every quarter window."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = min(r["t"] for r in rows)
    end = max(r["t"] + r["e2e_s"] for r in rows) - t0
    window = max(5.0, end / 10)
    step = window / 4
    times = [
        min(end, window) + i * step for i in range(max(1, math.ceil((end - window) / step)) + 1)
    ]
    done_at = [(r["t"] + r["e2e_s"] - t0, r) for r in rows]
    first_at = [(r["t"] + r["ttft_s"] - t0, r["ttft_s"] * 1000) for r in rows if r["ttft_s"]]
    scenarios = sorted({r["scenario"] for r in rows})

    def within(t: float, at: float) -> bool:
        return t - window < at <= t

    reqs, toks = [], []
    ttft: dict[float, list[float]] = {0.5: [], 0.9: [], 0.99: []}
    hit: dict[str, list[float]] = {s: [] for s in [*scenarios, "all"]}
    for t in times:
        finished = [r for at, r in done_at if within(t, at)]
        reqs.append(len(finished) / window)
        toks.append(sum(r["completion_tokens"] for r in finished) / window)
        firsts = [v for at, v in first_at if within(t, at)]
        for q, ys in ttft.items():
            ys.append(_pct(firsts, q))
        for s, ys in hit.items():
            mine = [r for r in finished if s in ("all", r["scenario"])]
            prompt = sum(r["prompt_tokens"] for r in mine)
            ys.append(100 * sum(r["cached_tokens"] for r in mine) / prompt if prompt else math.nan)

    fig, axes = plt.subplots(3, 1, figsize=(11, 11), sharex=True)
    ax = axes[0]
    ax.plot(times, reqs, "o-", label="requests/s")
    ax.set_ylabel("requests/s")
    ax.set_ylim(bottom=0)
    ax2 = ax.twinx()
    ax2.plot(times, toks, "s--", color="tab:orange", label="output tokens/s")
    ax2.set_ylabel("output tokens/s")
    ax2.set_ylim(bottom=0)
    ax.set_title("throughput (finished requests)")
    ax.legend(loc="upper left")
    ax2.legend(loc="upper right")

    ax = axes[1]
    for (q, ys), style in zip(ttft.items(), ("o-", "s-", "^-"), strict=False):
        ax.plot(times, ys, style, label=f"p{round(q * 100)}")
    ax.set_ylabel("time to first token (ms)")
    ax.set_ylim(bottom=0)
    ax.set_title("TTFT percentiles (by first-token time)")
    ax.legend()
    ax.grid(alpha=0.3)

    ax = axes[2]
    for s, ys in hit.items():
        ax.plot(times, ys, "o-" if s == "all" else ".--", lw=2.5 if s == "all" else 1, label=s)
    ax.set_ylim(-2, 102)
    ax.set_ylabel("cached / prompt tokens (%)")
    ax.set_xlabel(f"seconds since start (each point: the {window:.0f} s before it)")
    ax.set_title("prefix-cache hit ratio (token-weighted)")
    ax.legend()
    ax.grid(alpha=0.3)

    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def report(args: argparse.Namespace, log: Path) -> None:
    rows = load_rows(log)
    if not rows:
        print(f"no finished requests in {log}: nothing to report")
        return
    run_s = max(1e-9, max(r["t"] + r["e2e_s"] for r in rows) - min(r["t"] for r in rows))
    table = summary_table(rows, run_s)
    (args.out / "summary.md").write_text(table + "\n")
    title = (
        f"Pagoda load test: {args.host}, {args.users} users, {args.run_time}s, "
        f"model {args.model}, max_tokens {args.max_tokens}"
    )
    plot_report(rows, args.out / "report.png", title)
    print()
    print(table)
    print(f"\nreport: {args.out / 'report.png'}\nCSVs:   {args.out}/locust_*.csv")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "requests.jsonl"
    code = 0
    if not args.report_only:
        check_stack(args.host.rstrip("/"), args.model, args.api_key)
        log.unlink(missing_ok=True)
        code = run_locust(args, log)
    report(args, log)
    return code


if __name__ == "__main__":
    sys.exit(main())
