"""SIGTERM handling (preemption.Watcher): one process sets a flag at the next boundary; two
jax.distributed processes agree on the iteration to stop at, whichever of them got SIGTERM."""

import os
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np

from g2rpo_jax.run import preemption

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def test_single_process_sigterm_is_seen_at_the_next_boundary():
    previous = signal.getsignal(signal.SIGTERM)
    watcher = preemption.Watcher()
    assert not watcher.synced and not watcher.reached(1)
    os.kill(os.getpid(), signal.SIGTERM)     # would end the process without the watcher
    assert watcher.reached(2) and watcher.reached(3)
    watcher.close()
    assert signal.getsignal(signal.SIGTERM) == previous


def test_agree_in_one_process_is_the_value():
    assert preemption.agree(True) is True and preemption.agree(np.bool_(False)) is False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_stop_at_the_same_iteration(tmp_path):
    port, ready = _free_port(), str(tmp_path / "ready")
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    workers = [subprocess.Popen([sys.executable, os.path.join(HERE, "preemption_worker.py"),
                                 str(i), str(port), ready], cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for i in range(2)]
    deadline = time.monotonic() + 300
    while not all(os.path.exists(f"{ready}.{i}") for i in range(2)):
        assert time.monotonic() < deadline and all(w.poll() is None for w in workers), [
            w.communicate()[1][-2000:] for w in workers if w.poll() is not None]
        time.sleep(0.05)
    workers[1].send_signal(signal.SIGTERM)   # the slower process is preempted
    outputs = [w.communicate(timeout=300) for w in workers]
    assert [w.returncode for w in workers] == [0, 0], [err[-2000:] for _, err in outputs]
    stops = [out.strip().splitlines()[-1] for out, _ in outputs]
    assert stops[0] == stops[1] and stops[0].startswith("stopped "), stops
    print(f"both processes: {stops[0]}")
    assert jax.process_count() == 1   # this process never joined
