"""Held-out evaluation of a generator: deterministic ODE samples from fixed noise, scored by the
in-domain verifier, the out-of-domain learned judge and the image-quality probe; image grids.
The FLUX task gives `Evaluator` its precomputed conditioning and its reward models instead
(`cond=`, `score_fn=`; g2rpo_jax/tasks/flux.py). The program that evaluates a checkpoint is
g2rpo_jax/evaluate.py.

Scores (each a mean over held-out prompts × samples, in [0, 1]):
  in_domain       `rewards.verifier.score` (count, colour, shape, size, relation checks)
  out_of_domain   `rewards.judge` (a CLIP-style model; never an RL reward)
  quality         `rewards.verifier.quality` (1 − fraction of off-palette / speckle pixels)
and, on the embedded world, counts summed over the held-out images
(`rewards.verifier.object_counts_batch`): objects detected, unrecognised objects among them and
objects the prompts ask for.
"""

from collections.abc import Sequence
import dataclasses
import math

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from g2rpo_jax import parallel
from g2rpo_jax.core import storage
from g2rpo_jax.data import world
from g2rpo_jax.rewards import verifier
from g2rpo_jax.sampling import rollout, schedules

SCORES = ("in_domain", "out_of_domain", "quality")


def held_out_prompts(config) -> list[str]:
    prompts = world.split_prompts(config.world.split_seed,
                                  config.world.held_out_fraction)["held_out"]
    if config.evaluation.num_prompts > 0:
        prompts = prompts[:config.evaluation.num_prompts]
    if not prompts:
        raise ValueError("The held-out prompt split is empty: raise world.held_out_fraction "
                         "or evaluation.num_prompts.")
    return prompts


def sigmas_from_config(config) -> jax.Array:
    return schedules.flux_sigmas(config.sampling.num_steps, config.sampling.shift)


def sample_latents(apply_fn, cond: dict, noise: jax.Array, sigmas: jax.Array,
                   guidance: float | None) -> jax.Array:
    """Euler ODE from noise [P, M, N, C] at sigmas[0] to the final latents [P, M, N, C]."""
    velocity = rollout.make_velocity_fn(apply_fn, cond, guidance)
    xs, _ = rollout.ode_trajectory(velocity, noise, sigmas)
    return xs[-1]


def judge_fn(config, prompts: Sequence[str]):
    """The out-of-domain scorer `fn(images [..., H, W, 3], prompt_ids [...]) -> [...]`."""
    from g2rpo_jax.rewards import judge as judge_lib

    path = config.reward.judge_path or judge_lib.DEFAULT_JUDGE_PATH
    judge, tokenizer = judge_lib.load_judge(path)
    return judge_lib.jax_judge_fn(judge, tokenizer, prompts)


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """One evaluation of a set of parameters.

    per_image: {name: float32 [P, M]} for every scorer, in report order.
    first_images: [K, M, H, W, 3] in [0, 1], the samples of the first K prompts (for grids).
    counts: {name: int32 [P, M]} from the evaluator's `counts_fn` (empty without one).
    categories: each prompt's category [P] from the evaluator's `category_fn` (empty without
      one); category_names: the categories to report, in report order (GenEval's six for the
      embedded world, some without prompts).
    """

    per_image: dict[str, np.ndarray]
    first_images: np.ndarray
    counts: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    categories: tuple[str, ...] = ()
    category_names: tuple[str, ...] = ()

    def means(self) -> dict[str, float]:
        """Mean of each score over prompts and samples, in report order."""
        return {name: float(values.mean()) for name, values in self.per_image.items()}

    def totals(self) -> dict[str, int]:
        """Each count summed over prompts and samples."""
        return {name: int(values.sum()) for name, values in self.counts.items()}

    def by_category(self) -> dict[str, dict[str, float] | None]:
        """{category: {score: mean over its prompts and samples}, or None where no prompt has
        the category}, for `category_names` in order (then any other category of the
        prompts); empty without categories."""
        if not self.categories:
            return {}
        labels = np.asarray(self.categories)
        return {c: ({name: float(values[labels == c].mean())
                     for name, values in self.per_image.items()} if c in self.categories
                    else None)
                for c in dict.fromkeys((*self.category_names, *self.categories))}


