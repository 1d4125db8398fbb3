"""Run logs: a JSONL metrics file, TensorBoard event files, and PNG plots of the curves.

Only process 0 writes. Each `write(step, scalars)` appends one JSON line
{"step": n, "time": seconds since start, name: value, ...} to DIR/metrics.jsonl and the same
scalars to TensorBoard (DIR/tensorboard, via tensorboardX: no TensorFlow needed).
"""

from collections.abc import Mapping, Sequence
import json
import logging
import math
import os
import time

import jax
import numpy as np

logger = logging.getLogger(__name__)


class MetricsLogger:
    """Appends rows to DIR/metrics.jsonl and TensorBoard (process 0; every process counts the
    rows, so the count can be checkpointed on all of them).

    A resumed run continues the logs of the run it resumes: `keep_rows` truncates
    metrics.jsonl to the rows the checkpoint had seen (rows a killed run wrote after it are
    superseded), and `purge_step` makes TensorBoard drop that run's events from that step on.
    `elapsed` continues the `time` column.
    """

    def __init__(self, workdir: str, filename: str = "metrics.jsonl",
                 keep_rows: int | None = None, purge_step: int | None = None,
                 elapsed: float = 0.0):
        self.active = jax.process_index() == 0
        self.path = os.path.join(workdir, filename)
        self.start = time.perf_counter() - elapsed
        self.rows = keep_rows or 0
        self._file = self._writer = None
        if self.active:
            from tensorboardX import SummaryWriter  # heavy import, only where it writes

            os.makedirs(workdir, exist_ok=True)
            if keep_rows is not None:
                truncate_jsonl(self.path, keep_rows)
            self._file = open(self.path, "a")
            self._writer = SummaryWriter(os.path.join(workdir, "tensorboard"),
                                         purge_step=purge_step)

    @property
    def elapsed(self) -> float:
        """Seconds of this run so far (over every resumption)."""
        return time.perf_counter() - self.start

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        self.rows += 1
        if not self.active:
            return
        values = {k: float(v) for k, v in scalars.items()}
        row = {"step": int(step), "time": round(self.elapsed, 3), **values}
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


def truncate_jsonl(path: str, rows: int) -> int:
    """Keeps the first `rows` lines of a JSONL file (atomically: a new file renamed over it);
    returns how many lines were dropped. Fewer lines than `rows` is reported, not invented."""
    if not os.path.exists(path):
        if rows:
            logger.warning("%s is missing; the %d rows before the checkpoint are lost.", path,
                           rows)
        return 0
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    if len(lines) < rows:
        logger.warning("%s has %d rows but the checkpoint had seen %d; the missing rows are "
                       "lost.", path, len(lines), rows)
    dropped = max(0, len(lines) - rows)
    if dropped:
        logger.warning("%s: %d row(s) written after the checkpoint are superseded.", path,
                       dropped)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(lines[:rows])
        os.replace(tmp, path)
    return dropped


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
