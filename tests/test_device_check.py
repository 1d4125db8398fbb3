"""benchmarks/device_check.sh --dry-run: prints every step of the accelerator check, in order,
with its output under --out, and runs none of them; a wrong argument names the known ones."""

import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "device_check.sh")


def test_dry_run_lists_every_step_and_runs_none(tmp_path):
    out = tmp_path / "check"
    result = subprocess.run(["bash", SCRIPT, "--dry-run", f"--out={out}"], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith("[device_check]")]
    steps = [line.split()[1].rstrip(":") for line in lines]
    assert steps == ["devices", "gpu_tests", "run_medium", "run_large", "main_job", "mfu"]
    text = result.stdout
    assert "pytest -q -rs benchmarks/gpu" in text
    assert f"benchmarks/run.py --platform=gpu --out={out}/run_medium.json" in text
    assert "--size=large" in text and f"--workdir={out}/main_job" in text
    assert not out.exists()              # nothing ran, nothing was written


def test_unknown_argument_names_the_known_ones():
    result = subprocess.run(["bash", SCRIPT, "--dryrun"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2
    assert "unknown argument '--dryrun'" in result.stderr and "--dry-run" in result.stderr
