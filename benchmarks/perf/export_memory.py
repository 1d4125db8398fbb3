"""Peak host memory and time of `python -m g2rpo_jax.export` (diffusers and BFL layouts) for
the tiny FLUX fixture's transformer and a medium one, against the model's size.

  python benchmarks/perf/export_memory.py [--sizes=tiny,medium] [--out=benchmarks/results/export_memory.json]

Per size: a random transformer is written as a diffusers folder (the run's base,
model.checkpoint), its parameters are saved as a run's Orbax checkpoint
(checkpoint.RunCheckpoints, as mode=train writes them), and the export command runs in a fresh
process, once per layout, bfloat16 (the default). `peak_rss` is that process's maximum resident
set (`wait4`'s ru_maxrss); `baseline_rss` the same command's process stopped right after its
imports (jax, flax, orbax): the difference is what the export itself holds; `restore_peak_rss`
a process that only reads the checkpoint (`export.load_trained`), which tells the restore's
share of the peak from the writing's. On CPU the "device"
holding the model is host memory, so the floor is the model once in its parameter dtype
(float32 here); the check is that nothing near a second copy appears (a 12B model must not need
2× its size), i.e. `(peak - baseline) / float32 model bytes` stays near 1.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

SIZES = {
    # configs/flux_tiny.py's transformer (g2rpo_jax.testing.flux_fixture.TRANSFORMER).
    "tiny": None,
    # FLUX.1's input widths and head size, hidden 1536 (12 heads of 128), 4 + 8 blocks: 0.63 B
    # parameters, 2.5 GB in float32.
    "medium": dict(num_layers=4, num_single_layers=8, attention_head_dim=128,
                   num_attention_heads=12, joint_attention_dim=4096, pooled_projection_dim=768,
                   in_channels=64, guidance_embeds=True, axes_dims_rope=(16, 56, 56)),
}
ENV = dict(os.environ, JAX_PLATFORMS="cpu")


def _write_base(folder: str, shape: dict) -> int:
    """A random diffusers transformer/ folder (bfloat16, as FLUX.1-dev ships); returns the
    parameter count."""
    import ml_dtypes
    import numpy as np

    from g2rpo_jax.models import flux, flux_weights, safetensors_io

    cfg = flux.FluxConfig(**shape)
    rng = np.random.default_rng(0)
    specs = [safetensors_io.TensorSpec(
        t.key, t.shape, np.dtype(ml_dtypes.bfloat16),
        lambda t=t: (0.02 * rng.standard_normal(t.shape, np.float32)))
        for t in flux_weights.stored_layout(cfg, "diffusers")]
    os.makedirs(folder)
    with open(os.path.join(folder, "diffusion_pytorch_model.safetensors"), "wb") as f:
        safetensors_io.stream_safetensors(f, specs, {"format": "pt"})
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(flux_weights.diffusers_config(cfg), f)
    return int(sum(np.prod(s.shape) for s in specs))


def _save_run(workdir: str, base: str, config) -> None:
    """The base's parameters as iteration 1 of a run (what export reads)."""
    from flax import nnx
    import jax
    import jax.numpy as jnp

    from g2rpo_jax.models import flux_weights
    from g2rpo_jax.rl import policy_update
    from g2rpo_jax.run import checkpoint

    model = flux_weights.from_pretrained(base)
    state = policy_update.TrainState(params=nnx.state(model),
                                     opt_state={"count": jnp.zeros((), jnp.int32)},
                                     ref_params=None, step=jnp.asarray(1, jnp.int32))
    run = checkpoint.RunCheckpoints(workdir, async_save=False)
    run.save(1, state, jax.random.key(0), {"iteration": 1}, config, wait=True)
    run.close()


