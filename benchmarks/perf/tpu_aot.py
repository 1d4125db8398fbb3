r"""Per-chip memory and cost of the FLUX TPU job, compiled ahead of time for a real TPU topology
on any machine (a CPU is enough): no TPU and no weights, only abstract inputs.

  python -m venv --system-site-packages ~/tpuenv && ~/tpuenv/bin/pip install "jax[tpu]==0.10.2"
  ~/tpuenv/bin/python benchmarks/perf/tpu_aot.py --topology=v5p:2x2x2
  ~/tpuenv/bin/python benchmarks/perf/tpu_aot.py --topology=v5p:4x4x4 \
      --config=configs/flux_tpu.py:g2rpo,hps_clip --config.algorithm.max_lanes=1

libtpu stays out of the default environment (it is only needed here); its warnings about
TPU_ACCELERATOR_TYPE / TPU_WORKER_HOSTNAMES are harmless on a machine without a TPU. libtpu
admits one process at a time (a lock file); ALLOW_MULTIPLE_LIBTPU_LOAD=1 lets several of these
compile-only runs go side by side.

Pieces (--pieces), each a separate jitted program with the config's shapes and shardings:
  forward  one transformer call on the rollout's largest per-call batch (the continuation scan's
           prompts × lanes × G samples; trajectory baselines: prompts × G)
  sample   the whole jitted rollout stage (`iteration.make_rollout_stages(...)[0]`): anchor ODE,
           singular branches, every (k, λ) continuation (or the baselines' SDE trajectories)
  update   the GRPO update (`policy_update.make_update_fn` + `jit_update`): fp32 params and AdamW
           moments FSDP-sharded and donated, the rollout's TrainBatch, per-k optimizer steps
  t5       T5-XXL encoding of one preprocessing batch (bf16 weights; prompt preprocessing)
  vae      FLUX autoencoder decode of --vae_batch_per_chip latents per chip (the reward's decode)

Memory comes from `compiled.memory_analysis()` (per chip: arguments, outputs, aliased (donated)
bytes, temporaries; total = arguments + outputs − aliased + temporaries, as MaxText counts it).
`+state` is what stays resident beside a rollout program (the AdamW moments; Flow-GRPO's KL
reference too) and `peak` = total + state, compared with the chip's HBM.

XLA's `cost_analysis()` counts a loop body once, not once per iteration (the layer scan, the
sampling scans, and the windowed einsums XLA makes of FSDP all-gather + matmul), so its numbers
go to the JSON only (`xla_flops_one_pass`, `xla_optimal_seconds_one_pass`, `xla_cost_analysis`).
The table shows a model count of the program's matmul flops per chip ("TFLOP/chip": the model
calls the program makes × `models.flops.flux_forward_flops`, divided by the shards the batch is
split into; within 1% of XLA's count on unrolled blocks, tests/test_tpu_aot.py), the time that
takes at the chip's peak bf16 rate ("s@peak", a lower bound), and, where libtpu gives a time
estimate, XLA's estimated time ("est. s") and model FLOP utilisation ("est.MFU"; see
`estimated_mfu`). All of these are estimates: nothing here runs on a TPU. The attention kernel
is the config's `model.attention` resolved for the topology's platform ("auto" = splash on TPU).
Writes benchmarks/results/tpu_aot_<topology>.json and prints a table.
"""

import dataclasses
import math
import os
import time

# The local backend stays the CPU even where libtpu is installed; compilation targets the TPU
# topology through compile-only devices.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/flux_tpu.py", "Config file (any field can be overridden).",
    lock_config=True)
_TOPOLOGY = flags.DEFINE_multi_string(
    "topology", ["v5p:2x2x2"], "TPU topology names, e.g. v5p:2x2x2 (8 chips), v5p:2x4x4 (32), "
    "v5p:4x4x4 (64); repeat the flag for several. 'cpu': the local CPU devices (a quick check "
    "of this script with a small config).")
