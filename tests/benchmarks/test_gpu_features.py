"""benchmarks/gpu_features.py on the CPU: the checks a GPU lease runs, rehearsed, so that the
rare GPU minutes are not spent on a broken script; a check that fails is reported, not raised."""

from __future__ import annotations

from benchmarks import gpu_features


def test_checks_pass_on_the_cpu_and_each_is_reported() -> None:
    reported: list[dict] = []
    results = gpu_features.run(["graphs_async", "host_tier", "self_draft"], "cpu",
                               lambda r: reported.append(dict(r["checks"])))
    checks = results["checks"]
    assert [c["ok"] for c in checks.values()] == [True, True, True], checks
    assert checks["self_draft"]["accepted"] == checks["self_draft"]["draft_tokens"] > 0
    assert [list(r) for r in reported] == [["graphs_async"], ["graphs_async", "host_tier"],
                                           ["graphs_async", "host_tier", "self_draft"]]


def test_a_failing_check_is_recorded_and_the_rest_go_on(monkeypatch) -> None:
    def broken(self) -> dict:
        raise RuntimeError("planted")

    monkeypatch.setattr(gpu_features.Checks, "ngram", broken)
    checks = gpu_features.run(["ngram", "host_tier"], "cpu", lambda r: None)["checks"]
    assert not checks["ngram"]["ok"] and "planted" in checks["ngram"]["error"]
    assert checks["host_tier"]["ok"]
