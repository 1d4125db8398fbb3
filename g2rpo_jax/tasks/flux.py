"""The real FLUX.1 stack as a task.

- policy: the FLUX transformer (`config.model.checkpoint`: a diffusers folder or BFL file),
  sharded on the mesh;
- prompts: the preprocessed embedding datasets (`g2rpo_jax.preprocess`): T5 states → `txt`
  [P, L, 4096], pooled CLIP → `y` [P, 768], with FLUX's position ids: zeros for the text
  tokens, (0, row, col) for the 2×2-packed latent tokens;
- decode: the FLUX autoencoder at `config.image` size;
- rewards: reward models of the registry (`config.reward.models`), trained on
  `config.reward.train` with `weights`, reported on held-out prompts for `reward.evaluate`.

Every path may be a gs:// URL: the weights that are loaded (the transformer/ and vae/ of a FLUX.1
folder, the reward checkpoints, the tokenizer) are downloaded once into the cache
(`storage.local`), the prepared prompt embeddings likewise.

Decoding and reward models run on each process's own devices (a local mesh), on its own rows
of the batch, in micro-batches of `config.reward.batch_size` images: a micro-batch is decoded
and scored on the devices, so a whole iteration's images never sit in host memory at once.
"""

import dataclasses
import os

import jax
import numpy as np

from g2rpo_jax import parallel
from g2rpo_jax import rewards as rewards_lib
from g2rpo_jax.core import storage
from g2rpo_jax.data import embedding_dataset, embedding_preparation, tfds_dirs
from g2rpo_jax.data import reader as reader_lib
from g2rpo_jax.models import autoencoder as autoencoder_lib
from g2rpo_jax.models import autoencoder_weights, flux, flux_weights, lora, torch_checkpoints
from g2rpo_jax.run import config_lib
from g2rpo_jax.tasks import held_out
from g2rpo_jax.tasks.base import Batch

REQUIRED_SECTIONS = ("autoencoder", "text", "image", "data", "reward", "train", "evaluation")
# Reward kinds that tokenize with the OpenCLIP BPE (FLUX.1's tokenizer/ is the same one).
_CLIP_BPE_REWARDS = ("hps", "clip_score")
_PATH_OPTIONS = ("path", "tokenizer", "clip_path")


def check_config(config) -> None:
    missing = [s for s in REQUIRED_SECTIONS if s not in config]
    if missing:
        raise ValueError(f"config.task is 'flux' but the config has no {missing} section(s): "
                         "FLUX configs start from config_lib.flux_config() (see "
                         "configs/flux_tiny.py).")
    if not config.model.checkpoint:
        raise ValueError("config.model.checkpoint is empty: the FLUX task starts from a "
                         "transformer: a FLUX.1 folder (diffusers layout), its transformer/, or "
                         "a BFL flux1-*.safetensors file.")
    names, weights = list(config.reward.train), list(config.reward.weights)
    if not names or len(names) != len(weights):
        raise ValueError(f"reward.train {names} and reward.weights {weights} must be non-empty "
                         "and of the same length.")
    unknown = [n for n in names + list(config.reward.evaluate) if n not in config.reward.models]
    if unknown:
        raise ValueError(f"Rewards {unknown} are not configured: config.reward.models has "
                         f"{sorted(config.reward.models)}; add one with "
                         "config_lib.reward_model(kind, path, ...).")


def model_folder(config) -> str:
    """The FLUX.1 folder the other components default to (model.checkpoint, if a folder)."""
    path = config.model.checkpoint.rstrip("/")
    if os.path.basename(path) == "transformer" and storage.path(path).is_dir():
        return os.path.dirname(path)
    return path


def local_mesh():
    """This process's devices, for host-side work on its own rows (decode, rewards)."""
    return parallel.make_mesh({"data": 1, "fsdp": -1, "tensor": 1}, devices=jax.local_devices())


