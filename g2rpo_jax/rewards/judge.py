"""An out-of-domain learned judge for the embedded world: a small CLIP-style image/text model.

The verifier (`g2rpo_jax.rewards.verifier`) is the in-domain reward that RL trains on; this judge
plays the part of the paper's CLIP / PickScore rewards: a learned model of image–prompt
agreement that RL evaluation reports but never optimises, so reward hacking of the verifier
shows up as a gap between the two.

Model (`Judge`)
    image: a conv net (3×3 convolutions, GELU; the first at stride 1, the rest at stride 2, so a
        32 px image ends as a 4×4 grid), then the grid is flattened (it keeps *where* things
        are, which relations need), LayerNorm → Linear → GELU → Linear to `embed_dim`.
    text: word-token + learned position embeddings, `text_depth` pre-LayerNorm transformer
        blocks with padding-masked self-attention, a final LayerNorm, the masked mean over words
        and a Linear to `embed_dim`. Positions make it order-aware: "a red circle left of a blue
        square" and "a blue square left of a red circle" get different embeddings.
    Both embeddings are L2-normalised; `logit_scale` (learned, stored as its log) multiplies the
    cosine in the contrastive loss only.

Reward
    `similarity` is the cosine of an image's and a prompt's embeddings, in [−1, 1];
    `score = (cosine + 1) / 2`, in [0, 1] (`reward_from_similarity`). The figures measured on
    the shipped judge (retrieval accuracy, matching vs mismatched similarity) are stored in the
    file's config under "eval" (`state_io.read_config(DEFAULT_JUDGE_PATH)["eval"]`).

Files
    `save_judge` writes one safetensors file (`state_io`): the parameters under "judge." and a
    JSON config {"judge": JudgeConfig fields, ...extra} that rebuilds the module.
    `DEFAULT_JUDGE_PATH` is the judge shipped in the package (`g2rpo_jax/assets/`), made by
    `TRAIN_COMMAND`.
"""

from collections.abc import Mapping, Sequence
import dataclasses
import math
import os

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from g2rpo_jax.data import world
from g2rpo_jax.models import state_io
from g2rpo_jax.models.word_encoder import WordTokenizer

DEFAULT_JUDGE_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                  "assets", "judge.safetensors")
TRAIN_COMMAND = "python scripts/train_judge.py --out=g2rpo_jax/assets/judge.safetensors"
PREFIX = "judge"


@dataclasses.dataclass(frozen=True)
class JudgeConfig:
    """Sizes of the judge; the defaults are the shipped model's."""

    image_size: int = world.REFERENCE_CANVAS
    conv_channels: tuple[int, ...] = (16, 32, 64, 64)  # first at stride 1, the rest stride 2
    head_width: int = 128
    vocabulary: tuple[str, ...] = tuple(world.word_vocabulary())
    max_length: int = world.MAX_PROMPT_WORDS
    text_width: int = 64
    text_depth: int = 2
    text_heads: int = 4
    embed_dim: int = 64
    init_logit_scale: float = 10.0
    max_logit_scale: float = 100.0

    def __post_init__(self):
        if not self.conv_channels:
            raise ValueError("conv_channels may not be empty.")
        if self.image_size % self.grid_stride:
            raise ValueError(f"image_size {self.image_size} is not divisible by the conv net's "
                             f"stride {self.grid_stride} (conv_channels {self.conv_channels}).")
        if self.text_width % self.text_heads:
            raise ValueError(f"text_width {self.text_width} is not divisible by text_heads "
                             f"{self.text_heads}.")

    @property
    def grid_stride(self) -> int:
        return 2 ** (len(self.conv_channels) - 1)

    @property
    def grid(self) -> int:
        """Side of the conv net's output grid."""
        return self.image_size // self.grid_stride

    def to_dict(self) -> dict:
        fields = dataclasses.asdict(self)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in fields.items()}

    @classmethod
    def from_dict(cls, fields: Mapping) -> "JudgeConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(f"Unknown JudgeConfig field(s) {unknown}; the fields are "
                             f"{sorted(known)}.")
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})