_PIECES = flags.DEFINE_list("pieces", ["forward", "sample", "update", "t5", "vae"],
                            "Programs to compile (see the module docstring).")
_VAE_BATCH = flags.DEFINE_integer("vae_batch_per_chip", 4, "Latents decoded per chip per call.")
_T5_BATCH = flags.DEFINE_integer("t5_batch", 0, "Prompts per T5 call; 0 = "
                                 "config.data.chunk_size (preprocessing's work unit).")
_HBM_GIB = flags.DEFINE_float("hbm_gib", 0.0, "HBM per chip in GiB; 0 = from the device kind.")
_OUT = flags.DEFINE_string("out", "", "JSON path, local or gs://; default benchmarks/results/"
                           "tpu_aot_<topology>.json (one file per topology).")



def install_command() -> str:
    """How to get libtpu without touching the default (CPU) environment."""
    import jax

    return ('python -m venv --system-site-packages ~/tpuenv && ~/tpuenv/bin/pip install '
            f'"jax[tpu]=={jax.__version__}"   (then run this script with ~/tpuenv/bin/python)')


# Per chip: HBM (GiB) and peak dense bf16 FLOP/s, by `device_kind`, as Google Cloud's TPU
# documentation lists them (cloud.google.com/tpu/docs/v4, /v5p, /v5e, /v6e: "Peak compute per
# chip (bf16)" and "HBM2 / HBM capacity").
CHIPS = {
    "TPU v4": (32.0, 275e12),
    "TPU v5": (95.0, 459e12),          # v5p
    "TPU v5 lite": (16.0, 197e12),     # v5e
    "TPU v6 lite": (32.0, 918e12),     # v6e (Trillium)
}
GIB = 2 ** 30


# ---------------------------------------------------------------------------------------------
# Topology and abstract inputs.


def topology_devices(name: str):
    """Compile-only devices of a TPU topology; a clear error when libtpu is missing.
    "cpu" gives the local devices instead (a check of this script on a small config)."""
    import jax
    from jax.experimental import topologies

    if name == "cpu":
        return jax.devices("cpu")

    try:
        return topologies.get_topology_desc(platform="tpu", topology_name=name).devices
    except Exception as e:  # libtpu absent or an unknown topology name
        import importlib.util

        if importlib.util.find_spec("libtpu") is None:
            raise SystemExit(f"benchmarks/perf/tpu_aot.py needs libtpu to compile for TPU ({e}). "
                             f"Install it in a separate environment:\n  {install_command()}") from None
        raise SystemExit(f"Cannot build TPU topology {name!r}: {e}") from None


def chip_specs(device) -> tuple[float, float]:
    """(HBM GiB, peak bf16 FLOP/s) of a device, --hbm_gib overriding the memory."""
    hbm, peak = CHIPS.get(device.device_kind, (0.0, 0.0))
    return (_HBM_GIB.value or hbm), peak


def sharded(shape, dtype, mesh, names, rules):
    """A ShapeDtypeStruct laid out by logical axis names (the rules' divisibility fallback)."""
    import jax
    from jax.sharding import NamedSharding

    from g2rpo_jax import parallel

    spec = parallel.logical_to_spec(names, rules, shape, mesh)
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def replicated(shape, dtype, mesh):
    return sharded(shape, dtype, mesh, (None,) * len(shape), ())


def batch_shards(batch: int, mesh, rules) -> int:
    """How many ways a leading batch of `batch` is split (the rest of the mesh replicates it)."""
    from g2rpo_jax import parallel

    spec = parallel.logical_to_spec(("batch",), rules, (batch,), mesh)
    axes = spec[0] if spec else None
    axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
    return math.prod(mesh.shape[a] for a in axes)


def abstract_state(abstract_module, mesh, rules):
    """(graphdef, nnx.State of ShapeDtypeStructs carrying their FSDP shardings)."""
    from flax import nnx
    import jax

    from g2rpo_jax import parallel

    graphdef, state = nnx.split(abstract_module)
    shardings = parallel.state_shardings(state, mesh, rules)
    params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          state, shardings)
    return graphdef, params


