"""The text-to-image model bundle: FLUX transformer + text encoder + autoencoder.

The RL code only sees the transformer (`flux`) and a conditioning dict; this module turns
prompts into that dict and latents into images, so the embedded world (word encoder + pixel
packing) and the real stack (T5/CLIP + the FLUX autoencoder) sit behind one interface:

  generator = load_generator(path, mesh)    # or build_generator(config, mesh)
  cond = generator.encode(prompts)          # {"txt" [P,T,D], "y" [P,Dy], "txt_ids", "img_ids"}
  images = generator.decode(latents)        # latents [..., N, C] → images [..., H, W, 3]

A generator is saved as one self-describing safetensors file (`state_io`): the transformer
under "flux.", the text encoder under "text_encoder.", and a JSON config that rebuilds both.
"""

from collections.abc import Sequence
import dataclasses
import os

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from g2rpo_jax import parallel
from g2rpo_jax.data import world
from g2rpo_jax.models import flux, packing, state_io, word_encoder

# The base generator shipped with the package (configs/shapes_pretrain.py; docs/results.md has
# its commands and scores).
SHIPPED_BASE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets",
                            "shapes_base.safetensors")


@dataclasses.dataclass
class Generator:
    """flux: the policy; text_encoder: frozen conditioning model; autoencoder: latents ↔ pixels."""

    flux: flux.Flux
    text_encoder: word_encoder.WordEncoder
    tokenizer: word_encoder.WordTokenizer
    autoencoder: packing.PixelAutoencoder
    config: dict          # {"flux": FluxConfig fields, "text_encoder": {...}, "image": {...}}

    @property
    def latent_shape(self) -> tuple[int, int]:
        return self.autoencoder.latent_shape

    def tokenize(self, prompts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        if not len(prompts):
            raise ValueError("No prompts to encode (an empty prompt list).")
        return self.tokenizer.encode(prompts)

    def encode(self, prompts: Sequence[str], mesh: jax.sharding.Mesh | None = None) -> dict:
        """Prompts → conditioning; with a mesh, per-prompt entries are split over its batch."""
        ids, mask = self.tokenize(prompts)
        cond = encode_tokens(self.text_encoder, jnp.asarray(ids), jnp.asarray(mask))
        cond["img_ids"] = self.autoencoder.image_ids()
        return parallel.place_cond(cond, mesh) if mesh is not None else cond

    def decode(self, latents: jax.Array) -> jax.Array:
        """[..., N, C] latents → [..., H, W, 3] images in [0, 1]."""
        lead = latents.shape[:-2]
        images = self.autoencoder.decode(latents.reshape(-1, *latents.shape[-2:]))
        return images.reshape(*lead, *images.shape[1:])


@jax.jit
def _encode(graphdef, state, ids, mask):
    return nnx.merge(graphdef, state)(ids, mask)


def encode_tokens(text_encoder: word_encoder.WordEncoder, ids: jax.Array, mask: jax.Array) -> dict:
    graphdef, state = nnx.split(text_encoder)
    return _encode(graphdef, state, ids, mask)


def generator_config(config) -> dict:
    """The bundle's JSON config from a run config's `model`, `text_encoder` and `world`."""
    flux_fields = dataclasses.asdict(flux.FluxConfig.from_dict(config.model.to_dict()))
    flux_fields["axes_dims_rope"] = list(flux_fields["axes_dims_rope"])
    return {"flux": flux_fields,
            "text_encoder": {"kind": "words", "vocabulary": world.word_vocabulary(),
                             "max_length": config.text_encoder.max_length},
            "image": {"size": config.world.image_size, "patch": config.world.patch}}


def architecture_differences(file_config: dict, expected: dict) -> list[str]:
    """Names of the fields in which two generator configs' architectures differ (execution
    settings such as the attention kernel or dtype are not architecture)."""
    def flat(gen_config):
        fields = {f"flux.{k}": v for k, v in
                  flux.FluxConfig.from_dict(gen_config["flux"]).architecture().items()}
        for section in ("text_encoder", "image"):
            fields.update({f"{section}.{k}": v for k, v in gen_config[section].items()})
        return fields
    a, b = flat(file_config), flat(expected)
    return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))