def _linear(din: int, dout: int, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(din, dout, rngs=rngs)


def _normalise(x: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.maximum(jnp.sum(x * x, -1, keepdims=True), 1e-12))


def as_unit_images(images) -> jax.Array:
    """uint8 [0, 255] images → float32 in [0, 1]; float images are clipped to [0, 1]."""
    images = jnp.asarray(images)
    if images.dtype == jnp.uint8:
        return images.astype(jnp.float32) / 255.0
    return jnp.clip(images.astype(jnp.float32), 0.0, 1.0)


class TextBlock(nnx.Module):
    """Pre-LayerNorm transformer block: masked self-attention + GELU MLP (4× width)."""

    def __init__(self, width: int, heads: int, rngs: nnx.Rngs):
        self.heads = heads
        self.norm1 = nnx.LayerNorm(width, rngs=rngs)
        self.qkv = _linear(width, 3 * width, rngs)
        self.out = _linear(width, width, rngs)
        self.norm2 = nnx.LayerNorm(width, rngs=rngs)
        self.mlp_in = _linear(width, 4 * width, rngs)
        self.mlp_out = _linear(4 * width, width, rngs)

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        b, t, d = x.shape
        h = self.heads
        q, k, v = jnp.split(self.qkv(self.norm1(x)).reshape(b, t, 3, h, d // h), 3, axis=2)
        q, k, v = q[:, :, 0], k[:, :, 0], v[:, :, 0]  # [B, T, H, Dh]
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d // h)
        logits = jnp.where(mask[:, None, None, :], logits, -1e9)
        attn = jax.nn.softmax(logits, axis=-1)
        x = x + self.out(jnp.einsum("bhqk,bkhd->bqhd", attn, v).reshape(b, t, d))
        return x + self.mlp_out(jax.nn.gelu(self.mlp_in(self.norm2(x))))


class Judge(nnx.Module):
    """CLIP-style judge: `encode_image` and `encode_text` give L2-normalised [B, embed_dim]."""

    def __init__(self, cfg: JudgeConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        convs, cin = [], 3
        for i, cout in enumerate(cfg.conv_channels):
            convs.append(nnx.Conv(cin, cout, (3, 3), strides=1 if i == 0 else 2,
                                  padding="SAME", rngs=rngs))
            cin = cout
        self.convs = nnx.List(convs)
        flat = cfg.grid * cfg.grid * cin
        self.image_norm = nnx.LayerNorm(flat, rngs=rngs)
        self.image_hidden = _linear(flat, cfg.head_width, rngs)
        self.image_proj = _linear(cfg.head_width, cfg.embed_dim, rngs)

        init = nnx.initializers.normal(0.02)
        vocab_size = len(cfg.vocabulary) + 1  # id 0 is padding (WordTokenizer)
        self.token = nnx.Param(init(rngs.params(), (vocab_size, cfg.text_width)))
        self.position = nnx.Param(init(rngs.params(), (cfg.max_length, cfg.text_width)))
        self.blocks = nnx.List([TextBlock(cfg.text_width, cfg.text_heads, rngs)
                                for _ in range(cfg.text_depth)])
        self.text_norm = nnx.LayerNorm(cfg.text_width, rngs=rngs)
        self.text_proj = _linear(cfg.text_width, cfg.embed_dim, rngs)
        self.log_logit_scale = nnx.Param(jnp.asarray(math.log(cfg.init_logit_scale), jnp.float32))

    def logit_scale(self) -> jax.Array:
        return jnp.minimum(jnp.exp(self.log_logit_scale[...]), self.cfg.max_logit_scale)

    def encode_image(self, images) -> jax.Array:
        """images [B, H, W, 3] (float in [0, 1], or uint8) → L2-normalised [B, embed_dim]."""
        images = as_unit_images(images)
        size = self.cfg.image_size
        if images.ndim != 4 or images.shape[1:] != (size, size, 3):
            raise ValueError(f"Expected images [B, {size}, {size}, 3]; got shape "
                             f"{images.shape}.")
        x = images * 2.0 - 1.0
        for conv in self.convs:
            x = jax.nn.gelu(conv(x))
        x = self.image_norm(x.reshape(x.shape[0], -1))
        return _normalise(self.image_proj(jax.nn.gelu(self.image_hidden(x))))

    def encode_text(self, ids, mask) -> jax.Array:
        """ids, mask [B, T] (from `WordTokenizer.encode`) → L2-normalised [B, embed_dim]."""
        ids, mask = jnp.asarray(ids, jnp.int32), jnp.asarray(mask, bool)
        if ids.ndim != 2 or ids.shape != mask.shape or ids.shape[1] > self.cfg.max_length:
            raise ValueError(f"Expected ids and mask [B, T ≤ {self.cfg.max_length}]; got "
                             f"{ids.shape} and {mask.shape}.")
        x = self.token[...][ids] + self.position[...][None, :ids.shape[1]]
        for block in self.blocks:
            x = block(x, mask)
        m = mask.astype(jnp.float32)[..., None]
        pooled = (self.text_norm(x) * m).sum(1) / jnp.maximum(m.sum(1), 1.0)
        return _normalise(self.text_proj(pooled))


def num_params(judge: Judge) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(judge, nnx.Param)))


def make_tokenizer(cfg: JudgeConfig) -> WordTokenizer:
    return WordTokenizer(cfg.vocabulary, cfg.max_length)


def similarity(judge: Judge, images, ids, mask) -> jax.Array:
    """Cosine similarity [B] of images[i] and prompt i (ids, mask [B, T]), in [−1, 1]."""
    return jnp.sum(judge.encode_image(images) * judge.encode_text(ids, mask), -1)


def reward_from_similarity(cosine) -> jax.Array:
    """The judge's reward: (cosine + 1) / 2, in [0, 1]."""
    return (jnp.asarray(cosine, jnp.float32) + 1.0) / 2.0


def score(judge: Judge, images, ids, mask) -> jax.Array:
    """The reward [B] in [0, 1]: `reward_from_similarity(similarity(...))`."""
    return reward_from_similarity(similarity(judge, images, ids, mask))


def score_prompts(judge: Judge, tokenizer: WordTokenizer, images, prompts: Sequence[str]
                  ) -> np.ndarray:
    """Host convenience: images [B, H, W, 3] and B prompts → float32 [B] rewards."""
    if len(images) != len(prompts):
        raise ValueError(f"{len(images)} images but {len(prompts)} prompts.")
    ids, mask = tokenizer.encode(prompts)
    return np.asarray(score(judge, images, ids, mask), np.float32)


# ---------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------


def save_judge(path: str | os.PathLike, judge: Judge, extra: Mapping | None = None):
    """Writes the judge (atomically): parameters under "judge." and the JSON config
    {"judge": JudgeConfig fields, **extra} (`extra`: JSON-able, e.g. evaluation figures)."""
    config = {**dict(extra or {}), "judge": judge.cfg.to_dict()}
    return state_io.save(path, {PREFIX: nnx.state(judge, nnx.Param)}, config)


def load_judge(path: str | os.PathLike = DEFAULT_JUDGE_PATH) -> tuple[Judge, WordTokenizer]:
    """Loads a judge written by `save_judge` (default: the one shipped in the package).

    Raises:
      FileNotFoundError: no file at `path` (names the training command).
      CheckpointMismatchError: the tensors do not fit the stored config.
    """
    try:
        config = state_io.read_config(path)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{e} The judge is made by training it: {TRAIN_COMMAND} "
                                "(or --out=PATH for another file).") from None
    if "judge" not in config:
        raise ValueError(f"{path} holds no judge config (no 'judge' key in its metadata); it "
                         "was not written by g2rpo_jax.rewards.judge.save_judge.")
    cfg = JudgeConfig.from_dict(config["judge"])
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Judge(cfg, rngs=nnx.Rngs(0))))
    judge = nnx.merge(graphdef, state_io.load(path, abstract, PREFIX))
    return judge, make_tokenizer(cfg)


