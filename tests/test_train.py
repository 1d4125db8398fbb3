"""The embedded default end to end: a shortened RL run of every algorithm from the shipped base,
a shortened pre-training run, the shipped base against a random generator, and bad input."""

import io
import json
import os

from flax import nnx
import jax
import numpy as np
from PIL import Image
import pytest
import resume_helpers

from g2rpo_jax import parallel, pretrain, train
from g2rpo_jax.data import world
from g2rpo_jax.models import state_io
from g2rpo_jax.rl import algorithms
from g2rpo_jax.run import checkpoint as checkpoint_lib
from g2rpo_jax.run import config_lib
from g2rpo_jax.run import metrics as metrics_lib
from g2rpo_jax.tasks import generator, held_out


def short_rl_config(data_dir, algorithm="g2rpo", iterations=2):
    """configs/shapes_cpu.py, shrunk: 6 steps, groups of 4, 8 prompts, 8 held-out prompts."""
    config = config_lib.load_config("shapes_cpu.py", algorithm)
    config.sampling.num_steps = 6
    config.algorithm.group_size = 4
    config.algorithm.branch_steps = (0, 1)
    config.train.num_iterations = iterations
    config.train.prompts_per_iteration = 8
    config.train.eval_every = 1
    config.evaluation.num_prompts = 8
    config.data.images_per_prompt = 1
    config.data.data_dir = str(data_dir)
    return config


@pytest.fixture(scope="module")
def mesh():
    return parallel.make_mesh({"data": 2, "fsdp": 4, "tensor": 1})


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tfds")


# The programs XLA compiled during the g2rpo_run fixture, by name, in order.
XLA_COMPILED = []


def _record_compile(event, duration, fun_name="", **_):
    if event == "/jax/core/compile/backend_compile_duration":
        XLA_COMPILED.append(fun_name)


@pytest.fixture(scope="module")
def g2rpo_run(tmp_path_factory, data_dir, mesh):
    config = short_rl_config(data_dir)
    config.train.samples_every = 2
    workdir = tmp_path_factory.mktemp("g2rpo")
    jax.monitoring.register_event_duration_secs_listener(_record_compile)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(train, "COMPILE_AHEAD_ON_CPU", True)   # the accelerators' path
            report = train.train(config, str(workdir), mesh, parallel.rules_from_config(
                config.sharding_rules))
    finally:
        jax.monitoring.unregister_event_duration_listener(_record_compile)
    return config, workdir, report


