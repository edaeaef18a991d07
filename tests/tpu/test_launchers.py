"""The launchers in tpu/, run here against recording stand-ins for the tools they call.

A fake `gcloud` first on PATH records every call; for `tpu-vm scp` and `tpu-vm ssh --command` it
copies the file to, and runs the command in, the home folders of two simulated workers, so the
remote halves run too. Checked: the exact gcloud calls of create, install, launch and delete
(runtime image and accelerator, install and mount on every worker, the same command with
--distributed on every worker, delete); what every worker then runs (the unpacked commit, the
Python set-up, the bucket mount, the experiment's arguments, folder and commit); the GPU launcher
on one host and as one process of several; one line and a non-zero status for every missing
setting; the data and weights options the launchers pass against each experiment's own --help;
every recorded gcloud call against the real gcloud's argument parser, where gcloud is installed
(with no credentials and the TPU endpoint on a closed local port, it stops before any request);
shellcheck, where installed.

What is faked: gcloud's effects, uv (its `venv` makes a real virtual environment of this test's
Python that sees this test's packages, and a recording pip), pip, gcsfuse, sudo, mountpoint,
and the `dpmix` the launchers start. What runs for real: every script, git archive, tar, the
set-up's Python check (the virtual environment's interpreter reports its version and imports jax
and dpmix_jax), and JAX's refusal to start the TPU backend on a machine without a TPU.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import sysconfig
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
TPU = ROOT / "tpu"
PROJECT, ZONE, NAME, BUCKET = "dpmix-proj", "us-central2-b", "dpmix-v4", "dpmix-bucket"
WHERE = [f"--project={PROJECT}", f"--zone={ZONE}"]
TPU_VM = ["gcloud", "compute", "tpus", "tpu-vm"]
SETTINGS = {"PROJECT": PROJECT, "ZONE": ZONE, "TPU_NAME": NAME}
SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"

FAKE = f"""#!{sys.executable}
import json, os, pathlib, shutil, subprocess, sys, venv

name, args = os.path.basename(sys.argv[0]), sys.argv[1:]
with open(os.environ["FAKE_LOG"], "a") as log:
    log.write(json.dumps([name, *args]) + "\\n")
me = pathlib.Path(__file__).resolve()
workers = [w for w in os.environ.get("FAKE_WORKERS", "").split(os.pathsep) if w]
if name == "gcloud" and "scp" in args:
    source, target = [a for a in args[args.index("scp") + 1 :] if not a.startswith("--")]
    for home in workers:
        shutil.copy(source, os.path.join(home, target.split(":", 1)[1]))
elif name == "gcloud":
    for command in [a.removeprefix("--command=") for a in args if a.startswith("--command=")]:
        for home in workers:
            env = dict(os.environ, HOME=home)
            code = subprocess.run(["bash", "-c", command], cwd=home, env=env).returncode
            if code:
                sys.exit(code)
elif name == "uv" and args[0] == "venv":
    path = pathlib.Path(args[-1])
    venv.EnvBuilder(clear=True, symlinks=True).create(path)
    version = "python%d.%d" % sys.version_info[:2]
    site = path / "lib" / version / "site-packages"
    site.joinpath("test_packages.pth").write_text(
        "import site; site.addsitedir(%r)\\n" % os.environ["FAKE_SITE"]
    )
    shutil.copy(me, path / "bin" / "pip")
elif name == "python3":
    local_bin = pathlib.Path.home() / ".local" / "bin"
    local_bin.mkdir(parents=True, exist_ok=True)
    shutil.copy(me, local_bin / "uv")
elif name == "mountpoint":
    sys.exit(0 if os.environ.get("FAKE_MOUNTED") else 1)
elif name == "sudo":
    os.execvp(args[0], args)
