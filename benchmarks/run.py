r"""Our G²RPO rollout and train step against PyTorch on diffusers' FluxTransformer2DModel, and
how close our train step comes to this CPU's matmul peak.

  python benchmarks/run.py                 # the default run (about 13 minutes on 2 cores)
  python benchmarks/run.py --size=toy      # seconds-long smoke sizes (the test runs this)

Measurements (settings printed at the start; README "benchmarks/run.py" explains them):
  tiny rollout    ours (one jitted `sample` stage) against (a) torch_flux_rollout's
                  reference_rollout: the reference code's Python loops, one sample per call
  medium rollout  ours against (b) torch_flux_rollout's batched_rollout: our batching in eager
  medium train    policy_update's jitted update (forward + backward + AdamW) on the medium
                  rollout's TrainBatch against torch_flux_rollout.train_step on the same batch
  matmul peak     a 2048³ float32 matmul, jitted JAX and torch

Each engine runs in its own worker process (this file with --worker), so that each reports
its own peak RSS (VmHWM); the two workers of a measurement are driven alternately over pipes,
so their repeats interleave, and only one computes at a time. Times are medians of --repeats
after a compile/warm-up run and --warmup further runs. Both engines use every core of this
process's affinity mask: XLA's CPU client does by default, torch via set_num_threads.

Ends with the line
  rollout_speedup_vs_reference_loop=X rollout_speedup_vs_torch_batched=Y
  train_speedup_vs_torch=Z cpu_peak_fraction=W
(one line) and writes benchmarks/results/run.json (--out).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# Benchmark the checkout this file is in, whatever copy of the package is installed.
for _path in (ROOT, HERE):
    if _path not in sys.path:
        sys.path.insert(0, _path)

THREADS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()

# Model sections for the medium sizes, as config_lib builds the tiny one from shapes_cpu.py.
MEDIUM_MODEL = dict(num_layers=4, num_single_layers=8, attention_head_dim=64,
                    num_attention_heads=8, joint_attention_dim=4096, pooled_projection_dim=768,
                    in_channels=64, axes_dims_rope=(8, 28, 28), guidance_embeds=True)
# --size=large (benchmarks/device_check.sh on a GPU): hidden 1024 (16 heads × 64), 8 + 16 blocks.
LARGE_MODEL = dict(MEDIUM_MODEL, num_layers=8, num_single_layers=16, num_attention_heads=16)
TOY_MEDIUM_MODEL = dict(num_layers=1, num_single_layers=1, attention_head_dim=32,
                        num_attention_heads=2, joint_attention_dim=64, pooled_projection_dim=32,
                        in_channels=16, axes_dims_rope=(8, 12, 12), guidance_embeds=True)


# ---------------------------------------------------------------------------------------------
# Settings, shared by the driver and the workers (plain dicts: they travel as JSON).


def tiny_spec(args) -> dict:
    """The embedded default (configs/shapes_cpu.py): its model, sampling and algorithm."""
    from g2rpo_jax.run import config_lib

    config = config_lib.load_config("shapes_cpu.py")
    algo = config.algorithm.to_dict()
    side = config.world.image_size // config.world.patch
    spec = dict(name="tiny", model=config.model.to_dict(), num_steps=config.sampling.num_steps,
                shift=config.sampling.shift, guidance=config.sampling.guidance,
                prompts=config.train.prompts_per_iteration, group_size=algo["group_size"],
                branch_steps=list(algo["branch_steps"]),
                granularities=list(algo["granularities"]), eta=algo["eta"],
                image_side=side, text_tokens=config.text_encoder.max_length)
    if args.size == "toy":
        spec.update(prompts=1, num_steps=4, group_size=2, branch_steps=[0, 1],
                    granularities=[1, 2])
    if args.tiny_prompts:
        spec["prompts"] = args.tiny_prompts
    spec["model"].pop("checkpoint", None)
    return spec


def medium_spec(args) -> dict:
    from g2rpo_jax.run import config_lib

    toy = args.size == "toy"
    sections = {"toy": TOY_MEDIUM_MODEL, "large": LARGE_MODEL}.get(args.size, MEDIUM_MODEL)
    model = config_lib.flux_model_config(**sections).to_dict()
    model.pop("checkpoint", None)
    return dict(name="medium", model=model, num_steps=args.medium_steps, shift=3.0,
                guidance=3.5, prompts=args.medium_prompts, group_size=args.medium_group,
                branch_steps=[int(k) for k in args.medium_branch_steps.split(",")],
                granularities=[int(g) for g in args.medium_granularities.split(",")],
                eta=0.7, image_side=4 if toy else 16, text_tokens=8 if toy else 32,
                batch_steps=args.batch_steps)


def flux_config(spec):
    import ml_collections

    from g2rpo_jax.run import config_lib
    return config_lib.to_flux_config(ml_collections.ConfigDict(spec["model"]))


def algorithm(spec):
    from g2rpo_jax.rl import algorithms

    lams = tuple(spec["granularities"])
    return algorithms.Algorithm.from_config(algorithms.preset(
        "g2rpo", group_size=spec["group_size"], branch_steps=tuple(spec["branch_steps"]),
        granularities=lams, granularity_weights=(1.0,) * len(lams), eta=spec["eta"]))


def sigmas(spec):
    import numpy as np

    from g2rpo_jax.sampling import schedules

    return np.asarray(schedules.flux_sigmas(spec["num_steps"], spec["shift"]), np.float32)


def make_cond(spec, seed: int = 1) -> dict:
    """Random per-prompt conditioning (numpy; the same for both engines)."""
    import numpy as np

    cfg = flux_config(spec)
    rng = np.random.default_rng(seed)
    side, t, p = spec["image_side"], spec["text_tokens"], spec["prompts"]
    token = np.arange(side * side)
    return dict(
        txt=rng.normal(size=(p, t, cfg.joint_attention_dim)).astype(np.float32),
        y=rng.normal(size=(p, cfg.pooled_projection_dim)).astype(np.float32),
        txt_ids=np.zeros((t, 3), np.float32),
        img_ids=np.stack([np.zeros_like(token), token // side, token % side],
                         -1).astype(np.float32))


def plan(spec):
    from g2rpo_jax.rl import iteration

    return iteration.continuation_plan(algorithm(spec), sigmas(spec))


def rollout_samples(spec, packed: bool) -> int:
    """Transformer inputs (samples) one rollout evaluates: the plan's useful count (one sample
    per call) or what the packed scan computes, idle lanes included."""
    passes = algorithm(spec).rollout_forward_passes(spec["num_steps"], plan(spec))
    return spec["prompts"] * passes["computed" if packed else "useful"]


# ---------------------------------------------------------------------------------------------
# Workers: one engine each; commands over stdin, one JSON line per reply on the real stdout.


def vmhwm_mib() -> float:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class JaxRollout:
    def __init__(self, spec):
        from flax import nnx
        import jax
        import jax.numpy as jnp
        import numpy as np

        from g2rpo_jax.models import flux
        from g2rpo_jax.rl import iteration

        self.jax, self.np, self.spec = jax, np, spec
        cfg = flux_config(spec)
        algo = algorithm(spec)
        graphdef, self.params = nnx.split(flux.Flux(cfg, rngs=nnx.Rngs(0)))
        n = spec["image_side"] ** 2
        sample, _ = iteration.make_rollout_stages(graphdef, algo, sigmas(spec),
                                                  (n, cfg.in_channels), (1.0,), spec["guidance"])
        self.cond = {k: jnp.asarray(v) for k, v in make_cond(spec).items()}
        self.sample = jax.jit(sample)
        self.key = jax.random.key(0)

    def run(self):
        finals, transitions = self.sample(self.params, self.cond, self.key, 0)
        self.jax.block_until_ready((finals, transitions))
        self.last = (finals, transitions)
        return dict(finite=bool(self.np.isfinite(self.np.asarray(finals)).all()))

    def save_batch(self, path):
        """The last rollout's TrainBatch with group-normalised random advantages (a stand-in
        for rewards), for the train measurement."""
        np = self.np
        batch = self.last[1].batch
        adv = np.random.default_rng(2).normal(size=batch.advantages.shape)
        adv = (adv - adv.mean(-1, keepdims=True)) / (adv.std(-1, keepdims=True) + 1e-8)
        np.savez(path, x=np.asarray(batch.x), x_next=np.asarray(batch.x_next),
                 step=np.asarray(batch.step), old_log_prob=np.asarray(batch.old_log_prob),
                 advantages=adv.astype(np.float32))
        return {}


class TorchRollout:
    def __init__(self, spec, batched: bool):
        import numpy as np
        import torch
        import torch_flux_rollout as tfr

        self.tfr, self.torch, self.spec, self.batched = tfr, torch, spec, batched
        cfg = flux_config(spec)
        self.velocity = tfr.Velocity(tfr.diffusers_model(cfg), make_cond(spec), spec["guidance"])
        self.sigmas, self.plan = sigmas(spec), plan(spec)
        n = spec["image_side"] ** 2
        self.x_init = np.random.default_rng(3).normal(
            size=(spec["prompts"], n, cfg.in_channels)).astype(np.float32)
        self.np = np

    def run(self):
        fn = self.tfr.batched_rollout if self.batched else self.tfr.reference_rollout
        self.velocity.calls = self.velocity.samples = 0
        out = fn(self.velocity, self.x_init, self.sigmas, self.spec["branch_steps"],
                 self.spec["group_size"], self.spec["eta"], self.plan)
        return dict(finite=bool(self.torch.isfinite(out["finals"]).all()),
                    calls=self.velocity.calls, samples=self.velocity.samples)


def _load_batch(path):
    import numpy as np
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


def optimizer_settings() -> dict:
    from g2rpo_jax.run import config_lib
    return config_lib.optimizer_config(learning_rate=1e-5).to_dict()


class JaxTrain:
    def __init__(self, spec, batch_path):
        from flax import nnx
        import jax
        import ml_collections
        import numpy as np

        from g2rpo_jax import parallel
        from g2rpo_jax.models import flux
        from g2rpo_jax.rl import optimizer as optimizer_lib
        from g2rpo_jax.rl import policy_update

        self.jax = jax
        mesh = parallel.make_mesh((-1, 1, 1))
        self.mesh = mesh
        cfg = flux_config(spec)
        algo = algorithm(spec)
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        place = lambda tree: jax.tree.map(lambda a: jax.device_put(a, replicated), tree)
        graphdef, params = nnx.split(flux.init_sharded(cfg, mesh, seed=0))
        optimizer = optimizer_lib.make_optimizer(ml_collections.ConfigDict(optimizer_settings()))
        self.state = policy_update.init_state(params, optimizer, False, mesh)
        self.batch = place(policy_update.TrainBatch(**_load_batch(batch_path)))
        self.cond = place({k: np.asarray(v) for k, v in make_cond(spec).items()})
        settings = policy_update.PolicyUpdate(steps_per_update=0, guidance=spec["guidance"],
                                              batch_steps=spec.get("batch_steps", False))
        with jax.set_mesh(mesh):
            self.update = policy_update.jit_update(
                policy_update.make_update_fn(graphdef, optimizer, algo, settings,
                                             jax.numpy.asarray(sigmas(spec))),
                self.state, self.batch, self.cond)

    def run(self):
        with self.jax.set_mesh(self.mesh):
            self.state, metrics = self.update(self.state, self.batch, self.cond)
            self.jax.block_until_ready((self.state, metrics))
        return dict(loss=float(metrics["loss"].mean()))


class TorchTrain:
    def __init__(self, spec, batch_path):
        import torch_flux_rollout as tfr

        self.tfr, self.spec = tfr, spec
        cfg = flux_config(spec)
        model = tfr.diffusers_model(cfg).train()
        self.velocity = tfr.Velocity(model, make_cond(spec), spec["guidance"])
        opt = optimizer_settings()
        self.optimizer = tfr.make_optimizer(model, opt)
        self.grad_clip = opt["grad_clip_norm"]
        self.clip_range = algorithm(spec).clip_range
        self.batch = _load_batch(batch_path)
        self.sigmas = sigmas(spec)

    def run(self):
        loss = self.tfr.train_step(self.velocity, self.optimizer, self.batch, self.sigmas,
                                   self.spec["eta"], self.clip_range, self.grad_clip)
        return dict(loss=loss)


class Matmul:
    def __init__(self, engine, size):
        self.size = size
        if engine == "jax":
            import jax
            import jax.numpy as jnp
            keys = jax.random.split(jax.random.key(0))
            a, b = (jax.random.normal(k, (size, size), jnp.float32) for k in keys)
            f = jax.jit(jnp.matmul)
            self.fn = lambda: f(a, b).block_until_ready()
        else:
            import torch
            a, b = torch.randn(size, size), torch.randn(size, size)
            self.fn = lambda: torch.mm(a, b)

    def run(self):
        self.fn()
        return {}


def worker(engine: str) -> None:
    # Replies go to the real stdout; anything the libraries print goes to stderr.
    reply = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    if engine.startswith("torch"):
        import torch
        torch.set_num_threads(int(os.environ.get("G2RPO_RUN_TORCH_THREADS", THREADS)))
        if os.environ.get("G2RPO_RUN_PLATFORM") == "gpu":
            torch.set_default_device("cuda")   # models and tensors on the GPU
    obj = None
    for line in sys.stdin:
        msg = json.loads(line)
        out = {}
        if msg["cmd"] == "setup":
            start = time.perf_counter()
            spec = msg.get("spec")
            if engine == "jax_rollout":
                obj = JaxRollout(spec)
            elif engine in ("torch_reference", "torch_batched"):
                obj = TorchRollout(spec, batched=engine == "torch_batched")
            elif engine == "jax_train":
                obj = JaxTrain(spec, msg["batch"])
            elif engine == "torch_train":
                obj = TorchTrain(spec, msg["batch"])
            else:
                obj = Matmul(engine.split("_")[0], msg["size"])
            out = obj.run()  # compiles (JAX) / warms up
            out["setup_s"] = time.perf_counter() - start
        elif msg["cmd"] == "run":
            start = time.perf_counter()
            out = obj.run()
            out["seconds"] = time.perf_counter() - start
        elif msg["cmd"] == "save_batch":
            out = obj.save_batch(msg["path"])
        elif msg["cmd"] == "finish":
            out = dict(peak_rss_mib=vmhwm_mib())
        reply.write(json.dumps(out) + "\n")
        if msg["cmd"] == "finish":
            return


# ---------------------------------------------------------------------------------------------
# Driver.


class Worker:
    def __init__(self, engine: str, torch_threads: int, platform: str = "cpu"):
        env = dict(os.environ, JAX_PLATFORMS="cuda" if platform == "gpu" else "cpu",
                   G2RPO_RUN_TORCH_THREADS=str(torch_threads), G2RPO_RUN_PLATFORM=platform)
        self.engine = engine
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__),
                                      f"--worker={engine}"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)

    def ask(self, **msg) -> dict:
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            raise RuntimeError(f"worker {self.engine} exited ({self.proc.returncode}) on {msg}")
        return json.loads(line)

    def finish(self) -> dict:
        out = self.ask(cmd="finish")
        self.proc.wait()
        return out


def interleaved(workers: list[Worker], warmup: int, repeats: int) -> list[list[dict]]:
    """Alternates the workers' runs (ABAB…, BABA… on odd rounds); returns the timed runs'
    replies per worker, warm-up rounds dropped."""
    results = [[] for _ in workers]
    for r in range(warmup + repeats):
        order = list(range(len(workers)))
        if r % 2:
            order.reverse()
        for i in order:
            out = workers[i].ask(cmd="run")
            if r >= warmup:
                results[i].append(out)
    return results


def compare(name, engines, setups, args, extra_setup=None):
    """Runs a measurement: a worker per engine, set up one after the other, run interleaved."""
    workers, setup_out = [], []
    for engine, setup in zip(engines, setups):
        w = Worker(engine, args.torch_threads, args.platform)
        setup_out.append(w.ask(cmd="setup", **setup))
        workers.append(w)
        print(f"  [{name}] {engine} set up in {setup_out[-1]['setup_s']:.1f} s", flush=True)
    runs = interleaved(workers, args.warmup, args.repeats)
    if extra_setup is not None:
        extra_setup(workers)
    finished = [w.finish() for w in workers]
    return [dict(engine=e, setup=s, times=[r["seconds"] for r in rs],
                 median_s=statistics.median(r["seconds"] for r in rs), last=rs[-1],
                 peak_rss_mib=f["peak_rss_mib"])
            for e, s, rs, f in zip(engines, setup_out, runs, finished)]


def batch_steps_ab(medium: dict, batch_path: str, args) -> None:
    """Our medium train step scanned over its K trained steps (A) against batch_steps (B), on
    the same rollout batch, interleaved; writes --out (default results/batch_steps.json)."""
    rollout = Worker("jax_rollout", args.torch_threads, args.platform)
    rollout.ask(cmd="setup", spec=medium)
    rollout.ask(cmd="run")
    rollout.ask(cmd="save_batch", path=batch_path)
    rollout.finish()
    scan, batched = compare("medium train: scan (A) vs batch_steps (B)",
                            ["jax_train", "jax_train"],
                            [dict(spec=dict(medium, batch_steps=False), batch=batch_path),
                             dict(spec=dict(medium, batch_steps=True), batch=batch_path)], args)
    os.remove(batch_path)
    os.rmdir(os.path.dirname(batch_path))
    speedup = scan["median_s"] / batched["median_s"]
    print(f"medium train step: scan {scan['median_s']:.3f} s ({scan['peak_rss_mib']:.0f} MiB), "
          f"batch_steps {batched['median_s']:.3f} s ({batched['peak_rss_mib']:.0f} MiB): "
          f"batch_steps_speedup={speedup:.2f}")
    out = (args.out if args.out != os.path.join(HERE, "results", "run.json")
           else os.path.join(HERE, "results", "batch_steps.json"))
    with open(out, "w") as f:
        json.dump(dict(size=args.size, platform=args.platform, threads=THREADS,
                       repeats=args.repeats, medium=medium, scan=scan, batch_steps=batched,
                       batch_steps_speedup=speedup), f, indent=1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)
    parser.add_argument("--size", choices=("default", "toy", "large"), default="default",
                        help="toy: seconds-long smoke sizes; large: the medium rows at hidden "
                             "1024, 8 + 16 blocks (for an accelerator)")
    parser.add_argument("--platform", choices=("cpu", "gpu"), default="cpu",
                        help="where both engines run (gpu: JAX on CUDA, torch on cuda; the "
                             "GPU path has not run yet: benchmarks/device_check.sh)")
    parser.add_argument("--batch_steps", action="store_true",
                        help="our train step with policy_update.batch_steps (one batched "
                             "forward and backward over the K trained steps)")
    parser.add_argument("--batch_steps_ab", action="store_true",
                        help="only the medium train step, ours scanned over the K trained "
                             "steps against ours with batch_steps, interleaved → "
                             "results/batch_steps.json (--out)")
    parser.add_argument("--repeats", type=int, default=0, help="timed runs (0: 3, toy 1)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs after the compile")
    parser.add_argument("--tiny_prompts", type=int, default=0,
                        help="prompts of the tiny rollout (0: the embedded default's 16)")
    parser.add_argument("--medium_prompts", type=int, default=2)
    parser.add_argument("--medium_steps", type=int, default=6)
    parser.add_argument("--medium_group", type=int, default=4)
    parser.add_argument("--medium_branch_steps", default="0,1")
    parser.add_argument("--medium_granularities", default="1,2")
    parser.add_argument("--torch_threads", type=int, default=THREADS,
                        help="torch.set_num_threads (default: the cores XLA uses)")
    parser.add_argument("--matmul_size", type=int, default=0, help="0: 2048, toy 256")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "run.json"))
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    toy = args.size == "toy"
    if toy:
        args.medium_prompts, args.medium_steps, args.medium_group = 1, 3, 2
        args.medium_branch_steps, args.medium_granularities = "0", "1,2"
    args.repeats = args.repeats or (1 if toy else 3)
    args.warmup = 0 if toy else args.warmup
    matmul_size = args.matmul_size or (256 if toy else 2048)
    os.environ.setdefault("JAX_PLATFORMS", "cuda" if args.platform == "gpu" else "cpu")
    from g2rpo_jax.models import flops as flops_lib

    tiny, medium = tiny_spec(args), medium_spec(args)
    print(f"threads: {THREADS} (XLA CPU default); torch.set_num_threads({args.torch_threads}); "
          "float32; "
          f"repeats {args.repeats} after compile + {args.warmup} warm-up, interleaved")
    for spec in (tiny, medium):
        cfg = flux_config(spec)
        print(f"{spec['name']}: hidden {cfg.hidden_size}, {cfg.num_layers}+{cfg.num_single_layers}"
              f" blocks, {spec['image_side'] ** 2} image x {cfg.in_channels} + "
              f"{spec['text_tokens']} text x {cfg.joint_attention_dim}; P={spec['prompts']} "
              f"T={spec['num_steps']} (shift {spec['shift']}) G={spec['group_size']} "
              f"k={spec['branch_steps']} Λ={spec['granularities']} η={spec['eta']} "
              f"guidance={spec['guidance']}; samples per rollout: "
              f"{rollout_samples(spec, False)} useful, {rollout_samples(spec, True)} packed")

    rows = {}
    tmp = tempfile.mkdtemp(prefix="g2rpo_run_")
    batch_path = os.path.join(tmp, "train_batch.npz")
    if args.batch_steps_ab:
        batch_steps_ab(medium, batch_path, args)
        return
    rows["tiny_rollout"] = compare("tiny rollout", ["jax_rollout", "torch_reference"],
                                   [dict(spec=tiny)] * 2, args)
    rows["medium_rollout"] = compare(
        "medium rollout", ["jax_rollout", "torch_batched"], [dict(spec=medium)] * 2, args,
        extra_setup=lambda ws: ws[0].ask(cmd="save_batch", path=batch_path))
    rows["medium_train"] = compare("medium train", ["jax_train", "torch_train"],
                                   [dict(spec=medium, batch=batch_path)] * 2, args)
    rows["matmul_peak"] = compare("matmul", ["jax_matmul", "torch_matmul"],
                                  [dict(size=matmul_size)] * 2,
                                  argparse.Namespace(warmup=1, repeats=max(args.repeats, 7),
                                                     torch_threads=args.torch_threads,
                                                     platform=args.platform))
    os.remove(batch_path)
    os.rmdir(tmp)

    def fwd(spec):
        return flops_lib.flux_forward_flops(flux_config(spec), spec["image_side"] ** 2,
                                            spec["text_tokens"])
    n_train = len(medium["branch_steps"]) * medium["prompts"]
    flops = {
        "tiny_rollout": (fwd(tiny) * rollout_samples(tiny, True),
                         fwd(tiny) * rollout_samples(tiny, False)),
        "medium_rollout": (fwd(medium) * rollout_samples(medium, True),) * 2,
        "medium_train": (3 * fwd(medium) * n_train,) * 2,
        "matmul_peak": (2 * matmul_size ** 3,) * 2,
    }
    print(f"\n{'measurement':16s} {'ours s':>9s} {'torch s':>9s} {'speedup':>8s} "
          f"{'ours GFLOP/s':>13s} {'torch GFLOP/s':>14s} {'ours MiB':>9s} {'torch MiB':>10s}")
    summary = {}
    for name, (ours, theirs) in rows.items():
        f_ours, f_theirs = flops[name]
        speedup = theirs["median_s"] / ours["median_s"]
        g_ours, g_theirs = f_ours / ours["median_s"] / 1e9, f_theirs / theirs["median_s"] / 1e9
        summary[name] = dict(ours=ours, torch=theirs, speedup=speedup, flops_ours=f_ours,
                             flops_torch=f_theirs, gflops_per_s_ours=g_ours,
                             gflops_per_s_torch=g_theirs)
        print(f"{name:16s} {ours['median_s']:9.4f} {theirs['median_s']:9.4f} {speedup:8.2f} "
              f"{g_ours:13.1f} {g_theirs:14.1f} {ours['peak_rss_mib']:9.0f} "
              f"{theirs['peak_rss_mib']:10.0f}")
    calls = rows["tiny_rollout"][1]["last"]
    print(f"(a) made {calls['calls']} transformer calls per tiny rollout; ours evaluates "
          f"{rollout_samples(tiny, True)} samples in {tiny['num_steps']} + "
          f"{plan(tiny).length} calls")
    peak = summary["matmul_peak"]["gflops_per_s_ours"]
    x = summary["tiny_rollout"]["speedup"]
    y = summary["medium_rollout"]["speedup"]
    z = summary["medium_train"]["speedup"]
    w = summary["medium_train"]["gflops_per_s_ours"] / peak
    print(f"medium train step: {flops['medium_train'][0] / 1e9:.1f} GFLOP counted from the "
          f"shapes (g2rpo_jax/models/flops.py), {summary['medium_train']['gflops_per_s_ours']:.1f}"
          f" GFLOP/s = {w:.2f} of the JAX matmul peak {peak:.1f} GFLOP/s (torch's: "
          f"{summary['matmul_peak']['gflops_per_s_torch']:.1f})")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(size=args.size, threads=THREADS, torch_threads=args.torch_threads,
                       repeats=args.repeats, warmup=args.warmup, tiny=tiny, medium=medium,
                       matmul_size=matmul_size,
                       measurements=summary, rollout_speedup_vs_reference_loop=x,
                       rollout_speedup_vs_torch_batched=y, train_speedup_vs_torch=z,
                       cpu_peak_fraction=w), f, indent=1)
    print(f"rollout_speedup_vs_reference_loop={x:.2f} rollout_speedup_vs_torch_batched={y:.2f} "
          f"train_speedup_vs_torch={z:.2f} cpu_peak_fraction={w:.2f}")


if __name__ == "__main__":
    main()
