"""`dpmix demo --reproducible` on 8 simulated CPU devices (--mesh data=8 and data=4,model=2), and
as 2 processes joined by `jax.distributed` on 127.0.0.1 (--distributed), gives the utilities and
ε of the same demo in one process on one device."""

import json
import os
import socket
import subprocess
import sys

import pytest

from tests.simulated_devices import xla_flags

DEMO = [
    "demo", "--reproducible", "--epsilons", "1", "--seeds", "0",
    "--methods", "dp_mixmin", "uniform", "--quiet",
]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_demo(out, devices: int, mesh: str | None, processes: int = 1) -> list[dict]:
    """Runs the reduced demo (as `processes` processes of one distributed run) into `out`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env |= {
        "JAX_PLATFORMS": "cpu",
        "HF_HUB_OFFLINE": "1",
        "XLA_FLAGS": xla_flags(devices),
    }
    command = [sys.executable, "-m", "dpmix_jax.cli", *DEMO, "--out", str(out)]
    command += [] if mesh is None else ["--mesh", mesh]
    if processes > 1:
        command.append("--distributed")
        env |= {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{free_port()}"}
        env |= {"JAX_NUM_PROCESSES": str(processes)}
    procs = [
        subprocess.Popen(
            command,
            env=env | ({"JAX_PROCESS_ID": str(i)} if processes > 1 else {}),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for i in range(processes)
    ]
    try:
        outputs = [p.communicate(timeout=1200)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, output in zip(procs, outputs, strict=True):
        assert p.returncode == 0, output[-3000:]
    return json.loads((out / "results.json").read_text())["runs"]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    runs = run_demo(tmp_path_factory.mktemp("one"), 1, None)
    assert {r["method"] for r in runs} == {"dp_mixmin", "uniform"}
    return runs


def assert_same_runs(runs, single, label):
    assert [(r["method"], r["seed"]) for r in runs] == [(r["method"], r["seed"]) for r in single]
    for got, want in zip(runs, single, strict=True):
        # Sums over devices round differently, and 660 training steps carry float differences
        # of ~1e-7 in the proxy outputs to ~1e-3 in a test AUC; other noise or batches would
        # change it by several 1e-2.
        assert got["utility"] == pytest.approx(want["utility"], abs=3e-3), label
        assert got["spent_epsilon"] == pytest.approx(want["spent_epsilon"], rel=1e-9), label
        if want["weights"] is not None:
            assert got["weights"] == pytest.approx(want["weights"], abs=1e-4), label


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["data=8", "data=4,model=2"])
def test_demo_on_a_mesh_of_8_devices_matches_one_device(tmp_path, single, mesh):
    assert_same_runs(run_demo(tmp_path, 8, mesh), single, mesh)


@pytest.mark.slow
def test_demo_as_two_processes_matches_one_process(tmp_path, single):
    runs = run_demo(tmp_path, 1, None, processes=2)
    assert_same_runs(runs, single, "2 processes")
    # Process 0 wrote the results; both processes ran every stage (one stage store, no lock).
    assert (tmp_path / "results.md").exists()
