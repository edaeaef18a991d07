"""The experiments' shared tail: a `Command`'s options, config and run, and what `finish` leaves."""

import argparse
import dataclasses
import json

import numpy as np
import pytest

from experiments.harness import Command, UsageError, finish


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings:
    seeds: tuple[int, ...] = (0, 1)
    progress: bool = True
    size: int = 1


def _options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size", type=int, default=1, help="the size")


def _config(args: argparse.Namespace) -> Settings:
    if args.size > 1 and args.preset != "large":
        raise UsageError("--size applies to --preset large")
    return Settings(size=args.size)


COMMAND = Command(
    name="example",
    description="An example.",
    writes="results.json, results.md",
    presets={"small": "a small run", "large": "a large run"},
    options=_options,
    quiet=True,
    config=_config,
    run=lambda config, args: (config, args),
)


def test_options_come_in_order_and_reach_the_config(tmp_path):
    flags = [a.option_strings[0] for a in COMMAND.parser()._actions if a.option_strings]
    assert flags[flags.index("--preset") :] == [
        "--preset", "--out", "--size", "--reproducible", "--seeds", "--quiet",
    ]  # fmt: skip
    argv = ["--preset", "large", "--size", "3", "--seeds", "7", "--quiet", "--out", str(tmp_path)]
    config, args = COMMAND(argv)
    assert config == Settings(seeds=(7,), progress=False, size=3)
    assert args.out == tmp_path and args.preset == "large" and not args.reproducible
    config, args = COMMAND([])
    assert config == Settings() and str(args.out) == "runs/example" and args.preset == "small"


def test_options_turned_off_are_absent():
    command = dataclasses.replace(COMMAND, presets=None, seeds=None, quiet=False)
    flags = {flag for a in command.parser()._actions for flag in a.option_strings}
    assert {"--out", "--reproducible"} <= flags
    assert not flags & {"--preset", "--seeds", "--quiet"}
    one = dataclasses.replace(COMMAND, seeds="one", reproducible=False)
    flags = {flag for a in one.parser()._actions for flag in a.option_strings}
    assert "--seeds" in flags and "--reproducible" not in flags


def test_contradicting_options_end_like_a_bad_option(capsys):
    with pytest.raises(SystemExit) as exit_info:
        COMMAND(["--size", "2"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: ") and err.strip().endswith(
        "error: --size applies to --preset large"
    )


def test_finish_writes_the_files_and_plots_and_prints_the_table(tmp_path, capsys):
    drawn = []
    results = {"value": np.float32(0.5), "rows": (1, 2)}
    returned = finish(
        tmp_path / "run",
        results,
        "| a |\n",
        name="study",
        plots={"curve.png": lambda r, path: drawn.append((r, path))},
    )
    assert returned is results
    assert json.loads((tmp_path / "run" / "study.json").read_text()) == {
        "value": 0.5,
        "rows": [1, 2],
    }
    assert (tmp_path / "run" / "study.md").read_text() == "| a |\n"
    assert drawn == [(results, tmp_path / "run" / "curve.png")]
    assert capsys.readouterr().out == "| a |\n\n"


def test_finish_without_a_folder_or_a_table(tmp_path, capsys):
    finish(None, {"a": 1}, "table")
    assert capsys.readouterr().out == "table\n" and not any(tmp_path.iterdir())
    finish(tmp_path, {"a": 1}, None, name="bench")
    assert [p.name for p in tmp_path.iterdir()] == ["bench.json"]
    assert capsys.readouterr().out == ""
