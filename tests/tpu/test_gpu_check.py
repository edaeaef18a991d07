"""`tpu/gpu_check.sh`, the prepared accelerator run, against recording stand-ins: its Python (the
environment's `python`, whose `-c` check of the GPU backend, benchmark and pytest calls are
recorded and answered), `nvidia-smi`, and `python3` for an environment made from a folder of
wheels. Checked: the parts it runs and their arguments, the backend it forces, what it stores,
a failing part that does not stop the next, and one line where JAX sees no GPU."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tpu" / "gpu_check.sh"

FAKE = f"""#!{sys.executable}
import json, os, pathlib, sys

name, args = os.path.basename(sys.argv[0]), sys.argv[1:]
with open(os.environ["FAKE_LOG"], "a") as log:
    keys = ("JAX_PLATFORMS", "HF_HUB_OFFLINE", "XLA_PYTHON_CLIENT_MEM_FRACTION")
    log.write(json.dumps({{"name": name, "args": args,
                          "env": {{k: os.environ.get(k) for k in keys}}}}) + "\\n")
if name == "nvidia-smi":
    print("name, memory.total [MiB], driver_version\\nNVIDIA H100 80GB HBM3, 81559 MiB, 550.54")
elif name == "python3" and args[:2] == ["-m", "venv"]:
    bin_dir = pathlib.Path(args[2]) / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").write_text(pathlib.Path(__file__).read_text())
    (bin_dir / "python").chmod(0o755)
elif name == "python" and args[0] == "-c":
    sys.exit(int(os.environ.get("FAKE_NO_GPU", "0")))
elif name == "python" and args[:2] == ["-m", "experiments.bench_grads"]:
    out = pathlib.Path(args[args.index("--out") + 1])
    out.mkdir(parents=True)
    (out / "bench.json").write_text("{{}}")
    sys.exit(int(os.environ.get("FAKE_BENCH_STATUS", "0")))
elif name == "python" and args[:2] == ["-m", "pytest"]:
    pathlib.Path(args[args.index("--junitxml") + 1]).write_text("<testsuites/>")
"""


def _fake(path: pathlib.Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(FAKE)
    path.chmod(0o755)


def _run(tmp_path, *, venv_exists=True, **env):
    bin_dir, venv = tmp_path / "bin", tmp_path / "venv"
    for name in ("nvidia-smi", "python3"):
        _fake(bin_dir / name)
    if venv_exists:
        _fake(venv / "bin" / "python")
    log = tmp_path / "calls.jsonl"
    environment = {
        "PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "FAKE_LOG": str(log),
        "VENV": str(venv), "OUT": str(tmp_path / "out"), **env,
    }  # fmt: skip
    result = subprocess.run(
        ["bash", str(SCRIPT)], cwd=ROOT, env=environment, capture_output=True, text=True
    )
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return result, calls


def test_it_benchmarks_and_runs_the_clipping_harness_on_the_gpu(tmp_path):
    result, calls = _run(tmp_path)
    assert result.returncode == 0, result.stderr
    out = tmp_path / "out"
    assert "NVIDIA H100" in (out / "card.txt").read_text()
    assert (out / "status.txt").read_text().split("\n")[:2] == ["bench 0", "clipping 0"]
    assert (out / "bench_gpu" / "bench.json").exists() and (out / "clipping.xml").exists()
    python = [c for c in calls if c["name"] == "python"]
    assert python[0]["args"][0] == "-c" and "default_backend() == 'gpu'" in python[0]["args"][1]
    bench, harness = python[1]["args"], python[2]["args"]
    assert bench == ["-m", "experiments.bench_grads", "--preset", "gpu", "--out",
                     str(out / "bench_gpu")]  # fmt: skip
    assert "tests/privacy/test_adversarial_clipping.py" in harness
    assert all(c["env"]["JAX_PLATFORMS"] == "cuda" for c in python)
    assert all(c["env"]["HF_HUB_OFFLINE"] == "1" for c in python)


def test_a_failing_part_does_not_stop_the_next_and_sets_the_status(tmp_path):
    result, calls = _run(tmp_path, FAKE_BENCH_STATUS="3")
    assert result.returncode == 3
    status = (tmp_path / "out" / "status.txt").read_text().split("\n")[:2]
    assert status == ["bench 3", "clipping 0"]
    assert any("-m" in c["args"] and "pytest" in c["args"] for c in calls)


def test_without_a_gpu_it_stops_with_one_line(tmp_path):
    result, calls = _run(tmp_path, FAKE_NO_GPU="1")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("tpu/gpu_check.sh: JAX sees no GPU")
    assert not any("experiments.bench_grads" in c["args"] for c in calls)


def test_an_environment_is_made_from_the_wheels_it_brings(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    result, calls = _run(tmp_path, venv_exists=False, WHEELS=str(wheels))
    assert result.returncode == 0, result.stderr
    made = [c for c in calls if c["name"] == "python3"]
    assert made[0]["args"] == ["-m", "venv", str(tmp_path / "venv")]
    install = next(c["args"] for c in calls if c["name"] == "python" and "pip" in c["args"])
    assert install[:4] == ["-m", "pip", "install", "-q"]
    assert ["--no-index", "--find-links", str(wheels)] == install[4:7]
    assert install[7:] == ["-c", "constraints.txt", "jax[cuda12]", "-e", ".[test,compare]"]


def test_a_missing_wheels_folder_is_one_line(tmp_path):
    result, _ = _run(tmp_path, venv_exists=False, WHEELS=str(tmp_path / "nowhere"))
    assert result.returncode == 2
    assert (
        result.stderr.strip() == f"tpu/gpu_check.sh: WHEELS={tmp_path / 'nowhere'} is not a folder"
    )
    assert not os.path.exists(tmp_path / "venv")