def test_short_run_writes_summary_metrics_images_and_checkpoint(g2rpo_run):
    config, workdir, report = g2rpo_run
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["iterations"] == 2 and summary["seconds"] > 0
    assert isinstance(summary["warnings"], list)   # reward-hacking signals (test_metrics)
    for part in ("base", "final"):
        assert set(summary[part]) == {"in_domain", "out_of_domain", "quality"}
        assert all(0.0 <= v <= 1.0 for v in summary[part].values())
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "train/reward_in_domain" in r]
    assert [r["step"] for r in train_rows] == [1, 2]
    # On-policy check: before the first optimizer step of an iteration the ratio is exactly 1.
    assert all(r["train/first_update_log_ratio_abs_max"] < 1e-5 for r in train_rows)
    assert all(np.isfinite(r["train/loss"]) for r in train_rows)
    eval_steps = [r["step"] for r in rows if "eval/in_domain" in r]
    assert eval_steps == [0, 1, 2]
    assert os.listdir(workdir / "tensorboard")
    for name in ("images/base.png", "images/final.png", "reward_curves.png"):
        with Image.open(workdir / name) as image:
            assert image.size[0] > 100 and image.size[1] > 100
    # The final evaluation in the summary is the last eval row.
    assert rows[-1]["eval/in_domain"] == pytest.approx(summary["final"]["in_domain"])
    # summary.md: the same scores, a row per phase, the outputs and the TensorBoard command.
    markdown = (workdir / "summary.md").read_text()
    for name, base in summary["base"].items():
        final = summary["final"][name]
        assert f"| {name} | {base:.4f} | {final:.4f} | {final - base:+.4f} |" in markdown
    for name in metrics_lib.PHASES:
        total = summary["timing"]["phases"][name]["total_s"]
        assert f"| {name} | {total:.1f} |" in markdown
    assert f"tensorboard --logdir {workdir}/tensorboard" in markdown
    assert "- `generator.safetensors`: the fine-tuned generator" in markdown
    # The object counts at every evaluation; the prompts ask for what the world's parser
    # reads in them (one sample per prompt).
    eval_rows = [r for r in rows if "eval/in_domain" in r]
    asked = sum(world.parse_prompt(p).num_objects
                for p in held_out.held_out_prompts(config))
    assert [r["eval/objects_asked"] for r in eval_rows] == [asked] * 3
    assert all(0 <= r["eval/unrecognised_objects"] <= r["eval/objects"] for r in eval_rows)
    counts = summary["object_counts"]
    assert counts["base"]["objects"] == eval_rows[0]["eval/objects"]
    assert counts["final"]["unrecognised_objects"] == eval_rows[-1]["eval/unrecognised_objects"]
    base, final = counts["base"]["objects"], counts["final"]["objects"]
    assert f"| objects | {base} | {final} | {final - base:+d} |" in markdown
    # Per GenEval category: every category in GenEval's order, those of the held-out prompts
    # with the mean over their prompts (one sample each), the others without prompts.
    prompts = held_out.held_out_prompts(config)
    categories = summary["categories"]
    assert list(categories["final"]) == list(world.GENEVAL_CATEGORIES)
    present = {world.category(p) for p in prompts}   # the short config's few prompts
    assert present and present <= {"colors", "counting", "position"}
    for name in present:
        assert eval_rows[-1][f"eval/in_domain/{name}"] == pytest.approx(
            categories["final"][name]["in_domain"])
    assert all(categories[part][c] is None for part in ("base", "final")
               for c in set(world.GENEVAL_CATEGORIES) - present)
    # The overall score is the prompt-weighted mean of the categories'.
    overall = sum(categories["final"][c]["in_domain"] * np.mean(
        [world.category(p) == c for p in prompts]) for c in present)
    assert overall == pytest.approx(summary["final"]["in_domain"], rel=1e-5)
    values = " | ".join("—" if categories["base"][c] is None
                        else f"{categories['base'][c]['in_domain']:.4f}"
                        for c in world.GENEVAL_CATEGORIES)
    assert (f"| in_domain (base) | {summary['base']['in_domain']:.4f} | {values} |"
            in markdown)


def test_tensorboard_shows_samples_distributions_config_and_timings(g2rpo_run):
    """Read back with tensorboard's own event reader: the held-out grid at every evaluation,
    the training groups every `samples_every` iterations, histograms whose counts are the
    iteration's samples / transitions, the config as text at step 0, the phase seconds."""
    from tensorboard.backend.event_processing import event_accumulator as ea

    config, workdir, _ = g2rpo_run
    events = ea.EventAccumulator(str(workdir / "tensorboard"), size_guidance={
        ea.IMAGES: 0, ea.HISTOGRAMS: 0, ea.TENSORS: 0, ea.SCALARS: 0})
    events.Reload()
    assert [e.step for e in events.Images("eval/samples")] == [0, 1, 2]
    samples = events.Images("train/samples")
    assert [e.step for e in samples] == [2]
    with Image.open(io.BytesIO(samples[0].encoded_image_string)) as grid:
        # 2 prompts × one group of G = 4, at 128 px a sample (the shapes world's 32 px × 4).
        assert grid.size[0] >= 4 * 128 and grid.size[1] >= 2 * 128
    algo = config.algorithm
    k, g, p = len(algo.branch_steps), algo.group_size, config.train.prompts_per_iteration
    per_prompt = k * len(algo.granularities) * g
    for step in (1, 2):
        by_tag = {tag: next(e for e in events.Histograms(tag) if e.step == step)
                  for tag in ("train/rewards/in_domain", "train/advantages", "train/log_ratio",
                              "train/grad_norm_per_step")}
        assert by_tag["train/rewards/in_domain"].histogram_value.num == p * per_prompt
        assert by_tag["train/advantages"].histogram_value.num == k * p * g
        # Normalised in each group and summed over Λ: mean 0.
        assert abs(by_tag["train/advantages"].histogram_value.sum) < 1e-3
        # One accumulated step per iteration: every sample on-policy, log-ratio 0.
        log_ratio = by_tag["train/log_ratio"].histogram_value
        assert log_ratio.num == k * p * g and max(abs(log_ratio.min), abs(log_ratio.max)) < 1e-5
        assert by_tag["train/grad_norm_per_step"].histogram_value.num == 1
    text = events.Tensors("config/text_summary")
    assert [e.step for e in text] == [0]
    assert '"group_size": 4' in text[0].tensor_proto.string_val[0].decode()
    scalars = set(events.Tags()["scalars"])
    assert {f"time/{name}_s" for name in metrics_lib.PHASES} <= scalars


