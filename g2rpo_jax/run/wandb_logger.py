"""Weights & Biases, optional: the run's scalars, images, histograms and texts, as
`metrics.MetricsLogger` writes them to TensorBoard, also logged to a W&B run.

Turned on by `config.logging.wandb` (config_lib.base_config lists the fields); `wandb` is an
optional extra (`pip install -e ".[wandb]"`), imported only when a `WandbSink` is made, so a
run without the flag never loads it. Only process 0 makes one (MetricsLogger.active).

One W&B run per workdir: the first start writes a new run id to WORKDIR/wandb_run_id, and every
restart reads it and resumes that run (`resume="allow"`). A resumed run logs again the
iterations after its checkpoint that the killed run had logged already, so rows are not given
W&B's own step (which must increase: W&B would drop them) but an "iteration" field that every
metric is plotted against.

W&B writes locally first (the offline transaction log, media files, its own logs): into
WORKDIR/wandb/ for a local workdir; for a gs:// workdir into $WANDB_DIR/wandb/ if WANDB_DIR is
set, else a new temporary folder at each start (its path is logged). Each start writes a folder of its own,
DIR/wandb/offline-run-<time>-<run id> in offline mode; `wandb sync --id RUN_ID
DIR/wandb/offline-run-*` uploads them into that run in order of start time.
"""

from collections.abc import Mapping
import html
import importlib.util
import logging
import os
import tempfile
import uuid

import numpy as np

from g2rpo_jax.core import storage

logger = logging.getLogger(__name__)

# config.logging.wandb_mode: "" leaves the choice to W&B ($WANDB_MODE or `wandb offline`,
# else online); wandb.init's own `mode` argument would override those.
MODES = ("", "online", "offline", "disabled")
RUN_ID_FILE = "wandb_run_id"
# The field every metric is plotted against (the loop's step: an RL iteration, a
# pre-training step), logged in each row.
STEP_FIELD = "iteration"
INSTALL_HINT = 'pip install -e ".[wandb]"'


def enabled(settings) -> bool:
    """Whether a config's `logging` section (None for a config without one) turns W&B on."""
    return bool(settings is not None and settings.get("wandb", False))


def validate(settings) -> None:
    """Checks the W&B settings before any compute, without importing wandb.

    Raises:
      ValueError: an unknown `wandb_mode`.
      ImportError: W&B is turned on and the wandb package is not installed.
    """
    if not enabled(settings):
        return
    mode = settings.get("wandb_mode", "")
    if mode not in MODES:
        raise ValueError(f"config.logging.wandb_mode is {mode!r}; use one of "
                         f"{', '.join(repr(m) for m in MODES)} (\"\": W&B's default, "
                         "$WANDB_MODE or online).")
    if importlib.util.find_spec("wandb") is None:
        raise ImportError("config.logging.wandb=True needs the wandb package: "
                          f"{INSTALL_HINT}, or turn it off with --config.logging.wandb=False.")


def tags(value) -> list[str]:
    """W&B tags from `wandb_tags`: a tuple of tags or one comma-separated string (a command
    line's `--config.logging.wandb_tags=a,b` gives the tuple ("a,b",): split too)."""
    if isinstance(value, str):
        value = (value,)
    return [tag.strip() for item in value for tag in item.split(",") if tag.strip()]


def run_id(workdir: str) -> str:
    """The workdir's W&B run id: read from WORKDIR/wandb_run_id, or a new one written there
    (through g2rpo_jax.core.storage: a gs:// workdir keeps it in the bucket)."""
    path = os.path.join(workdir, RUN_ID_FILE)
    stored = storage.path(path)
    if stored.exists():
        value = stored.read_text().strip()
        if value:
            return value
    value = uuid.uuid4().hex[:12]   # W&B ids: letters, digits, - and _; unique per project
    storage.write_text(path, value + "\n")
    return value


