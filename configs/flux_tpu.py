r"""The paper's setting on a TPU pod: RL fine-tuning of FLUX.1-dev at 720×720 (method.md,
"Reference setting" and "The update").

  python -m g2rpo_jax.main --config=configs/flux_tpu.py:g2rpo,hps_clip \
      --config.paths.root=gs://BUCKET/flux --workdir=gs://BUCKET/runs/g2rpo_hps_clip

It trains by default; `--config.mode=describe` reports the job instead (parameters and
shardings; no weights needed), as launch/run.sh does first on every worker.
The argument is comma-separated words: one algorithm (g2rpo [default], g2rpo_no_mgai, dance_grpo,
flow_grpo, mix_grpo), one training reward (hps [default]: HPS-v2.1; hps_clip: HPS-v2.1 + CLIP
score, unit weights) and optionally `lambda12` (G²RPO with the reference scripts' Λ = {1, 2}
instead of the paper's {1, 2, 3}), optionally a LoRA word (`lora32`, `lora128`: train rank-32 or
-128 adapters on a frozen bf16 base instead of every parameter; see LORA) and one of the smallest
TPU slices that fit (full fine-tuning: `v5p8`, `v6e8`, `v5e16`; LoRA only: `v6e4`, `v5e8`; see
SLICES; without one: v5p-16 and larger); e.g. `:dance_grpo,hps_clip`, `:g2rpo,hps,lambda12`,
`:g2rpo,hps,v6e8` or `:g2rpo,hps,lora32,v6e4`.

Paths are fields: they all derive from `paths.root` (a gs:// placeholder), laid out as below;
override the root, or any single path, on the command line. Every path may be local or gs://
(g2rpo_jax.core.storage: weights are downloaded once into a local cache and memory-mapped from
there; no gcsfuse needed).
  ROOT/FLUX.1-dev/                 diffusers FLUX.1-dev (transformer/, vae/, text_encoder/,
                                   text_encoder_2/, tokenizer/, tokenizer_2/)
  ROOT/rewards/                    HPS_v2.1_compressed.safetensors (the published .pt, converted
                                   once: python -m g2rpo_jax.convert), DFN5B-CLIP-ViT-H-14-378/,
                                   PickScore_v1/
  ROOT/prompts/                    hpdv2_train.txt, hpdv2_test.txt (one prompt per line)
  ROOT/tfds/                       the preprocessed prompt-embedding datasets (g2rpo_jax.preprocess)

Memory: `benchmarks/perf/tpu_aot.py` compiles this config's rollout and update for real TPU
topologies on a CPU and reports per-chip memory (docs/tpu_memory.md); the defaults of
the mesh, the continuation lanes and the update's micro-batch are the measured ones.
"""

import ml_collections

from g2rpo_jax.rl import algorithms
from g2rpo_jax.run import config_lib

# ------------------------------------------------------------------------------------------
# The paper's numbers (method.md), named for the tests and the AOT tool.
IMAGE_SIZE = 720                 # pixels per side
VAE_DOWNSAMPLE = 8               # FLUX autoencoder: 720 → 90×90 latents of 16 channels
LATENT_CHANNELS = 16
PATCH = 2                        # 2×2 latent patches → 45×45 = 2,025 tokens of 64 channels
T5_MAX_LENGTH = 512
NUM_STEPS = 16
SHIFT = 3.0
GUIDANCE = 3.5
GROUP_SIZE = 12
ETA = 0.7
BRANCH_STEPS = tuple(range(8))   # the first, high-noise half of T = 16
CLIP_RANGE = 1e-4
PROMPTS_PER_ITERATION = 16       # 16 groups: the paper's 16 GPUs × one prompt
NUM_ITERATIONS = 300

# Training rewards by the argument's reward word: (names in config.reward.models, weights).
REWARDS = {
    "hps": (("hps",), (1.0,)),
    "hps_clip": (("hps", "clip_score"), (1.0, 1.0)),
}

