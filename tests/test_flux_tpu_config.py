"""configs/flux_tpu.py: every variant loads, and its fields are method.md's numbers (written out
here by hand, not read from the config module)."""

import json
import os
import subprocess
import sys

import pytest

from g2rpo_jax.rl import algorithms, policy_update
from g2rpo_jax.rl import optimizer as optimizer_lib
from g2rpo_jax.run import config_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALGORITHMS = ("g2rpo", "g2rpo_no_mgai", "dance_grpo", "flow_grpo", "mix_grpo")


def load(argument=None):
    """configs/flux_tpu.py's config for `argument` (None: its default)."""
    return config_lib.load_config("flux_tpu.py", argument)


@pytest.mark.parametrize("reward", ["hps", "hps_clip"])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_every_variant_has_the_papers_setting(algorithm, reward):
    config = load(f"{algorithm},{reward}")
    algo = algorithms.Algorithm.from_config(config.algorithm)
    assert config.algorithm.name == algorithm
    # method.md, "Reference setting": 720×720 (90×90×16 latents → 2,025 tokens), T5 512,
    # guidance 3.5, T = 16, shift 3, G = 12, 16 prompts per iteration, ~300 iterations.
    assert (config.image.height, config.image.width) == (720, 720)
    assert config.describe.image_tokens == 2025 and config.describe.text_tokens == 512
    assert config.text.t5_max_length == 512
    assert config.sampling.num_steps == 16 and config.sampling.shift == 3.0
    assert config.sampling.guidance == 3.5 and not config.sampling.quantize_timesteps
    assert algo.group_size == 12
    assert config.train.prompts_per_iteration == 16 and config.train.num_iterations == 300
    # The FLUX.1-dev transformer: bf16 compute, fp32 master weights, remat.
    flux_cfg = config_lib.to_flux_config(config.model)
    assert (flux_cfg.num_layers, flux_cfg.num_single_layers, flux_cfg.hidden_size) == (19, 38, 3072)
    assert (flux_cfg.in_channels, flux_cfg.joint_attention_dim) == (64, 4096)
    assert flux_cfg.guidance_embeds
    assert (flux_cfg.dtype, flux_cfg.param_dtype) == ("bfloat16", "float32")
    assert flux_cfg.remat_policy != "none"
    # "The update": AdamW lr 2e-6, betas (0.9, 0.999), eps 1e-8, wd 1e-4, constant, clip 1.0.
    opt = config.optimizer
    assert (opt.learning_rate, opt.b1, opt.b2, opt.eps, opt.weight_decay) == \
        (2e-6, 0.9, 0.999, 1e-8, 1e-4)
    assert opt.schedule == "constant" and opt.grad_clip_norm == 1.0
    optimizer_lib.make_optimizer(opt)
    settings = policy_update.PolicyUpdate.from_config(config)
    assert settings.guidance == 3.5 and settings.steps_per_update == 1
    # Rewards: HPS, or HPS + CLIP score with unit weights.
    expected = {"hps": (["hps"], [1.0]), "hps_clip": (["hps", "clip_score"], [1.0, 1.0])}
    assert (list(config.reward.train), list(config.reward.weights)) == expected[reward]
    # Pod: FSDP over groups of 8 chips, data over the groups, jax.distributed on.
    assert (config.mesh.data, config.mesh.fsdp, config.mesh.tensor) == (-1, 8, 1)
    assert config.distributed.enabled
    assert dict(map(tuple, config.sharding_rules))["batch"] == ["fsdp", "data"]


@pytest.mark.parametrize("algorithm", ["g2rpo", "g2rpo_no_mgai"])
def test_g2rpo_variants(algorithm):
    algo = algorithms.Algorithm.from_config(load(algorithm).algorithm)
    assert algo.rollout == "singular" and algo.sde_step == "flow_grpo"
    assert algo.branch_steps == (0, 1, 2, 3, 4, 5, 6, 7)
    assert algo.eta == 0.7 and algo.clip_range == 1e-4 and algo.kl_beta == 0.0
    assert algo.granularities == ((1, 2, 3) if algorithm == "g2rpo" else (1,))
    assert all(w == 1.0 for w in algo.granularity_weights)
    algo.validate(16)


