"""Shared pieces of the ml_collections configs in `configs/` (big_vision's `common` role).

A config file's `get_config()` starts from `base_config()` and overrides fields; code reads the
fields and never branches on a config's name. Programs take a config file through
`define_config_flag()`; tests and benchmarks load one with `load_config()`.
"""

import dataclasses
import importlib.util
import os

import ml_collections
from ml_collections import config_flags

from g2rpo_jax.models import flux, lora
from g2rpo_jax.parallel import sharding
from g2rpo_jax.rl import algorithms


def define_config_flag():
    """Defines the entry points' --config flag (a config file with get_config(), fields
    overridable as --config.section.field=value); returns its FlagHolder. Called once per
    program: importing two entry points must not define it twice."""
    return config_flags.DEFINE_config_file(
        "config", None, "Path to a config file with get_config(); override fields as "
        "--config.section.field=value.", lock_config=True)


# The repository's config files (next to the package in a source checkout).
_REPOSITORY = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG_DIR = os.path.join(_REPOSITORY, "configs")


def load_config(path: str, argument: str | None = None, **overrides) -> ml_collections.ConfigDict:
    """The config of a config file, as `--config=PATH[:ARGUMENT]` gives it to a program, with
    `--config.section.field=value` overrides.

    Args:
      path: a config file, or a bare file name ("shapes_cpu.py") of one in CONFIG_DIR.
      argument: passed to `get_config(argument)`; None calls `get_config()`.
      **overrides: fields by dotted name, e.g. `**{"train.num_iterations": 2}`, set in order.

    Raises:
      KeyError: an override names a field the config does not have.
    """
    if os.path.dirname(path) == "":
        path = os.path.join(CONFIG_DIR, path)
    name = os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config() if argument is None else module.get_config(argument)
    for dotted, value in overrides.items():
        *sections, field = dotted.split(".")
        node = config
        for section in sections:
            node = node[section]
        if field not in node:
            raise KeyError(f"{path} has no field {dotted!r}.")
        node[field] = value
    return config


def flux_model_config(**overrides) -> ml_collections.ConfigDict:
    """The FLUX transformer section; defaults are FLUX.1-dev (12B)."""
    fields = dataclasses.asdict(flux.FluxConfig())
    fields["axes_dims_rope"] = tuple(fields["axes_dims_rope"])
    fields.update(overrides)
    model = ml_collections.ConfigDict(fields)
    # A diffusers transformer/ folder, a model folder containing it, or a BFL single file;
    # empty = random initialisation.
    model.checkpoint = ""
    # Low-rank adapters (models.lora): rank 0 = off (full fine-tuning); alpha / rank scales the
    # update; targets name our FLUX port's linears (models.lora.TARGETS: attention q / k / v /
    # out and MLP of the double and single blocks).
    model.lora = ml_collections.ConfigDict(dict(
        rank=0, alpha=64.0, dropout=0.0, targets=list(lora.TARGETS)))
    return model


def to_flux_config(model_config) -> flux.FluxConfig:
    """FluxConfig from a config's `model` section (extra keys such as `checkpoint` ignored)."""
    return flux.FluxConfig.from_dict(model_config.to_dict())


EXECUTION_FIELDS = ("dtype", "param_dtype", "scan_layers", "remat_policy", "attention")


def execution_fields(model_config) -> dict:
    """How a loaded transformer runs (not what it is): FluxConfig's execution fields from a
    config's `model` section, for loaders that read the architecture from the checkpoint."""
    return {k: model_config[k] for k in EXECUTION_FIELDS}