elif name == "dpmix":
    keys = ("DPMIX_RUN_COMMIT", "PYTHONUNBUFFERED", "JAX_PLATFORMS", "JAX_COORDINATOR_ADDRESS",
            "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
    call = {{"argv": args, "cwd": os.getcwd(), "env": {{k: os.environ.get(k) for k in keys}}}}
    pathlib.Path.home().joinpath("dpmix-call.json").write_text(json.dumps(call))
"""


class Fakes:
    """A folder of stand-ins first on PATH, the log they append to, and simulated workers."""

    def __init__(self, tmp_path, names=("gcloud", "uv", "gcsfuse", "sudo", "mountpoint")):
        self.tmp = tmp_path
        self.bin = tmp_path / "fakebin"
        self.bin.mkdir()
        for name in names:
            self.add(name)
        self.log = tmp_path / "calls.jsonl"
        self.home = tmp_path / "home"
        self.home.mkdir()
        self.workers = []

    def add(self, name, folder=None):
        path = (folder or self.bin) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(FAKE)
        path.chmod(0o755)
        return path

    def add_workers(self, count=2):
        self.workers = [self.tmp / f"worker{i}" for i in range(count)]
        for home in self.workers:
            home.mkdir()
        return self.workers

    def run(self, script, *args, env=None, cwd=None):
        environment = {
            "PATH": f"{self.bin}:{SYSTEM_PATH}",
            "HOME": str(self.home),
            "LANG": "C.UTF-8",
            "FAKE_LOG": str(self.log),
            "FAKE_SITE": sysconfig.get_paths()["purelib"],
            "FAKE_WORKERS": os.pathsep.join(map(str, self.workers)),
            **(env or {}),
        }
        return subprocess.run(
            ["bash", str(script), *args],
            env=environment,
            cwd=cwd or self.tmp,
            capture_output=True,
            text=True,
            timeout=300,
        )

    def calls(self, name=None):
        if not self.log.exists():
            return []
        calls = [json.loads(line) for line in self.log.read_text().splitlines()]
        return [c for c in calls if name is None or c[0] == name]


def _ok(result):
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def _one_line_error(result):
    assert result.returncode != 0, result.stdout
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    return result.stderr.strip()


def _remote(call):
    (command,) = [a.removeprefix("--command=") for a in call if a.startswith("--command=")]
    return command


def _without_command(call):
    return [a if not a.startswith("--command=") else "--command=..." for a in call]


def _reported_python(stdout, venv):
    """The (major, minor) Python version that setup_host.sh's check printed for `venv`."""
    found = re.search(rf"{re.escape(str(venv))}: Python (\d+)\.(\d+)\.\d+, jax \S+", stdout)
    assert found, stdout
    return int(found[1]), int(found[2])


def _wait_for(path, seconds=60):
    deadline = time.monotonic() + seconds
    while not path.exists() or not path.read_text():
        assert time.monotonic() < deadline, f"{path} was not written"
        time.sleep(0.1)
    return json.loads(path.read_text())


def _checkout(tmp_path):
    """A one-commit git repository with the launchers and the constraints, as install.sh copies
    HEAD (the launchers of the working tree, committed or not)."""
    repo = tmp_path / "checkout"
    shutil.copytree(TPU, repo / "tpu")
    shutil.copy(ROOT / "constraints.txt", repo / "constraints.txt")
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@example.com",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@example.com",
        "GIT_CONFIG_GLOBAL": os.devnull,
        "GIT_CONFIG_NOSYSTEM": "1",
    }
    for command in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "launchers"]):
        subprocess.run(["git", "-C", str(repo), *command], env=env, check=True)
    head = subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    return repo, head


@pytest.mark.parametrize(
    ("accelerator", "runtime"),
    [
        ("v4-32", "tpu-ubuntu2204-base"),
        ("v5litepod-16", "v2-alpha-tpuv5-lite"),
        ("v5p-8", "v2-alpha-tpuv5"),
        ("v6e-8", "v2-alpha-tpuv6e"),
    ],
)
def test_create_uses_the_base_image_of_the_accelerator(tmp_path, accelerator, runtime):
    fakes = Fakes(tmp_path)
    env = {**SETTINGS, "ACCELERATOR_TYPE": accelerator}
    _ok(fakes.run(TPU / "create.sh", "--spot", env=env))
    assert fakes.calls() == [
        [
            *TPU_VM,
            "create",
            NAME,
            f"--accelerator-type={accelerator}",
            f"--version={runtime}",
            "--scopes=https://www.googleapis.com/auth/cloud-platform",
            "--spot",
            *WHERE,
        ],
        [
            *TPU_VM,
            "describe",
            NAME,
            "--format=value(state,acceleratorType,networkEndpoints[].ipAddress)",
            *WHERE,
        ],
    ]