def test_reference_script_granularities():
    algo = algorithms.Algorithm.from_config(load("g2rpo,hps_clip,lambda12").algorithm)
    assert algo.granularities == (1, 2) and algo.granularity_weights == (1.0, 1.0)


@pytest.mark.parametrize("argument,lanes", [("g2rpo", 3), ("g2rpo,lambda12", 4),
                                            ("g2rpo_no_mgai", 4)])
def test_continuation_lanes_fit_the_smallest_pod(argument, lanes):
    """Measured on v5p:2x2x2 with splash attention (docs/tpu_memory.md): the rollout's peak
    stays at or under 50% of HBM with these bounds, the most lanes each Λ's plan packs."""
    config = load(argument)
    algo = algorithms.Algorithm.from_config(config.algorithm)
    assert algo.max_lanes == lanes
    assert config.model.attention == "auto"


@pytest.mark.parametrize("argument,fsdp,moments,lanes", [
    ("g2rpo", 8, "float32", 3), ("g2rpo,v5p8", 4, "float32", 3),
    ("g2rpo,v6e8", 8, "bfloat16", 1), ("g2rpo,lambda12,v6e8", 8, "bfloat16", 1),
    ("g2rpo,v5e16", 16, "bfloat16", 1)])
def test_slice_words_select_the_fitted_setting(argument, fsdp, moments, lanes):
    """docs/tpu_memory.md, "The smallest slice", measured: v5p-8 fits the defaults on fsdp 4;
    v6e-8 (32 GiB per chip) and v5e-16 (16 GiB) fit full fine-tuning with bf16 AdamW moments
    and one continuation lane."""
    config = load(argument)
    assert config.mesh.fsdp == fsdp
    assert config.optimizer.moments_dtype == moments
    assert algorithms.Algorithm.from_config(config.algorithm).max_lanes == lanes
    assert config.policy_update.offload_optimizer_state is True


@pytest.mark.parametrize("argument,fsdp,lanes,rank", [
    ("g2rpo,lora32,v6e4", 4, 1, 32), ("g2rpo,lora128,v6e4", 4, 1, 128),
    ("g2rpo,lora32,v5e8", 8, 1, 32), ("g2rpo,lambda12,lora32,v5p8", 4, 4, 32),
    ("g2rpo,lora128", 8, 3, 128)])
def test_lora_words_select_adapters_on_a_bf16_base(argument, fsdp, lanes, rank):
    """docs/tpu_memory.md, "The smallest slice", measured with these settings: LoRA of rank 32
    fits a v6e-4 and a v5e-8 with one lane, rank 128 a v6e-4; the frozen base is bf16, alpha
    is twice the rank and the learning rate Flow-GRPO's LoRA default."""
    config = load(argument)
    assert (config.model.lora.rank, config.model.lora.alpha) == (rank, 2.0 * rank)
    assert config.model.param_dtype == "bfloat16" and config.model.dtype == "bfloat16"
    assert config.optimizer.learning_rate == 3e-4
    assert config.mesh.fsdp == fsdp
    assert algorithms.Algorithm.from_config(config.algorithm).max_lanes == lanes


def test_full_fine_tuning_keeps_float32_weights():
    config = load("g2rpo,v6e8")
    assert config.model.lora.rank == 0 and config.model.param_dtype == "float32"
    assert config.optimizer.learning_rate == 2e-6


