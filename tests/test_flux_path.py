"""The FLUX path end to end on the tiny FLUX.1-dev written by the reference libraries
(g2rpo_jax.testing.flux_fixture), on the emulated 8-device mesh (data=2, fsdp=4):
preprocess (twice: identical records; embeddings equal to transformers' encoders) → RL
iterations (rollout → decode with the FLUX autoencoder → HPS reward → update) → evaluation of
the Orbax checkpoint with every configured reward; and the errors."""

import json
import os
import subprocess
import sys
import time

from flax import nnx
import jax
import numpy as np
import pytest
import torch

from g2rpo_jax import evaluate, export, parallel, preprocess, train
from g2rpo_jax.data import embedding_dataset
from g2rpo_jax.models import clip_text, flux_weights, t5
from g2rpo_jax.run import checkpoint as checkpoint_lib
from g2rpo_jax.run import config_lib, metrics
from g2rpo_jax.testing import flux_fixture, flux_reference

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_config(overrides: dict, **fields):
    """configs/flux_tiny.py pointed at the fixture, RL mode, data=2 × fsdp=4 mesh."""
    return config_lib.load_config("flux_tiny.py", **{"mode": "train", "mesh.data": 2,
                                                     "mesh.fsdp": 4, **overrides, **fields})


@pytest.fixture(scope="module")
def mesh():
    return parallel.make_mesh({"data": 2, "fsdp": 4, "tensor": 1})


@pytest.fixture(scope="module")
def fixture_root(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("flux"))
    start = time.perf_counter()
    overrides = flux_fixture.write_tiny_setup(root)
    print(f"tiny FLUX.1-dev, rewards and prompts written in {time.perf_counter() - start:.1f} s")
    return root, overrides


@pytest.fixture(scope="module")
def prepared(fixture_root):
    root, overrides = fixture_root
    start = time.perf_counter()
    directories = preprocess.preprocess(tiny_config(overrides))
    print(f"preprocessing (24 + 8 prompts): {time.perf_counter() - start:.1f} s")
    return directories