def test_create_takes_an_explicit_runtime_and_asks_for_one_it_cannot_choose(tmp_path):
    fakes = Fakes(tmp_path)
    env = {**SETTINGS, "ACCELERATOR_TYPE": "v4-8", "RUNTIME_VERSION": "tpu-ubuntu2204-base"}
    _ok(fakes.run(TPU / "create.sh", env=env))
    assert "--version=tpu-ubuntu2204-base" in fakes.calls()[0]

    error = _one_line_error(
        fakes.run(TPU / "create.sh", env={**env, "ACCELERATOR_TYPE": "x9-8", "RUNTIME_VERSION": ""})
    )
    assert "ACCELERATOR_TYPE=x9-8" in error and "set RUNTIME_VERSION" in error


def test_delete_deletes_the_slice(tmp_path):
    fakes = Fakes(tmp_path)
    _ok(fakes.run(TPU / "delete.sh", env=SETTINGS))
    assert fakes.calls() == [[*TPU_VM, "delete", NAME, "--quiet", *WHERE]]


def test_install_sets_up_and_mounts_every_worker_then_checks_for_the_tpu(tmp_path):
    fakes = Fakes(tmp_path)
    workers = fakes.add_workers()
    repo, head = _checkout(tmp_path)
    shared = tmp_path / "mnt" / "dpmix"
    env = {**SETTINGS, "BUCKET": f"gs://{BUCKET}", "SHARED": str(shared)}
    result = fakes.run(repo / "tpu" / "install.sh", env=env)

    gcloud = fakes.calls("gcloud")
    scp, setup, check = gcloud
    assert scp[:5] == [*TPU_VM, "scp"] and scp[5].endswith(".tar.gz")
    assert scp[6:] == [f"{NAME}:dpmix_jax.tar.gz", "--worker=all", *WHERE]
    assert not os.path.exists(scp[5]), "the local archive is removed"
    for call in (setup, check):
        assert _without_command(call) == [
            *TPU_VM,
            "ssh",
            NAME,
            "--worker=all",
            "--command=...",
            *WHERE,
        ]
    assert "bash dpmix_jax/tpu/setup_host.sh tpu" in _remote(setup)
    assert "JAX_PLATFORMS=tpu ~/dpmix-venv/bin/python" in _remote(check)

    # Every worker ran the set-up and the mount; the TPU check then fails here, with no TPU.
    assert result.returncode != 0
    assert "Unable to initialize backend 'tpu'" in result.stderr
    for home in workers:
        assert (home / "dpmix_jax" / "COMMIT").read_text() == head + "\n"
        assert not (home / "dpmix_jax.tar.gz").exists()
        assert (home / "dpmix_jax" / "tpu" / "setup_host.sh").exists()
        assert _reported_python(result.stdout, home / "dpmix-venv") >= (3, 11)
    source = [str(home / "dpmix_jax") for home in workers]
    venv = [str(home / "dpmix-venv") for home in workers]
    assert fakes.calls("uv") == [
        call
        for v in venv
        for call in (
            ["uv", "python", "install", "3.11"],
            ["uv", "venv", "--clear", "--seed", "--python", "3.11", v],
        )
    ]
    assert fakes.calls("pip") == [
        ["pip", "install", "--quiet", "-c", f"{s}/constraints.txt", "jax[tpu]", "-e", s]
        for s in source
    ]
    gcsfuse = [
        "gcsfuse",
        "--implicit-dirs",
        "--file-mode=600",
        "--dir-mode=700",
        "--rename-dir-limit=1000000",
        "--metadata-cache-ttl-secs=0",
        "--metadata-cache-negative-ttl-secs=0",
        BUCKET,
        str(shared),
    ]
    assert fakes.calls("gcsfuse") == [gcsfuse, gcsfuse]
    assert shared.is_dir()


