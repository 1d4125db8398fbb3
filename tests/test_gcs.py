"""gs:// paths end to end against a GCS emulator on 127.0.0.1 (tests/gcs_emulator.py): the
shapes main job with a gs:// workdir and TFDS data_dir, resumed from its gs:// checkpoints; the
tiny FLUX path with every input (weights, rewards, prompts, embeddings) in the bucket; and the
errors for a missing bucket, an unreachable endpoint and a missing gs:// weight file."""

import json
import os
import subprocess
import sys

from gcs_emulator import GcsEmulator
import pytest
import resume_helpers as rh
from test_resume import shapes_flags

from g2rpo_jax.models.safetensors_io import SafetensorsCheckpoint
from g2rpo_jax.testing import flux_fixture


@pytest.fixture(scope="module")
def gcs():
    with GcsEmulator() as emulator:
        yield emulator


def _run(command: list[str], gcs, tmp_path, devices: int = 2, timeout: float = 900, **env):
    environment = {**rh.environment(devices), **gcs.env,
                   "G2RPO_CACHE_DIR": str(tmp_path / "download_cache"), **env}
    return subprocess.run([sys.executable, *command], cwd=rh.ROOT, env=environment,
                          capture_output=True, text=True, timeout=timeout)


def _flags(workdir, data_dir, iterations):
    flags = [f for f in shapes_flags(workdir, data_dir, "")
             if not f.startswith(("--config.train.num_iterations", "--config.compilation_cache"))]
    return flags + [f"--config.train.num_iterations={iterations}"]


@pytest.mark.slow
def test_shapes_main_job_writes_and_resumes_in_the_bucket(gcs, tmp_path):
    workdir, data_dir = f"gs://{gcs.bucket}/shapes/run", f"gs://{gcs.bucket}/shapes/tfds"
    first = _run(["-m", "g2rpo_jax.main", *_flags(workdir, data_dir, 2)], gcs, tmp_path)
    assert first.returncode == 0, first.stderr[-6000:]
    objects = gcs.objects("shapes/run/")
    for name in ("summary.json", "metrics.jsonl", "generator.safetensors", "images/base.png",
                 "images/final.png", "reward_curves.png", "checkpoints/2/commit_success.txt"):
        assert f"shapes/run/{name}" in objects, name
    assert any(n.startswith("shapes/run/tensorboard/events.") for n in objects)
    assert any(n.startswith("shapes/run/compilation_cache/") for n in objects)
    assert any(n.endswith("dataset_info.json") for n in gcs.objects("shapes/tfds/"))
    assert not any(n.startswith("gs:") for n in os.listdir(rh.ROOT))   # no ./gs:/ folder

    second = _run(["-m", "g2rpo_jax.main", *_flags(workdir, data_dir, 3)], gcs, tmp_path)
    assert second.returncode == 0, second.stderr[-6000:]
    assert f"Resuming {workdir} from iteration 2" in second.stderr
    local = tmp_path / "metrics.jsonl"
    local.write_bytes(_download(gcs, "shapes/run/metrics.jsonl"))
    steps = [row["step"] for row in map(json.loads, local.read_text().splitlines())]
    assert sorted(set(steps)) == [0, 1, 2, 3]
    assert json.loads(_download(gcs, "shapes/run/summary.json"))["iterations"] == 3


def _download(gcs, name: str) -> bytes:
    import urllib.parse
    import urllib.request

    quoted = urllib.parse.quote(name, safe="")
    with urllib.request.urlopen(f"{gcs.url}/storage/v1/b/{gcs.bucket}/o/{quoted}?alt=media",
                                timeout=10) as r:
        return r.read()


