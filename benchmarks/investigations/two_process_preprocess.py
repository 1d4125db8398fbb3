"""How often two jax.distributed CPU processes preprocess the tiny FLUX.1-dev's prompts cleanly.

  python benchmarks/investigations/two_process_preprocess.py [--runs=6] [--prompts=40] [--chunk_size=1]
      [--root=CHECKOUT]

Each run starts two `python -m g2rpo_jax.preprocess` processes with 2 CPU devices each, as
tests/data/test_embedding_preparation.py does, and counts the runs where either process fails (and
those whose error names gloo). `--root` runs the preprocessing of another checkout, e.g. an
older commit made with `git worktree add DIR COMMIT`, to compare before and after a change.

Measured with the defaults (docs/flux.md, "Preprocess"): with the encoders sharded over both local
devices (`--root` at commit 897089f) 4 of 6 runs aborted in gloo ("Received data size doesn't
match expected size"); with one encoder device per CPU process
(`text_encoders.encoder_devices`) 0 of 9.
"""

import argparse
import os
import socket
import subprocess
import sys
import tempfile

from g2rpo_jax.testing import flux_fixture

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=40)
    parser.add_argument("--chunk_size", type=int, default=1)
    parser.add_argument("--root", default=ROOT, help="the checkout whose g2rpo_jax runs")
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="two_process_preprocess_")
    folder = flux_fixture.write_tiny_flux_dev(os.path.join(work, "flux"))
    prompts = flux_fixture.write_prompts(os.path.join(work, "prompts"), train=args.prompts,
                                         held_out=2)
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="2")
    failed = in_gloo = 0
    for run in range(args.runs):
        flags = ["--config=configs/flux_tiny.py", f"--config.model.checkpoint={folder}",
                 f"--config.data.prompts_file={prompts['train']}",
                 f"--config.data.data_dir={os.path.join(work, f'run{run}')}",
                 f"--config.data.chunk_size={args.chunk_size}",
                 "--config.distributed.enabled=True",
                 f"--config.distributed.coordinator_address=127.0.0.1:{free_port()}",
                 "--config.distributed.num_processes=2"]
        processes = [subprocess.Popen(
            [sys.executable, "-m", "g2rpo_jax.preprocess", *flags,
             f"--config.distributed.process_id={i}"], cwd=args.root, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
        errors = [p.communicate(timeout=600)[1] for p in processes]
        codes = [p.returncode for p in processes]
        failed += any(codes)
        in_gloo += any(codes) and any("gloo" in e for e in errors)
        print(f"run {run}: exit codes {codes}", flush=True)
    print(f"{failed} of {args.runs} runs failed ({in_gloo} in gloo); {args.prompts} prompts in "
          f"chunks of {args.chunk_size}, checkout {args.root}")


if __name__ == "__main__":
    main()
