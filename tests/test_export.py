"""Export (`python -m g2rpo_jax.export`): a trained transformer written as diffusers' and BFL's
layouts, read back by diffusers itself (from_pretrained, the single-file loader, FluxPipeline)
and by our loader; LoRA runs merged; and the bad inputs (another model, an existing folder, a
full disk, an unknown format)."""

import errno
import json
import os
import subprocess
import sys

from diffusers import FluxPipeline, FluxTransformer2DModel
from diffusers.loaders import single_file_model
from flax import nnx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.torch import load_file
import torch

from g2rpo_jax import export, parallel
from g2rpo_jax.models import flux, flux_weights, lora, safetensors_io
from g2rpo_jax.rl import policy_update
from g2rpo_jax.run import checkpoint as checkpoint_lib
from g2rpo_jax.run import config_lib
from g2rpo_jax.testing import flux_fixture
from g2rpo_jax.testing import flux_reference as ref

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MESH_SHAPE = {"data": 2, "fsdp": 4, "tensor": 1}
# The two tiny shapes of tests/models/test_flux.py: guidance and square in/out; no guidance,
# out_channels != in_channels, 1 + 3 blocks.
SHAPES = {
    "h2d16": dict(num_layers=2, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
                  joint_attention_dim=32, pooled_projection_dim=16, in_channels=16,
                  axes_dims_rope=(4, 6, 6)),
    "h4d8": dict(num_layers=1, num_single_layers=3, attention_head_dim=8, num_attention_heads=4,
                 joint_attention_dim=24, pooled_projection_dim=12, in_channels=8, out_channels=12,
                 axes_dims_rope=(2, 2, 4), guidance_embeds=False),
}


@pytest.fixture(scope="module")
def mesh():
    return parallel.make_mesh(MESH_SHAPE)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """The tiny FLUX.1-dev folder (every pipeline component), written by diffusers."""
    return flux_fixture.write_tiny_flux_dev(str(tmp_path_factory.mktemp("flux")))


def tiny_config(base_dir: str, **fields):
    return config_lib.load_config("flux_tiny.py", **{
        "model.checkpoint": base_dir, **{f"mesh.{k}": v for k, v in MESH_SHAPE.items()},
        **fields})


def perturb(model: flux.Flux, seed: int, variables=nnx.Param) -> None:
    """Moves every parameter (as a run would), so an export of the base could not pass."""
    state = nnx.state(model, variables)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    moved = [x + 0.01 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    nnx.update(model, jax.tree.unflatten(treedef, moved))


def save_run(workdir: str, params, config, step: int = 3) -> None:
    """A run's Orbax checkpoint (checkpoint.RunCheckpoints, as mode=train writes it)."""
    state = policy_update.TrainState(params=params, opt_state={"count": jnp.zeros((), jnp.int32)},
                                     ref_params=None, step=jnp.asarray(step, jnp.int32))
    run = checkpoint_lib.RunCheckpoints(workdir, async_save=False)
    run.save(step, state, jax.random.key(0), {"iteration": step}, config, wait=True)
    run.close()


@pytest.fixture(scope="module")
def trained(base, mesh, tmp_path_factory):
    """(config, workdir, the trained model): a full fine-tune's checkpoint at iteration 3."""
    config = tiny_config(base)
    model = flux_weights.from_pretrained(os.path.join(base, "transformer"), mesh=mesh)
    perturb(model, seed=1)
    workdir = str(tmp_path_factory.mktemp("run"))
    save_run(workdir, nnx.state(model), config)
    return config, workdir, model


def _forward(model, cfg: dict, seed: int = 0) -> tuple[np.ndarray, dict]:
    inputs = ref.random_inputs(cfg, guidance=cfg.get("guidance_embeds", True), seed=seed)
    return np.asarray(model(**inputs)), inputs


def _flat(model) -> dict:
    flat, _ = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(model)))
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in flat}


# ---------------------------------------------------------------------------------------------
# The streamed file and the key maps backwards.


