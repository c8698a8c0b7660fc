"""benchmarks/gpu_throughput.py without a GPU: its workload, ceiling and summary arithmetic."""

from __future__ import annotations

import pytest

from benchmarks.gpu_throughput import make_workload, summarise, workload_summary


def test_the_workload_is_issue_10s() -> None:
    work = make_workload(tiny=False)
    assert work == make_workload(tiny=False)  # seeded
    assert len(work) == 256
    assert all(64 <= len(r.prompt) <= 1024 and 32 <= r.output_len <= 256 for r in work)
    summary = workload_summary(work)
    # Issue 10 measured ~139k prompt and ~37k output tokens: a ~69k output tok/s ceiling.
    assert 125_000 < summary["prompt_tokens"] < 155_000
    assert 33_000 < summary["output_tokens"] < 41_000
    assert 60_000 < summary["ceiling_tok_s"] < 80_000


def test_each_run_has_the_same_lengths_and_prompts_of_its_own() -> None:
    """A later run must not find an earlier one's prompts in the prefix cache: warm means
    compiled, not cached (the first H200 run's "warm" 38k tok/s were prefix hits)."""
    runs = [make_workload(tiny=False, run=i) for i in range(3)]
    assert runs[0] == make_workload(tiny=False)  # the first is the historic workload
    for later in runs[1:]:
        assert [len(r.prompt) for r in later] == [len(r.prompt) for r in runs[0]]
        assert [r.output_len for r in later] == [r.output_len for r in runs[0]]
    firsts = [{tuple(r.prompt[:16]) for r in work} for work in runs]
    assert not (firsts[0] & firsts[1]) and not (firsts[1] & firsts[2])


def test_summary_ratios() -> None:
    results = {
        "workload": {"ceiling_tok_s": 70_000.0},
        "parts": {
            "offline": {"runs": [{"tok_s": 5_000.0}, {"tok_s": 9_000.0}, {"tok_s": 10_000.0}]},
            "server": {"runs": [{"tok_s": 8_500.0, "failures": 0}]},
            "server_process": {"runs": [{"tok_s": 9_000.0, "failures": 0}]},
            "hf_batch": {"tok_s": 1_000.0},
            "hf_static": {"error": "timed out"},
        },
    }
    s = summarise(results)
    assert s["offline_warm_tok_s"] == 10_000.0 and s["cold_over_warm"] == pytest.approx(0.5)
    assert s["share_of_ceiling"] == pytest.approx(1 / 7)
    assert s["offline_over_hf_batch"] == pytest.approx(10.0)
    assert "offline_over_hf_static" not in s
    assert s["server_over_offline"] == [pytest.approx(0.85)]
    assert s["server_process_over_offline"] == [pytest.approx(0.9)]
