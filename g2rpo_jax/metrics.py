"""Run logs: a JSONL metrics file, TensorBoard event files, and PNG plots of the curves.

Only process 0 writes. Each `write(step, scalars)` appends one JSON line
{"step": n, "time": seconds since start, name: value, ...} to DIR/metrics.jsonl and the same
scalars to TensorBoard (DIR/tensorboard, via tensorboardX: no TensorFlow needed).
"""

from collections.abc import Mapping, Sequence
import json
import math
import os
import time

import jax
import numpy as np


class MetricsLogger:
    def __init__(self, workdir: str, filename: str = "metrics.jsonl"):
        self.active = jax.process_index() == 0
        self.path = os.path.join(workdir, filename)
        self.start = time.perf_counter()
        self._file = self._writer = None
        if self.active:
            from tensorboardX import SummaryWriter  # heavy import, only where it writes

            os.makedirs(workdir, exist_ok=True)
            self._file = open(self.path, "a")
            self._writer = SummaryWriter(os.path.join(workdir, "tensorboard"))

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        if not self.active:
            return
        values = {k: float(v) for k, v in scalars.items()}
        row = {"step": int(step), "time": round(time.perf_counter() - self.start, 3), **values}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        for name, value in values.items():
            if math.isfinite(value):
                self._writer.add_scalar(name, value, int(step))
        self._writer.flush()

    def close(self) -> None:
        if self.active:
            self._file.close()
            self._writer.close()


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def series(rows: Sequence[dict], name: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of one scalar over the rows that have it."""
    pairs = [(r["step"], r[name]) for r in rows if name in r]
    if not pairs:
        return np.zeros(0), np.zeros(0)
    steps, values = zip(*pairs)
    return np.asarray(steps), np.asarray(values, np.float64)


def plot_curves(rows: Sequence[dict], panels: Mapping[str, Sequence[str]], path: str,
                title: str = "") -> str:
    """One panel per entry of `panels` (panel title → metric names), steps on x; a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6), squeeze=False)
    for ax, (panel, names) in zip(axes[0], panels.items()):
        for name in names:
            steps, values = series(rows, name)
            if len(steps):
                ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3,
                        label=name.split("/")[-1])
        ax.set_title(panel)
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