def base_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.seed = 0
    # What the RL and evaluation code runs on (g2rpo_jax.tasks): "flux" (the real FLUX.1 stack:
    # flux_config) or "shapes" (the embedded world: shapes_config).
    config.task = "flux"
    # What `main` does (main.MODES): "describe" builds the mesh and model, reports parameters
    # and shardings and optionally times a forward pass; "pretrain" and "train" run
    # g2rpo_jax/pretrain.py and g2rpo_jax/train.py.
    config.mode = "describe"
    config.model = flux_model_config()

    # Mesh over all devices; one axis may be -1 ("the rest").
    config.mesh = ml_collections.ConfigDict(
        dict(data=-1, fsdp=1, tensor=1, axis_types="auto"))
    config.sharding_rules = [list(rule) for rule in sharding.DEFAULT_RULES]
    # JAX's persistent compilation cache ("" = WORKDIR/compilation_cache; local or gs://): a
    # resumed or repeated run loads the compiled programs instead of compiling them again
    # (minutes for FLUX.1-dev on TPU).
    config.compilation_cache_dir = ""
    # Multi-process jobs (TPU pods): jax.distributed.initialize(); on TPU the other fields
    # can stay empty (discovered from the environment).
    config.distributed = ml_collections.ConfigDict(
        dict(enabled=False, coordinator_address="", num_processes=-1, process_id=-1))

    # The RL algorithm (G²RPO by default; baselines are presets of the same fields). Config
    # files take a preset name as their argument: --config=configs/file.py:dance_grpo.
    config.algorithm = algorithms.preset("g2rpo")
    # Sampling (method.md): T steps, SD3 time shift, FLUX guidance embedding.
    config.sampling = ml_collections.ConfigDict(dict(
        num_steps=16, shift=3.0, guidance=3.5, quantize_timesteps=False))
    config.optimizer = optimizer_config()
    # The policy update (rl.policy_update.PolicyUpdate). steps_per_update: 1 = one optimizer
    # step per trained k (reference code); 0 (or K) = one accumulated step over all k
    # (on-policy). micro_batch_prompts: 0 = all prompts at once. recompute_old_log_prob:
    # re-score the rollout's transitions in the update's layout before the first step, so the
    # first ratio is exactly 1 in bf16 too (tests/rl/test_policy_update.py).
    # offload_optimizer_state / offload_reference: keep the AdamW moments / the KL reference in
    # pinned host memory outside the update (rollout memory; docs/tpu_memory.md).
    # batch_steps: a group's trained steps in one batched forward and backward instead of a scan
    # over them (the same loss in another summation order; more activation memory;
    # benchmarks/README.md "The K trained steps in one batch").
    config.policy_update = ml_collections.ConfigDict(dict(
        steps_per_update=1, micro_batch_prompts=0, recompute_old_log_prob=True,
        offload_optimizer_state=False, offload_reference=False, batch_steps=False))

    # Where a run is watched besides metrics.jsonl and TensorBoard (always written): wandb=True
    # also logs to a Weights & Biases run (g2rpo_jax.run.wandb_logger; pip install -e ".[wandb]"),
    # one per workdir, resumed on restart. run_name "" = the workdir's name; tags a tuple or
    # "a,b"; mode "online", "offline" (no network; `wandb sync` later), "disabled", or "" =
    # W&B's default ($WANDB_MODE, else online).
    config.logging = ml_collections.ConfigDict(dict(
        wandb=False, wandb_project="g2rpo-jax", wandb_entity="", wandb_run_name="",
        wandb_tags=(), wandb_mode=""))

    # mode=describe: the dummy batch used to time one forward pass.
    config.describe = ml_collections.ConfigDict(dict(
        forward=True, batch_size=-1, image_tokens=256, text_tokens=32, num_runs=3,
        # Parameter lines printed (largest first); 0 = none, -1 = all.
        max_param_lines=20))
    return config


def optimizer_config(**overrides) -> ml_collections.ConfigDict:
    """The optimizer section (`config.optimizer`, read by `optimizer.make_optimizer`): AdamW as
    in the paper, constant schedule, grad-norm clip 1.0; a config overrides what differs.

    schedule: "constant", "warmup_constant" (linear warm-up over warmup_steps, then constant)
      or "warmup_cosine" (warm-up, then cosine decay to 0 at decay_steps, the total length).
    moments_dtype: "float32" or "bfloat16" (AdamW's two moments stored in bfloat16, computed in
      float32: half their memory).
    """
    fields = dict(learning_rate=2e-6, schedule="constant", warmup_steps=0, decay_steps=1,
                  b1=0.9, b2=0.999, eps=1e-8, weight_decay=1e-4, grad_clip_norm=1.0,
                  moments_dtype="float32")
    unknown = set(overrides) - set(fields)
    if unknown:
        raise ValueError(f"Unknown optimizer fields {sorted(unknown)}; known: {sorted(fields)}.")
    fields.update(overrides)
    return ml_collections.ConfigDict(fields)