def abstract_cond(config, cfg, prompts: int, mesh, rules) -> dict:
    """Per-prompt conditioning: T5 embeddings txt [P, T, 4096], pooled CLIP y [P, 768] (batch
    split), position ids txt_ids [T, 3] and img_ids [N, 3] (replicated)."""
    import jax.numpy as jnp

    text, image = config.describe.text_tokens, config.describe.image_tokens
    return dict(
        txt=sharded((prompts, text, cfg.joint_attention_dim), jnp.float32, mesh,
                    ("batch", None, None), rules),
        y=sharded((prompts, cfg.pooled_projection_dim), jnp.float32, mesh, ("batch", None), rules),
        txt_ids=replicated((text, 3), jnp.float32, mesh),
        img_ids=replicated((image, 3), jnp.float32, mesh))


@dataclasses.dataclass
class Job:
    """Everything the pieces share for one topology."""

    config: object
    mesh: object
    rules: tuple
    cfg: object            # FluxConfig
    algo: object           # Algorithm
    sigmas: object
    graphdef: object
    params: object         # abstract nnx.State
    optimizer: object
    state: object          # abstract TrainState (policy_update.abstract_state), host-offloaded
                           # parts in pinned host memory
    prompts: int
    latent_shape: tuple

    @property
    def forward_flops(self) -> float:
        from g2rpo_jax.models import flops

        return flops.flux_forward_flops(self.cfg, self.config.describe.image_tokens,
                                        self.config.describe.text_tokens)


def make_job(config, devices) -> Job:
    from flax import nnx

    from g2rpo_jax import parallel
    from g2rpo_jax.models import flux, lora
    from g2rpo_jax.rl import optimizer as optimizer_lib
    from g2rpo_jax.rl import policy_update
    from g2rpo_jax.rl.algorithms import Algorithm
    from g2rpo_jax.run import config_lib
    from g2rpo_jax.tasks import held_out

    mesh = parallel.mesh_from_config(config.mesh, devices=devices)
    rules = parallel.rules_from_config(config.sharding_rules)
    cfg = config_lib.to_flux_config(config.model)
    flux.validate_mesh(cfg, mesh)
    model = flux.abstract_model(cfg, rules)
    lora_config = lora.LoRAConfig.from_config(config.model.get("lora"))
    if lora_config.enabled:
        lora.wrap(model, lora_config)       # adapters as shapes, like the rest
    graphdef, params = abstract_state(model, mesh, rules)
    optimizer = optimizer_lib.make_optimizer(config.optimizer)
    algo = Algorithm.from_config(config.algorithm)
    settings = policy_update.PolicyUpdate.from_config(config)
    if lora_config.enabled:   # as train.py: the adapters train, the base rides along frozen
        adapters, frozen = nnx.split_state(params, nnx.LoRAParam, ...)
        state = policy_update.abstract_state(adapters, optimizer, False, mesh, settings)
        state = state.replace(frozen=frozen)
    else:
        state = policy_update.abstract_state(params, optimizer, algo.kl_beta > 0, mesh, settings)
    return Job(config=config, mesh=mesh, rules=rules, cfg=cfg, algo=algo,
               sigmas=held_out.sigmas_from_config(config), graphdef=graphdef, params=params,
               optimizer=optimizer, state=state,
               prompts=config.train.prompts_per_iteration,
               latent_shape=(config.describe.image_tokens, cfg.in_channels))


def bytes_per_chip(tree, memory_kind: str | None = None) -> int:
    """Bytes one chip holds of a tree of sharded ShapeDtypeStructs (those in `memory_kind`
    only, if given: "device" or "pinned_host")."""
    import jax

    return sum(math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize
               for a in jax.tree.leaves(tree)
               if memory_kind is None or (a.sharding.memory_kind or "device") == memory_kind)