def test_phase_timings_in_metrics_and_summary(g2rpo_run):
    """Every training row times each phase; the phases fit in the row's wall time; the summary
    totals them (the fixture: 2 iterations, evaluation after the first, no periodic save)."""
    _, workdir, report = g2rpo_run
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "train/loss" in r]
    phases = metrics_lib.PHASES
    columns = {f"time/{name}_s" for name in (*phases, "compile", "compile_background",
                                             "iteration")}
    for row in train_rows:
        assert columns <= row.keys()
        assert all(row[c] >= 0 for c in columns)
        for name in ("data", "rollout", "reward", "advantages", "update"):
            assert row[f"time/{name}_s"] > 0, name
        assert sum(row[f"time/{name}_s"] for name in phases) <= row["time/iteration_s"]
        assert row["time/compile_s"] <= row["time/iteration_s"]
        # train/seconds times the training part of the same window.
        assert row["train/seconds"] <= row["time/iteration_s"]
    first, second = train_rows
    assert first["time/evaluation_s"] > 0 and second["time/evaluation_s"] == 0
    assert first["time/checkpoint_s"] == second["time/checkpoint_s"] == 0

    summary = json.loads((workdir / "summary.json").read_text())
    timing = summary["timing"]
    assert timing == report["timing"]
    for name in (*phases, "compile", "compile_background", "iteration"):
        stats = timing["phases"][name]
        assert set(stats) == {"total_s", "first_s", "median_s"}
        values = [r[f"time/{name}_s"] for r in train_rows]
        assert stats["total_s"] == pytest.approx(sum(values))
        assert stats["first_s"] == values[0]
        assert stats["median_s"] == (values[1] if values[1] > 0 else 0.0)
    assert sum(timing["phases"][n]["total_s"] for n in phases) \
        <= timing["phases"]["iteration"]["total_s"]
    for name in ("setup_s", "base_evaluation_s", "final_evaluation_s", "final_checkpoint_s",
                 "compile_s", "wall_s"):
        assert timing[name] > 0, name
    assert timing["base_evaluation_s"] <= timing["setup_s"]
    assert timing["wall_s"] == pytest.approx(
        timing["setup_s"] + timing["phases"]["iteration"]["total_s"]
        + timing["final_evaluation_s"] + timing["final_checkpoint_s"])
    assert timing["compile_s"] <= timing["wall_s"]
    by_phase = timing["compile_by_phase_s"]
    assert by_phase["evaluation"] > 0   # the base evaluation compiles its sampler
    # Setup (the first batch, the base evaluation) and the end (the final evaluation and save)
    # are timed outside the iterations.
    outside = timing["setup_s"] + timing["final_evaluation_s"] + timing["final_checkpoint_s"]
    for name in phases:
        assert by_phase[name] <= timing["phases"][name]["total_s"] + outside, name
    assert sum(by_phase.values()) <= timing["compile_s"] + 1e-6
    # The rollout's and the update's programs compile ahead, on another thread: once each,
    # and the loop's own calls find them compiled.
    assert timing["compile_background_s"] > 0
    assert XLA_COMPILED.count("jit(singular_sample)") == 1
    assert XLA_COMPILED.count("jit(singular_finish)") == 1
    assert XLA_COMPILED.count("jit(update)") == 1