def train_config(**overrides) -> ml_collections.ConfigDict:
    """The RL loop's section (`config.train`), shared by every RL config; README "Checkpoints
    and resuming" explains the checkpoint fields.

    checkpoint_every: save every that many iterations (0: only the final one and on
      preemption); checkpoint_every_seconds: also when that many seconds passed since the last
      save (0: off); checkpoints_to_keep: the newest kept (0: all); async_checkpointing: write
      in the background while training goes on.
    start_over: in a workdir that holds a run, start again from iteration 0 (its checkpoints,
      metrics and events are removed) instead of resuming it.
    max_consecutive_skips: optimizer steps in a row whose loss or gradient was not finite
      (skipped, not applied) after which the run stops with an error.
    samples_every: every that many iterations, TensorBoard shows one group of training samples
      for each of the first `sample_prompts` prompts, with rewards and advantages (0: never).
    hacking_margin / hacking_window: a warning is logged (and kept in summary.json / .md) when
      a held-out score the policy is not trained on falls by more than `hacking_margin` over
      the last `hacking_window` evaluations while a trained one rises (0: off).
    """
    fields = dict(num_iterations=300, prompts_per_iteration=16, eval_every=50,
                  images_in_grid=16, checkpoint_every=50, checkpoint_every_seconds=0,
                  checkpoints_to_keep=3, async_checkpointing=True, start_over=False,
                  max_consecutive_skips=10, samples_every=10, sample_prompts=2,
                  hacking_margin=0.02, hacking_window=2)
    unknown = set(overrides) - set(fields)
    if unknown:
        raise ValueError(f"Unknown train fields {sorted(unknown)}; known: {sorted(fields)}.")
    fields.update(overrides)
    return ml_collections.ConfigDict(fields)


def reward_model(kind: str, path: str = "", **options) -> ml_collections.ConfigDict:
    """One reward model of `config.reward.models`: `rewards.get(kind, path, **options)`.

    Empty options are not passed, except `config=""`: None, i.e. the architecture is read from
    the checkpoint's config file or inferred from its shapes. `path`, `tokenizer` and
    `clip_path` may be relative to `config.reward.root`; an empty `tokenizer` of hps /
    clip_score means FLUX.1's own tokenizer/ (the same CLIP BPE as OpenCLIP's).

    A `remote` reward takes its URL as `path` and, besides `timeout=` and `image_format=`, the
    retry options of rewards.registry.RemoteReward: e.g. `reward_model("remote",
    "http://scorer:8000/score", retries=5, backoff_seconds=1.0, max_backoff_seconds=30.0,
    jitter=0.1)` (0 is passed as is: `retries=0` fails on the first error)."""
    return ml_collections.ConfigDict(dict(kind=kind, path=path, **options))