class Evaluator:
    """Samples and scores a fixed set of prompts with fixed noise, so that evaluations of
    different parameters (base, during training, final) are directly comparable.

    Args:
      config: the run config (`sampling`, `evaluation`; `reward.judge_path` for the judge).
      generator: the model bundle: `flux`, `latent_shape`, `decode(latents [..., N, C]) ->
        images`, and `encode(prompts) -> cond` unless `cond` is given (a
        `generator.Generator`, or the FLUX task's `tasks.flux.FluxGenerator`).
      prompts: the held-out prompts [P].
      mesh: the device mesh.
      scorers: the score names, in report order.
      cond: the prompts' conditioning, precomputed ({"txt" [P, T, D], "y" [P, Dy], "txt_ids",
        "img_ids"}, host arrays): the FLUX task's, read from its embedding dataset.
      score_fn: `score_fn(images [P, M, H, W, 3], prompts) -> {name: float [P, M]}` for every
        scorer; default: the embedded world's scores (`score_images`).
      counts_fn: `counts_fn(images [P, M, H, W, 3], prompts) -> {name: int [P, M]}`, counts
        kept beside the scores (Evaluation.counts); default: the embedded world's object
        counts (`count_objects`) when `score_fn` is its default too, else none.
      category_fn: `category_fn(prompt) -> str`, each prompt's category for the per-category
        scores (Evaluation.by_category); default: the embedded world's GenEval category
        (`world.category`) when `score_fn` is its default too, else none.
    """

    def __init__(self, config, generator, prompts: Sequence[str], mesh,
                 scorers: Sequence[str] = SCORES, *, cond: dict | None = None, score_fn=None,
                 counts_fn=None, category_fn=None):
        self.generator, self.mesh, self.scorers = generator, mesh, tuple(scorers)
        self.prompts = list(prompts)
        self.counts_fn = counts_fn or (count_objects if score_fn is None else None)
        self.category_names = ()
        if category_fn is None and score_fn is None:   # the embedded world's
            category_fn, self.category_names = world.category, world.GENEVAL_CATEGORIES
        self.categories = tuple(map(category_fn, self.prompts)) if category_fn else ()
        if score_fn is None:
            unknown = set(scorers) - set(SCORES)
            if unknown:
                raise ValueError(f"Unknown scores {sorted(unknown)}; known: {SCORES}.")
            judge = judge_fn(config, self.prompts) if "out_of_domain" in scorers else None
            index = {prompt: i for i, prompt in enumerate(self.prompts)}   # the judge's ids
            strict = strict_verifier(config)
            self.score_fn = lambda images, prompts: score_images(
                images, prompts, self.scorers, judge, [index[p] for p in prompts], strict)
        else:
            self.score_fn = score_fn
        batch_devices = math.prod(mesh.shape[a] for a in ("data", "fsdp"))
        # Pad the prompt batch to split evenly over the batch axes; padding rows are dropped.
        padded = -len(self.prompts) % batch_devices
        self._padded_prompts = self.prompts + self.prompts[:1] * padded
        self._rows = parallel.host_row_indices(mesh, len(self._padded_prompts))
        self.samples = config.evaluation.samples_per_prompt
        self.sigmas = sigmas_from_config(config)
        self.guidance = config.sampling.guidance
        # The images kept for grids (Evaluation.first_images): the first prompts, every sample.
        grid = (config.get("train") or {}).get("images_in_grid", 16)
        self.kept = min(len(self.prompts), max(16, grid))
        n, c = generator.latent_shape
        noise = np.asarray(jax.random.normal(jax.random.key(config.evaluation.seed),
                                             (len(self._padded_prompts), self.samples, n, c)))
        self.noise = parallel.put_global(noise, parallel.batch_sharding(mesh, noise.shape))
        self.graphdef = nnx.graphdef(generator.flux)
        self._fixed_cond = cond is not None
        self._cond = None   # the prompts' conditioning on the mesh, encoded on first use
        if cond is not None:
            cond = {k: (np.concatenate([v, np.repeat(v[:1], padded, 0)])
                        if k in parallel.PER_PROMPT_COND else v) for k, v in cond.items()}
            self._cond = parallel.place_cond(cond, mesh)

        @jax.jit
        def sample(params, cond, noise):
            return sample_latents(nnx.merge(self.graphdef, params), cond, noise, self.sigmas,
                                  self.guidance)
        self._sample = sample

    def _conditioning(self, text_encoder=None) -> dict:
        """The padded prompts' conditioning on the mesh. With `text_encoder` (pre-training, where
        the encoder changes) they are encoded by it for this call only; otherwise the
        precomputed conditioning, or the generator's own encoding made once."""
        if text_encoder is not None:
            if self._fixed_cond:
                raise ValueError("This evaluator's conditioning is precomputed; it cannot "
                                 "re-encode the prompts with a text encoder.")
            encoding = dataclasses.replace(self.generator, text_encoder=text_encoder)
            return parallel.place_cond(encoding.encode(self._padded_prompts), self.mesh)
        if self._cond is None:
            self._cond = parallel.place_cond(self.generator.encode(self._padded_prompts),
                                            self.mesh)
        return self._cond

    def _host_images(self, params, text_encoder=None) -> np.ndarray:
        """This process's rows of the padded prompts as images [R, M, H, W, 3] in [0, 1]."""
        cond = self._conditioning(text_encoder)
        with jax.set_mesh(self.mesh):
            latents = self._sample(params, cond, self.noise)
        return np.asarray(self.generator.decode(parallel.local_rows(latents, self.mesh)))

    def images(self, params, text_encoder=None) -> np.ndarray:
        """[P, M, H, W, 3] float images in [0, 1], all prompts on every process."""
        images = parallel.gather_rows(self._host_images(params, text_encoder), self.mesh,
                                      len(self._padded_prompts))
        return images[:len(self.prompts)]

    def evaluate(self, params, text_encoder=None) -> Evaluation:
        """Fresh samples of every prompt, scored (the same on every process). Each process
        decodes and scores its own rows; only the scores and the first rows' images cross
        hosts."""
        images = self._host_images(params, text_encoder)
        scores = self.score_fn(images, [self._padded_prompts[i] for i in self._rows])
        rows = len(self._padded_prompts)
        per_image = {name: parallel.gather_rows(np.asarray(scores[name], np.float32),
                                                self.mesh, rows)[:len(self.prompts)]
                     for name in self.scorers}
        counts = {}
        if self.counts_fn is not None:
            local = self.counts_fn(images, [self._padded_prompts[i] for i in self._rows])
            counts = {name: parallel.gather_rows(np.asarray(values, np.int32), self.mesh,
                                                 rows)[:len(self.prompts)]
                      for name, values in local.items()}
        return Evaluation(per_image, _first_rows(images, self._rows, self.kept, self.mesh, rows),
                          counts, self.categories, self.category_names)

    def scores(self, params, text_encoder=None) -> dict[str, float]:
        """Mean of each score over prompts and samples, in `scorers` order."""
        return self.evaluate(params, text_encoder).means()