def test_setup_host_makes_a_python_3_11_environment_with_the_pinned_versions(tmp_path):
    fakes = Fakes(tmp_path)
    venv = tmp_path / "env"
    result = _ok(fakes.run(TPU / "setup_host.sh", "cpu", env={"VENV": str(venv)}))
    assert fakes.calls() == [
        ["uv", "python", "install", "3.11"],
        ["uv", "venv", "--clear", "--seed", "--python", "3.11", str(venv)],
        ["pip", "install", "--quiet", "-c", f"{ROOT}/constraints.txt", "jax", "-e", str(ROOT)],
    ]
    assert _reported_python(result.stdout, venv) >= (3, 11)


def test_setup_host_installs_uv_with_the_system_pip_where_it_is_missing(tmp_path):
    if shutil.which("uv", path=SYSTEM_PATH):
        pytest.skip("the uv installed on this machine would be used instead")
    fakes = Fakes(tmp_path, names=("python3",))
    venv = tmp_path / "env"
    _ok(fakes.run(TPU / "setup_host.sh", "cuda12", env={"VENV": str(venv)}))
    calls = fakes.calls()
    assert calls[0] == ["python3", "-m", "pip", "install", "--quiet", "--user", "uv"]
    assert calls[1] == ["uv", "python", "install", "3.11"]
    assert calls[-1][:6] == [
        "pip",
        "install",
        "--quiet",
        "-c",
        f"{ROOT}/constraints.txt",
        "jax[cuda12]",
    ]


def test_mount_bucket_mounts_once(tmp_path):
    fakes = Fakes(tmp_path)
    shared = tmp_path / "shared"
    env = {"BUCKET": BUCKET, "SHARED": str(shared)}
    _ok(fakes.run(TPU / "mount_bucket.sh", env=env))
    assert fakes.calls("gcsfuse")[0][-2:] == [BUCKET, str(shared)]
    _ok(fakes.run(TPU / "mount_bucket.sh", env={**env, "FAKE_MOUNTED": "1"}))
    assert len(fakes.calls("gcsfuse")) == 1, "an existing mount is kept"


def _worker_with_venv(fakes, home, commit="abc1234"):
    fakes.add("dpmix", home / "dpmix-venv" / "bin")
    (home / "dpmix_jax").mkdir()
    (home / "dpmix_jax" / "COMMIT").write_text(commit + "\n")


def test_launch_starts_the_same_command_on_every_worker(tmp_path):
    fakes = Fakes(tmp_path)
    shared = tmp_path / "shared folder"  # every path is quoted on its way to the workers
    shared.mkdir()
    for home in fakes.add_workers():
        _worker_with_venv(fakes, home)
    env = {**SETTINGS, "SHARED": str(shared), "MESH": "data=4,model=4", "FAKE_MOUNTED": "1"}
    result = _ok(
        fakes.run(TPU / "launch.sh", "enron", "--preset", "paper", "--seeds", "0", env=env)
    )

    (call,) = fakes.calls("gcloud")
    assert _without_command(call) == [*TPU_VM, "ssh", NAME, "--worker=all", "--command=...", *WHERE]
    assert result.stdout.count("started enron, log ~/dpmix-enron.log") == 2
    assert "--worker=0 --command='tail -f ~/dpmix-enron.log'" in result.stdout
    for home in fakes.workers:
        started = _wait_for(home / "dpmix-call.json")
        assert started["argv"] == [
            "run",
            "enron",
            "--distributed",
            "--mesh",
            "data=4,model=4",
            "--out",
            f"{shared}/runs/enron",
            "--data-root",
            f"{shared}/data",
            "--weights-root",
            f"{shared}/weights",
            "--preset",
            "paper",
            "--seeds",
            "0",
        ]
        assert started["cwd"] == str(shared)
        assert started["env"]["DPMIX_RUN_COMMIT"] == "abc1234"
        assert started["env"]["PYTHONUNBUFFERED"] == "1"
        assert (home / "dpmix-enron.pid").read_text().strip().isdigit()