# ------------------------------------------------------------------------------------------
# Memory-bound settings, measured with benchmarks/perf/tpu_aot.py (docs/tpu_memory.md) with the
# model's default attention ("auto": the splash flash kernel on TPU, which keeps the
# [S, S] attention logits out of HBM).
# Continuation lanes run side by side in one model call of prompts × lanes × G samples; every
# lane count makes the same number of model calls (the plan packs the (k, λ) finishes), so the
# bound only trades call size for scan length: the most lanes the plan can pack (Λ = {1,2,3}:
# 1 or 3; {1,2} and {1}: 1, 2 or 4) whose rollout peak per chip stays within ~90% of a v5p's
# 95 GiB on 8 chips (2 prompts per chip). Measured peaks (splash, moments offloaded to host):
# Λ = {1,2,3} with 3 lanes (72 samples per chip) 30.9 GiB; Λ = {1,2} and {1} with 4 lanes (96
# per chip) 36.3 and 35.2 GiB (with the moments in HBM 42.0, 47.4 and 46.3). With
# attention="xla" and moments in HBM: 74.3 GiB with 3 lanes; {1,2} and {1} 83.3 and 82.4
# already with 2 lanes, so 1 there. Other Λ: 1 lane.
MAX_LANES = {(1, 2, 3): 3, (1, 2): 4, (1,): 4}
FSDP_CHIPS = 8                   # chips sharing one copy of the parameters (mesh.fsdp)
# Prompts per gradient micro-batch (0 = all at once). G²RPO's update scores one anchor per
# prompt and k (16 samples per call); the trajectory baselines score every member
# (prompts × 12 samples per call), which with all 16 prompts needs 117 GiB per chip on 8 chips.
MICRO_BATCH_PROMPTS = {"singular": 0, "trajectory": 4}

# LoRA (models/lora.py) by word: adapters of this rank on every target linear, alpha = 2 × rank,
# the frozen base stored in bf16 (no fp32 master copy: nothing updates it) and Flow-GRPO's LoRA
# learning rate (its config/base.py: 3e-4; adapters move much less per step than full weights).
LORA = {"lora32": dict(rank=32, alpha=64.0), "lora128": dict(rank=128, alpha=256.0)}
LORA_LEARNING_RATE = 3e-4

# The smallest slice of each TPU generation on which the paper's setting (16 prompts) compiles
# with rollout and update within 90% of HBM per chip, as measured with benchmarks/perf/tpu_aot.py for
# Λ = {1,2,3} and {1,2} (docs/tpu_memory.md, "The smallest slice"): the option word sets the
# mesh's fsdp group, the moments' dtype and a cap on the continuation lanes; `lora_ranks` names
# the adapter ranks a LoRA-only slice was measured with (None: full fine-tuning fits, and LoRA
# with it). GiB per chip below are Λ = {1,2,3}'s rollout / update.
SLICES = {
    # v5p-8 (v5p:2x2x1, 4 chips, 95 GiB): fsdp over the 4 chips (52.0 / 62.5; LoRA 32.9 / 15.8).
    "v5p8": dict(fsdp=4, moments_dtype="float32", max_lanes=None, lora_ranks=None),
    # v6e-8 (v6e:2x4, 8 chips, 32 GiB): bf16 moments, one lane (16.2 / 24.9; 3 lanes take
    # 29.7 GiB, 93%).
    "v6e8": dict(fsdp=8, moments_dtype="bfloat16", max_lanes=1, lora_ranks=None),
    # v5e-16 (v5e:4x4, 16 chips, 16 GiB): fsdp 16, bf16 moments, one lane (8.7 / 13.5).
    "v5e16": dict(fsdp=16, moments_dtype="bfloat16", max_lanes=1, lora_ranks=None),
    # v6e-4 (v6e:2x2, 4 chips): LoRA only, one lane (rank 32: 18.4 / 16.4; rank 128:
    # 20.1 / 22.4). Full fine-tuning's fp32 weights, gradients and moments need ~34 GiB a chip.
    "v6e4": dict(fsdp=4, moments_dtype="float32", max_lanes=1, lora_ranks=(32, 128)),
    # v5e-8 (v5e:2x4, 8 chips): LoRA rank 32 only, one lane (13.6 / 8.8); rank 128 takes
    # 15.2 GiB (95%) in the rollout.
    "v5e8": dict(fsdp=8, moments_dtype="float32", max_lanes=1, lora_ranks=(32,)),
}
# Without a slice word: v5p-16 and larger (fsdp 8, fp32 moments, the most lanes).
LARGER_SLICES = dict(fsdp=FSDP_CHIPS, moments_dtype="float32", max_lanes=None, lora_ranks=None)
OPTIONS = ("lambda12",) + tuple(LORA) + tuple(SLICES)

PLACEHOLDER_ROOT = "gs://YOUR_BUCKET/flux"


