"""``scripts/bench_scheduler_hooks.py`` runs the real connector's scheduler hooks and reports what they produced
(not timed)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.script_loader import load_script


def _script():
    return load_script("bench_scheduler_hooks")


def test_scheduler_hooks_script_runs_and_its_hooks_make_the_pulls_and_holds_it_reports(tmp_path: Path) -> None:
    out = tmp_path / "sched.json"
    rc = _script().main(["--churn", "1,4", "--running", "8", "--waiting", "8", "--steps", "20", "--warmup", "3",
                         "--prompt-tokens", "100", "--block-size", "16", "--json", str(out), "--quiet"])
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["bench"] == "scheduler" and result["command"]
    assert result["config"]["running"] == 8 and result["config"]["waiting"] == 8
    assert result["target"]["p99_us_per_step_below"] == 50.0
    assert set(result["target"]["met"]) == {"decode/churn1", "decode/churn4", "prefill/churn1", "prefill/churn4"}
    assert [(c["side"], c["churn"]) for c in result["cases"]] == [
        ("decode", 1), ("decode", 4), ("prefill", 1), ("prefill", 4)]
    assert result["timer_overhead_ns_per_call"] > 0
    for case in result["cases"]:
        n = case["churn"] * case["steps"]
        counts = case["counts"]
        assert case["state_after"] == {"running": 8, "waiting": 8}
        assert {"p50", "p99", "mean", "min", "max"} <= set(case["step_us"])
        assert 0 < case["step_us"]["p50"] <= case["step_us"]["p99"] <= case["step_us"]["max"]
        assert counts["arrived"] == counts["admitted"] == counts["finished"] == n
        assert case["hooks"]["build_connector_meta"]["calls"] == case["steps"] == counts["metas"]
        assert case["hooks"]["request_finished"]["calls"] == n
        if case["side"] == "decode":
            # one LoadSpec per admitted request, with exactly its local blocks (7 for 100 tokens), no holds
            assert counts["pulls"] == n and counts["pull_blocks"] == 7 * n and counts["promoted"] == n
            assert counts["holds"] == counts["leases_sent"] == 0
            assert case["hooks"]["update_state_after_alloc"]["calls"] == 2 * n  # on admission and on promotion
        else:
            # every finished prefill is held, answered with do_remote_prefill params and leased to the workers
            assert counts["holds"] == counts["hold_params"] == counts["leases_sent"] == counts["released"] == n
            assert counts["pulls"] == 0


def test_a_churn_above_the_held_requests_is_refused(capsys) -> None:
    assert _script().main(["--churn", "9", "--running", "8", "--waiting", "8", "--quiet"]) == 2
    assert "churn" in capsys.readouterr().err