def _upload_tree(gcs, local_dir: str, prefix: str, tmp_path) -> None:
    script = ("import sys; from g2rpo_jax.core import storage; "
              "storage.upload_tree(sys.argv[1], sys.argv[2])")
    result = _run(["-c", script, local_dir, f"gs://{gcs.bucket}/{prefix}"], gcs, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.slow
def test_tiny_flux_path_reads_everything_from_the_bucket(gcs, tmp_path):
    root = tmp_path / "flux_inputs"
    flux_fixture.write_tiny_setup(str(root))
    _upload_tree(gcs, str(root), "flux", tmp_path)
    bucket = f"gs://{gcs.bucket}/flux"
    overrides = {key: value.replace(str(root), bucket)
                 for key, value in flux_fixture.config_overrides(str(root)).items()}
    flags = ["--config=configs/flux_tiny.py", *(f"--config.{k}={v}" for k, v in overrides.items())]
    prepared = _run(["-m", "g2rpo_jax.preprocess", *flags], gcs, tmp_path)
    assert prepared.returncode == 0, prepared.stderr[-6000:]
    assert any(n.endswith("dataset_info.json") for n in gcs.objects("flux/tfds/prompt_embeddings/"))
    assert not any("_chunks" in n for n in gcs.objects("flux/tfds/"))

    workdir = f"gs://{gcs.bucket}/flux_run"
    trained = _run(["-m", "g2rpo_jax.main", *flags, f"--workdir={workdir}",
                    "--config.mode=train", "--config.train.num_iterations=1",
                    "--config.train.checkpoint_every=1"],
                   gcs, tmp_path)
    assert trained.returncode == 0, trained.stderr[-6000:]
    objects = gcs.objects("flux_run/")
    for name in ("summary.json", "metrics.jsonl", "reward_curves.png",
                 "checkpoints/1/commit_success.txt"):
        assert f"flux_run/{name}" in objects, name
    # The transformer and autoencoder came through the download cache.
    cached = tmp_path / "download_cache" / "gs" / gcs.bucket / "flux" / "flux"
    assert (cached / "transformer" / "config.json").is_file()
    assert (cached / "vae" / "config.json").is_file()

    # The run exported from the bucket into the bucket, as a FluxPipeline folder.
    exported = _run(["-m", "g2rpo_jax.export", *flags, f"--checkpoint={workdir}",
                     f"--out=gs://{gcs.bucket}/flux_export", "--pipeline=copy"], gcs, tmp_path)
    assert exported.returncode == 0, exported.stderr[-6000:]
    objects = gcs.objects("flux_export/")
    for name in ("export.json", "model_index.json", "vae/config.json", "transformer/config.json",
                 "transformer/diffusion_pytorch_model.safetensors"):
        assert f"flux_export/{name}" in objects, name
    weights = tmp_path / "exported.safetensors"
    weights.write_bytes(_download(gcs, "flux_export/transformer/diffusion_pytorch_model.safetensors"))
    report = json.loads(_download(gcs, "flux_export/export.json"))
    assert report["step"] == 1 and report["checkpoint"].startswith(f"gs://{gcs.bucket}/flux_run")
    assert len(SafetensorsCheckpoint(weights).keys()) == report["tensors"]


def test_missing_bucket_unreachable_endpoint_and_missing_weights_are_named(gcs, tmp_path):
    flags = ["--config=configs/shapes_cpu.py", "--config.train.num_iterations=1"]
    missing = _run(["-m", "g2rpo_jax.main", *flags, "--workdir=gs://no-such-bucket/run"], gcs,
                   tmp_path, timeout=120)
    assert missing.returncode != 0
    assert "The workdir gs://no-such-bucket/run is not writable" in missing.stderr
    assert "in an existing bucket" in missing.stderr

    unreachable = _run(["-m", "g2rpo_jax.main", *flags, f"--workdir=gs://{gcs.bucket}/run"],
                       gcs, tmp_path, timeout=120, STORAGE_EMULATOR_HOST="http://127.0.0.1:9",
                       TENSORSTORE_GCS_HTTP_URL="http://127.0.0.1:9", G2RPO_STORAGE_TIMEOUT="5")
    assert unreachable.returncode != 0
    assert "storage endpoint of gs://" in unreachable.stderr
    assert "STORAGE_EMULATOR_HOST=http://127.0.0.1:9" in unreachable.stderr

    weights = _run(["-m", "g2rpo_jax.main", *flags, f"--workdir=gs://{gcs.bucket}/w",
                    f"--config.model.checkpoint=gs://{gcs.bucket}/nothing.safetensors"],
                   gcs, tmp_path, timeout=300)
    assert weights.returncode != 0
    assert f"No weights file at gs://{gcs.bucket}/nothing.safetensors" in weights.stderr


def test_aot_report_is_written_to_the_bucket(gcs, tmp_path):
    out = f"gs://{gcs.bucket}/aot/tpu_aot_cpu.json"
    result = _run([os.path.join("benchmarks", "perf", "tpu_aot.py"), "--topology=cpu",
                   "--config=configs/flux_tiny.py", "--pieces=forward", f"--out={out}"],
                  gcs, tmp_path, devices=8, timeout=600, JAX_PLATFORMS="cpu")
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(_download(gcs, "aot/tpu_aot_cpu.json"))
    assert report["chips"] == 8 and [row["piece"] for row in report["pieces"]] == ["forward"]