def resident_bytes(job: Job, memory_kind: str = "device") -> int:
    """What the train state holds beside a rollout program that does not take it as an argument:
    the AdamW moments (and the KL reference's copy of the params); the params are an argument.
    In HBM ("device") unless offloaded to pinned host memory (policy_update.offload_*)."""
    return bytes_per_chip((job.state.opt_state, job.state.ref_params), memory_kind)


# ---------------------------------------------------------------------------------------------
# The pieces: each returns (jitted fn, abstract args, description, model FLOPs per chip).


def rollout_call_batch(job: Job) -> int:
    """Samples in the rollout's largest model call: the continuation scan calls the model on
    prompts × lanes × G samples (trajectory baselines: prompts × G)."""
    from g2rpo_jax.rl import iteration

    g = job.algo.group_size
    if job.algo.rollout != "singular":
        return job.prompts * g
    return job.prompts * iteration.continuation_plan(job.algo, job.sigmas).num_lanes * g


def piece_forward(job: Job):
    from flax import nnx
    import jax
    import jax.numpy as jnp

    b = rollout_call_batch(job)
    n, c = job.latent_shape
    text = job.config.describe.text_tokens
    cond = abstract_cond(job.config, job.cfg, b, job.mesh, job.rules)
    batch = dict(
        img=sharded((b, n, c), jnp.float32, job.mesh, ("batch", None, None), job.rules),
        img_ids=cond["img_ids"], txt=cond["txt"], txt_ids=cond["txt_ids"],
        timesteps=sharded((b,), jnp.float32, job.mesh, ("batch",), job.rules), y=cond["y"],
        guidance=sharded((b,), jnp.float32, job.mesh, ("batch",), job.rules))
    graphdef = job.graphdef

    def forward(params, batch):
        return nnx.merge(graphdef, params)(**batch)

    flops = job.forward_flops * b / batch_shards(b, job.mesh, job.rules)
    return jax.jit(forward), (job.params, batch), f"B={b} N={n} T={text}", flops


def piece_sample(job: Job):
    import jax
    import jax.numpy as jnp

    from g2rpo_jax.rl import iteration

    config = job.config
    sample, _ = iteration.make_rollout_stages(
        job.graphdef, job.algo, job.sigmas, job.latent_shape, config.reward.weights,
        config.sampling.guidance, config.sampling.quantize_timesteps)
    cond = abstract_cond(config, job.cfg, job.prompts, job.mesh, job.rules)
    key = jax.eval_shape(lambda: jax.random.key(0))
    key = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=replicated((), jnp.int32,
                                                                           job.mesh).sharding)
    it = replicated((), jnp.int32, job.mesh)
    num_steps = config.sampling.num_steps
    g = job.algo.group_size
    if job.algo.rollout == "singular":
        plan = iteration.continuation_plan(job.algo, job.sigmas)
        anchor = num_steps * job.prompts / batch_shards(job.prompts, job.mesh, job.rules)
        b = rollout_call_batch(job)
        calls = anchor + plan.length * b / batch_shards(b, job.mesh, job.rules)
        what = (f"P={job.prompts} G={g} K={len(job.algo.branch_steps)} "
                f"Λ={job.algo.granularities} lanes={plan.num_lanes} scan={plan.length}")
    else:
        b = job.prompts * g
        calls = num_steps * b / batch_shards(b, job.mesh, job.rules)
        what = f"P={job.prompts} G={g} T={num_steps}"
    return jax.jit(sample), (job.params, cond, key, it), what, calls * job.forward_flops


