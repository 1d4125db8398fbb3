"""Run logs: a JSONL metrics file, TensorBoard event files, and PNG plots of the curves.

Only process 0 writes. Each `write(step, scalars)` appends one JSON line
{"step": n, "time": seconds since start, name: value, ...} to DIR/metrics.jsonl and the same
scalars to TensorBoard (DIR/tensorboard, via tensorboardX: no TensorFlow needed). `image`,
`histogram` and `text` add TensorBoard's other kinds (sample grids, distributions of rewards,
advantages and log-ratios, the config); they reach the files with the next `write`. With
`config.logging.wandb` the same go to a Weights & Biases run too (g2rpo_jax.run.wandb_logger).

A DIR on an object store (gs://): objects cannot be appended to, so both logs are written to a
local staging folder (metrics.jsonl continued from the bucket's copy) and each file is uploaded
whole after every `write` (an upload replaces the object atomically), so the bucket always holds
every row written. tensorboardX's own gs:// writer is not used: it would be a second GCS client
(google-cloud-storage, its own credentials and retries) beside epath's.
"""

from collections.abc import Mapping, Sequence
import contextlib
import json
import logging
import math
import os
import shutil
import tempfile
import threading
import time

import jax
import numpy as np

from g2rpo_jax.core import storage
from g2rpo_jax.run import wandb_logger

logger = logging.getLogger(__name__)


class MetricsLogger:
    """Appends rows to DIR/metrics.jsonl and TensorBoard (process 0; every process counts the
    rows, so the count can be checkpointed on all of them).

    A resumed run continues the logs of the run it resumes: `keep_rows` truncates
    metrics.jsonl to the rows the checkpoint had seen (rows a killed run wrote after it are
    superseded), and `purge_step` makes TensorBoard drop that run's events from that step on.
    `elapsed` continues the `time` column. `config`, the run's config: its `logging` section
    may turn on Weights & Biases (process 0 then also logs everything to a W&B run, which
    stores the whole config; a config without the section logs to no W&B run).
    """

    def __init__(self, workdir: str, filename: str = "metrics.jsonl",
                 keep_rows: int | None = None, purge_step: int | None = None,
                 elapsed: float = 0.0, config=None):
        self.active = jax.process_index() == 0
        self.path = os.path.join(workdir, filename)
        self.start = time.perf_counter() - elapsed
        self.rows = keep_rows or 0
        self._file = self._writer = self._wandb = None
        self._workdir, self._staging = workdir, None
        if self.active:
            from tensorboardX import SummaryWriter  # heavy import, only where it writes

            storage.makedirs(workdir)
            settings = config.get("logging") if config is not None else None
            if wandb_logger.enabled(settings):   # first: a bad setting fails before any file
                self._wandb = wandb_logger.WandbSink(workdir, settings, config.to_dict())
            if keep_rows is not None:
                truncate_jsonl(self.path, keep_rows)
            local_dir = workdir
            if storage.is_remote(workdir):
                local_dir = self._staging = tempfile.mkdtemp(prefix="g2rpo_jax_logs_")
                remote = storage.path(self.path)
                if remote.exists():
                    remote.copy(os.path.join(local_dir, filename))
            self._local_path = os.path.join(local_dir, filename)
            self._file = open(self._local_path, "a")
            self._events = os.path.join(local_dir, "tensorboard")
            self._writer = SummaryWriter(self._events, purge_step=purge_step)

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
        self._upload()
        if self._wandb is not None:
            self._wandb.write(step, values)

    def image(self, step: int, tag: str, image: np.ndarray) -> None:
        """An image [H, W, 3] (uint8, or float in [0, 1])."""
        if self.active:
            self._writer.add_image(tag, np.asarray(image), int(step), dataformats="HWC")
            if self._wandb is not None:
                self._wandb.image(step, tag, image)

    def histogram(self, step: int, tag: str, values) -> None:
        """The distribution of `values` (any shape; non-finite values left out)."""
        if not self.active:
            return
        values = np.asarray(values, np.float64).ravel()
        values = values[np.isfinite(values)]
        if values.size:
            self._writer.add_histogram(tag, values, int(step))
            if self._wandb is not None:
                self._wandb.histogram(step, tag, values)

    def text(self, step: int, tag: str, markdown: str) -> None:
        if self.active:
            self._writer.add_text(tag, markdown, int(step))
            if self._wandb is not None:
                self._wandb.text(step, tag, markdown)

    def _upload(self) -> None:
        """A remote workdir: the staged files, each uploaded whole (see the module docstring)."""
        if self._staging is None:
            return
        storage.put(self._local_path, self.path)
        for name in sorted(os.listdir(self._events)):
            storage.put(os.path.join(self._events, name),
                        os.path.join(self._workdir, "tensorboard", name))

    def close(self) -> None:
        if self.active:
            self._file.close()
            self._writer.close()
            self._upload()
            if self._wandb is not None:
                self._wandb.close()
                self._wandb = None
            if self._staging is not None:
                shutil.rmtree(self._staging, ignore_errors=True)
                self._staging = None


