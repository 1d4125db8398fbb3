"""Shared pieces of the ml_collections configs in `configs/` (big_vision's `common` role).

A config file's `get_config()` starts from `base_config()` and overrides fields; code reads the
fields and never branches on a config's name.
"""

import dataclasses

import ml_collections

from g2rpo_jax.models import flux
from g2rpo_jax.parallel import sharding


def flux_model_config(**overrides) -> ml_collections.ConfigDict:
    """The FLUX transformer section; defaults are FLUX.1-dev (12B)."""
    fields = dataclasses.asdict(flux.FluxConfig())
    fields["axes_dims_rope"] = tuple(fields["axes_dims_rope"])
    fields.update(overrides)
    model = ml_collections.ConfigDict(fields)
    # A diffusers transformer/ folder, a model folder containing it, or a BFL single file;
    # empty = random initialisation.
    model.checkpoint = ""
    return model


def to_flux_config(model_config) -> flux.FluxConfig:
    """FluxConfig from a config's `model` section (extra keys such as `checkpoint` ignored)."""
    return flux.FluxConfig.from_dict(model_config.to_dict())


def base_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.seed = 0
    # What `main` does. "describe": build the mesh and model, report parameters and shardings,
    # optionally time a forward pass. Later modes: train, pretrain, evaluate.
    config.mode = "describe"
    config.model = flux_model_config()

    # Mesh over all devices; one axis may be -1 ("the rest").
    config.mesh = ml_collections.ConfigDict(
        dict(data=-1, fsdp=1, tensor=1, axis_types="auto"))
    config.sharding_rules = [list(rule) for rule in sharding.DEFAULT_RULES]
    # Multi-process jobs (TPU pods): jax.distributed.initialize(); on TPU the other fields
    # can stay empty (discovered from the environment).
    config.distributed = ml_collections.ConfigDict(
        dict(enabled=False, coordinator_address="", num_processes=-1, process_id=-1))

    # mode=describe: the dummy batch used to time one forward pass.
    config.describe = ml_collections.ConfigDict(dict(
        forward=True, batch_size=-1, image_tokens=256, text_tokens=32, num_runs=3,
        # Parameter lines printed (largest first); 0 = none, -1 = all.
        max_param_lines=20))
    return config
