"""benchmarks/engine_throughput.py's ``--against``: the pairs' arithmetic, and the baseline's
checkout (the same script in a worktree of the commit, gone afterwards)."""

from __future__ import annotations

import subprocess

import pytest

from benchmarks.engine_throughput import REPO, checkout_of, pair_summary


def result(step: float, model: float) -> dict:
    return {"ms_per_step": step, "model_ms_per_step": model}


def test_the_summary_takes_each_pairs_own_ratio_and_the_medians() -> None:
    pairs = [
        (result(3.0, 1.5), result(2.25, 1.5)),  # rest 1.5 -> 0.75: 0.5
        (result(4.0, 2.0), result(3.2, 2.4)),  # a slow moment on both sides: 2.0 -> 0.8: 0.4
        (result(3.2, 1.6), result(2.6, 2.0)),  # 1.6 -> 0.6: 0.375
    ]
    s = pair_summary(pairs)
    assert s["rest_ratio"] == pytest.approx(0.4)
    assert s["rest_over_model_before"] == pytest.approx(1.0)
    assert s["rest_over_model_after"] == pytest.approx(0.3333, abs=1e-3)  # 0.5, 0.333, 0.3
    assert s["step_ms_after"] == pytest.approx(2.6)
    assert s["model_ms_after"] == pytest.approx(2.0)


def worktrees() -> str:
    return subprocess.run(["git", "worktree", "list"], cwd=REPO, capture_output=True,
                          text=True, check=True).stdout


def test_the_baseline_runs_this_script_in_a_worktree_that_goes_afterwards() -> None:
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                          text=True, check=True).stdout.strip()
    with checkout_of(head) as tree:
        assert str(tree) in worktrees()
        script = tree / "benchmarks" / "engine_throughput.py"
        assert script.read_bytes() == (REPO / "benchmarks" / "engine_throughput.py").read_bytes()
        assert (tree / "services" / "engine" / "scheduler.py").exists()
    assert not tree.exists()
    assert str(tree) not in worktrees()