def test_streamed_file_reads_back_in_the_safetensors_library(tmp_path):
    values = {"b.weight": np.arange(6.0).reshape(2, 3), "a": np.ones(5), "z": np.zeros((0, 4))}
    dtypes = {"b.weight": ml_dtypes.bfloat16, "a": np.float32, "z": np.float16}
    produced = []
    specs = [safetensors_io.TensorSpec(k, v.shape, np.dtype(dtypes[k]),
                                       lambda k=k, v=v: produced.append(k) or v)
             for k, v in values.items()]
    path = tmp_path / "x.safetensors"
    with open(path, "wb") as f:
        written = safetensors_io.stream_safetensors(f, specs, {"format": "pt"})
    assert written == path.stat().st_size
    assert produced == list(values)        # each produced once, in order
    loaded = load_file(path)
    assert loaded["b.weight"].dtype == torch.bfloat16 and loaded["z"].dtype == torch.float16
    for key, value in values.items():
        np.testing.assert_array_equal(loaded[key].float().numpy(), value)
    bad = [safetensors_io.TensorSpec("w", (2, 2), np.dtype(np.float32), lambda: np.ones(3))]
    with pytest.raises(safetensors_io.SafetensorsError, match=r"'w'.*shape \(3,\).*\(2, 2\)"):
        with open(tmp_path / "bad.safetensors", "wb") as f:
            safetensors_io.stream_safetensors(f, bad)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_stored_tensors_are_the_public_state_dicts(shape, tmp_path):
    """Our weights out, key by key, equal diffusers' own state dict and its BFL re-pack
    (flux_reference.diffusers_to_bfl, checked against diffusers' converter in test_flux)."""
    torch_model = ref.write_diffusers_flux(str(tmp_path), seed=3, **SHAPES[shape])
    model = flux_weights.from_pretrained(str(tmp_path))
    cfg = torch_model.config
    expected = {"diffusers": {k: v.numpy() for k, v in torch_model.state_dict().items()},
                "bfl": {k: v.numpy() for k, v in ref.diffusers_to_bfl(
                    torch_model.state_dict(), cfg.num_layers, cfg.num_single_layers).items()}}
    for layout, state_dict in expected.items():
        specs = flux_weights.stored_tensors(model, layout, "float32")
        assert sorted(s.key for s in specs) == sorted(state_dict), layout
        for spec in specs:
            np.testing.assert_array_equal(spec.produce(), state_dict[spec.key],
                                          err_msg=f"{layout} {spec.key}")


def test_layouts_that_cannot_carry_the_architecture_are_refused():
    cfg = flux.FluxConfig(**SHAPES["h2d16"], mlp_ratio=2.0)
    with pytest.raises(ValueError, match=r"diffusers FLUX layout fixes.*'mlp_ratio': 2\.0"):
        flux_weights.check_exportable(cfg, "diffusers")
    with pytest.raises(ValueError, match=r"Unknown FLUX weight layout 'comfy'.*'diffusers', 'bfl'"):
        flux_weights.check_exportable(flux.FluxConfig(**SHAPES["h2d16"]), "comfy")


def test_sizes_are_read_as_diffusers_writes_them():
    assert export.parse_size("10GB") == 10 * 10 ** 9
    assert export.parse_size("500MB") == 500 * 10 ** 6
    assert export.parse_size("2GiB") == 2 * 2 ** 30
    assert export.parse_size(1234) == 1234
    with pytest.raises(ValueError, match="Cannot read the size 'ten GB'"):
        export.parse_size("ten GB")


# ---------------------------------------------------------------------------------------------
# Round trips: diffusers, BFL through diffusers' single-file loader, ours.


def test_diffusers_export_is_the_trained_model_in_diffusers(trained, base, mesh, tmp_path):
    """float32, sharded into several files with an index, plus the pipeline components: the
    folder loads in FluxTransformer2DModel.from_pretrained and FluxPipeline.from_pretrained and
    computes our outputs; our loader reads the weights back bit-exactly."""
    config, workdir, model = trained
    out = str(tmp_path / "export")
    report = export.export(config, workdir, out, mesh, config.sharding_rules, dtype="float32",
                           max_shard_size="40KB", pipeline="copy")
    folder = os.path.join(out, "transformer")
    index = json.load(open(os.path.join(folder, "diffusion_pytorch_model.safetensors.index.json")))
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards[0] == f"diffusion_pytorch_model-00001-of-{len(shards):05d}.safetensors"
    assert report["step"] == 3 and report["kind"] == "orbax" and report["tensors"] == len(
        index["weight_map"])
    assert json.load(open(os.path.join(out, "export.json")))["files"][-1] == "model_index.json"

    cfg = json.load(open(os.path.join(folder, "config.json")))
    expected, inputs = _forward(model, cfg)
    torch_model = FluxTransformer2DModel.from_pretrained(folder).eval()
    err = np.abs(ref.diffusers_forward(torch_model, inputs) - expected).max()
    print(f"diffusers from_pretrained of the export: max abs err {err:.2e} (|out| max "
          f"{np.abs(expected).max():.1f})")
    assert err <= 1e-4
    pipeline = FluxPipeline.from_pretrained(out)
    assert np.abs(ref.diffusers_forward(pipeline.transformer.eval(), inputs) - expected).max() <= 1e-4

    again = flux_weights.from_pretrained(out, mesh=mesh)
    got, want = _flat(again), _flat(model)
    assert got.keys() == want.keys()
    assert all(np.array_equal(got[k], want[k]) for k in want)