def _abstract_batch(job: Job):
    """The rollout's TrainBatch: x [K, P, Gx, N, C], x_next [K, P, G, N, C], step [K],
    old_log_prob and advantages [K, P, G], prompts split over the batch axes."""
    import jax.numpy as jnp

    from g2rpo_jax.rl import policy_update

    k = job.algo.num_trained_steps(job.config.sampling.num_steps)
    g = job.algo.group_size
    gx = 1 if job.algo.rollout == "singular" else g
    p, mesh, rules = job.prompts, job.mesh, job.rules
    latent = lambda m: sharded((k, p, m, *job.latent_shape), jnp.float32, mesh,
                               (None, "batch", None, None, None), rules)
    per_member = lambda: sharded((k, p, g), jnp.float32, mesh, (None, "batch", None), rules)
    return policy_update.TrainBatch(x=latent(gx), x_next=latent(g),
                                    step=replicated((k,), jnp.int32, mesh),
                                    old_log_prob=per_member(), advantages=per_member()), k, gx


def piece_update(job: Job):
    from g2rpo_jax.rl import policy_update

    config = job.config
    optimizer = job.optimizer
    state = job.state
    batch, k, gx = _abstract_batch(job)
    cond = abstract_cond(config, job.cfg, job.prompts, job.mesh, job.rules)
    settings = policy_update.PolicyUpdate.from_config(config)
    update_fn = policy_update.make_update_fn(job.graphdef, optimizer, job.algo, settings,
                                             job.sigmas)
    jitted = policy_update.jit_update(update_fn, state, batch, cond)
    micro = settings.micro_batch_prompts or job.prompts
    per_call = micro * gx
    # Per trained transition: forward + backward (2×) + the rematerialised forward; plus the
    # re-scoring pass and the KL reference's forward.
    passes = 3 + (job.cfg.remat_policy != "none") + settings.recompute_old_log_prob \
        + (job.algo.kl_beta > 0)
    calls = k * (job.prompts // micro) * passes * per_call / batch_shards(per_call, job.mesh,
                                                                          job.rules)
    what = (f"K={k} P={job.prompts} micro={micro} Gx={gx} "
            f"steps/update={settings.steps_per_update or k}")
    return jitted, (state, batch, cond), what, calls * job.forward_flops


def piece_t5(job: Job):
    from flax import nnx
    import jax
    import jax.numpy as jnp

    from g2rpo_jax.models import t5

    cfg = t5.T5Config(dtype="bfloat16", param_dtype="bfloat16", remat_policy="none")
    graphdef, params = abstract_state(t5.abstract_model(cfg, job.rules), job.mesh, job.rules)
    b = _T5_BATCH.value or job.config.data.chunk_size
    length = job.config.describe.text_tokens
    ids = sharded((b, length), jnp.int32, job.mesh, ("batch", None), job.rules)

    def encode(params, ids):
        return nnx.merge(graphdef, params)(ids, None)

    per_token = 2 * cfg.num_layers * (4 * cfg.d_model * cfg.inner_dim
                                      + 3 * cfg.d_model * cfg.d_ff)
    flops = b * (length * per_token + cfg.num_layers * 4 * length * length * cfg.inner_dim)
    return jax.jit(encode), (params, ids), f"B={b} T={length}", \
        flops / batch_shards(b, job.mesh, job.rules)


def piece_vae(job: Job):
    from flax import nnx
    import jax
    import jax.numpy as jnp

    from g2rpo_jax.models import autoencoder

    cfg = autoencoder.AutoencoderConfig(dtype="bfloat16", param_dtype="float32")
    graphdef, params = abstract_state(autoencoder.abstract_model(cfg), job.mesh, job.rules)
    side = job.config.image.height // cfg.downsample_factor
    b = _VAE_BATCH.value * job.mesh.size
    latents = sharded((b, side, side, cfg.latent_channels), jnp.float32, job.mesh,
                      ("batch", None, None, None), job.rules)

    def decode(params, latents):
        return nnx.merge(graphdef, params).decode(latents)

    return jax.jit(decode), (params, latents), f"B={b} {side}x{side}→{side * 8}px", None


PIECES = {"forward": piece_forward, "sample": piece_sample, "update": piece_update,
          "t5": piece_t5, "vae": piece_vae}


# ---------------------------------------------------------------------------------------------
# Compile and report.


