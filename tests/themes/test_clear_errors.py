"""Hostile input and interruptions end in one clear line, before any work they make pointless.

The CLI is driven through `main` with the expensive steps replaced by sentinels that fail the
test if reached; the experiments run as modules (`python -m experiments.NAME`) in a subprocess
and stop at argument or data checks, a few seconds each.
"""

import ast
import contextlib
import fcntl
import gc
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest
from PIL import Image

from dpmix_jax import cli, interrupt
from dpmix_jax.cli import errors, run
from dpmix_jax.data import text, tfds_sources
from dpmix_jax.data.tokenizer import gpt2_tokenizer, train_bpe_tokenizer
from dpmix_jax.pipeline import presets
from experiments import common_args

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _fail_with(monkeypatch, action):
    """Makes `dpmix experiments` run `action()` in place of its work."""

    def listing():
        action()
        return 0

    monkeypatch.setattr(run, "list_experiments", listing)


def _one_line(capsys, status=2):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["experiments"])
    assert exit_info.value.code == status
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    return err.strip()


@pytest.fixture
def no_data_loading(monkeypatch):
    """The demo's data loaders fail the test: the command must stop before them."""

    def loaded(*args, **kwargs):
        raise AssertionError("the demo loaded its data before refusing the command")

    monkeypatch.setattr(presets, "digit_task", loaded)


# ------------------------------------------------------------------------------------------
# Ctrl-C
# ------------------------------------------------------------------------------------------


def test_ctrl_c_says_how_to_resume_and_exits_130(capsys, monkeypatch):
    def interrupt():
        raise KeyboardInterrupt

    _fail_with(monkeypatch, interrupt)
    line = _one_line(capsys, status=130)
    assert line == f"dpmix: {errors.INTERRUPTED}"
    assert "rerun the same command (same --out)" in line and "privacy ledger is kept" in line


def _ctrl_c_in_gc_callback(times: int):
    """Ctrl-C (`times` SIGINTs) arriving while JAX's kind of gc callback runs, where Python
    cannot raise: the interrupt it raises there is printed as ignored and dropped."""

    def interrupted_callback(phase, info):
        gc.callbacks.remove(interrupted_callback)
        for _ in range(times):
            signal.raise_signal(signal.SIGINT)

    gc.callbacks.append(interrupted_callback)
    gc.collect()
    assert interrupted_callback not in gc.callbacks


@pytest.mark.parametrize("times", [1, 2])
def test_ctrl_c_in_a_callback_stops_the_run_at_its_next_step(times, capsys, monkeypatch):
    steps = []

    def work():
        _ctrl_c_in_gc_callback(times)
        for step in range(10_000):  # a training loop: each step is a safe point
            interrupt.raise_if_interrupted()
            steps.append(step)
            time.sleep(0.001)

    _fail_with(monkeypatch, work)
    line = _one_line(capsys, status=130)  # nothing printed about the dropped interrupt
    assert line == f"dpmix: {errors.INTERRUPTED}"
    assert steps == []  # stopped at the first safe point after Ctrl-C


def test_ctrl_c_in_a_callback_stops_work_without_safe_points_after_the_grace(capsys, monkeypatch):
    monkeypatch.setattr(interrupt, "GRACE_SECONDS", 0.2)
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN when started in a background job
    started = time.monotonic()

    def work():
        _ctrl_c_in_gc_callback(2)  # the second one raises in the callback, and is dropped
        while time.monotonic() < started + 30:  # no safe point: interrupted anyway
            time.sleep(0.001)

    _fail_with(monkeypatch, work)
    line = _one_line(capsys, status=130)
    assert line == f"dpmix: {errors.INTERRUPTED}"
    assert time.monotonic() - started < 10
    assert signal.getsignal(signal.SIGINT) is before  # handler restored


@pytest.mark.slow
def test_ctrl_c_stops_the_demo_in_one_line_and_the_same_command_resumes(tmp_path):
    out = tmp_path / "demo"
    command = [
        sys.executable, "-m", "dpmix_jax.cli", "demo", "--out", str(out), "--epsilons", "1",
        "--seeds", "0", "--methods", "uniform", "random_init", "--reproducible",
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    stderr = tmp_path / "stderr"
    with stderr.open("w") as err:
        demo = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=err)
        deadline = time.monotonic() + 600
        while "1/2 [" not in stderr.read_text() and demo.poll() is None:  # the first run done
            assert time.monotonic() < deadline, stderr.read_text()
            time.sleep(0.2)
        demo.send_signal(signal.SIGINT)
        demo.communicate(timeout=120)
    lines = [line for line in stderr.read_text().replace("\r", "\n").splitlines() if line]
    progress = ("digits (MNIST-5k", " ")  # the progress bar's lines
    messages = [line for line in lines if not line.startswith(progress)]
    assert demo.returncode == 130, messages
    assert messages == [f"dpmix: {errors.INTERRUPTED}"]
    assert not (out / "results.json").exists()

    resumed = subprocess.run(command + ["--quiet"], cwd=tmp_path, env=env, capture_output=True)
    assert resumed.returncode == 0, resumed.stderr.decode()
    results = json.loads((out / "results.json").read_text())
    assert results["reused_runs"] >= 1  # the finished run is read back, not run again
    assert {run["method"] for run in results["runs"]} == {"uniform", "random_init"}


# ------------------------------------------------------------------------------------------
# Hostile documents and images
# ------------------------------------------------------------------------------------------