# The RL loop's phases, in order (g2rpo_jax/train.py). Every training row has every one.
PHASES = ("data", "rollout", "reward", "advantages", "update", "evaluation", "checkpoint")
# JAX's compile events (jax.monitoring time spans): tracing to a jaxpr, lowering to MLIR, and
# the XLA compilation, which includes a persistent-cache lookup.
_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
                   "/jax/core/compile/jaxpr_to_mlir_module_duration",
                   "/jax/core/compile/backend_compile_duration")


def _union_seconds(spans: Sequence[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals: a jit traced inside another's tracing
    reports a span inside the outer one, counted once."""
    total, reach = 0.0, -math.inf
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


class PhaseTimer:
    """Wall seconds of each phase of an iteration, and the seconds JAX spent compiling (tracing,
    lowering, XLA) inside them: this process's clock only (on several processes each has its
    own; process 0's are the ones written).

    `with timer.phase(name):` adds the block's wall time to `name` for the current window;
    `lap()` closes the window (started by the previous `lap()`), returns its row
    {"time/<phase>_s", "time/compile_s", "time/compile_background_s", "time/iteration_s"} and
    starts the next. Compile time comes from jax.monitoring's compile events: those on the
    thread that made the timer (the loop's, inside its phases) and those on other threads
    (compiled ahead in the background, overlapping the phases); phases do not nest.
    """

    def __init__(self, phases: Sequence[str] = PHASES):
        self.phases = tuple(phases)
        self._thread = threading.get_ident()
        self._lock = threading.Lock()
        self._spans: list[tuple[float, float]] = []   # this window's compile spans (time.time)
        self._background: list[tuple[float, float]] = []   # ... on other threads
        self._current: str | None = None
        self._compile_by_phase = dict.fromkeys(self.phases, 0.0)
        self._seconds = dict.fromkeys(self.phases, 0.0)
        self._window_start = time.perf_counter()
        jax.monitoring.register_event_time_span_listener(self._on_span)

    def _on_span(self, event: str, start: float, end: float, **_) -> None:
        if event in _COMPILE_EVENTS:
            with self._lock:
                spans = self._spans if threading.get_ident() == self._thread else self._background
                spans.append((start, end))

    @contextlib.contextmanager
    def phase(self, name: str):
        if name not in self._seconds:
            raise ValueError(f"Unknown phase {name!r}; known: {self.phases}.")
        if self._current is not None:
            raise RuntimeError(f"Phase {name!r} started inside {self._current!r}.")
        self._current = name
        with self._lock:
            first_span = len(self._spans)
        start = time.perf_counter()
        try:
            yield
        finally:
            self._seconds[name] += time.perf_counter() - start
            with self._lock:
                self._compile_by_phase[name] += _union_seconds(self._spans[first_span:])
            self._current = None

    def lap(self) -> dict[str, float]:
        """This window's row, and a new window."""
        now = time.perf_counter()
        with self._lock:
            compile_s, self._spans = _union_seconds(self._spans), []
            background_s, self._background = _union_seconds(self._background), []
        row = {f"time/{name}_s": seconds for name, seconds in self._seconds.items()}
        row["time/compile_s"] = compile_s
        row["time/compile_background_s"] = background_s
        row["time/iteration_s"] = now - self._window_start
        self._seconds = dict.fromkeys(self.phases, 0.0)
        self._window_start = now
        return row

    def compile_by_phase(self) -> dict[str, float]:
        """Compile seconds inside each phase since this timer started."""
        return dict(self._compile_by_phase)

    def close(self) -> None:
        with contextlib.suppress(AssertionError):   # already unregistered
            jax.monitoring.unregister_event_time_span_listener(self._on_span)


def phase_summary(rows: Sequence[Mapping[str, float]], skip: Sequence[int] = (),
                  phases: Sequence[str] = PHASES) -> dict[str, dict[str, float]]:
    """Per phase over the iterations' `PhaseTimer.lap()` rows: total seconds, the first
    iteration's, and the median over the other iterations (those not in `skip`: each session's
    first, which compiles) in which the phase ran."""
    out = {}
    for name in (*phases, "compile", "compile_background", "iteration"):
        values = [float(row.get(f"time/{name}_s", 0.0)) for row in rows]
        steady = [v for i, v in enumerate(values) if i not in skip and v > 0]
        out[name] = {"total_s": float(sum(values)), "first_s": values[0] if values else 0.0,
                     "median_s": float(np.median(steady)) if steady else 0.0}
    return out


def truncate_jsonl(path: str, rows: int) -> int:
    """Keeps the first `rows` lines of a JSONL file (atomically: a new file renamed over it);
    returns how many lines were dropped. Fewer lines than `rows` is reported, not invented."""
    if not storage.path(path).exists():
        if rows:
            logger.warning("%s is missing; the %d rows before the checkpoint are lost.", path,
                           rows)
        return 0
    lines = [line for line in storage.path(path).read_text().splitlines(keepends=True)
             if line.strip()]
    if len(lines) < rows:
        logger.warning("%s has %d rows but the checkpoint had seen %d; the missing rows are "
                       "lost.", path, len(lines), rows)
    dropped = max(0, len(lines) - rows)
    if dropped:
        logger.warning("%s: %d row(s) written after the checkpoint are superseded.", path,
                       dropped)
        storage.write_text(path, "".join(lines[:rows]))
    return dropped


def read_jsonl(path: str) -> list[dict]:
    return [json.loads(line) for line in storage.path(path).read_text().splitlines()
            if line.strip()]


def by_step(rows: Sequence[dict], prefix: str) -> dict[int, dict[str, float]]:
    """{step: {name: value}} of the scalars named `prefix` + name (e.g. "eval/": the held-out
    scores at each evaluation), steps in order."""
    out: dict[int, dict[str, float]] = {}
    for row in rows:
        scalars = {k[len(prefix):]: v for k, v in row.items() if k.startswith(prefix)}
        if scalars:
            out.setdefault(int(row["step"]), {}).update(scalars)
    return dict(sorted(out.items()))


def series(rows: Sequence[dict], name: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of one scalar over the rows that have it."""
    pairs = [(r["step"], r[name]) for r in rows if name in r]
    if not pairs:
        return np.zeros(0), np.zeros(0)
    steps, values = zip(*pairs)
    return np.asarray(steps), np.asarray(values, np.float64)


def hacking_warnings(evaluations: Sequence[tuple[int, Mapping[str, float]]],
                     trained: Sequence[str], untrained: Sequence[str], margin: float,
                     window: int) -> list[str]:
    """Reward-hacking signals: one line per held-out score the policy is not trained on that
    fell by more than `margin` from the evaluation `window` evaluations back to the latest,
    while a score it is trained on rose over the same evaluations.

    Args:
      evaluations: (iteration, {score: mean}) of every held-out evaluation so far, in order.
      trained / untrained: the score names trained on (in-domain) and not.
      margin: the fall that counts (in the score's units); 0 turns the check off.
      window: how many evaluations back the latest is compared with.
    """
    if margin <= 0 or window <= 0 or len(evaluations) <= window:
        return []
    (start, old), (end, new) = evaluations[-1 - window], evaluations[-1]
    rose = {k: new[k] - old[k] for k in trained if k in old and k in new and new[k] > old[k]}
    if not rose:
        return []
    gains = ", ".join(f"{k} {old[k]:.3f} → {new[k]:.3f}" for k in rose)
    return [f"Possible reward hacking: from iteration {start} to {end} the held-out {gains} "
            f"rose while {k}, not trained on, fell {old[k]:.3f} → {new[k]:.3f} (more than "
            f"train.hacking_margin={margin}). Look at the samples (TensorBoard eval/samples, "
            "train/samples)."
            for k in untrained if k in old and k in new and old[k] - new[k] > margin]


def changes_since_base(rows: Sequence[dict], trained: Sequence[str],
                       untrained: Sequence[str]) -> tuple[list[dict], list[str]]:
    """Rows with `change/<score> (trained|not trained)` = eval/<score> − its first value, and
    those names: the held-out scores trained on and not, on one axis (`plot_curves`)."""
    first: dict[str, float] = {}
    names = {k: f"change/{k} (trained)" for k in trained}
    names.update({k: f"change/{k} (not trained)" for k in untrained})
    out = []
    for row in rows:
        extra = {}
        for k, name in names.items():
            if f"eval/{k}" in row:
                first.setdefault(k, row[f"eval/{k}"])
                extra[name] = row[f"eval/{k}"] - first[k]
        out.append({**row, **extra} if extra else row)
    return out, list(names.values())


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
    with storage.open_atomic(path) as f:
        fig.savefig(f, format="png", dpi=110)
    plt.close(fig)
    return path