def test_checkpoint_and_generator_file_hold_the_trained_params(g2rpo_run, mesh):
    config, workdir, report = g2rpo_run
    assert sorted(n for n in os.listdir(workdir / "checkpoints") if n.isdigit()) == ["2"]
    restored = resume_helpers.read_step(str(workdir / "checkpoints/2"))
    # One accumulated optimizer step per iteration (steps_per_update=0), 2 iterations.
    assert int(restored["['step']"]) == 2
    counts = {k: int(v) for k, v in restored.items() if k.endswith("['count']")}
    assert counts and set(counts.values()) == {2}   # AdamW's and the schedule's step counts
    moments = [v for k, v in restored.items() if "['mu']" in k or "['nu']" in k]
    assert len(moments) == 2 * len([k for k in restored if k.startswith("['params']")])
    assert all(np.isfinite(m).all() for m in moments) and max(
        float(np.abs(m).max()) for m in moments) > 0
    fine_tuned = generator.load_generator(str(workdir / "generator.safetensors"))
    params = nnx.to_pure_dict(nnx.state(fine_tuned.flux, nnx.Param))
    flat_saved = jax.tree.leaves(params)
    flat_restored = [v for k, v in restored.items() if k.startswith("['params']")]
    assert len(flat_saved) == len(flat_restored)
    for a, b in zip(flat_saved, flat_restored):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    base = generator.load_generator(generator.SHIPPED_BASE)
    moved = [float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(
        jax.tree.leaves(nnx.state(base.flux, nnx.Param)), flat_saved)]
    assert max(moved) > 0  # RL changed the policy
    assert state_io.read_config(str(workdir / "generator.safetensors"))["rl"]["iterations"] == 2


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["g2rpo_no_mgai", "dance_grpo", "flow_grpo", "mix_grpo"])
def test_every_algorithm_runs(tmp_path, data_dir, mesh, algorithm):
    config = short_rl_config(data_dir, algorithm, iterations=1)
    config.train.eval_every = 0
    report = train.train(config, str(tmp_path), mesh, parallel.rules_from_config(
        config.sharding_rules))
    assert report["algorithm"] == algorithm and report["iterations"] == 1
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    (row,) = [r for r in rows if "train/loss" in r]
    assert np.isfinite(row["train/loss"]) and row["train/first_update_log_ratio_abs_max"] < 1e-5
    assert (tmp_path / "summary.json").exists()


@pytest.mark.parametrize("algorithm", sorted(algorithms.PRESETS))
def test_cpu_config_keeps_each_presets_sde_and_update_settings(algorithm):
    """configs/shapes_cpu.py sizes every algorithm alike (group, branch steps, clip range) and
    keeps what defines it: DanceGRPO's η 0.3 SDE step, Flow-GRPO's KL, MixGRPO's window."""
    section = config_lib.load_config("shapes_cpu.py", algorithm).algorithm
    preset = algorithms.preset(algorithm)
    sized = {"group_size", "branch_steps", "clip_range", "window_shift_every"}
    for field in set(preset) - sized:
        assert section[field] == preset[field], field


def test_shipped_base_beats_a_random_generator_on_held_out_prompts(mesh):
    config = config_lib.load_config("shapes_cpu.py")
    config.evaluation.num_prompts = 48
    prompts = held_out.held_out_prompts(config)
    base = generator.load_generator(generator.SHIPPED_BASE, mesh)
    base_scores = held_out.Evaluator(config, base, prompts, mesh, ("in_domain", "quality")
                                     ).scores(nnx.state(base.flux))
    random = generator.build_generator(config, mesh, seed=3)
    random_scores = held_out.Evaluator(config, random, prompts, mesh, ("in_domain", "quality")
                                       ).scores(nnx.state(random.flux))
    print(f"held-out in_domain: base {base_scores['in_domain']:.3f}, random "
          f"{random_scores['in_domain']:.3f}")
    assert base_scores["in_domain"] > random_scores["in_domain"] + 0.1
    assert base_scores["quality"] > 0.9