def compile_piece(job: Job, name: str) -> dict:
    import jax

    fn, args, what, model_flops = PIECES[name](job)
    with jax.set_mesh(job.mesh):
        start = time.perf_counter()
        lowered = fn.lower(*args)
        lower_s = time.perf_counter() - start
        start = time.perf_counter()
        compiled = lowered.compile()
        compile_s = time.perf_counter() - start
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis() or {}
    cost = cost[0] if isinstance(cost, list | tuple) else cost
    total = (mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
             + mem.temp_size_in_bytes)
    rollout = name in ("forward", "sample")
    resident = resident_bytes(job) if rollout else 0
    return dict(piece=name, shapes=what, lower_s=lower_s, compile_s=compile_s,
                argument_gib=mem.argument_size_in_bytes / GIB,
                output_gib=mem.output_size_in_bytes / GIB,
                alias_gib=mem.alias_size_in_bytes / GIB, temp_gib=mem.temp_size_in_bytes / GIB,
                code_mib=mem.generated_code_size_in_bytes / 2**20, total_gib=total / GIB,
                resident_gib=resident / GIB, peak_gib=(total + resident) / GIB,
                # Pinned host memory per chip: the offloaded state beside a rollout; a
                # program's host arguments / outputs (the update's offloaded moments).
                host_resident_gib=(resident_bytes(job, "pinned_host") if rollout else 0) / GIB,
                host_argument_gib=mem.host_argument_size_in_bytes / GIB,
                host_output_gib=mem.host_output_size_in_bytes / GIB,
                xla_flops_one_pass=float(cost.get("flops", 0.0)),
                xla_optimal_seconds_one_pass=float(cost.get("optimal_seconds", 0.0)),
                # Program totals only (libtpu adds per-operand "utilization3{}"-style entries).
                xla_cost_analysis={k: float(v) for k, v in cost.items()
                                   if isinstance(v, int | float) and "{" not in k},
                # The autoencoder has no loops (and replicated weights: no windowed einsums), so
                # XLA's count is the whole program's.
                model_flops_per_chip=float(cost.get("flops", 0.0)) if model_flops is None
                else model_flops)


def estimated_mfu(row: dict, peak: float) -> dict:
    """XLA's estimate of the program's time and the model FLOP utilisation it implies (both
    estimated, nothing measured): {} where libtpu gives no time estimate.

    libtpu's `cost_analysis()` has "optimal_seconds", its cost model's time, for the same
    one-pass program its "flops" count (loop bodies once). Their ratio is XLA's estimated
    FLOP rate per chip for this program's mix of work; the program's time is its model FLOPs
    per chip at that rate, and MFU = model FLOPs / (chips × peak × that time), the same per chip.
    A Pallas kernel (splash attention) is a custom call without a cost estimate: XLA sees
    neither its FLOPs nor its time, so the estimate assumes attention runs at the rate of the
    rest of the program."""
    flops, seconds = row["xla_flops_one_pass"], row["xla_optimal_seconds_one_pass"]
    if not (flops > 0 and seconds > 0):
        return {}
    estimated_s = row["model_flops_per_chip"] * seconds / flops
    return dict(estimated_seconds=estimated_s,
                estimated_mfu=row["model_flops_per_chip"] / (peak * estimated_s))


def run_topology(config, topology: str) -> dict:
    devices = topology_devices(topology)
    hbm, peak = chip_specs(devices[0])
    job = make_job(config, devices)
    report = dict(topology=topology, chips=len(devices), device_kind=devices[0].device_kind,
                  versions=_versions(),
                  hbm_gib_per_chip=hbm, peak_bf16_flops=peak, mesh=dict(job.mesh.shape),
                  algorithm=config.algorithm.name, granularities=list(job.algo.granularities),
                  prompts_per_iteration=job.prompts, model=_model_summary(job, devices[0]),
                  pieces=[])
    for name in _PIECES.value:
        if name not in PIECES:
            raise SystemExit(f"Unknown piece {name!r}; choose from {sorted(PIECES)}.")
        row = compile_piece(job, name)
        row["fits"] = bool(hbm) and row["peak_gib"] <= hbm
        if peak and row["model_flops_per_chip"]:
            row["seconds_at_peak"] = row["model_flops_per_chip"] / peak
            row.update(estimated_mfu(row, peak))
        report["pieces"].append(row)
        print_row(row, hbm)
    return report


