"""benchmarks/learning/compare_algorithms.py's bookkeeping: the equal-calls budget, the paired differences
and the report, on hand-made records (the sweep itself is a benchmark, not a test)."""

import json
import math
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks", "learning"))
import compare_algorithms  # noqa: E402

CONFIG = "configs/shapes_cpu.py"


def test_calls_per_iteration_counts_rollout_and_update_passes():
    config = compare_algorithms.load(CONFIG, "dance_grpo")
    # DanceGRPO: G trajectories of T steps, plus the update's G passes at round(0.6 T) steps.
    t, g, p = config.sampling.num_steps, config.algorithm.group_size, \
        config.train.prompts_per_iteration
    assert compare_algorithms.calls_per_iteration(config) == p * (t * g + round(0.6 * t) * g)
    flow = compare_algorithms.load(CONFIG, "flow_grpo")   # own starts, KL doubles the update
    assert compare_algorithms.calls_per_iteration(flow) == p * (t * g + 2 * t * g)


def test_equal_calls_budget_matches_g2rpo_within_one_iteration():
    runs = compare_algorithms.plan_runs(CONFIG, list(compare_algorithms.METHODS),
                                        compare_algorithms.BUDGETS, 16)
    by = {(r["budget"], r["method"]): r for r in runs}
    budget = 16 * by[("equal_calls", "g2rpo")]["calls_per_iteration"]
    for method in compare_algorithms.METHODS:
        same = by[("equal_iterations", method)]
        assert same["iterations"] == 16
        calls = by[("equal_calls", method)]
        assert abs(calls["iterations"] * calls["calls_per_iteration"] - budget) \
            <= calls["calls_per_iteration"] / 2
        assert calls["overrides"]["train.num_iterations"] == calls["iterations"]
    # Λ is in the name and in the overrides; MGAI costs calls.
    assert by[("equal_calls", "g2rpo_lambda12")]["overrides"]["algorithm.granularities"] == (1, 2)
    assert by[("equal_calls", "dance_grpo")]["iterations"] > \
        by[("equal_calls", "g2rpo_no_mgai")]["iterations"] > 16


def _record(method, seed, final, budget="equal_iterations"):
    return dict(method=method, seed=seed, budget=budget, iterations=16, transformer_calls=100,
                calls_per_iteration=10, base={"in_domain": 0.3, "out_of_domain": 0.7,
                                              "quality": 1.0},
                final={"in_domain": final, "out_of_domain": 0.7, "quality": 1.0}, wall_s=1.0,
                curve=[dict(iteration=0, calls=0, in_domain=0.3),
                       dict(iteration=16, calls=160, in_domain=final)])


def test_paired_difference_is_a_t_interval_over_seeds():
    reference = [0.35, 0.36, 0.34]
    other = [0.33, 0.35, 0.30]
    records = [_record("g2rpo", s, v) for s, v in enumerate(reference)] + \
        [_record("dance_grpo", s, v) for s, v in enumerate(other)]
    mean, half, n = compare_algorithms.paired_difference(records, "dance_grpo",
                                                         "equal_iterations")
    diffs = np.subtract(other, reference)
    assert n == 3 and mean == pytest.approx(diffs.mean())
    # t(0.975, 2) = 4.303 (a published table value, to its 4 digits).
    assert half == pytest.approx(4.303 * diffs.std(ddof=1) / math.sqrt(3), rel=1e-4)
    # One shared seed is no interval.
    assert compare_algorithms.paired_difference(records[:1] + records[3:4], "dance_grpo",
                                                "equal_iterations") is None


def test_report_and_plot(tmp_path):
    records = [_record(m, s, 0.3 + 0.01 * s + 0.02 * i)
               for i, m in enumerate(("g2rpo", "g2rpo_lambda12", "dance_grpo"))
               for s in range(3)]
    text = compare_algorithms.report(records, "python benchmarks/learning/compare_algorithms.py")
    assert "| g2rpo | 3 | 16 |" in text
    # dance − g2rpo is +0.04 on every seed: mean +0.040, zero spread.
    assert "+0.040 ± 0.000" in text
    assert "| {1, 2} |" in text and "| {1, 2, 3} |" in text
    compare_algorithms.plot(records, str(tmp_path / "curves.png"))
    assert (tmp_path / "curves.png").stat().st_size > 0


def test_recorded_runs_are_kept_only_for_the_same_config(tmp_path):
    path = tmp_path / "runs.json"
    record = _record("g2rpo", 0, 0.35)
    path.write_text(json.dumps(dict(config=CONFIG, runs=[record])))
    kept = compare_algorithms.recorded_runs(str(path), CONFIG)
    assert kept == {("g2rpo", 0, "equal_iterations", 16): record}
    assert compare_algorithms.recorded_runs(str(path), "configs/other.py") == {}
    assert compare_algorithms.recorded_runs(str(tmp_path / "missing.json"), CONFIG) == {}