def test_short_pretraining_writes_a_loadable_generator(tmp_path, data_dir, mesh):
    config = config_lib.load_config("shapes_pretrain.py")
    config.pretrain.num_steps = 3
    config.pretrain.batch_size = 8
    config.pretrain.eval_every = 0
    config.optimizer.warmup_steps = 1
    config.evaluation.num_prompts = 8
    config.data.images_per_prompt = 1
    config.data.data_dir = str(data_dir)
    report = pretrain.pretrain(config, str(tmp_path), mesh, parallel.rules_from_config(
        config.sharding_rules))
    assert report["steps"] == 3 and set(report["held_out"]) == {"in_domain", "quality"}
    loaded = generator.load_generator(str(tmp_path / "generator.safetensors"), mesh)
    assert loaded.latent_shape == (64, 48)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    assert losses and all(np.isfinite(losses))


def test_pretraining_continues_from_a_generator_file(tmp_path, data_dir, mesh):
    """pretrain.init_checkpoint loads the file's weights: with a zero learning rate the written
    generator equals the shipped base tensor for tensor; another architecture is refused."""
    config = config_lib.load_config("shapes_pretrain.py")
    config.pretrain.update(num_steps=2, batch_size=8, eval_every=0,
                           init_checkpoint=generator.SHIPPED_BASE, ema_decay=0.0)
    config.optimizer.update(learning_rate=0.0, warmup_steps=1)
    config.evaluation.num_prompts = 8
    config.data.images_per_prompt = 1
    config.data.data_dir = str(data_dir)
    rules = parallel.rules_from_config(config.sharding_rules)
    pretrain.pretrain(config, str(tmp_path), mesh, rules)
    written = generator.load_generator(str(tmp_path / "generator.safetensors"))
    base = generator.load_generator(generator.SHIPPED_BASE)
    for module in ("flux", "text_encoder"):
        got = nnx.to_pure_dict(nnx.state(getattr(written, module), nnx.Param))
        want = nnx.to_pure_dict(nnx.state(getattr(base, module), nnx.Param))
        jax.tree.map(np.testing.assert_array_equal, got, want)
    config.model.num_layers = 1
    with pytest.raises(ValueError, match="init_checkpoint .*different architecture.*differing: "
                       "flux.num_layers\\)"):
        pretrain.pretrain(config, str(tmp_path / "other"), mesh, rules)


# ---------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------


def test_missing_base_checkpoint_names_the_pretraining_command(tmp_path, mesh):
    config = short_rl_config(tmp_path)
    config.model.checkpoint = str(tmp_path / "nope.safetensors")
    with pytest.raises(FileNotFoundError, match="nope.safetensors.*configs/shapes_pretrain.py"):
        train.train(config, str(tmp_path), mesh, parallel.rules_from_config(
            config.sharding_rules))


def test_unknown_word_and_empty_prompt_list_are_named():
    base = generator.load_generator(generator.SHIPPED_BASE)
    with pytest.raises(ValueError, match=r"Unknown word\(s\) \['purple'\]"):
        base.encode(["a purple circle"])
    with pytest.raises(ValueError, match="empty prompt list"):
        base.encode([])


def test_empty_held_out_split_is_named(monkeypatch):
    config = config_lib.load_config("shapes_cpu.py")
    monkeypatch.setattr(held_out.world, "split_prompts",
                        lambda seed, fraction: {"train": ["a red circle"], "held_out": []})
    with pytest.raises(ValueError, match="held-out prompt split is empty"):
        held_out.held_out_prompts(config)


def test_lora_run_checkpoints_resumes_and_writes_adapters(tmp_path, data_dir, mesh):
    """model.lora.rank > 0: the checkpoint holds the adapters (no base), an extended run
    resumes from it, and the run writes the adapters (PEFT layout) and the merged generator."""
    config = short_rl_config(data_dir, "g2rpo", iterations=1)
    config.train.eval_every = 0
    config.model.lora.rank = 2
    rules = parallel.rules_from_config(config.sharding_rules)
    train.train(config, str(tmp_path), mesh, rules)
    config.train.num_iterations = 2
    report = train.train(config, str(tmp_path), mesh, rules)
    assert report["iterations"] == 2
    arrays = checkpoint_lib.read_arrays(os.path.join(str(tmp_path), "checkpoints", "2"))
    params = [k for k in arrays if k.startswith("['params']")]
    assert params and all("lora_" in k for k in params)
    assert (tmp_path / "lora.safetensors").exists() and (tmp_path / "generator.safetensors").exists()