def _measured(command: list[str]) -> tuple[float, float, str]:
    """Runs `command` under a wrapper that reports its child's ru_maxrss (Linux: KiB)."""
    wrapper = ("import resource, subprocess, sys, time, json;"
               "t = time.perf_counter(); p = subprocess.run(sys.argv[1:], capture_output=True, "
               "text=True); s = time.perf_counter() - t;"
               "sys.stderr.write(p.stderr[-3000:]) if p.returncode else None;"
               "print(json.dumps({'rc': p.returncode, 'kib': resource.getrusage("
               "resource.RUSAGE_CHILDREN).ru_maxrss, 's': s, 'out': p.stdout}))")
    done = subprocess.run([sys.executable, "-c", wrapper, *command], cwd=ROOT, env=ENV,
                          capture_output=True, text=True)
    if done.returncode or not done.stdout.strip():
        raise RuntimeError(f"{' '.join(command)}: {done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if result["rc"]:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return result["kib"] / 1024, result["s"], result["out"]


def measure(size: str, root: str) -> list[dict]:
    from g2rpo_jax.run import config_lib
    from g2rpo_jax.testing import flux_fixture

    shape = SIZES[size] or flux_fixture.TRANSFORMER
    base = os.path.join(root, size, "transformer")
    parameters = _write_base(base, shape)
    config = config_lib.load_config("flux_tiny.py", **{"model.checkpoint": base})
    workdir = os.path.join(root, size, "run")
    _save_run(workdir, base, config)
    flags = [f"--config.model.checkpoint={base}", f"--checkpoint={workdir}"]
    baseline_mib, _, _ = _measured([
        sys.executable, "-c", "import jax, flax, orbax.checkpoint; import g2rpo_jax.export; "
        "jax.devices()"])
    restore_mib, _, _ = _measured([
        sys.executable, "-c", "import sys; from g2rpo_jax import export, parallel; "
        "from g2rpo_jax.run import config_lib; "
        "c = config_lib.load_config('flux_tiny.py', **{'model.checkpoint': sys.argv[1]}); "
        "export.load_trained(c, sys.argv[2], parallel.mesh_from_config(c.mesh), "
        "c.sharding_rules)", base, workdir])
    rows = []
    for layout in ("diffusers", "bfl"):
        out = os.path.join(root, size, f"export_{layout}")
        peak_mib, seconds, stdout = _measured([
            sys.executable, "-m", "g2rpo_jax.export", "--config=configs/flux_tiny.py", *flags,
            f"--out={out}", f"--format={layout}"])
        written = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(out)
                      for f in fs)
        model_mib = parameters * 4 / 2 ** 20
        rows.append(dict(size=size, layout=layout, parameters=parameters,
                         float32_model_mib=round(model_mib, 1),
                         written_mib=round(written / 2 ** 20, 1),
                         baseline_rss_mib=round(baseline_mib, 1),
                         restore_peak_rss_mib=round(restore_mib, 1), peak_rss_mib=round(peak_mib, 1),
                         export_rss_over_model=round((peak_mib - baseline_mib) / model_mib, 3),
                         seconds=round(seconds, 1), line=stdout.strip().splitlines()[-1]))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="tiny,medium")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results",
                                                      "export_memory.json"))
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for size in args.sizes.split(","):
            rows += measure(size, root)
    print(f"{'size':<8}{'layout':<11}{'params':>13}{'f32 MiB':>10}{'written':>10}"
          f"{'base RSS':>10}{'restore':>10}{'peak RSS':>10}{'(peak-base)/f32':>17}{'s':>7}")
    for r in rows:
        print(f"{r['size']:<8}{r['layout']:<11}{r['parameters']:>13,}{r['float32_model_mib']:>10}"
              f"{r['written_mib']:>10}{r['baseline_rss_mib']:>10}{r['restore_peak_rss_mib']:>10}"
              f"{r['peak_rss_mib']:>10}"
              f"{r['export_rss_over_model']:>17}{r['seconds']:>7}")
    with open(args.out, "w") as f:
        json.dump({"command": "python benchmarks/perf/export_memory.py --sizes=" + args.sizes,
                   "rows": rows}, f, indent=2)
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