def _parts(gen_config: dict, execution: dict | None = None):
    cfg = flux.FluxConfig.from_dict(gen_config["flux"])
    cfg = dataclasses.replace(cfg, axes_dims_rope=tuple(cfg.axes_dims_rope), **(execution or {}))
    text = gen_config["text_encoder"]
    if text.get("kind") != "words":
        raise ValueError(f"Unknown text encoder kind {text.get('kind')!r}; this build has "
                         "'words' (the embedded world's word encoder).")
    tokenizer = word_encoder.WordTokenizer(text["vocabulary"], text["max_length"])
    image = gen_config["image"]
    autoencoder = packing.PixelAutoencoder(image["size"], image["size"], image["patch"])
    n, c = autoencoder.latent_shape
    if c != cfg.in_channels:
        raise ValueError(f"The autoencoder's {c} latent channels (patch {image['patch']}) do not "
                         f"match the transformer's in_channels {cfg.in_channels}.")

    def make_encoder(rngs):
        return word_encoder.WordEncoder(tokenizer.vocab_size, text["max_length"],
                                        cfg.joint_attention_dim, cfg.pooled_projection_dim,
                                        rngs=rngs)
    return cfg, tokenizer, autoencoder, make_encoder


def build_generator(config, mesh: jax.sharding.Mesh, seed: int = 0, rules=None) -> Generator:
    """A randomly initialised generator from a run config (the start of pre-training)."""
    gen_config = generator_config(config)
    cfg, tokenizer, autoencoder, make_encoder = _parts(gen_config)
    model = flux.init_sharded(cfg, mesh, seed, parallel.rules_from_config(rules))
    encoder = make_encoder(nnx.Rngs(seed + 1))
    return Generator(model, encoder, tokenizer, autoencoder, gen_config)


def save_generator(path, generator: Generator, metadata: dict | None = None):
    """Writes the bundle (atomically); `metadata` (JSON-able) is stored beside the config."""
    config = dict(generator.config, **(metadata or {}))
    return state_io.save(path, {"flux": nnx.state(generator.flux, nnx.Param),
                                "text_encoder": nnx.state(generator.text_encoder, nnx.Param)},
                         config)


def load_generator(path, mesh: jax.sharding.Mesh | None = None, rules=None,
                   **execution) -> Generator:
    """Loads a bundle written by `save_generator`; the transformer goes straight into its
    shardings on `mesh`. `execution`: FluxConfig execution fields (dtype, remat_policy, ...).

    Raises:
      FileNotFoundError: no file at path (names the pre-training command).
      CheckpointMismatchError: the tensors do not fit the stored config.
    """
    try:
        gen_config = state_io.read_config(path)
    except FileNotFoundError as e:
        raise FileNotFoundError(
            f"{e} A base generator is made by pre-training: python -m g2rpo_jax.main "
            "--config=configs/shapes_pretrain.py --workdir=DIR (writes DIR/generator.safetensors)."
        ) from None
    cfg, tokenizer, autoencoder, make_encoder = _parts(gen_config, execution)
    rules = parallel.rules_from_config(rules)
    graphdef, abstract = nnx.split(flux.abstract_model(cfg, rules))
    shardings = (parallel.state_shardings(abstract, mesh, rules) if mesh is not None else None)
    if mesh is not None:
        flux.validate_mesh(cfg, mesh)
    model = nnx.merge(graphdef, state_io.load(path, abstract, "flux", shardings))
    enc_graphdef, enc_abstract = nnx.split(nnx.eval_shape(lambda: make_encoder(nnx.Rngs(0))))
    encoder = nnx.merge(enc_graphdef, state_io.load(path, enc_abstract, "text_encoder"))
    return Generator(model, encoder, tokenizer, autoencoder, gen_config)