def local_dir(workdir: str) -> str:
    """Where W&B writes its files (it writes locally only; see the module docstring)."""
    if not storage.is_remote(workdir):
        return workdir
    if os.environ.get("WANDB_DIR"):
        os.makedirs(os.environ["WANDB_DIR"], exist_ok=True)
        return os.environ["WANDB_DIR"]
    folder = tempfile.mkdtemp(prefix="g2rpo_jax_wandb_")
    # A warning: an offline run exists only there until it is synced.
    logger.warning("W&B writes the local files of %s to %s/wandb (set WANDB_DIR to choose the "
                   "folder; an offline run is uploaded from there with `wandb sync`).",
                   workdir, folder)
    return folder


def _uint8(image: np.ndarray) -> np.ndarray:
    """An image [H, W, 3] as uint8 (floats are in [0, 1], as TensorBoard takes them)."""
    image = np.asarray(image)
    if image.dtype == np.uint8:
        return image
    return np.round(np.clip(image.astype(np.float32), 0.0, 1.0) * 255).astype(np.uint8)


class WandbSink:
    """One W&B run of a workdir, fed by MetricsLogger (process 0 only).

    `image`, `histogram` and `text` are held until a `write` (as TensorBoard's files get
    them with the next one): a write of step n logs what is held for earlier steps in rows of
    their own, then what is held for n in one row with its scalars; `close` logs what is still
    held and finishes the run.
    """

    def __init__(self, workdir: str, settings, run_config: Mapping | None = None):
        """Starts the workdir's W&B run, or resumes it (the id in WORKDIR/wandb_run_id).

        Args:
          workdir: the run's workdir (local or gs://): the run id file, the run's default name.
          settings: the config's `logging` section (config_lib.base_config).
          run_config: stored as the W&B run's config (the whole config, as a dict).
        """
        validate(settings)   # names the install command when wandb is missing
        import wandb  # optional: only a run with config.logging.wandb=True loads it
        self._wandb = wandb
        self.run_id = run_id(workdir)
        self.run = wandb.init(
            project=settings.get("wandb_project") or None,
            entity=settings.get("wandb_entity") or None,
            name=settings.get("wandb_run_name") or os.path.basename(workdir.rstrip("/")),
            tags=tags(settings.get("wandb_tags", ())),
            mode=settings.get("wandb_mode") or None,
            dir=local_dir(workdir), id=self.run_id, resume="allow",
            config=dict(run_config) if run_config is not None else None)
        self.run.define_metric(STEP_FIELD)
        self.run.define_metric("*", step_metric=STEP_FIELD)
        self._held: dict[int, dict] = {}   # step → media and texts not yet logged

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        """The finite scalars (as TensorBoard gets them), with what is held for `step`."""
        step = int(step)
        for earlier in sorted(s for s in self._held if s < step):
            self._log(earlier, self._held.pop(earlier))
        values = {k: float(v) for k, v in scalars.items() if np.isfinite(v)}
        self._log(step, {**self._held.pop(step, {}), **values})

    def image(self, step: int, tag: str, image: np.ndarray) -> None:
        self._hold(step, tag, self._wandb.Image(_uint8(image), caption=f"iteration {step}"))

    def histogram(self, step: int, tag: str, values: np.ndarray) -> None:
        """Finite values (MetricsLogger.histogram leaves the others out)."""
        self._hold(step, tag, self._wandb.Histogram(np.asarray(values, np.float64)))

    def text(self, step: int, tag: str, markdown: str) -> None:
        """As preformatted text: W&B has no Markdown panel for logged values."""
        self._hold(step, tag, self._wandb.Html(f"<pre>{html.escape(markdown)}</pre>",
                                               inject=False))

    def close(self) -> None:
        for step in sorted(self._held):
            self._log(step, self._held.pop(step))
        self.run.finish()

    def _hold(self, step: int, tag: str, value) -> None:
        self._held.setdefault(int(step), {})[tag] = value

    def _log(self, step: int, row: dict) -> None:
        if row:
            self.run.log({STEP_FIELD: step, **row})