# ---------------------------------------------------------------------------------------------
# Reward function for jit
# ---------------------------------------------------------------------------------------------


@jax.jit
def _encode_text(graphdef, state, ids, mask):
    return nnx.merge(graphdef, state).encode_text(ids, mask)


def jax_judge_fn(judge: Judge, tokenizer: WordTokenizer, prompts_by_index: Sequence[str]):
    """→ reward(images [..., H, W, 3] in [0, 1] (or uint8), prompt_ids [...] int) → float32 [...]:
    `(cos(image, prompts_by_index[id]) + 1) / 2`, pure JAX (no host callback), so it may be
    jitted, vmapped and sharded like any array function. The prompts are tokenized and encoded
    here, once, into a [P, embed_dim] table gathered by id (unknown words raise ValueError now);
    ids outside [0, P) give NaN."""
    prompts = list(prompts_by_index)
    if not prompts:
        raise ValueError("No prompts (an empty prompts_by_index).")
    ids, mask = tokenizer.encode(prompts)
    graphdef, state = nnx.split(judge)
    table = _encode_text(graphdef, state, jnp.asarray(ids), jnp.asarray(mask))  # [P, E]
    size = judge.cfg.image_size

    def reward(images, prompt_ids):
        images = jnp.asarray(images)
        prompt_ids = jnp.asarray(prompt_ids, jnp.int32)
        if images.ndim < 4 or images.shape[-3:] != (size, size, 3):
            raise ValueError(f"Expected images [..., {size}, {size}, 3]; got shape "
                             f"{images.shape}.")
        if prompt_ids.shape != images.shape[:-3]:
            raise ValueError(f"prompt_ids shape {prompt_ids.shape} does not match the images' "
                             f"batch shape {images.shape[:-3]}.")
        flat_ids = prompt_ids.reshape(-1)
        emb = nnx.merge(graphdef, state).encode_image(images.reshape(-1, size, size, 3))
        text = table[jnp.clip(flat_ids, 0, len(prompts) - 1)]
        out = reward_from_similarity(jnp.sum(emb * text, -1))
        valid = (flat_ids >= 0) & (flat_ids < len(prompts))
        return jnp.where(valid, out, jnp.nan).reshape(prompt_ids.shape)

    return reward