def latent_tokens(image_size: int = IMAGE_SIZE) -> int:
    """Image tokens of one sample: (720 / 8 / 2)² = 2,025."""
    side = image_size // VAE_DOWNSAMPLE // PATCH
    return side * side


def parse_argument(argument: str | None) -> tuple[str, str, tuple[str, ...]]:
    """"g2rpo,hps_clip,lambda12" → ("g2rpo", "hps_clip", ("lambda12",)); words may be missing
    (defaults g2rpo, hps) and come in any order."""
    chosen = {"algorithm": [], "reward": [], "option": []}
    for word in (w.strip() for w in (argument or "").split(",")):
        if not word:
            continue
        kind = ("algorithm" if word in algorithms.PRESETS else "reward" if word in REWARDS
                else "option" if word in OPTIONS else None)
        if kind is None:
            raise ValueError(
                f"Unknown word {word!r} in the config argument {argument!r}. Give one algorithm "
                f"{sorted(algorithms.PRESETS)}, one reward {sorted(REWARDS)} and options "
                f"{list(OPTIONS)}, e.g. configs/flux_tpu.py:g2rpo,hps_clip.")
        chosen[kind].append(word)
    for kind in ("algorithm", "reward"):
        if len(chosen[kind]) > 1:
            raise ValueError(f"The config argument {argument!r} names several {kind}s: "
                             f"{chosen[kind]}.")
    algorithm = (chosen["algorithm"] or ["g2rpo"])[0]
    options = tuple(chosen["option"])
    for table, what in ((SLICES, "TPU slices"), (LORA, "LoRA ranks")):
        if len([o for o in options if o in table]) > 1:
            raise ValueError(f"The config argument {argument!r} names several {what}: "
                             f"{[o for o in options if o in table]}.")
    for word in (o for o in options if o in SLICES and SLICES[o]["lora_ranks"]):
        ranks = SLICES[word]["lora_ranks"]
        lora_word = next((o for o in options if o in LORA), None)
        if lora_word is None or LORA[lora_word]["rank"] not in ranks:
            fits = ", ".join(f"lora{r}" for r in ranks)
            raise ValueError(
                f"The slice {word!r} fits LoRA only, measured with ranks {list(ranks)} "
                f"(docs/tpu_memory.md, \"The smallest slice\"); the argument {argument!r} asks "
                f"for {lora_word or 'full fine-tuning'}. Add {fits}, or pick a larger slice.")
    if "lambda12" in options and algorithms.PRESETS[algorithm]["rollout"] != "singular":
        raise ValueError(f"lambda12 sets G²RPO's granularities; {algorithm!r} has none.")
    return algorithm, (chosen["reward"] or ["hps"])[0], options


def algorithm_config(name: str, options: tuple[str, ...] = ()) -> ml_collections.ConfigDict:
    """The named preset with the paper's group size; the G²RPO variants also get its branch
    steps, η and clip range explicitly (the baselines keep their own, e.g. DanceGRPO's η 0.3)."""
    overrides = dict(group_size=GROUP_SIZE)
    if algorithms.PRESETS[name]["rollout"] == "singular":
        overrides.update(branch_steps=BRANCH_STEPS, eta=ETA, clip_range=CLIP_RANGE)
    if "lambda12" in options:
        overrides.update(granularities=(1, 2), granularity_weights=(1.0, 1.0))
    config = algorithms.preset(name, **overrides)
    if config.rollout == "singular":
        config.max_lanes = MAX_LANES.get(tuple(config.granularities), 1)
    return config