def test_launch_takes_out_and_stops_where_the_bucket_is_not_mounted(tmp_path):
    fakes = Fakes(tmp_path)
    shared = tmp_path / "shared"
    for home in fakes.add_workers(1):
        _worker_with_venv(fakes, home)
    env = {**SETTINGS, "SHARED": str(shared), "OUT": "/elsewhere/out"}
    result = fakes.run(TPU / "launch.sh", "quickstart", env=env)
    assert result.returncode != 0
    assert f"{shared} is not mounted; run tpu/install.sh" in _one_line_error(result)
    assert "--out /elsewhere/out" in _remote(fakes.calls("gcloud")[0])
    assert not (fakes.workers[0] / "dpmix-call.json").exists()


def test_gpu_launch_on_one_host_uses_every_local_gpu_in_one_process(tmp_path):
    fakes = Fakes(tmp_path)
    venv = tmp_path / "env"
    fakes.add("dpmix", venv / "bin")
    shared = tmp_path / "shared folder"
    shared.mkdir()
    env = {"VENV": str(venv), "SHARED": str(shared)}
    _ok(fakes.run(TPU / "gpu_launch.sh", "nih_mimic", "--preset", "paper", env=env))
    started = json.loads((fakes.home / "dpmix-call.json").read_text())
    assert started["argv"] == [
        "run",
        "nih_mimic",
        "--mesh",
        "data=-1",
        "--out",
        f"{shared}/runs/nih_mimic",
        "--nih-root",
        f"{shared}/data/nih",
        "--public-root",
        f"{shared}/data/mimic",
        "--preset",
        "paper",
    ]
    assert started["cwd"] == str(shared)
    assert started["env"]["JAX_PLATFORMS"] == "cuda"
    assert started["env"]["JAX_COORDINATOR_ADDRESS"] is None


def test_gpu_launch_as_one_process_of_several_hosts(tmp_path):
    fakes = Fakes(tmp_path)
    venv = tmp_path / "env"
    fakes.add("dpmix", venv / "bin")
    shared = tmp_path / "shared"
    shared.mkdir()
    env = {
        "VENV": str(venv),
        "SHARED": str(shared),
        "COORDINATOR": "10.0.0.1:1234",
        "NUM_PROCESSES": "2",
        "PROCESS_ID": "1",
        "MESH": "data=16",
    }
    _ok(fakes.run(TPU / "gpu_launch.sh", "quickstart", env=env))
    started = json.loads((fakes.home / "dpmix-call.json").read_text())
    assert started["argv"] == [
        "run",
        "quickstart",
        "--distributed",
        "--mesh",
        "data=16",
        "--out",
        f"{shared}/runs/quickstart",
    ]
    jax_settings = {k: v for k, v in started["env"].items() if k.startswith("JAX_")}
    assert jax_settings == {
        "JAX_PLATFORMS": "cuda",
        "JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234",
        "JAX_NUM_PROCESSES": "2",
        "JAX_PROCESS_ID": "1",
    }


@pytest.mark.parametrize(
    ("script", "args", "env", "named"),
    [
        ("create.sh", [], {}, "PROJECT ZONE TPU_NAME ACCELERATOR_TYPE"),
        ("create.sh", [], {"PROJECT": PROJECT, "TPU_NAME": NAME}, "set ZONE ACCELERATOR_TYPE"),
        ("install.sh", [], SETTINGS, "set BUCKET"),
        ("launch.sh", ["enron"], {"ZONE": ZONE}, "set PROJECT TPU_NAME"),
        ("launch.sh", [], SETTINGS, "give the experiment"),
        ("delete.sh", [], {"PROJECT": PROJECT, "ZONE": ZONE}, "set TPU_NAME"),
        ("mount_bucket.sh", [], {}, "set BUCKET"),
        ("setup_host.sh", [], {}, "tpu, cuda12, cuda13 or cpu"),
        ("gpu_launch.sh", [], {}, "give the experiment"),
        ("gpu_launch.sh", ["enron"], {"VENV": "/nonexistent"}, "/nonexistent/bin/dpmix is missing"),
        (
            "gpu_launch.sh",
            ["enron"],
            {"COORDINATOR": "h:1", "VENV": "VENV"},
            "set NUM_PROCESSES PROCESS_ID SHARED",
        ),
    ],
)
def test_a_missing_setting_stops_with_one_line(tmp_path, script, args, env, named):
    fakes = Fakes(tmp_path)
    if env.get("VENV") == "VENV":
        env = {**env, "VENV": str(tmp_path / "env")}
        fakes.add("dpmix", tmp_path / "env" / "bin")
    error = _one_line_error(fakes.run(TPU / script, *args, env=env))
    assert error.startswith(f"tpu/{script}: ") and named in error, error
    assert [c for c in fakes.calls() if c[0] != "mountpoint"] == [], "nothing ran"