def test_baselines_keep_their_own_settings():
    dance = load("dance_grpo").algorithm
    assert (dance.rollout, dance.sde_step, dance.eta, dance.train_fraction) == \
        ("trajectory", "dance_grpo", 0.3, 0.6)
    flow = load("flow_grpo").algorithm
    assert (flow.eta, flow.kl_beta, flow.shared_initial_noise) == (0.7, 0.04, False)
    mix = load("mix_grpo").algorithm
    assert (mix.sde_window, mix.eta) == (4, 0.7)
    for name in ("dance_grpo", "flow_grpo", "mix_grpo"):
        config = load(name)
        assert config.algorithm.group_size == 12
        # Every member is scored in their update: micro-batches of 4 prompts fit in HBM
        # (docs/tpu_memory.md).
        assert config.policy_update.micro_batch_prompts == 4
    assert load("g2rpo").policy_update.micro_batch_prompts == 0


def test_defaults_and_paths():
    config = load()
    assert config.algorithm.name == "g2rpo" and list(config.reward.train) == ["hps"]
    assert config.mode == "train"   # the pod command trains; describe is asked for
    # Every path derives from paths.root and follows an override of it.
    config.paths.root = "gs://bucket/flux"
    assert config.model.checkpoint == "gs://bucket/flux/FLUX.1-dev"
    assert config.autoencoder.path == "gs://bucket/flux/FLUX.1-dev/vae"
    assert config.reward.root == "gs://bucket/flux/rewards"
    assert config.data.data_dir == "gs://bucket/flux/tfds"
    assert config.data.prompts_file.endswith(".txt") and config.data.eval_prompts_file


@pytest.mark.parametrize("argument,message", [
    ("g2rpo,hsp", "Unknown word 'hsp'"),
    ("g2rpo,dance_grpo", "several algorithms"),
    ("dance_grpo,lambda12", "lambda12 sets G²RPO's granularities"),
    ("g2rpo,v5p8,v6e8", "several TPU slices"),
    ("g2rpo,lora32,lora128", "several LoRA ranks"),
    ("g2rpo,v6e4", "'v6e4' fits LoRA only.*full fine-tuning.*Add lora32, lora128"),
    ("g2rpo,lora128,v5e8", "'v5e8' fits LoRA only, measured with ranks \\[32\\].*lora128"),
])
def test_bad_arguments(argument, message):
    with pytest.raises(ValueError, match=message):
        load(argument)


def describe(workdir, argument: str) -> dict:
    """`main --config.mode=describe` for configs/flux_tpu.py:ARGUMENT on 8 CPU devices."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="8")
    result = subprocess.run(
        [sys.executable, "-m", "g2rpo_jax.main", f"--config=configs/flux_tpu.py:{argument}",
         f"--workdir={workdir}", "--config.mode=describe", "--config.describe.forward=False"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return json.loads((workdir / "describe.json").read_text())


def test_describe_runs_on_this_cpu(tmp_path):
    report = describe(tmp_path, "g2rpo,hps_clip")
    assert report["mesh"] == {"data": 1, "fsdp": 8, "tensor": 1}
    assert 11.8e9 < report["parameters"] < 12.0e9
    # fp32 FLUX.1-dev split 8 ways: under 6 GiB of parameters per device.
    assert report["parameter_mib_per_device"] < 6 * 1024


def test_describe_counts_the_lora_adapters(tmp_path):
    report = describe(tmp_path, "g2rpo,lora32,v6e4")
    assert report["mesh"] == {"data": 2, "fsdp": 4, "tensor": 1}
    # Rank r adapters hold r × (fan in + fan out) per target linear. Hidden h = 3,072, MLP 4h:
    # a double block's two streams have q, k, v, out (2h each) and fc1, fc2 (5h each), 36h; a
    # single block q, k, v, out_attn (2h each), mlp_in and out_mlp (5h each), 18h.
    hidden = 3072
    assert report["lora"] == {"rank": 32, "alpha": 64.0,
                              "parameters": 32 * (19 * 36 + 38 * 18) * hidden}
    # The frozen base is bf16: 11.9B × 2 bytes over the 4 chips of an fsdp group.
    assert 5.4 * 1024 < report["parameter_mib_per_device"] < 5.7 * 1024