def micro_batches(count: int, size: int, multiple: int) -> list[tuple[int, int, int]]:
    """(start, stop, padded) covering range(count) in steps of `size` (0 = all at once); every
    batch is padded to the same `padded` rows, a multiple of `multiple` (the devices it is split
    over), so one compiled program serves every call."""
    size = count if size <= 0 else min(size, count)
    padded = -(-size // multiple) * multiple
    return [(start, min(start + size, count), padded) for start in range(0, count, size)]


def pad_rows(x: np.ndarray, rows: int) -> np.ndarray:
    """x [n, ...] → [rows, ...], repeating the last row (real data: no special values)."""
    return np.concatenate([x, np.repeat(x[-1:], rows - len(x), 0)]) if rows > len(x) else x


@dataclasses.dataclass
class FluxGenerator:
    """FLUX.1 as the evaluator's model bundle (`flux`, `latent_shape`, `decode`): the policy and
    the autoencoder bound to one image size. No text encoders: the prompts come preprocessed."""

    flux: flux.Flux
    autoencoder: autoencoder_lib.PackedAutoencoder
    mesh: jax.sharding.Mesh          # the local mesh the autoencoder runs on
    batch_size: int = 0

    @property
    def latent_shape(self) -> tuple[int, int]:
        return self.autoencoder.latent_shape

    def image_ids(self) -> np.ndarray:
        """[N, 3] position ids (0, row, col) of the packed latent tokens."""
        return np.asarray(self.autoencoder.image_ids())

    def place(self, x: np.ndarray) -> jax.Array:
        return jax.device_put(x, parallel.batch_sharding(self.mesh, x.shape))

    def decode_rows(self, latents: np.ndarray) -> jax.Array:
        """Packed latents [B, N, C] (B a multiple of the local devices) → images [B, H, W, 3]
        in [0, 1], on the local devices."""
        return self.autoencoder.decode(self.place(latents))

    def decode(self, latents) -> np.ndarray:
        """Latents [..., N, C] (host or global array) → images [..., H, W, 3], float32, host."""
        x = parallel.to_host(latents)
        flat = x.reshape(-1, *x.shape[-2:])
        parts = [np.asarray(self.decode_rows(pad_rows(flat[a:b], n)))[:b - a]
                 for a, b, n in micro_batches(len(flat), self.batch_size, self.mesh.size)]
        images = np.concatenate(parts)
        return images.reshape(*x.shape[:-2], *images.shape[1:])


class RewardModels:
    """The configured reward models (`config.reward.models`), each built on first use:
    `score(images [B, H, W, 3] in [0, 1], prompts [B], names) -> {name: float32 [B]}`."""

    def __init__(self, config, mesh, rules, default_tokenizer: str | None):
        self.entries = {name: entry.to_dict() for name, entry in config.reward.models.items()}
        self.root = config.reward.root
        self.mesh, self.rules = mesh, rules
        self.default_tokenizer = default_tokenizer
        self._models = {}

    def _resolve(self, path: str) -> str:
        """Relative to reward.root; a gs:// file or folder: its local copy (storage.local). A
        gs:// PyTorch checkpoint: the local copy of its converted safetensors beside it (the
        pickle is never downloaded), or NeedsConversionError naming the converter command."""
        if path and self.root and not os.path.isabs(path) and "://" not in path:
            path = os.path.join(self.root, path)
        if path and storage.is_remote(path):
            if torch_checkpoints.is_torch_checkpoint(path):
                path = torch_checkpoints.require_converted(path)
            try:
                return storage.local(path)
            except FileNotFoundError:
                return path   # reported by `options` with the config field that names it
        return path

    def options(self, name: str) -> tuple[str, str, dict]:
        """(kind, path, keyword arguments) of `rewards.get` for one configured reward."""
        entry = dict(self.entries[name])
        kind = entry.pop("kind")
        options = {k: (self._resolve(v) if k in _PATH_OPTIONS else v)
                   for k, v in entry.items() if v not in ("", None)}
        if entry.get("config") == "":   # "" = read or infer the architecture from the files
            options["config"] = None
        path = options.pop("path", None)
        if kind != "remote":
            if path is None:
                raise ValueError(f"config.reward.models.{name}.path is empty: give the "
                                 f"{kind} checkpoint (absolute, or relative to reward.root).")
            if not os.path.exists(path):
                raise FileNotFoundError(f"No {kind} checkpoint at {path} "
                                        f"(config.reward.models.{name}.path, reward.root).")
            options.update(mesh=self.mesh, rules=self.rules)
        if kind in _CLIP_BPE_REWARDS and "tokenizer" not in options and self.default_tokenizer:
            options["tokenizer"] = self.default_tokenizer
        return kind, path, options

    def get(self, name: str):
        if name not in self._models:
            kind, path, options = self.options(name)
            self._models[name] = rewards_lib.get(kind, path, **options)
        return self._models[name]

    def score(self, images, prompts, names) -> dict[str, np.ndarray]:
        """Images on the local devices or on the host; a remote reward gets host pixels."""
        out = {}
        for name in names:
            reward = self.get(name)
            pixels = np.asarray(images) if self.entries[name]["kind"] == "remote" else images
            out[name] = np.asarray(reward(pixels, list(prompts)), np.float32)
        return out


def _default_tokenizer(config) -> str | None:
    folder = os.path.join(config.text.path or model_folder(config), "tokenizer")
    return storage.local(folder) if storage.path(folder).is_dir() else None


def load_embeddings(config, role: str, cfg: flux.FluxConfig
                    ) -> embedding_dataset.EmbeddingSource | None:
    """The prepared embedding dataset of `role` ("train" / "eval"; None if that prompts file is
    not configured), checked against the transformer and the config's text settings."""
    specs = embedding_preparation.specs_from_config(config)
    if role not in specs:
        return None
    data_dir = config.data.data_dir or tfds_dirs.default_data_dir()
    directory = embedding_dataset.dataset_dir(data_dir, specs[role].name)
    source = embedding_dataset.load(directory)
    embedding_dataset.check_dims(source.metadata, cfg.joint_attention_dim,
                                 cfg.pooled_projection_dim, directory)
    for field, wanted in (("t5_max_length", config.text.t5_max_length),
                          ("clip_max_length", config.text.clip_max_length)):
        if source.metadata.get(field) != wanted:
            raise ValueError(f"{directory} was prepared with {field} {source.metadata.get(field)}"
                             f" but config.text.{field} is {wanted}: preprocess again (with "
                             "another data.name), or match the config to the dataset.")
    return source


class FluxTask:
    """See `tasks.base.Task` and the module docstring."""

    def __init__(self, config, mesh, rules, training: bool = True):
        check_config(config)
        self.mesh, self.rules = mesh, parallel.rules_from_config(rules)
        execution = config_lib.execution_fields(config.model)
        self.policy = flux_weights.from_pretrained(
            storage.local(config.model.checkpoint, parts=("transformer",)), mesh=mesh,
            rules=self.rules, **execution)
        # model.lora.rank > 0: adapters on the policy before anything takes its graph.
        lora.from_config(self.policy, config.model, config.seed, mesh, self.rules)
        cfg = self.policy.cfg
        self.host_mesh = local_mesh()
        vae_path = storage.local(config.autoencoder.path or model_folder(config),
                                 parts=("vae",))
        if os.path.isfile(vae_path):
            raise ValueError(f"config.model.checkpoint {vae_path} is a single file; set "
                             "config.autoencoder.path to FLUX.1's vae/ folder.")
        ae = autoencoder_weights.from_pretrained(vae_path, config.autoencoder.dtype,
                                                 mesh=self.host_mesh)
        height, width = config.image.height, config.image.width
        self.generator = FluxGenerator(self.policy, ae.at(height, width), self.host_mesh,
                                       config.reward.batch_size)
        n, c = self.generator.latent_shape
        if c != cfg.in_channels:
            raise ValueError(f"The autoencoder's packed latents have {c} channels "
                             f"({ae.cfg.latent_channels} × 2×2) but the transformer takes "
                             f"in_channels={cfg.in_channels}: load the matching vae/ "
                             "(config.autoencoder.path).")
        self.latent_shape = (n, c)
        self.reward_names = tuple(config.reward.train)
        self.reward_weights = tuple(config.reward.weights)
        self.reward_models = RewardModels(config, self.host_mesh, self.rules,
                                          _default_tokenizer(config))
        self.batch_size = config.reward.batch_size
        if training:
            source = load_embeddings(config, "train", cfg)
            self.prompts_per_iteration = config.train.prompts_per_iteration
            self.reader = reader_lib.Reader(
                source, self.prompts_per_iteration, seed=config.seed,
                rows=parallel.host_row_indices(mesh, self.prompts_per_iteration, self.rules))
            self._shared = self._shared_cond(source.metadata["t5_max_length"])
        self.evaluator, self.score_names, self.in_domain = None, (), ()
        eval_source = load_embeddings(config, "eval", cfg)
        if eval_source is not None:
            self.score_names = tuple(config.reward.evaluate) or self.reward_names
            self.evaluator = self._evaluator(config, eval_source)
            self.in_domain = tuple(n for n in self.score_names if n in self.reward_names)

    def _shared_cond(self, text_length: int) -> dict:
        """FLUX's position ids: zeros for the text tokens, (0, row, col) for image tokens."""
        return {"txt_ids": np.zeros((text_length, 3), np.float32),
                "img_ids": self.generator.image_ids()}

    def _evaluator(self, config, source) -> held_out.Evaluator:
        """The held-out prompts of `source`, scored by `score_images` on `score_names`."""
        records = source.records_by_index()
        if config.evaluation.num_prompts > 0:
            records = records[:config.evaluation.num_prompts]
        prompts = [r["prompt"].decode() if isinstance(r["prompt"], bytes) else r["prompt"]
                   for r in records]
        cond = dict(self._shared_cond(source.metadata["t5_max_length"]),
                    txt=np.stack([np.asarray(r["t5"], np.float32) for r in records]),
                    y=np.stack([np.asarray(r["clip_pooled"], np.float32) for r in records]))
        return held_out.Evaluator(config, self.generator, prompts, self.mesh, self.score_names,
                                  cond=cond, score_fn=self.score_images)

    def score_images(self, images: np.ndarray, prompts) -> dict[str, np.ndarray]:
        """Host images [P, M, H, W, 3] of prompts [P] → {name: [P, M]} for every name of
        `score_names` (the evaluator's)."""
        p, m = images.shape[:2]
        flat = images.reshape(p * m, *images.shape[2:])
        repeated = [prompt for prompt in prompts for _ in range(m)]
        parts = []
        for a, b, n in micro_batches(len(flat), self.batch_size, self.host_mesh.size):
            part = self.generator.place(pad_rows(flat[a:b], n))
            scores = self.reward_models.score(part, pad_rows(np.asarray(repeated[a:b]), n),
                                              self.score_names)
            parts.append({k: v[:b - a] for k, v in scores.items()})
        return {k: np.concatenate([s[k] for s in parts]).reshape(p, m) for k in parts[0]}

    def decode(self, latents: np.ndarray) -> np.ndarray:
        return self.generator.decode(latents)

    def next_batch(self) -> Batch:
        batch = next(self.reader)
        cond = parallel.place_cond(
            dict(self._shared, txt=batch["t5"].astype(np.float32),
                 y=batch["clip_pooled"].astype(np.float32)),
            self.mesh, self.rules, prompts=self.prompts_per_iteration)
        return Batch(cond, batch["prompt"], batch["index"])

    def data_state(self) -> dict:
        return self.reader.state()

    def restore_data_state(self, state: dict) -> None:
        self.reader.restore(state)

    def rewards(self, finals, batch: Batch):
        """finals [P, M, N, C] → [R, P, M] on every process: this process's rows decoded and
        scored in micro-batches on its devices, then shared."""
        latents = parallel.local_rows(finals, self.mesh, rules=self.rules)   # [P_host, M, N, C]
        p, m = latents.shape[:2]
        flat = latents.reshape(p * m, *latents.shape[2:])
        repeated = np.asarray([prompt for prompt in batch.prompts for _ in range(m)])
        scores = {name: [] for name in self.reward_names}
        for a, b, n in micro_batches(len(flat), self.batch_size, self.host_mesh.size):
            images = self.generator.decode_rows(pad_rows(flat[a:b], n))
            part = self.reward_models.score(images, pad_rows(repeated[a:b], n),
                                            self.reward_names)
            for name in self.reward_names:
                scores[name].append(part[name][:b - a])
        local = np.stack([np.concatenate(scores[n]).reshape(p, m) for n in self.reward_names])
        return parallel.gather_rows(local, self.mesh, self.prompts_per_iteration, axis=1,
                                    rules=self.rules)

    def save(self, workdir: str, policy, metadata: dict) -> None:
        """The Orbax checkpoint the loop writes is the FLUX task's output (`evaluate` loads
        it); a 12B transformer is not written a second time."""
        del workdir, policy, metadata
        return None
