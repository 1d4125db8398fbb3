"""LoRA adapters (models.lora): zero B is the base exactly, gradients reach only the adapters,
diffusers reads our exported adapters (parity), merged weight files, sharded = unsharded."""

import json

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from g2rpo_jax import parallel
from g2rpo_jax.models import flux, flux_weights, lora, safetensors_io
from g2rpo_jax.testing import flux_reference as ref

SHAPE = dict(num_layers=2, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
             joint_attention_dim=32, pooled_projection_dim=16, in_channels=16,
             axes_dims_rope=(4, 6, 6))
CFG = lora.LoRAConfig(rank=4, alpha=8.0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("flux"))
    return directory, ref.write_diffusers_flux(directory, seed=3, **SHAPE)


def _inputs():
    return ref.random_inputs(ref.tiny_diffusers_config(**SHAPE))


def _randomize_b(model, seed=1):
    """Nonzero B everywhere (the adapted outputs then differ from the base's)."""
    state = nnx.state(model, lora.LoRAParam)
    flat = []
    for i, (path, variable) in enumerate(nnx.to_flat_state(state)):
        if path[-1] == "lora_b":
            value = 0.2 * jax.random.normal(jax.random.key(seed * 1000 + i), variable.shape)
            variable = variable.replace(jax.device_put(value, variable[...].sharding))
        flat.append((path, variable))
    nnx.update(model, nnx.from_flat_state(flat))
    return model


def test_zero_b_is_the_base_exactly(checkpoint):
    directory, _ = checkpoint
    model = flux_weights.from_pretrained(directory)
    base = np.asarray(model(**_inputs()))
    lora.apply(model, CFG, 0)
    np.testing.assert_array_equal(np.asarray(model(**_inputs())), base)
    _randomize_b(model)
    assert np.abs(np.asarray(model(**_inputs())) - base).max() > 1e-3


def test_adapters_carry_logical_axes_and_config_checks():
    model = lora.apply(flux.Flux(flux.FluxConfig(**SHAPE), rngs=nnx.Rngs(0)), CFG, 0)
    a = model.double_blocks.img_attn.q.lora_a
    b = model.double_blocks.img_mlp.fc1.lora_b
    assert a.get_metadata()["logical_axes"] == ("layers", "embed", None) and a.shape == (2, 32, 4)
    assert b.get_metadata()["logical_axes"] == ("layers", None, "mlp") and b.shape == (2, 4, 128)
    assert len(lora.targets_in(model)) == len(lora.TARGETS)
    with pytest.raises(ValueError, match="Unknown model.lora.targets"):
        lora.LoRAConfig(rank=2, targets=("double_blocks.img_mod.lin",))
    with pytest.raises(ValueError, match="dropout"):
        lora.LoRAConfig(rank=2, dropout=0.1)


def test_gradients_reach_only_the_adapters(checkpoint):
    directory, _ = checkpoint
    model = lora.apply(flux_weights.from_pretrained(directory), CFG, 0)
    graphdef, adapters, frozen = nnx.split(model, lora.LoRAParam, ...)
    optimizer = optax.adamw(1e-2)
    opt_state = optimizer.init(adapters)
    assert (len(jax.tree.leaves(opt_state[0].mu)) == len(jax.tree.leaves(adapters)) ==
            2 * len(lora.TARGETS))
    inputs = _inputs()

    def loss_fn(adapters, frozen):
        return jnp.mean(nnx.merge(graphdef, adapters, frozen)(**inputs) ** 2)

    grads = jax.grad(loss_fn)(adapters, frozen)
    updates, _ = optimizer.update(grads, opt_state, adapters)
    new_adapters = optax.apply_updates(adapters, updates)
    # B starts at zero, so A's gradient is zero at the first step; B's is not.
    changed = [not np.array_equal(x, y) for x, y in
               zip(jax.tree.leaves(new_adapters), jax.tree.leaves(adapters))]
    assert sum(changed) >= len(lora.TARGETS)
    model2 = nnx.merge(graphdef, new_adapters, frozen)
    _, frozen2 = nnx.split(model2, lora.LoRAParam, ...)[1:]
    for x, y in zip(jax.tree.leaves(frozen2), jax.tree.leaves(frozen)):
        assert x is y or np.array_equal(x, y)
    assert loss_fn(new_adapters, frozen) != loss_fn(adapters, frozen)


def test_a_bfloat16_base_trains_float32_adapters():
    """The frozen base may be stored in bf16 (`model.param_dtype`); the adapters stay float32,
    zero B still gives the base's outputs exactly, and their gradients are float32."""
    cfg = flux.FluxConfig(**SHAPE, dtype="bfloat16", param_dtype="bfloat16")
    model = flux.Flux(cfg, rngs=nnx.Rngs(0))
    inputs = _inputs()
    base = np.asarray(model(**inputs).astype(jnp.float32))
    lora.apply(model, CFG, 0)
    graphdef, adapters, frozen = nnx.split(model, lora.LoRAParam, ...)
    assert {x.dtype for x in jax.tree.leaves(frozen) if x.ndim > 1} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves(adapters)} == {jnp.dtype(jnp.float32)}
    np.testing.assert_array_equal(np.asarray(model(**inputs).astype(jnp.float32)), base)

    def loss_fn(adapters):
        return jnp.mean(nnx.merge(graphdef, adapters, frozen)(**inputs).astype(jnp.float32) ** 2)

    grads = jax.grad(loss_fn)(adapters)
    b_grads = [np.asarray(g[...]) for path, g in nnx.to_flat_state(grads) if path[-1] == "lora_b"]
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))
    assert len(b_grads) == len(lora.TARGETS) and all(np.isfinite(g).all() for g in b_grads)
    assert sum(np.abs(g).max() > 0 for g in b_grads) >= len(lora.TARGETS) // 2