def _first_rows(local: np.ndarray, rows: np.ndarray, count: int, mesh, total: int
                ) -> np.ndarray:
    """Rows [0, count) of a batch from every process's rows (`local` [R, ...] at `rows`):
    only those rows cross hosts, not the whole batch."""
    if jax.process_count() == 1:
        return local[np.argsort(rows)][:count]
    from jax.experimental import multihost_utils

    mine = np.zeros((count, *local.shape[1:]), local.dtype)
    wanted = rows < count
    mine[rows[wanted]] = local[wanted]
    gathered = np.asarray(multihost_utils.process_allgather(mine))     # [H, count, ...]
    out = np.empty_like(mine)
    for process, owned in enumerate(parallel.process_row_indices(mesh, total)):
        kept = owned[owned < count]
        out[kept] = gathered[process][kept]
    return out


def strict_verifier(config) -> bool:
    """Whether in_domain uses the verifier's strict rule (`config.reward.strict_verifier`)."""
    return bool(config.reward.get("strict_verifier", False))


def score_images(images: np.ndarray, prompts: Sequence[str], scorers: Sequence[str],
                 judge=None, prompt_ids=None, strict: bool = False) -> dict[str, np.ndarray]:
    """Per-image scores {name: float32 [P, M]} of images [P, M, H, W, 3] (M samples of prompt p;
    `prompt_ids` [P]: each row's index in the judge's prompt list, default 0..P-1; `strict`:
    the verifier's strict rule for in_domain, `verifier.score`)."""
    p, m = images.shape[:2]
    flat = images.reshape(p * m, *images.shape[2:])
    repeated = [prompt for prompt in prompts for _ in range(m)]
    out = {}
    if "in_domain" in scorers:
        out["in_domain"] = verifier.score_batch(flat, repeated, strict)
    if "quality" in scorers:
        out["quality"] = verifier.quality_batch(flat)
    if "out_of_domain" in scorers:
        ids = np.arange(p) if prompt_ids is None else np.asarray(prompt_ids)
        out["out_of_domain"] = np.asarray(judge(jnp.asarray(flat), jnp.asarray(np.repeat(ids, m))),
                                          np.float32)
    return {name: values.reshape(p, m) for name, values in out.items()}


