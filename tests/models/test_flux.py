"""FLUX transformer (models.flux) loaded by models.flux_weights: numeric parity with diffusers,
BFL loading, sharding, gradients, errors. One file for both: every parity case runs the
architecture on weights its loader placed."""

import dataclasses
import json
import os

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.torch import load_file, save_file
import torch

from g2rpo_jax import parallel
from g2rpo_jax.models import flux, flux_weights, weights
from g2rpo_jax.testing import flux_reference as ref

# Two different tiny shapes: (hidden 32, 2 heads, 2+2 blocks) and (hidden 32, 4 heads of 8,
# 1+3 blocks, other in/out and text widths) — the second also splits over tensor=4.
SHAPES = {
    "h2d16": dict(num_layers=2, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
                  joint_attention_dim=32, pooled_projection_dim=16, in_channels=16,
                  axes_dims_rope=(4, 6, 6)),
    "h4d8": dict(num_layers=1, num_single_layers=3, attention_head_dim=8, num_attention_heads=4,
                 joint_attention_dim=24, pooled_projection_dim=12, in_channels=8, out_channels=12,
                 axes_dims_rope=(2, 2, 4)),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(shape, guidance) → (diffusers folder, diffusers model), written by diffusers itself."""
    out = {}
    for seed, (name, shape) in enumerate(SHAPES.items()):
        for guidance in (True, False):
            directory = str(tmp_path_factory.mktemp(f"{name}_{guidance}"))
            model = ref.write_diffusers_flux(directory, seed=seed, guidance_embeds=guidance, **shape)
            out[name, guidance] = (directory, model)
    return out


def _call(model, inputs):
    return np.asarray(model(**inputs))


@pytest.mark.parametrize("guidance", [True, False])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_parity_with_diffusers(checkpoints, shape, guidance):
    directory, torch_model = checkpoints[shape, guidance]
    inputs = ref.random_inputs(ref.tiny_diffusers_config(guidance_embeds=guidance, **SHAPES[shape]),
                               guidance=guidance)
    expected = ref.diffusers_forward(torch_model, inputs)
    model = flux_weights.from_pretrained(directory)
    got = _call(model, inputs)
    err = np.abs(got - expected).max()
    print(f"parity {shape} guidance={guidance}: max abs err {err:.2e} (|out| max "
          f"{np.abs(expected).max():.2f})")
    assert got.shape == expected.shape
    assert err <= 1e-4


def test_per_sample_ids_match_shared_ids(checkpoints):
    directory, _ = checkpoints["h2d16", True]
    model = flux_weights.from_pretrained(directory)
    inputs = ref.random_inputs(ref.tiny_diffusers_config(**SHAPES["h2d16"]))
    batched = dict(inputs, img_ids=np.broadcast_to(inputs["img_ids"], (2, *inputs["img_ids"].shape)),
                   txt_ids=np.broadcast_to(inputs["txt_ids"], (2, *inputs["txt_ids"].shape)))
    np.testing.assert_allclose(_call(model, batched), _call(model, inputs), atol=1e-6)


def test_bfl_layout_is_what_diffusers_converter_reads(checkpoints):
    """Our BFL re-pack, converted back by diffusers' own converter, is the original state dict."""
    _, torch_model = checkpoints["h2d16", True]
    cfg = torch_model.config
    bfl = ref.diffusers_to_bfl(torch_model.state_dict(), cfg.num_layers, cfg.num_single_layers)
    converted = ref.diffusers_bfl_converter(cfg.num_attention_heads * cfg.attention_head_dim)(dict(bfl))
    original = torch_model.state_dict()
    assert set(converted) == set(original)
    for key, value in original.items():
        torch.testing.assert_close(converted[key], value, rtol=0, atol=0)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_bfl_single_file_parity(checkpoints, tmp_path, shape):
    _, torch_model = checkpoints[shape, True]
    path = str(tmp_path / "flux1-tiny.safetensors")
    ref.write_bfl_flux(path, torch_model)
    kwargs = {} if SHAPES[shape]["attention_head_dim"] == 128 else {
        "axes_dims_rope": SHAPES[shape]["axes_dims_rope"]}
    model = flux_weights.from_pretrained(path, **kwargs)
    assert model.cfg.num_layers == torch_model.config.num_layers
    assert model.cfg.num_single_layers == torch_model.config.num_single_layers
    assert model.cfg.guidance_embeds
    inputs = ref.random_inputs(ref.tiny_diffusers_config(**SHAPES[shape]))
    err = np.abs(_call(model, inputs) - ref.diffusers_forward(torch_model, inputs)).max()
    print(f"BFL parity {shape}: max abs err {err:.2e}")
    assert err <= 1e-4


def test_sharded_index_folder(checkpoints, tmp_path):
    """A diffusers folder split into several safetensors shards with an index loads the same."""
    directory, torch_model = checkpoints["h2d16", True]
    sharded = tmp_path / "transformer"
    torch_model.save_pretrained(sharded, max_shard_size="20KB")
    assert (sharded / "diffusion_pytorch_model.safetensors.index.json").exists()
    inputs = ref.random_inputs(ref.tiny_diffusers_config(**SHAPES["h2d16"]))
    # The parent folder (as in a full FLUX repo with transformer/ inside) is accepted too.
    np.testing.assert_array_equal(_call(flux_weights.from_pretrained(tmp_path), inputs),
                                  _call(flux_weights.from_pretrained(directory), inputs))


# (2, 2, 2) guards the modulation rule: its output split over `tensor` miscompiled there.
@pytest.mark.parametrize("mesh_shape", [(8, 1, 1), (2, 4, 1), (1, 2, 4), (2, 2, 2)])
def test_sharded_forward_matches_unsharded(checkpoints, mesh_shape):
    directory, _ = checkpoints["h4d8", True]
    inputs = ref.random_inputs(ref.tiny_diffusers_config(**SHAPES["h4d8"]), batch=8)
    expected = _call(flux_weights.from_pretrained(directory), inputs)

    mesh = parallel.make_mesh(mesh_shape)
    model = flux_weights.from_pretrained(directory, mesh=mesh)
    kernel = model.double_blocks.img_attn.q.kernel[...]
    data, fsdp, tensor = mesh_shape
    # [layers, embed, heads]: embed over fsdp, heads over tensor; each device holds 1/(fsdp·tensor).
    expected_spec = {(8, 1, 1): (), (2, 4, 1): (None, "fsdp"), (1, 2, 4): (None, "fsdp", "tensor"),
                     (2, 2, 2): (None, "fsdp", "tensor")}
    assert kernel.sharding.spec == jax.sharding.PartitionSpec(*expected_spec[mesh_shape])
    assert kernel.addressable_shards[0].data.size == kernel.size // (fsdp * tensor)

    graphdef, state = nnx.split(model)
    batch = {k: (jax.device_put(v, parallel.batch_sharding(mesh, v.shape))
                 if k in ("img", "txt", "timesteps", "y", "guidance") else v)
             for k, v in inputs.items()}

    @jax.jit
    def forward(state, batch):
        return nnx.merge(graphdef, state)(**batch)

    with jax.set_mesh(mesh):
        got = forward(state, batch)
    assert got.sharding.spec[0] is not None  # the batch stays split over data/fsdp
    err = np.abs(np.asarray(got) - expected).max()
    print(f"mesh {mesh_shape}: max abs err vs unsharded {err:.2e}")
    assert err <= 1e-5


def test_init_sharded_places_parameters(checkpoints):
    cfg = flux.FluxConfig.from_dict(ref.tiny_diffusers_config(**SHAPES["h4d8"]))
    mesh = parallel.make_mesh((1, 2, 4))
    model = flux.init_sharded(cfg, mesh, seed=1)
    kernel = model.single_blocks.mlp_in.kernel[...]
    assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor")
    inputs = ref.random_inputs(ref.tiny_diffusers_config(**SHAPES["h4d8"]), batch=8)
    assert np.isfinite(_call(model, inputs)).all()


def _loss_and_grads(model, inputs):
    graphdef, params = nnx.split(model)

    def loss(params):
        out = nnx.merge(graphdef, params)(**inputs)
        return jnp.mean(jnp.square(out - 0.5))

    return jax.jit(jax.value_and_grad(loss))(params)


@pytest.mark.parametrize("remat_policy", ["none", "full", "dots"])
def test_grads_scanned_match_unscanned(checkpoints, remat_policy):
    directory, _ = checkpoints["h2d16", True]
    inputs = ref.random_inputs(ref.tiny_diffusers_config(**SHAPES["h2d16"]))
    scanned = flux_weights.from_pretrained(directory, remat_policy=remat_policy)
    unrolled = flux_weights.from_pretrained(directory, scan_layers=False)
    loss_s, grads_s = _loss_and_grads(scanned, inputs)
    loss_u, grads_u = _loss_and_grads(unrolled, inputs)
    np.testing.assert_allclose(loss_s, loss_u, rtol=1e-6)
    leaves_s, leaves_u = jax.tree.leaves(grads_s), jax.tree.leaves(grads_u)
    assert all(np.isfinite(g).all() for g in leaves_s)
    assert sum(float(jnp.abs(g).sum()) for g in leaves_s) > 0
    for gs, gu in zip(leaves_s, leaves_u, strict=True):
        np.testing.assert_allclose(gs, gu, rtol=1e-4, atol=1e-6)


def test_grad_matches_finite_difference(checkpoints):
    """Directional derivative along a random direction in parameter space, float64-free check."""
    directory, _ = checkpoints["h2d16", True]
    inputs = ref.random_inputs(ref.tiny_diffusers_config(**SHAPES["h2d16"]))
    model = flux_weights.from_pretrained(directory)
    graphdef, params = nnx.split(model)

    def loss(params):
        return jnp.mean(jnp.square(nnx.merge(graphdef, params)(**inputs) - 0.5))

    _, grads = jax.jit(jax.value_and_grad(loss))(params)
    keys = jax.random.split(jax.random.key(0), len(jax.tree.leaves(params)))
    direction = jax.tree.unflatten(jax.tree.structure(params), [
        jax.random.normal(k, p.shape) for k, p in zip(keys, jax.tree.leaves(params), strict=True)])
    eps = 1e-3
    shifted = lambda s: jax.tree.map(lambda p, d: p + s * eps * d, params, direction)
    fd = (loss(shifted(1.0)) - loss(shifted(-1.0))) / (2 * eps)
    analytic = sum(jnp.vdot(g, d) for g, d in
                   zip(jax.tree.leaves(grads), jax.tree.leaves(direction), strict=True))
    np.testing.assert_allclose(float(analytic), float(fd), rtol=2e-2)


def test_bfloat16_compute_stays_close(checkpoints):
    directory, torch_model = checkpoints["h2d16", True]
    inputs = ref.random_inputs(ref.tiny_diffusers_config(**SHAPES["h2d16"]))
    expected = ref.diffusers_forward(torch_model, inputs)
    got = _call(flux_weights.from_pretrained(directory, dtype="bfloat16"), inputs)
    assert got.dtype == jnp.bfloat16
    rel = np.abs(got.astype(np.float32) - expected).max() / np.abs(expected).max()
    assert rel < 5e-2


def test_flux_dev_parameter_count():
    count = flux.count_params(flux.FluxConfig())
    print(f"FLUX.1-dev parameters: {count:,}")
    assert 11.8e9 < count < 12.0e9


# ------------------------------------------------------------------------------- bad inputs


def _edited_copy(checkpoints, tmp_path, edit):
    """A copy of the tiny diffusers checkpoint with its state dict passed through `edit`."""
    directory, _ = checkpoints["h2d16", True]
    broken = tmp_path / "broken"
    broken.mkdir()
    state = load_file(os.path.join(directory, "diffusion_pytorch_model.safetensors"))
    edit(state)
    save_file(state, broken / "diffusion_pytorch_model.safetensors")
    (broken / "config.json").write_text(open(os.path.join(directory, "config.json")).read())
    return broken


def test_missing_tensor_is_named(checkpoints, tmp_path):
    broken = _edited_copy(checkpoints, tmp_path,
                          lambda state: state.pop("transformer_blocks.1.attn.to_k.weight"))
    with pytest.raises(weights.CheckpointMismatchError,
                       match=r"missing tensor 'transformer_blocks\.1\.attn\.to_k\.weight'.*\(32, 32\)"):
        flux_weights.from_pretrained(broken)


def test_wrong_shape_names_both_shapes(checkpoints, tmp_path):
    broken = _edited_copy(checkpoints, tmp_path, lambda state: state.update(
        {"context_embedder.weight": torch.zeros(32, 31)}))
    with pytest.raises(weights.CheckpointMismatchError,
                       match=r"'context_embedder\.weight' has shape \(32, 31\).*needs \(32, 32\)"):
        flux_weights.from_pretrained(broken)


def test_config_mismatch_reports_unused_tensors(checkpoints, tmp_path):
    directory, _ = checkpoints["h2d16", True]
    config = json.loads(open(os.path.join(directory, "config.json")).read())
    config["num_layers"] = 1
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps(config))
    os.symlink(os.path.join(directory, "diffusion_pytorch_model.safetensors"),
               other / "diffusion_pytorch_model.safetensors")
    with pytest.raises(weights.CheckpointMismatchError, match=r"not used by the model.*transformer_blocks\.1"):
        flux_weights.from_pretrained(other)