HELP_ROOTS = """
import contextlib, io, json, re
from dpmix_jax import cli
from dpmix_jax.cli import run
roots = {}
for name in run.EXPERIMENTS:
    text = io.StringIO()
    with contextlib.redirect_stdout(text), contextlib.suppress(SystemExit):
        cli.main(["run", name, "--help"])
    roots[name] = sorted(set(re.findall(r"--[a-z-]+-root\\b", text.getvalue())))
print(json.dumps(roots))
"""


def test_the_root_options_are_the_experiments_own():
    """Every data and weights option an experiment's --help lists is passed by the launchers,
    and only those; per_task alone keeps its default public folder, which follows its preset."""
    result = subprocess.run(
        [sys.executable, "-c", HELP_ROOTS],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 0, result.stderr
    accepted = json.loads(result.stdout.splitlines()[-1])
    assert "enron" in accepted and "nih_chexpert" in accepted
    script = 'source tpu/common.sh; for e; do root_options "$e" /S; echo "$e ${roots[*]}"; done'
    table = subprocess.run(
        ["bash", "-c", script, "table", *accepted],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for line in table.splitlines():
        name, *words = line.split()
        passed = sorted(w for w in words if w.startswith("--"))
        expected = [o for o in accepted[name] if (name, o) != ("per_task", "--public-root")]
        assert passed == expected, name
        for option, value in zip(words[::2], words[1::2], strict=True):
            assert value.startswith(("/S/data", "/S/weights")), (name, option, value)


def test_gcloud_accepts_every_call_the_scripts_make(tmp_path):
    real = shutil.which("gcloud")
    if real is None:
        pytest.skip("gcloud is not installed")
    fakes = Fakes(tmp_path)
    repo, _ = _checkout(tmp_path)
    shared = tmp_path / "shared"
    shared.mkdir()
    for script, args, env in [
        ("create.sh", ["--spot"], {"ACCELERATOR_TYPE": "v4-32"}),
        ("install.sh", [], {"BUCKET": BUCKET}),
        ("launch.sh", ["enron", "--preset", "paper"], {"SHARED": str(shared)}),
        ("delete.sh", [], {}),
    ]:
        _ok(fakes.run(repo / "tpu" / script, *args, env={**SETTINGS, **env}))
    calls = fakes.calls("gcloud")
    assert len(calls) == 7
    config = tmp_path / "gcloud-config"
    config.mkdir()
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path),
        "CLOUDSDK_CONFIG": str(config),
        "CLOUDSDK_CORE_DISABLE_PROMPTS": "1",
        "CLOUDSDK_CORE_CHECK_GCE_METADATA": "false",
        "CLOUDSDK_API_ENDPOINT_OVERRIDES_TPU": "http://127.0.0.1:9/",
    }
    archive = tmp_path / "archive.tar.gz"
    archive.write_bytes(b"")
    for call in calls:
        args = [str(archive) if a.endswith(".tar.gz") and "/" in a else a for a in call[1:]]
        result = subprocess.run([real, *args], env=env, capture_output=True, text=True, timeout=120)
        assert result.returncode != 0, "no credentials: gcloud must stop before any request"
        assert "do not currently have an active account" in result.stderr, (call, result.stderr)


def test_shellcheck_finds_nothing():
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed")
    scripts = sorted(str(p.relative_to(ROOT)) for p in TPU.glob("*.sh"))
    result = subprocess.run(
        ["shellcheck", "-x", *scripts], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout
