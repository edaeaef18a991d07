"""The `dpmix` command: help, argument errors, experiment dispatch."""

import subprocess
import sys

import pytest

from dpmix_jax import cli


def test_help_lists_the_commands(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for command in ("demo", "run", "audit", "bench", "experiments"):
        assert command in out


def test_experiments_are_listed_and_importable(capsys):
    assert cli.main(["experiments"]) == 0
    listed = capsys.readouterr().out
    import importlib.util

    for name in cli.EXPERIMENTS:
        assert name in listed
        assert importlib.util.find_spec(f"experiments.{name}") is not None, name


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["demo", "video"], "invalid choice"),
        (["demo", "--epsilons", "0"], "must be a finite number > 0"),
        (["demo", "--epsilons", "-1"], "must be a finite number > 0"),
        (["demo", "--seeds", "one"], "invalid int value"),
        (["run", "no_such_experiment"], "invalid choice"),
    ],
)
def test_bad_arguments_give_clear_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("command", ["bench", "audit"])
def test_shortcuts_pass_every_argument_to_the_experiment(command, capsys):
    # The experiment's own parser sees the options: an unknown preset is its error, not ours.
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, "--preset", "no_such_preset"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--preset: invalid choice: 'no_such_preset'" in err


def test_unknown_demo_method_is_rejected():
    with pytest.raises(SystemExit, match="unknown method"):
        cli.main(["demo", "--methods", "dp_mixmin", "oracle"])


def test_paper_preset_without_data_fails_naming_the_missing_folder(tmp_path):
    missing = tmp_path / "nih"
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "dpmix_jax.cli",
            "run",
            "nih_chexpert",
            "--preset",
            "paper",
            "--nih-root",
            str(missing),
            "--out",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode != 0
    assert str(missing) in completed.stderr