def test_preprocessing_twice_gives_identical_records(fixture_root, prepared, tmp_path):
    """Again from the command line: another process (protobuf's map order differs between
    processes; the records must not), the same 8 devices."""
    _, overrides = fixture_root
    flags = [f"--config.{k}={v}" for k, v in dict(overrides, **{
        "data.data_dir": str(tmp_path)}).items()]
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="8")
    result = subprocess.run([sys.executable, "-m", "g2rpo_jax.preprocess",
                             "--config=configs/flux_tiny.py", *flags], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    again = json.loads(result.stdout[result.stdout.rindex('{\n  "datasets"'):])
    assert set(again["datasets"]) == set(prepared) == {"train", "eval"}
    for role in prepared:
        assert again["datasets"][role] != prepared[role]
        assert again["records_sha256"][role] == embedding_dataset.records_digest(prepared[role])
    meta = embedding_dataset.load(prepared["train"]).metadata
    assert (meta["num_prompts"], meta["t5_max_length"], meta["t5_dim"], meta["clip_dim"]) == (
        24, 16, 64, 32)


def test_embeddings_are_the_reference_encoders_outputs(fixture_root, prepared):
    """T5 (no attention mask, as FluxPipeline) and CLIP's pooled output, against transformers."""
    import transformers

    root, _ = fixture_root
    folder = os.path.join(root, "flux")
    records = embedding_dataset.load(prepared["eval"]).records_by_index()[:3]
    prompts = [r["prompt"].decode() for r in records]
    t5_ids, _ = t5.tokenize(t5.load_tokenizer(folder), prompts, 16)
    clip_ids = clip_text.tokenize(clip_text.load_tokenizer(folder), prompts)
    with torch.no_grad():
        t5_ref = transformers.T5EncoderModel.from_pretrained(f"{folder}/text_encoder_2")(
            input_ids=torch.from_numpy(t5_ids).long()).last_hidden_state.numpy()
        clip_ref = transformers.CLIPTextModel.from_pretrained(f"{folder}/text_encoder")(
            input_ids=torch.from_numpy(clip_ids).long()).pooler_output.numpy()
    t5_err = np.abs(np.stack([r["t5"] for r in records]) - t5_ref).max()
    clip_err = np.abs(np.stack([r["clip_pooled"] for r in records]) - clip_ref).max()
    print(f"stored embeddings vs transformers: T5 max abs err {t5_err:.1e}, "
          f"CLIP pooled {clip_err:.1e}")
    assert t5_err < 1e-4 and clip_err < 1e-4


@pytest.fixture(scope="module")
def run(fixture_root, prepared, mesh, tmp_path_factory):
    """mode=train: 2 iterations (the first compiles), evaluation before and after."""
    _, overrides = fixture_root
    config = tiny_config(overrides)
    config.train.eval_every = 0
    config.train.samples_every = 2   # the training samples decoded by the FLUX autoencoder
    workdir = str(tmp_path_factory.mktemp("train"))
    start = time.perf_counter()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(train, "COMPILE_AHEAD_ON_CPU", True)   # the accelerators' path
        report = train.train(config, workdir, mesh, parallel.rules_from_config(
            config.sharding_rules))
    print(f"train: {time.perf_counter() - start:.1f} s in all; tiny end-to-end G²RPO iteration "
          f"(8 prompts × {config.algorithm.group_size} × k ∈ {config.algorithm.branch_steps} × "
          f"Λ = {config.algorithm.granularities}, {config.sampling.num_steps} steps): first "
          f"{report['first_iteration_seconds']:.1f} s (with compilation), then "
          f"{report['seconds_per_iteration']:.2f} s")
    return config, workdir, report


def test_one_iteration_end_to_end(run, mesh):
    config, workdir, report = run
    rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
    train_rows = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in train_rows] == [1, 2]
    for row in train_rows:
        assert np.isfinite(row["train/loss"]) and np.isfinite(row["train/reward_hps"])
        # On-policy: before the first optimizer step the ratio is exactly 1.
        assert row["train/first_update_log_ratio_abs_max"] < 1e-5
    assert set(report["base"]) == set(report["final"]) == {"hps", "clip_score", "pickscore"}
    # The checkpoint holds parameters that moved away from the starting transformer.
    base = nnx.state(flux_weights.from_pretrained(config.model.checkpoint, mesh=mesh))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), base)
    trained = checkpoint_lib.restore_params(checkpoint_lib.find_step(workdir), abstract,
                                            jax.tree.map(lambda x: x.sharding, base))
    moved = [float(np.abs(np.asarray(a) - np.asarray(b)).max())
             for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(trained))]
    assert max(moved) > 0 and all(np.isfinite(moved))
    for name in ("images/base.png", "images/final.png", "reward_curves.png", "summary.json",
                 "summary.md"):
        assert os.path.exists(os.path.join(workdir, name))
    from tensorboard.backend.event_processing import event_accumulator as ea

    events = ea.EventAccumulator(os.path.join(workdir, "tensorboard"),
                                 size_guidance={ea.IMAGES: 0})
    events.Reload()
    assert [e.step for e in events.Images("train/samples")] == [2]
    assert [e.step for e in events.Images("eval/samples")] == [0, 2]
    # The same per-phase timing as the shapes task (tests/test_train.py checks it in detail).
    for row in train_rows:
        assert all(row[f"time/{name}_s"] >= 0 for name in metrics.PHASES)
        assert sum(row[f"time/{name}_s"] for name in metrics.PHASES) <= row["time/iteration_s"]
    assert report["timing"]["phases"]["rollout"]["total_s"] > 0
    assert report["timing"]["compile_background_s"] > 0   # the loop's programs, compiled ahead


def test_evaluate_reports_every_reward(run, mesh):
    config, workdir, report = run
    result = evaluate.evaluate(config, workdir, mesh, parallel.rules_from_config(
        config.sharding_rules))
    written = json.load(open(result["output"]))
    assert result["output"] == os.path.join(workdir, "evaluation-2.json")
    assert list(written["in_domain"]) == ["hps"]
    assert list(written["out_of_domain"]) == ["clip_score", "pickscore"]
    assert written["prompts"] == 8 and written["trained_on"] == ["hps"]
    for side in ("in_domain", "out_of_domain"):
        for name, values in written[side].items():
            assert np.isfinite(values["mean"]) and values["std"] >= 0
            # The same prompts, noise and parameters as the run's final evaluation.
            assert values["mean"] == pytest.approx(report["final"][name], abs=1e-5)
    assert os.path.exists(os.path.join(workdir, "evaluation-2.png"))


def test_evaluate_accepts_the_export(run, mesh, tmp_path):
    """The run exported as a FluxPipeline folder (float32: the weights exactly) and evaluated
    from there gives the run's final scores."""
    config, workdir, report = run
    out = str(tmp_path / "export")
    export.export(config, workdir, out, mesh, config.sharding_rules, dtype="float32",
                  pipeline="link")
    result = evaluate.evaluate(config, out, mesh, parallel.rules_from_config(
        config.sharding_rules), output=str(tmp_path / "evaluation.json"))
    assert result["checkpoint"] == out
    scores = {**result["in_domain"], **result["out_of_domain"]}
    assert set(scores) == set(report["final"])
    for name, values in scores.items():
        assert values["mean"] == pytest.approx(report["final"][name], abs=1e-5)