def test_diffusers_reads_our_adapters(checkpoint, tmp_path):
    """diffusers' load_lora_adapter (PEFT) on our exported file gives our outputs."""
    directory, torch_model = checkpoint
    import copy

    model = _randomize_b(lora.apply(flux_weights.from_pretrained(directory), CFG, 0))
    inputs = _inputs()
    ours = np.asarray(model(**inputs))
    path = lora.save_peft(tmp_path / "adapter.safetensors", model)
    adapted = copy.deepcopy(torch_model)
    adapted.load_lora_adapter(str(path), prefix="transformer")
    expected = ref.diffusers_forward(adapted, inputs)
    base = ref.diffusers_forward(torch_model, inputs)
    err = np.abs(ours - expected).max()
    print(f"LoRA parity with diffusers: max abs err {err:.2e}; adapter effect "
          f"{np.abs(expected - base).max():.2e}")
    assert np.abs(expected - base).max() > 1e-2   # the adapter was applied
    assert err <= 1e-4
    # And back into our model: the same adapters.
    reloaded = lora.load_peft(path, lora.apply(flux_weights.from_pretrained(directory), CFG, 5))
    np.testing.assert_allclose(np.asarray(reloaded(**inputs)), ours, atol=1e-5)


def test_pipeline_load_lora_weights_reads_our_file(checkpoint, tmp_path):
    """FluxLoraLoaderMixin.lora_state_dict (what pipe.load_lora_weights reads) accepts it."""
    directory, _ = checkpoint
    from diffusers import FluxPipeline

    model = _randomize_b(lora.apply(flux_weights.from_pretrained(directory), CFG, 0))
    lora.save_peft(tmp_path / "pytorch_lora_weights.safetensors", model)
    state_dict, metadata = FluxPipeline.lora_state_dict(str(tmp_path), return_lora_metadata=True)
    assert all(k.startswith("transformer.") for k in state_dict)
    assert metadata["transformer.r"] == CFG.rank and metadata["transformer.lora_alpha"] == CFG.rank


@pytest.mark.parametrize("layout", ["diffusers", "bfl"])
def test_merged_model_written_out_equals_adapted_model(checkpoint, tmp_path, layout):
    """Adapters folded in (`merge`) and written in a public layout (as `export` does): our
    loader and, for diffusers, diffusers itself compute the adapted model's outputs."""
    directory, _ = checkpoint
    model = _randomize_b(lora.apply(flux_weights.from_pretrained(directory), CFG, 0))
    inputs = _inputs()
    expected = np.asarray(model(**inputs))
    merged = lora.merge(model)
    assert not lora.targets_in(merged) and not jax.tree.leaves(nnx.state(merged, lora.LoRAParam))
    np.testing.assert_allclose(np.asarray(merged(**inputs)), expected, atol=1e-5)
    out = tmp_path / ("diffusion_pytorch_model.safetensors" if layout == "diffusers"
                      else "flux1-tiny.safetensors")
    with open(out, "wb") as f:
        safetensors_io.stream_safetensors(
            f, flux_weights.stored_tensors(merged, layout, "float32"))
    if layout == "diffusers":
        (tmp_path / "config.json").write_text(json.dumps(
            flux_weights.diffusers_config(merged.cfg)))
    loaded = flux_weights.from_pretrained(tmp_path if layout == "diffusers" else out,
                                          **({} if layout == "diffusers" else
                                             {"axes_dims_rope": SHAPE["axes_dims_rope"]}))
    np.testing.assert_allclose(np.asarray(loaded(**inputs)), expected, atol=1e-5)
    if layout == "diffusers":   # diffusers itself reads the merged folder
        import diffusers

        theirs = diffusers.FluxTransformer2DModel.from_pretrained(str(tmp_path)).eval()
        np.testing.assert_allclose(ref.diffusers_forward(theirs, inputs), expected, atol=1e-4)


def test_sharded_equals_unsharded(checkpoint):
    directory, _ = checkpoint
    inputs = _inputs()
    plain = _randomize_b(lora.apply(flux_weights.from_pretrained(directory), CFG, 0))
    expected = np.asarray(plain(**inputs))
    mesh = parallel.make_mesh((2, 4, 1))
    model = flux_weights.from_pretrained(directory, mesh=mesh)
    _randomize_b(lora.apply(model, CFG, 0, mesh=mesh))
    a = model.double_blocks.img_attn.q.lora_a[...]
    assert a.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp")
    graphdef, state = nnx.split(model)
    batch = {k: (jax.device_put(v, parallel.batch_sharding(mesh, v.shape))
                 if k in ("img", "txt", "timesteps", "y", "guidance") else v)
             for k, v in inputs.items()}
    with jax.set_mesh(mesh):
        got = np.asarray(jax.jit(lambda s, x: nnx.merge(graphdef, s)(**x))(state, batch))
    np.testing.assert_allclose(got, expected, atol=1e-5)
