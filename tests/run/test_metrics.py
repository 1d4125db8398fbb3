"""The loop's phase timer: wall time per phase, compile time from JAX's compile events."""

import time

import jax
import jax.numpy as jnp
import pytest

from g2rpo_jax.run import metrics


def test_union_counts_nested_spans_once():
    assert metrics._union_seconds([]) == 0.0
    assert metrics._union_seconds([(0.0, 4.0), (1.0, 2.0), (3.0, 6.0), (8.0, 9.0)]) == 7.0


def test_phase_timer_rows_phases_and_compile_time():
    timer = metrics.PhaseTimer()
    try:
        timer.lap()
        with timer.phase("rollout"):
            jax.jit(lambda x: jnp.sin(x) * 3.0 + 1.0)(jnp.arange(7.0)).block_until_ready()
        with timer.phase("update"):
            time.sleep(0.01)
        with pytest.raises(RuntimeError, match="inside"), timer.phase("data"), \
                timer.phase("reward"):
            pass
        with pytest.raises(ValueError, match="Unknown phase"), timer.phase("nap"):
            pass
        row = timer.lap()
        assert set(row) == {f"time/{n}_s" for n in (*metrics.PHASES, "compile", "compile_background",
                                                  "iteration")}
        assert row["time/update_s"] >= 0.01 and row["time/rollout_s"] > 0
        assert 0 < row["time/compile_s"] <= row["time/rollout_s"]
        assert sum(row[f"time/{n}_s"] for n in metrics.PHASES) <= row["time/iteration_s"]
        assert timer.compile_by_phase()["rollout"] == pytest.approx(row["time/compile_s"])
        assert timer.compile_by_phase()["update"] == 0.0
        assert timer.lap()["time/rollout_s"] == 0.0   # a new window
    finally:
        timer.close()


def test_phase_summary_skips_session_starts_and_idle_phases():
    rows = [{"time/rollout_s": 5.0, "time/evaluation_s": 0.0},
            {"time/rollout_s": 1.0, "time/evaluation_s": 2.0},
            {"time/rollout_s": 3.0, "time/evaluation_s": 0.0}]
    out = metrics.phase_summary(rows, skip=[0])
    assert out["rollout"] == {"total_s": 9.0, "first_s": 5.0, "median_s": 2.0}
    assert out["evaluation"] == {"total_s": 2.0, "first_s": 0.0, "median_s": 2.0}
    assert out["update"] == {"total_s": 0.0, "first_s": 0.0, "median_s": 0.0}


def test_by_step_groups_prefixed_scalars_in_step_order():
    rows = [{"step": 6, "eval/in_domain": 0.35, "train/loss": 1.0},
            {"step": 0, "eval/in_domain": 0.32, "eval/quality": 0.99},
            {"step": 3, "train/loss": 2.0},
            {"step": 6, "eval/quality": 0.98}]
    assert metrics.by_step(rows, "eval/") == {
        0: {"in_domain": 0.32, "quality": 0.99}, 6: {"in_domain": 0.35, "quality": 0.98}}
    assert list(metrics.by_step(rows, "train/")) == [3, 6]


def test_hacking_warning_when_a_trained_score_rises_and_an_untrained_one_falls():
    evaluations = [(0, {"in_domain": 0.30, "out_of_domain": 0.70, "quality": 0.99}),
                   (6, {"in_domain": 0.33, "out_of_domain": 0.69, "quality": 0.99}),
                   (12, {"in_domain": 0.36, "out_of_domain": 0.66, "quality": 0.985})]
    trained, untrained = ["in_domain"], ["out_of_domain", "quality"]
    lines = metrics.hacking_warnings(evaluations, trained, untrained, margin=0.02, window=2)
    # out_of_domain fell 0.04 > 0.02 over the last 2 evaluations; quality only 0.005.
    assert len(lines) == 1
    assert ("from iteration 0 to 12 the held-out in_domain 0.300 → 0.360 rose while "
            "out_of_domain, not trained on, fell 0.700 → 0.660") in lines[0]
    # One evaluation back the fall is 0.03: still past 0.02; with margin 0.05 nothing.
    assert len(metrics.hacking_warnings(evaluations, trained, untrained, 0.02, 1)) == 1
    assert metrics.hacking_warnings(evaluations, trained, untrained, 0.05, 2) == []
    # The trained score did not rise: a fall of the others alone is not hacking.
    flat = [(i, dict(s, in_domain=0.30)) for i, s in evaluations]
    assert metrics.hacking_warnings(flat, trained, untrained, 0.02, 2) == []
    # Too few evaluations, or the check off.
    assert metrics.hacking_warnings(evaluations[:2], trained, untrained, 0.02, 2) == []
    assert metrics.hacking_warnings(evaluations, trained, untrained, 0.0, 2) == []


def test_changes_since_base_put_trained_and_untrained_scores_on_one_axis():
    rows = [{"step": 0, "eval/in_domain": 0.3, "eval/quality": 0.9},
            {"step": 1, "train/loss": 1.0},
            {"step": 2, "eval/in_domain": 0.35, "eval/quality": 0.85}]
    out, names = metrics.changes_since_base(rows, ["in_domain"], ["quality"])
    assert names == ["change/in_domain (trained)", "change/quality (not trained)"]
    assert out[1] == rows[1]
    assert out[2]["change/in_domain (trained)"] == pytest.approx(0.05)
    assert out[2]["change/quality (not trained)"] == pytest.approx(-0.05)
    assert out[0]["change/quality (not trained)"] == 0.0