def test_bfl_export_loads_through_diffusers_single_file_loader(trained, mesh, tmp_path,
                                                               monkeypatch):
    config, workdir, model = trained
    out = str(tmp_path / "bfl")
    export.export(config, workdir, out, mesh, config.sharding_rules, fmt="bfl", dtype="float32",
                  name="flux1-tiny")
    path = os.path.join(out, "flux1-tiny.safetensors")
    assert sorted(os.listdir(out)) == ["export.json", "flux1-tiny.safetensors"]
    # diffusers' BFL converter has FLUX.1's width 3072 in its code; the same code with the
    # tiny width (flux_reference.diffusers_bfl_converter) converts the tiny file.
    monkeypatch.setitem(single_file_model.SINGLE_FILE_LOADABLE_CLASSES["FluxTransformer2DModel"],
                        "checkpoint_mapping_fn", ref.diffusers_bfl_converter(model.cfg.hidden_size))
    torch_model = FluxTransformer2DModel.from_single_file(
        path, config=config.model.checkpoint, subfolder="transformer", local_files_only=True,
        torch_dtype=torch.float32).eval()
    cfg = dict(torch_model.config)
    expected, inputs = _forward(model, cfg, seed=1)
    err = np.abs(ref.diffusers_forward(torch_model, inputs) - expected).max()
    print(f"diffusers from_single_file of the BFL export: max abs err {err:.2e}")
    assert err <= 1e-4
    # A BFL file has no config; the tiny model's RoPE axes are not FLUX.1's, so they are given.
    again = flux_weights.from_pretrained(path, mesh=mesh, axes_dims_rope=model.cfg.axes_dims_rope)
    got, want = _flat(again), _flat(model)
    assert all(np.array_equal(got[k], want[k]) for k in want)


def test_bfloat16_export_is_the_rounded_weights(trained, mesh, tmp_path):
    """The default dtype: every stored value is the float32 weight rounded to bfloat16, and the
    folder is one file (no index) at the default shard size."""
    config, workdir, model = trained
    out = str(tmp_path / "bf16")
    export.export(config, workdir, out, mesh, config.sharding_rules)
    folder = os.path.join(out, "transformer")
    assert sorted(os.listdir(folder)) == ["config.json", "diffusion_pytorch_model.safetensors"]
    stored = safetensors_io.SafetensorsCheckpoint(folder)
    specs = flux_weights.stored_tensors(model, "diffusers", "float32")
    for spec in specs:
        assert stored.dtype(spec.key) == np.dtype(ml_dtypes.bfloat16)
        np.testing.assert_array_equal(np.asarray(stored.array(spec.key)),
                                      spec.produce().astype(ml_dtypes.bfloat16))


def test_lora_run_exports_the_merged_model(base, mesh, tmp_path):
    """A LoRA run's checkpoint holds the adapters only: the export merges them into the base
    from model.checkpoint, and diffusers computes the adapted model's outputs."""
    config = tiny_config(base, **{"model.lora.rank": 4, "model.lora.alpha": 8.0})
    model = flux_weights.from_pretrained(os.path.join(base, "transformer"), mesh=mesh)
    lora.from_config(model, config.model, config.seed, mesh)
    perturb(model, seed=2, variables=nnx.LoRAParam)   # B away from zero
    save_run(str(tmp_path / "run"), nnx.state(model, nnx.LoRAParam), config)
    out = str(tmp_path / "export")
    export.export(config, str(tmp_path / "run"), out, mesh, config.sharding_rules,
                  dtype="float32")
    cfg = json.load(open(os.path.join(out, "transformer", "config.json")))
    expected, inputs = _forward(model, cfg)
    base_out, _ = _forward(flux_weights.from_pretrained(os.path.join(base, "transformer")), cfg)
    assert np.abs(expected - base_out).max() > 1e-3   # the adapters change the outputs
    torch_model = FluxTransformer2DModel.from_pretrained(os.path.join(out, "transformer")).eval()
    assert np.abs(ref.diffusers_forward(torch_model, inputs) - expected).max() <= 1e-4