def flux_config(algorithm: str = "g2rpo") -> ml_collections.ConfigDict:
    """RL and evaluation of FLUX.1 (task "flux"), with the paper's settings (method.md):
    prompts from preprocessed embedding datasets (g2rpo_jax.preprocess), the FLUX autoencoder,
    and the reward models of the registry (HPS-v2.1 trained; CLIP score and PickScore reported).
    Paths are empty; a config file or the command line sets them."""
    config = base_config()
    config.mode = "train"
    config.model = flux_model_config(dtype="bfloat16", param_dtype="float32",
                                     remat_policy="full")
    # The FLUX autoencoder: a diffusers vae/ folder or a folder containing it; "" = the
    # folder of model.checkpoint.
    config.autoencoder = ml_collections.ConfigDict(dict(path="", dtype="bfloat16"))
    # The text encoders (used by preprocessing only): a folder with text_encoder/, tokenizer/,
    # text_encoder_2/, tokenizer_2/; "" = model.checkpoint. FLUX.1-dev: T5 length 512.
    config.text = ml_collections.ConfigDict(dict(path="", dtype="bfloat16", t5_max_length=512,
                                                 clip_max_length=77))
    # Sampled image size in pixels (latents: /8 by the autoencoder, then 2×2 patches).
    config.image = ml_collections.ConfigDict(dict(height=720, width=720))
    # Prompts (HPDv2 style text files) and their preprocessed embedding datasets, stored
    # under data_dir ("" = TFDS's default) as prompt_embeddings/<name>/ (name "" = the prompts
    # file's stem). The reference code trained on the first 50,000 HPDv2 training prompts and
    # evaluates on HPDv2's 400 test prompts. chunk_size: prompts per resumable work unit.
    config.data = ml_collections.ConfigDict(dict(
        prompts_file="", eval_prompts_file="", max_prompts=50_000, max_eval_prompts=0,
        name="", eval_name="", data_dir="", storage_dtype="bfloat16", chunk_size=256,
        keep_chunks=False))
    config.sampling.num_steps = 16
    config.sampling.shift = 3.0
    config.sampling.guidance = 3.5
    # train: rewards trained on, in the advantage with `weights` (HPS, or HPS + CLIP score with
    # unit weights: --config.reward.train='("hps","clip_score")' --config.reward.weights=
    # '(1.0,1.0)'); evaluate: rewards reported on held-out prompts (in-domain = trained on,
    # out-of-domain = the rest, as the paper's Table 1). batch_size: images decoded and
    # scored per call on each host (0 = all at once).
    config.reward = ml_collections.ConfigDict(dict(
        train=("hps",), weights=(1.0,), evaluate=("hps", "clip_score", "pickscore"), root="",
        batch_size=32,
        models=ml_collections.ConfigDict(dict(
            # HPS_v2.1_compressed.pt as published, converted once (python -m g2rpo_jax.convert).
            hps=reward_model("hps", "HPS_v2.1_compressed.safetensors", tokenizer="", config="ViT-H-14",
                             dtype=""),
            clip_score=reward_model("clip_score", "DFN5B-CLIP-ViT-H-14-378", tokenizer="",
                                    config="", dtype=""),
            pickscore=reward_model("pickscore", "PickScore_v1", tokenizer="", dtype=""),
        ))))
    # The presets' defaults are the paper's (G = 12, k ∈ 0..7, η = 0.7, ε = 1e-4).
    config.algorithm = algorithms.preset(algorithm)
    config.train = train_config()
    # Held-out evaluation: fixed noise (seed), the ODE sampler; num_prompts 0 = every prompt
    # of the evaluation dataset.
    config.evaluation = ml_collections.ConfigDict(dict(num_prompts=0, samples_per_prompt=1,
                                                       seed=1234))
    return config


def shapes_config() -> ml_collections.ConfigDict:
    """The embedded world (g2rpo_jax.data.world): a tiny FLUX-architecture transformer over
    32×32 images packed 4×4 → 64 tokens of 48 channels, a learned word encoder, no guidance
    embedding. Shared by shapes_pretrain.py and shapes_cpu.py."""
    config = base_config()
    config.task = "shapes"
    config.model = flux_model_config(
        num_layers=2, num_single_layers=2, attention_head_dim=32, num_attention_heads=4,
        joint_attention_dim=64, pooled_projection_dim=64, in_channels=48,
        axes_dims_rope=(8, 12, 12), guidance_embeds=False, scan_layers=False)
    # placement_grid: rendered objects' boxes start on a lattice of this pitch (px,
    # world.sample_scene); the patch size, so that a shape's pixels inside a token do not
    # depend on a sub-token offset: a model this small, pre-trained on objects at any pixel,
    # draws ragged blobs (docs/results.md, "The shipped base generator").
    config.world = ml_collections.ConfigDict(dict(
        image_size=32, patch=4, split_seed=0, held_out_fraction=0.2, placement_grid=4))
    config.text_encoder = ml_collections.ConfigDict(dict(max_length=8))
    # The TFDS ArrayRecord dataset of rendered images (built on first use); "" = DIR/tfds.
    config.data = ml_collections.ConfigDict(dict(data_dir="", images_per_prompt=16,
                                                 render_seed=0))
    config.sampling.num_steps = 16
    config.sampling.shift = 1.0
    config.sampling.guidance = ml_collections.config_dict.placeholder(float)
    # Held-out evaluation: fixed noise (seed), ODE samples of the held-out prompts
    # (num_prompts 0 = all of them).
    config.evaluation = ml_collections.ConfigDict(dict(
        num_prompts=0, samples_per_prompt=1, seed=1234))
    # The out-of-domain judge's weights; "" = the file shipped in g2rpo_jax/assets.
    # strict_verifier: in_domain gives no credit for extra or unrecognised objects
    # (`rewards.verifier.score`'s strict rule), in training and evaluation alike.
    config.reward = ml_collections.ConfigDict(dict(judge_path="", strict_verifier=False))
    return config