def test_deeply_nested_json_document_is_one_line(tmp_path, capsys, monkeypatch):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": ' + "[" * 100_000 + "\n")
    _fail_with(monkeypatch, lambda: list(text.iter_documents(path)))
    line = _one_line(capsys)
    assert line == f"dpmix: error: {path} line 1: JSON nested too deeply to read"


def test_lone_surrogate_is_a_value_error_naming_the_text(tmp_path, capsys, monkeypatch):
    path = tmp_path / "docs.jsonl"
    path.write_text(json.dumps({"text": "fine"}) + "\n" + '{"text": "a\\ud800b"}\n')
    with pytest.raises(ValueError, match=re.escape(f"{path} line 2: the 'text' text holds the")):
        list(text.iter_documents(path))
    documents = ["fine", "a\ud800b"]  # texts that reach the tokenizer by another way
    tokenizer = gpt2_tokenizer()
    surrogate = "text 1 holds the lone surrogate U+D800 at character 1"
    with pytest.raises(ValueError, match=re.escape(surrogate)):
        tokenizer.encode_batch(documents)
    with pytest.raises(ValueError, match=re.escape("text 0 holds the lone surrogate U+D800")):
        tokenizer.encode(documents[1])
    with pytest.raises(ValueError, match=re.escape(surrogate)):
        train_bpe_tokenizer(documents, vocab_size=300)
    _fail_with(monkeypatch, lambda: tokenizer.encode_batch(documents))
    assert _one_line(capsys).startswith(f"dpmix: error: {surrogate}")


def test_decompression_bomb_image_is_one_line(tmp_path, capsys, monkeypatch):
    path = tmp_path / "bomb.png"
    Image.new("L", (100, 100)).save(path)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # 100x100 is a bomb at this limit
    _fail_with(monkeypatch, lambda: Image.open(path))
    assert "could be decompression bomb" in _one_line(capsys)


def test_raw_bytes_in_an_error_are_escaped_and_cut(capsys, monkeypatch):
    def corrupt():
        raise ValueError("data/a.parquet: not readable (thrift: \x0e\x00\x1b[2J" + "x" * 5000 + ")")

    _fail_with(monkeypatch, corrupt)
    line = _one_line(capsys)
    assert line.startswith("dpmix: error: data/a.parquet: not readable (thrift: \\x0e\\x00\\x1b")
    assert line.isprintable() and line.endswith("…")
    assert len(line) < 500


# ------------------------------------------------------------------------------------------
# `dpmix demo`: refused before data loading and training
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--epsilons", "1", "1000"], "--epsilons: 1000 gives the private stages ε = 1000, 1000"),
        (["--epsilons", "0.001"], "each must be in [0.01, 100]"),
    ],
)
def test_demo_privacy_arguments_are_refused_before_any_work(
    argv, message, tmp_path, capsys, no_data_loading
):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["demo", "--out", str(tmp_path), *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # nothing written


@contextlib.contextmanager
def _held_by_process_4242(folder):
    """Holds `folder`'s lock as another run would (flock locks belong to an open file)."""
    fd = os.open(folder / ".lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, b"4242\n")
        yield
    finally:
        os.close(fd)


def test_demo_output_folder_in_use_is_refused_before_any_work(tmp_path, capsys, no_data_loading):
    with _held_by_process_4242(tmp_path), pytest.raises(SystemExit) as exit_info:
        cli.main(["demo", "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert f"{tmp_path} is in use by process 4242" in capsys.readouterr().err


def test_experiment_output_folder_in_use_is_refused_when_parsed(tmp_path, capsys, monkeypatch):
    from experiments import k_scaling

    def loaded(*args, **kwargs):
        raise AssertionError("the experiment started before refusing the folder")

    monkeypatch.setattr(k_scaling, "main", loaded)
    held = _held_by_process_4242(tmp_path)
    with held, pytest.raises(SystemExit) as exit_info, common_args.experiment_main("k_scaling"):
        k_scaling.cli(["--out", str(tmp_path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"python -m experiments.k_scaling: error: {tmp_path} is in use by process 4242; wait "
        "for that run to finish, or give another output folder"
    )


# ------------------------------------------------------------------------------------------
# Experiments run as modules
# ------------------------------------------------------------------------------------------


def _main_block(path: pathlib.Path) -> ast.If | None:
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
            return node
    return None


def test_every_runnable_experiment_enters_through_experiment_main():
    runnable = {p: _main_block(p) for p in (ROOT / "experiments").glob("*.py")}
    runnable = {p: block for p, block in runnable.items() if block is not None}
    assert len(runnable) >= len(run.EXPERIMENTS)
    for path, block in runnable.items():
        [statement] = block.body
        assert isinstance(statement, ast.With), path.name
        assert ast.unparse(statement.items[0].context_expr) == (
            f"experiment_main('{path.stem}')"
        ), path.name


def _run_module(name, *args, env=None):
    return subprocess.run(
        [sys.executable, "-m", f"experiments.{name}", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
    )


def test_experiment_module_reports_bad_arguments_in_one_line():
    done = _run_module("quickstart", "--epsilons", "0")
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        "python -m experiments.quickstart: error: epsilon must be a finite number > 0, got 0.0."
    )


def test_experiment_module_names_missing_tfds_data_and_how_to_prepare_it(tmp_path):
    done = _run_module("k_scaling", "--preset", "paper", env={"TFDS_DATA_DIR": str(tmp_path)})
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("python -m experiments.k_scaling: error: tfds data set 'imagenet2012'")
    assert "tfds build imagenet2012 --file_format array_record" in last


def test_missing_tfds_data_names_the_build_command(tmp_path):
    with pytest.raises(ValueError) as refused:
        tfds_sources.open_data_source("cifar100", "train", data_dir=str(tmp_path))
    assert (
        f"prepare it there first with `tfds build cifar100 --file_format array_record "
        f"--data_dir {tmp_path}`"
    ) in str(refused.value)