def test_a_pretrained_transformer_converts_between_layouts(base, mesh, tmp_path):
    """--checkpoint may be a diffusers folder: the export is then a conversion (here to BFL),
    equal to the BFL re-pack of diffusers' own state dict."""
    config = tiny_config(base)
    out = str(tmp_path / "bfl")
    report = export.export(config, os.path.join(base, "transformer"), out, mesh,
                           config.sharding_rules, fmt="bfl", dtype="float32")
    assert report["kind"] == "pretrained"
    torch_model = FluxTransformer2DModel.from_pretrained(os.path.join(base, "transformer"))
    cfg = torch_model.config
    expected = ref.diffusers_to_bfl(torch_model.state_dict(), cfg.num_layers,
                                    cfg.num_single_layers)
    got = load_file(os.path.join(out, "flux1-g2rpo.safetensors"))
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k]) for k in expected)


# ---------------------------------------------------------------------------------------------
# Bad input.


def test_checkpoint_of_another_model_names_the_parameters_and_fields(trained, mesh, tmp_path):
    config, workdir, _ = trained
    other = ref.write_diffusers_flux(str(tmp_path / "other"), seed=0, **dict(
        flux_fixture.TRANSFORMER, num_single_layers=3))
    del other
    wrong = tiny_config(str(tmp_path / "other"), **{"model.num_single_layers": 3})
    with pytest.raises(checkpoint_lib.CheckpointError, match=(
            r"(?s)belongs to another model:\n.*single_blocks.*\(2, .*model\.num_single_layers: 2 "
            r"in the checkpoint, 3 now")) as raised:
        export.export(wrong, workdir, str(tmp_path / "out"), mesh, wrong.sharding_rules)
    assert "model.checkpoint" in str(raised.value)
    assert not os.path.exists(tmp_path / "out")


def test_existing_output_is_refused_unless_overwrite(trained, mesh, tmp_path):
    config, workdir, _ = trained
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("a user's file")
    with pytest.raises(FileExistsError, match=r"out exists: pass --overwrite"):
        export.export(config, workdir, str(out), mesh, config.sharding_rules)
    assert os.listdir(out) == ["keep.txt"]
    export.export(config, workdir, str(out), mesh, config.sharding_rules, fmt="bfl",
                  overwrite=True)
    assert sorted(os.listdir(out)) == ["export.json", "flux1-g2rpo.safetensors"]


def test_full_disk_leaves_no_folder_that_looks_complete(trained, mesh, tmp_path, monkeypatch):
    config, workdir, _ = trained
    calls = []
    real = safetensors_io.stream_safetensors

    def fills_up(f, specs, metadata=None):
        calls.append(len(specs))
        if len(calls) == 3:   # the third shard: some files are already written
            f.write(b"\0" * 100)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(f, specs, metadata)

    monkeypatch.setattr(safetensors_io, "stream_safetensors", fills_up)
    with pytest.raises(OSError, match="No space left"):
        export.export(config, workdir, str(tmp_path / "out"), mesh, config.sharding_rules,
                      max_shard_size="40KB")
    assert len(calls) == 3
    assert os.listdir(tmp_path) == []       # neither out nor the hidden partial folder


def test_unknown_choices_are_refused_before_any_work(trained, mesh, tmp_path):
    config, workdir, _ = trained
    for kwargs, message in [
            (dict(fmt="comfy"), r"Unknown --format 'comfy'.*'diffusers', 'bfl'"),
            (dict(dtype="int8"), r"Unknown --dtype 'int8'"),
            (dict(pipeline="move"), r"Unknown --pipeline 'move'"),
            (dict(fmt="bfl", pipeline="link"), r"--pipeline adds diffusers components")]:
        with pytest.raises(ValueError, match=message):
            export.export(config, workdir, str(tmp_path / "out"), mesh, config.sharding_rules,
                          **kwargs)
    with pytest.raises(FileNotFoundError, match="No checkpoint at .*nowhere"):
        export.export(config, str(tmp_path / "nowhere"), str(tmp_path / "out"), mesh,
                      config.sharding_rules)
    assert os.listdir(tmp_path) == []


def test_command_line(trained, tmp_path):
    config, workdir, _ = trained
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="8")
    flags = [f"--config.model.checkpoint={config.model.checkpoint}",
             *[f"--config.mesh.{k}={v}" for k, v in MESH_SHAPE.items()]]
    command = [sys.executable, "-m", "g2rpo_jax.export", "--config=configs/flux_tiny.py",
               f"--checkpoint={workdir}", f"--out={tmp_path / 'out'}", "--format=bfl", *flags]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "exported" in done.stdout and "bfloat16, bfl layout" in done.stdout
    assert os.path.exists(tmp_path / "out" / "flux1-g2rpo.safetensors")
    refused = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=600)
    assert refused.returncode != 0 and "pass --overwrite" in refused.stderr
    unknown = subprocess.run(command[:-len(flags)] + ["--format=onnx"], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=600)
    assert unknown.returncode != 0 and "--format" in unknown.stderr and "onnx" in unknown.stderr