def category_table(evaluations) -> list[str]:
    """Markdown in GenEval's layout: a row per score and evaluation, the overall mean, then a
    column per category ("—" where it has no prompts). `evaluations`: (label, {score: overall
    mean}, Evaluation.by_category()) triples, all with the same categories."""
    names = list(evaluations[0][2])
    lines = ["| held-out score | overall | " + " | ".join(names) + " |",
             "|---|" + "---:|" * (len(names) + 1)]
    for score in evaluations[0][1]:
        for label, overall, by_category in evaluations:
            cells = [f"{by_category[c][score]:.4f}" if by_category.get(c) else "—"
                     for c in names]
            lines.append(f"| {score} ({label}) | {overall[score]:.4f} | " + " | ".join(cells)
                         + " |")
    return lines


def count_objects(images: np.ndarray, prompts: Sequence[str]) -> dict[str, np.ndarray]:
    """The embedded world's per-image counts {name: int32 [P, M]} of images [P, M, H, W, 3]
    (`rewards.verifier.object_counts_batch`)."""
    p, m = images.shape[:2]
    counts = verifier.object_counts_batch(images.reshape(p * m, *images.shape[2:]),
                                          [prompt for prompt in prompts for _ in range(m)])
    return {name: values.reshape(p, m) for name, values in counts.items()}


def save_grid(path: str, images: np.ndarray, captions: Sequence[str], columns: int = 8,
              scale: int = 4, title: str = "") -> str:
    """A PNG grid of images [K, H, W, 3] in [0, 1] (nearest-neighbour ×scale), each captioned."""
    canvas = grid_image(images, captions, columns, scale, title)
    with storage.open_atomic(path) as f:
        canvas.save(f, format="PNG")
    return path


def grid_image(images: np.ndarray, captions: Sequence[str], columns: int = 8, scale: int = 4,
               title: str = ""):
    """`save_grid`'s picture as a PIL image (for TensorBoard: `np.asarray(...)`, [H, W, 3])."""
    from PIL import Image, ImageDraw

    images = np.clip(np.asarray(images) * 255 + 0.5, 0, 255).astype(np.uint8)
    k, h, w = images.shape[:3]
    cell_w, cell_h, text_h = w * scale + 8, h * scale + 8, 28
    top = 18 if title else 0
    rows = max(1, math.ceil(k / columns))
    canvas = Image.new("RGB", (columns * cell_w, top + rows * (cell_h + text_h)), (40, 40, 40))
    draw = ImageDraw.Draw(canvas)
    if title:
        draw.text((4, 3), title, fill=(255, 255, 255))
    for i, (image, caption) in enumerate(zip(images, captions)):
        x, y = (i % columns) * cell_w, top + (i // columns) * (cell_h + text_h)
        big = Image.fromarray(image).resize((w * scale, h * scale), Image.NEAREST)
        canvas.paste(big, (x + 4, y + 4))
        words, lines = caption.split(), [""]
        for word in words:  # wrap to the cell width (~6 px a character in the default font)
            if len(lines[-1]) + len(word) + 1 > cell_w // 6:
                lines.append("")
            lines[-1] = f"{lines[-1]} {word}".strip()
        draw.text((x + 4, y + cell_h - 2), "\n".join(lines[:2]), fill=(220, 220, 220))
    return canvas