def _versions() -> dict:
    import importlib.metadata

    versions = {}
    for name in ("jax", "jaxlib", "libtpu", "flax"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return versions


def _model_summary(job: Job, device) -> dict:
    from g2rpo_jax.models import attention

    cfg = job.cfg
    return dict(num_layers=cfg.num_layers, num_single_layers=cfg.num_single_layers,
                dtype=cfg.dtype, param_dtype=cfg.param_dtype, remat_policy=cfg.remat_policy,
                attention=cfg.attention,
                attention_kernel=attention.resolve(cfg.attention, cfg.dtype, device.platform),
                image_tokens=job.config.describe.image_tokens,
                text_tokens=job.config.describe.text_tokens,
                max_lanes=job.algo.max_lanes,
                lora_rank=int(job.config.model.get("lora", {}).get("rank", 0)),
                moments_dtype=job.config.optimizer.get("moments_dtype", "float32"),
                micro_batch_prompts=job.config.policy_update.micro_batch_prompts,
                steps_per_update=job.config.policy_update.steps_per_update)


HEADER = (f"{'piece':8s} {'shapes':44s} {'args':>6s} {'out':>6s} {'alias':>6s} {'temp':>6s} "
          f"{'total':>6s} {'+state':>6s} {'peak':>6s} {'HBM%':>5s} {'compile':>8s} "
          f"{'TFLOP/chip':>10s} {'s@peak':>7s} {'est. s':>7s} {'est.MFU':>7s}")


def print_row(row: dict, hbm: float) -> None:
    share = f"{100 * row['peak_gib'] / hbm:5.0f}" if hbm else "    -"
    tflops = row["model_flops_per_chip"]
    print(f"{row['piece']:8s} {row['shapes'][:44]:44s} {row['argument_gib']:6.2f} "
          f"{row['output_gib']:6.2f} {row['alias_gib']:6.2f} {row['temp_gib']:6.2f} "
          f"{row['total_gib']:6.2f} {row['resident_gib']:6.2f} {row['peak_gib']:6.2f} "
          f"{share} {row['compile_s']:7.1f}s "
          f"{(tflops or 0) / 1e12:10.1f} {row.get('seconds_at_peak', float('nan')):7.2f} "
          f"{row.get('estimated_seconds', float('nan')):7.2f} "
          f"{100 * row.get('estimated_mfu', float('nan')):6.1f}%",
          flush=True)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    from g2rpo_jax.core import storage

    config = _CONFIG.value
    for topology in _TOPOLOGY.value:
        devices = topology_devices(topology)
        hbm, _ = chip_specs(devices[0])
        from g2rpo_jax.models import attention

        kernel = attention.resolve(config.model.attention, config.model.dtype,
                                   devices[0].platform)
        print(f"\n{topology}: {len(devices)} chips ({devices[0].device_kind}, {hbm:g} GiB HBM "
              f"each), {config.algorithm.name} Λ={tuple(config.algorithm.granularities)}, "
              f"{config.train.prompts_per_iteration} prompts, attention {kernel}; GiB per chip "
              "(est. = XLA's cost model, not measured):")
        print(HEADER, flush=True)
        report = run_topology(config, topology)
        results = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                               "results")
        path = _OUT.value or os.path.join(results,
                                          f"tpu_aot_{topology.replace(':', '_')}.json")
        storage.write_json(path, report)   # a local path or gs://
        print(f"mesh {report['mesh']}; wrote {path}")


if __name__ == "__main__":
    app.run(main)