def get_config(argument: str = "g2rpo,hps"):
    algorithm, reward, options = parse_argument(argument)
    config = config_lib.flux_config(algorithm)
    # The RL job; --config.mode=describe: parameters and shardings, no weights needed.
    config.mode = "train"

    # The transformer: FLUX.1-dev, bf16 compute, fp32 master weights, rematerialised blocks,
    # the platform's fused attention (splash on TPU; the memory bounds above assume it).
    config.model = config_lib.flux_model_config(dtype="bfloat16", param_dtype="float32",
                                                remat_policy="full", attention="auto")
    lora_word = next((o for o in options if o in LORA), None)
    if lora_word:
        config.model.lora.rank = LORA[lora_word]["rank"]
        config.model.lora.alpha = LORA[lora_word]["alpha"]
        config.model.param_dtype = "bfloat16"
    config.algorithm = algorithm_config(algorithm, options)
    config.sampling.num_steps = NUM_STEPS
    config.sampling.shift = SHIFT
    config.sampling.guidance = GUIDANCE
    config.sampling.quantize_timesteps = False
    config.optimizer = config_lib.optimizer_config(
        learning_rate=LORA_LEARNING_RATE if lora_word else 2e-6)
    # The reference code's one optimizer step per trained k (0 = one accumulated step).
    config.policy_update.steps_per_update = 1
    config.policy_update.micro_batch_prompts = MICRO_BATCH_PROMPTS[config.algorithm.rollout]
    config.policy_update.recompute_old_log_prob = True
    # The AdamW moments (and Flow-GRPO's KL reference) wait in pinned host memory while the
    # rollout runs (11.1 GiB per chip on v5p:2x2x2, +5.6 for the reference), for two host↔HBM
    # copies per iteration inside the update (docs/tpu_memory.md).
    config.policy_update.offload_optimizer_state = True
    config.policy_update.offload_reference = True
    config.train.num_iterations = NUM_ITERATIONS
    config.train.prompts_per_iteration = PROMPTS_PER_ITERATION
    # Spot / preemptible slices: a checkpoint every 10 iterations (and one on SIGTERM); the
    # two newest are kept (params + AdamW moments in float32: 142.8 GB each; with LoRA the
    # adapters and their moments only).
    config.train.checkpoint_every = 10
    config.train.checkpoints_to_keep = 2
    names, weights = REWARDS[reward]
    config.reward.train = list(names)
    config.reward.weights = list(weights)
    config.image.height = config.image.width = IMAGE_SIZE
    config.text.t5_max_length = T5_MAX_LENGTH

    # ---- TPU pod: mesh, multi-host, paths (this file's own block) ----
    # Parameters, gradients and AdamW moments sharded over `fsdp` groups of FSDP_CHIPS chips
    # (fp32 params + moments + gradients of 12B: ~177 GiB, ~22 GiB per chip); `data` (-1: the
    # rest of the pod) replicates them over the groups: v5p-16 (8 chips) 1 × 8, v5p-64
    # (32 chips) 4 × 8, v5p-128 (64 chips, a 4x4x4 torus: groups of 8 split a physical axis)
    # 8 × 8. The batch is split over fsdp first, then data, so the iteration's 16 prompts (the
    # anchor ODE, the update's per-prompt passes) spread over the chips of a group rather than
    # over replicas, while the continuation's big calls (prompts × lanes × G) use every chip.
    config.mesh.data = -1
    config.mesh.tensor = 1
    tpu_slice = next((SLICES[o] for o in options if o in SLICES), LARGER_SLICES)
    config.mesh.fsdp = tpu_slice["fsdp"]
    config.optimizer.moments_dtype = tpu_slice["moments_dtype"]
    if tpu_slice["max_lanes"] and config.algorithm.rollout == "singular":
        config.algorithm.max_lanes = min(config.algorithm.max_lanes, tpu_slice["max_lanes"])
    config.sharding_rules = [["batch", ["fsdp", "data"]] if name == "batch" else [name, axes]
                             for name, axes in config.sharding_rules]
    # Every TPU VM of the pod runs the same command; jax.distributed finds the others. Without a
    # cluster (a workstation running describe) it runs as one process.
    config.distributed.enabled = True
    config.distributed.single_process_fallback = True

    root = ml_collections.FieldReference(PLACEHOLDER_ROOT)
    config.paths = ml_collections.ConfigDict(dict(root=root))
    config.model.checkpoint = root + "/FLUX.1-dev"         # its transformer/ folder is read
    config.autoencoder.path = root + "/FLUX.1-dev/vae"
    config.text.path = root + "/FLUX.1-dev"                 # text_encoder{,_2}/, tokenizer{,_2}/
    config.reward.root = root + "/rewards"
    config.data.prompts_file = root + "/prompts/hpdv2_train.txt"
    config.data.eval_prompts_file = root + "/prompts/hpdv2_test.txt"
    config.data.data_dir = root + "/tfds"

    # describe on the real shapes: one 720×720 sample (2,025 image tokens), a 512-token prompt;
    # the 12B forward itself needs the accelerator (--config.describe.forward=True on a pod).
    config.describe.forward = False
    config.describe.image_tokens = latent_tokens()
    config.describe.text_tokens = T5_MAX_LENGTH
    return config