def test_table_has_in_and_out_of_domain_columns():
    report = {"in_domain": {"hps": {"mean": 0.31, "std": 0.02}},
              "out_of_domain": {"clip_score": {"mean": 0.4, "std": 0.03},
                                "pickscore": {"mean": 22.6, "std": 1.1}}}
    lines = evaluate.format_table(report, "step 300").splitlines()
    assert "in-domain" in lines[0] and lines[0].index("in-domain") < lines[0].index("out-of")
    assert lines[1].split() == ["reward", "|", "hps", "|", "clip_score", "pickscore"]
    assert "0.3100 ± 0.0200" in lines[2] and "22.6000 ± 1.1000" in lines[2]


def test_errors_name_the_problem_and_the_fix(fixture_root, prepared, tmp_path, mesh):
    root, overrides = fixture_root
    with pytest.raises(FileNotFoundError, match="nowhere does not exist.*config.text.path"):
        preprocess.preprocess(tiny_config(overrides, **{"text.path": str(tmp_path / "nowhere"),
                                                        "data.data_dir": str(tmp_path)}))
    with pytest.raises(FileNotFoundError, match="No prompts file at .*missing.txt"):
        preprocess.preprocess(tiny_config(overrides, **{
            "data.prompts_file": str(tmp_path / "missing.txt"), "data.data_dir": str(tmp_path)}))
    # Embeddings for a transformer with other text dims: refused before anything is encoded.
    flux_reference.write_diffusers_flux(str(tmp_path / "other" / "transformer"),
                                        **dict(flux_fixture.TRANSFORMER, joint_attention_dim=32))
    with pytest.raises(ValueError, match="64-d but the transformer's joint_attention_dim is 32"):
        preprocess.preprocess(tiny_config(overrides, **{
            "model.checkpoint": str(tmp_path / "other"), "text.path": overrides[
                "model.checkpoint"], "data.data_dir": str(tmp_path)}))
    # Training with the dataset of another transformer's encoders, or without preprocessing.
    bad = tiny_config(overrides, **{"model.checkpoint": str(tmp_path / "other"),
                                    "autoencoder.path": overrides["model.checkpoint"]})
    with pytest.raises(ValueError, match="joint_attention_dim is 32"):
        train.train(bad, str(tmp_path / "w1"), mesh, parallel.rules_from_config(None))
    with pytest.raises(FileNotFoundError, match="No prepared prompt embeddings.*preprocess"):
        train.train(tiny_config(overrides, **{"data.data_dir": str(tmp_path / "empty")}),
                    str(tmp_path / "w2"), mesh, parallel.rules_from_config(None))
    with pytest.raises(ValueError, match=r"Rewards \['imagereward'\] are not configured"):
        train.train(tiny_config(overrides, **{"reward.evaluate": ("hps", "imagereward")}),
                    str(tmp_path / "w3"), mesh, parallel.rules_from_config(None))


@pytest.mark.slow
def test_killed_run_resumes_bit_identically(fixture_root, prepared, tmp_path):
    """3 iterations uninterrupted, against a run killed by SIGKILL inside the asynchronous save
    of iteration 2 (written, not committed) and run again with the same command: the same
    parameters, AdamW state and metrics rows, bit for bit (subprocesses, 8 devices)."""
    import resume_helpers as rh

    _, overrides = fixture_root

    def flags(workdir):
        return ["--config=configs/flux_tiny.py", "--config.mode=train", f"--workdir={workdir}",
                "--config.train.num_iterations=3", "--config.train.checkpoint_every=1",
                "--config.train.eval_every=2", "--config.mesh.data=2", "--config.mesh.fsdp=4",
                f"--config.compilation_cache_dir={tmp_path / 'jax_cache'}",
                *[f"--config.{k}={v}" for k, v in overrides.items()]]

    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    done = rh.run_main(flags(reference), devices=8)
    assert done.returncode == 0, done.stderr[-3000:]
    killed = rh.run_main(flags(resumed), kill_at_commit=2, devices=8)
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert "2" not in os.listdir(resumed / "checkpoints")
    finished = rh.run_main(flags(resumed), devices=8)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert "Resuming" in finished.stderr
    count = rh.assert_identical_states(rh.read_step(str(reference / "checkpoints/3")),
                                       rh.read_step(str(resumed / "checkpoints/3")))
    assert rh.computed_rows(resumed) == rh.computed_rows(reference)
    assert [r["step"] for r in rh.metrics_rows(resumed) if "train/loss" in r] == [1, 2, 3]
    summary = json.loads((resumed / "summary.json").read_text())
    assert summary["final"] == json.loads((reference / "summary.json").read_text())["final"]
    print(f"tiny FLUX: bit-identical after SIGKILL in the save of iteration 2 ({count} arrays)")