def test_missing_checkpoint_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="No FLUX checkpoint"):
        flux_weights.from_pretrained(tmp_path / "nowhere")


def test_mesh_that_does_not_divide_devices():
    with pytest.raises(parallel.MeshError, match="3 positions but there are 8 devices"):
        parallel.make_mesh((3, 1, 1))


def test_heads_not_divisible_by_tensor(checkpoints):
    directory, _ = checkpoints["h2d16", True]  # 2 heads
    mesh = parallel.make_mesh((2, 1, 4))
    with pytest.raises(ValueError, match=r"num_attention_heads=2 is not divisible .* tensor axis \(4\)"):
        flux_weights.from_pretrained(directory, mesh=mesh)


def test_guidance_required_and_refused(checkpoints):
    with_g = flux_weights.from_pretrained(checkpoints["h2d16", True][0])
    without_g = flux_weights.from_pretrained(checkpoints["h2d16", False][0])
    inputs = ref.random_inputs(ref.tiny_diffusers_config(**SHAPES["h2d16"]))
    with pytest.raises(ValueError, match="pass guidance"):
        with_g(**dict(inputs, guidance=None))
    with pytest.raises(ValueError, match="guidance_embeds=False"):
        without_g(**inputs)


def test_config_validation():
    with pytest.raises(ValueError, match="must sum to attention_head_dim"):
        flux.FluxConfig(axes_dims_rope=(16, 56, 48))
    with pytest.raises(ValueError, match="remat_policy"):
        flux.FluxConfig(remat_policy="sometimes")
    with pytest.raises(ValueError, match="patch_size must be 1"):
        flux.FluxConfig.from_dict({"patch_size": 2})
    assert dataclasses.replace(flux.FluxConfig(), dtype="bfloat16").hidden_size == 3072
