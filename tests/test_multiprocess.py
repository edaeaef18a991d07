"""Multi-process runs: 2 processes joined by `jax.distributed` on 127.0.0.1 (CPU collectives)
train, checkpoint and resume exactly as one process does, each reading only its rows."""

import json
import os
import pathlib
import socket
import subprocess
import sys

import numpy as np
import pytest

SCRIPT = pathlib.Path(__file__).with_name("multiprocess_check.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(command: list[str], processes: int, cwd: pathlib.Path, timeout: int = 600) -> None:
    """Runs `command` as `processes` processes of one jax.distributed run; all must succeed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env |= {"JAX_PLATFORMS": "cpu", "HF_HUB_OFFLINE": "1"}
    if processes > 1:
        env |= {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{free_port()}"}
        env |= {"JAX_NUM_PROCESSES": str(processes)}
    procs = [
        subprocess.Popen(
            command,
            cwd=cwd,
            env=env | ({"JAX_PROCESS_ID": str(i)} if processes > 1 else {}),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for i in range(processes)
    ]
    try:
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, output in zip(procs, outputs, strict=True):
        assert p.returncode == 0, output[-3000:]


@pytest.mark.slow
def test_two_processes_train_checkpoint_and_resume_like_one(tmp_path):
    runs = {}
    for processes in (1, 2):
        out = tmp_path / f"p{processes}"
        out.mkdir()
        launch([sys.executable, str(SCRIPT), str(out)], processes, tmp_path)
        runs[processes] = out
    one, two = (json.loads((runs[n] / "ledger.json").read_text()) for n in (1, 2))
    assert one == two
    for case in ("resnet", "gpt2"):
        assert two[case]["steps"] == 4 and two[case]["resumed_from"] == 2
        assert two[case]["clipping"] == "ghost"
        single, multi = (np.load(runs[n] / f"{case}.npz") for n in (1, 2))
        assert set(single) == set(multi)
        for name in single:
            np.testing.assert_allclose(multi[name], single[name], rtol=1e-5, atol=1e-6)
    # Each of the 2 processes read exactly half of the rows the single process read.
    total = json.loads((runs[1] / "rows_0.json").read_text())["rows"]
    halves = [json.loads((runs[2] / f"rows_{i}.json").read_text())["rows"] for i in (0, 1)]
    assert halves == [total // 2, total // 2] and total > 0
