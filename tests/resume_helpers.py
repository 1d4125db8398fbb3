"""Shared by the resume tests: the entry point in a subprocess (optionally killed), and a
checkpoint step read back as numpy for bit-for-bit comparisons."""

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

from g2rpo_jax.run import checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Columns of metrics.jsonl that measure wall time, not the computation (and every time/*
# column: the per-phase seconds).
TIMING_COLUMNS = ("time", "train/seconds")


def is_timing(column: str) -> bool:
    return column in TIMING_COLUMNS or column.startswith("time/")


def environment(devices: int = 2) -> dict:
    return dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(devices),
                PYTHONUNBUFFERED="1")


def run_main(flags: list[str], *, kill_at_commit: int | None = None, devices: int = 2,
             timeout: float = 900) -> subprocess.CompletedProcess:
    """`python -m g2rpo_jax.main FLAGS` to the end (or to its self-inflicted SIGKILL)."""
    command = [sys.executable, "-m", "g2rpo_jax.main", *flags]
    if kill_at_commit is not None:
        command = [sys.executable, "-m", "g2rpo_jax.testing.interrupt",
                   f"--kill_at_commit={kill_at_commit}", "--", *flags]
    return subprocess.run(command, cwd=ROOT, env=environment(devices), capture_output=True,
                          text=True, timeout=timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_processes(flags: list[str], processes: int = 2, devices: int = 1,
                  extra: dict[int, list[str]] | None = None, timeout: float = 900,
                  module: str = "g2rpo_jax.main") -> list[subprocess.CompletedProcess]:
    """`python -m MODULE FLAGS` (default: the main program) as one JAX job of `processes`
    processes on this machine (`devices` CPU devices each), joined through jax.distributed on
    a free port; `extra[i]`: flags for process i only."""
    port = free_port()
    logs, procs = [], []
    for i in range(processes):
        command = [sys.executable, "-m", module, *flags,
                   "--config.distributed.enabled=True",
                   f"--config.distributed.coordinator_address=127.0.0.1:{port}",
                   f"--config.distributed.num_processes={processes}",
                   f"--config.distributed.process_id={i}", *(extra or {}).get(i, [])]
        logs.append(tempfile.TemporaryFile("w+"))
        procs.append(subprocess.Popen(command, cwd=ROOT, env=environment(devices),
                                      stdout=logs[-1], stderr=subprocess.STDOUT, text=True))
    deadline = time.monotonic() + timeout
    results = []
    for proc, log in zip(procs, logs):
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            proc.wait()
        log.seek(0)
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, log.read(), ""))
        log.close()
    return results


def start_main(flags: list[str], log_path: str, devices: int = 2) -> subprocess.Popen:
    log = open(log_path, "w")
    return subprocess.Popen([sys.executable, "-m", "g2rpo_jax.main", *flags], cwd=ROOT,
                            env=environment(devices), stdout=log, stderr=subprocess.STDOUT,
                            text=True)


def metrics_rows(workdir) -> list[dict]:
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def wait_for(predicate, process: subprocess.Popen, timeout: float = 900, what: str = ""):
    """Polls `predicate()` until true; fails if the process ends first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if process.poll() is not None:
            raise AssertionError(f"The run ended (rc {process.returncode}) before {what}.")
        time.sleep(0.05)
    process.kill()
    raise AssertionError(f"Timed out waiting for {what}.")


def kill(process: subprocess.Popen, sig=signal.SIGKILL) -> int:
    process.send_signal(sig)
    return process.wait(timeout=600)


def computed_rows(workdir) -> list[dict]:
    """metrics.jsonl without its wall-time columns."""
    return [{k: v for k, v in row.items() if not is_timing(k)}
            for row in metrics_rows(workdir)]


def read_step(step_dir: str) -> dict:
    """The `state` item of a checkpoint step as a flat {path: numpy array}."""
    return checkpoint.read_arrays(step_dir)


def loop_item(step_dir: str) -> dict:
    with open(os.path.join(step_dir, "loop", "metadata")) as f:
        return json.load(f)


def assert_identical_states(a: dict, b: dict) -> int:
    """Bit-for-bit equality of two `read_step` results; returns the number of arrays."""
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert a[name].tobytes() == b[name].tobytes(), f"{name} differs"
    return len(a)
