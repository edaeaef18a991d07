"""The `dpmix` command: help, argument errors, experiment dispatch."""

import argparse
import pathlib
import subprocess
import sys

import pytest

from dpmix_jax import cli
from dpmix_jax.cli import errors, run

ROOT = pathlib.Path(__file__).resolve().parents[2]


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

    for name in run.EXPERIMENTS:
        assert name in listed
        assert importlib.util.find_spec(f"experiments.{name}") is not None, name


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["demo", "video"], "invalid choice"),
        (["demo", "--epsilons", "0"], "must be a finite number > 0"),
        (["demo", "--epsilons", "-1"], "must be a finite number > 0"),
        (["demo", "--seeds", "one"], "argument --seeds"),
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


def test_unknown_demo_method_is_rejected(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["demo", "--methods", "dp_mixmin", "oracle"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'oracle'" in capsys.readouterr().err


def test_the_demo_offers_the_pipeline_methods_and_the_run_help_loads_no_library(capsys):
    from dpmix_jax.pipeline import METHODS

    parser = cli.build_parser()
    (demo_parser,) = [p for p in parser._subparsers._group_actions[0].choices.values()
                      if p.prog == "dpmix demo"]  # fmt: skip
    demo_parser.format_help()  # the options are added on first use
    (methods,) = [a for a in demo_parser._actions if a.dest == "methods"]
    assert tuple(methods.choices) == METHODS and methods.default == list(METHODS)


def _help(argv, monkeypatch, capsys):
    """The help text of `dpmix ARGV --help` and the parser that printed it."""
    printed = []
    print_help = argparse.ArgumentParser.print_help

    def record(self, file=None):
        printed.append(self)
        print_help(self, file)

    monkeypatch.setattr(argparse.ArgumentParser, "print_help", record)
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*argv, "--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out, printed[-1]


@pytest.mark.parametrize(
    ("argv", "prog"),
    [
        ([], "dpmix"),
        (["demo"], "dpmix demo"),
        (["run"], "dpmix run"),
        (["audit"], "dpmix audit"),
        (["bench"], "dpmix bench"),
        (["report"], "dpmix report"),
        *[(["run", name], f"dpmix run {name}") for name in run.EXPERIMENTS],
    ],
)
def test_help_shows_every_option_with_its_default(argv, prog, monkeypatch, capsys):
    text, parser = _help(argv, monkeypatch, capsys)
    assert text.startswith(f"usage: {prog} ")
    assert "SPEC" not in text and "examples:" in text
    flat = " ".join(text.split())
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction | argparse._VersionAction):
            continue
        if isinstance(action, argparse._SubParsersAction):
            for name in action.choices:
                assert f" {name} " in flat, name
            continue
        for option in action.option_strings:
            assert option in flat, option
        assert action.help, f"{prog}: {action.dest} has no help"
        if action.default is None and action.option_strings:
            assert "default" in action.help, f"{prog}: {action.dest} does not say its default"
        elif action.default != argparse.SUPPRESS and action.option_strings:
            assert f"(default: {action.default})" in flat, (prog, action.dest, action.default)


# The options that mean the same in every command; an experiment lacks one only for a reason.
ONE_SEED = {
    "audit",
    "discrete_noise",
    "hot_pate",
    "hot_pate_ablations",
    "hot_pate_scaling",
}  # one run, from the config's `seed`
NO_SEEDS = {"bench_grads", "bench_generation"}  # fixed keys: timing benchmarks, nothing private
NOT_REPRODUCIBLE = {"audit", "bench_grads", "bench_generation"}  # always seeded
NO_OUT = {"quickstart"}  # prints its results, writes nothing
SHOWS_PROGRESS = {
    "nih_chexpert", "nih_mimic", "enron", "openwebmath", "ablations", "per_task",
    "patient_level", "small_eps", "gsd",
}  # fmt: skip


class _Parsed(Exception):
    def __init__(self, namespace: argparse.Namespace):
        self.namespace = namespace


def _parsed(argv, monkeypatch) -> argparse.Namespace:
    """The arguments `dpmix ARGV` gives its command (stopped once they are parsed)."""
    parse_args = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, *args, **kwargs):
        raise _Parsed(parse_args(self, *args, **kwargs))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    with pytest.raises(_Parsed) as parsed:
        cli.main(argv)
    return parsed.value.namespace


@pytest.mark.parametrize("name", ["demo", *run.EXPERIMENTS])
def test_every_command_takes_the_common_options(name, tmp_path, monkeypatch):
    seeds = [] if name in NO_SEEDS else ["3"] if name in ONE_SEED else ["3", "4"]
    argv = [
        *(["--out", str(tmp_path / "out")] if name not in NO_OUT else []),
        *(["--seeds", *seeds] if seeds else []),
        *(["--quiet"] if name in SHOWS_PROGRESS or name == "demo" else []),
        *(["--reproducible"] if name not in NOT_REPRODUCIBLE else []),
    ]
    if name == "demo":
        args, _ = cli.build_parser().parse_known_args(["demo", *argv])
    else:
        args = _parsed(["run", name, *argv], monkeypatch)
    assert getattr(args, "seeds", None) == ([int(seed) for seed in seeds] if seeds else None)
    assert getattr(args, "quiet", False) == ("--quiet" in argv)
    assert getattr(args, "reproducible", False) == ("--reproducible" in argv)
    if name not in NO_OUT:
        assert pathlib.Path(args.out) == tmp_path / "out"
    assert not vars(args).keys() & {"seed", "epsilon", "json"}  # no singular or stray forms


def test_common_options_reach_the_config():
    from experiments.common_args import with_common_options
    from experiments.configs import hot_pate, nih, per_task

    config = per_task.get_config("paper")
    assert config.pipeline.finetune.progress  # the paper preset shows training progress
    quiet = with_common_options(config, argparse.Namespace(seeds=[5, 6], quiet=True))
    assert quiet.seeds == (5, 6)
    assert not any(
        stage.progress
        for stage in (quiet.pipeline.proxy, quiet.pipeline.pretrain, quiet.pipeline.finetune)
    )
    unchanged = with_common_options(config, argparse.Namespace(seeds=None, quiet=False))
    assert unchanged == config
    assert with_common_options(hot_pate.get_config("tiny"), argparse.Namespace(seeds=[7])).seed == 7
    with pytest.raises(ValueError, match="argument --seeds: this experiment runs one seed"):
        with_common_options(hot_pate.get_config("tiny"), argparse.Namespace(seeds=[7, 8]))
    assert nih.get_config("chexpert", "cpu").seeds != (9,)
    assert with_common_options(
        nih.get_config("chexpert", "cpu"), argparse.Namespace(seeds=[9])
    ).seeds == (9,)


def test_run_help_lists_the_experiments(capsys):
    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    out = capsys.readouterr().out
    for name, text in run.EXPERIMENTS.items():
        assert f"{name}  " in out and text in out


@pytest.mark.parametrize(
    "argv",
    [
        ["-m", "experiments.quickstart", "--help"],
        ["-m", "dpmix_jax.cli", "run", "quickstart", "--help"],
    ],
)
def test_experiment_help_answers_without_loading_jax(argv):
    # `--help` exits at parsing; JAX, the accountants and the data are imported after it.
    check = (
        "import runpy, sys\n"
        f"sys.argv = {[argv[1], *argv[2:]]!r}\n"
        "try:\n"
        f"    runpy.run_module({argv[1]!r}, run_name='__main__', alter_sys=True)\n"
        "except SystemExit as exit_info:\n"
        "    assert exit_info.code == 0, exit_info.code\n"
        "loaded = sorted(m for m in ('jax', 'numpy', 'dp_accounting') if m in sys.modules)\n"
        "assert not loaded, loaded\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", check], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout and "--reproducible" in done.stdout


def test_version(capsys):
    import importlib.metadata

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"dpmix {importlib.metadata.version('dpmix_jax')}"


def test_demo_delta_reaches_the_pipeline_config(monkeypatch, tmp_path):
    from dpmix_jax import pipeline

    seen = {}

    def fake_comparison(stages, **kwargs):
        seen["delta"] = stages.config.delta
        (kwargs["out_dir"] / "results.md").write_text("")
        return {"runs": []}

    monkeypatch.setattr(pipeline, "run_comparison", fake_comparison)
    assert cli.main(["demo", "--delta", "1e-6", "--out", str(tmp_path)]) == 0
    assert seen["delta"] == 1e-6


@pytest.mark.parametrize("value", ["0", "1", "-1e-5", "nan"])
def test_demo_delta_must_be_a_probability(value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["demo", f"--delta={value}"])
    assert exit_info.value.code == 2
    assert "argument --delta must be in the open interval (0, 1)" in capsys.readouterr().err


def test_demo_text_writes_to_its_own_default_folder(monkeypatch, tmp_path):
    from dpmix_jax import pipeline

    outs = []

    def fake_comparison(stages, **kwargs):
        outs.append(kwargs["out_dir"])
        (kwargs["out_dir"] / "results.md").write_text("")
        return {"runs": []}

    monkeypatch.setattr(pipeline, "run_comparison", fake_comparison)
    monkeypatch.chdir(tmp_path)
    cli.main(["demo", "text", "--methods", "uniform"])
    cli.main(["demo", "--methods", "uniform"])
    assert outs == [pathlib.Path("runs/demo_text"), pathlib.Path("runs/demo")]


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


@pytest.mark.parametrize(("flags", "seeded"), [([], False), (["--reproducible"], True)])
def test_demo_seeds_private_randomness_only_with_reproducible(flags, seeded, tmp_path, monkeypatch):
    import dpmix_jax.pipeline

    seen = []

    def fake_comparison(pipeline, *, out_dir, **kwargs):
        seen.append(pipeline.reproducible)
        (out_dir / "results.md").write_text("table\n")
        return {"runs": []}

    monkeypatch.setattr(dpmix_jax.pipeline, "run_comparison", fake_comparison)
    assert cli.main(["demo", "--quiet", "--out", str(tmp_path), *flags]) == 0
    assert seen == [seeded]


def test_demo_delta_of_one_over_n_is_refused_unless_allowed(monkeypatch, tmp_path, capsys):
    from dpmix_jax import pipeline

    seen = {}

    def fake_comparison(stages, **kwargs):
        seen["allow"] = stages.config.allow_large_delta
        stages.check_delta(0)
        (kwargs["out_dir"] / "results.md").write_text("")
        return {"runs": []}

    monkeypatch.setattr(pipeline, "run_comparison", fake_comparison)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["demo", "--delta", "0.5", "--out", str(tmp_path / "a")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --delta: delta = 0.5 >= 1/n" in err and seen["allow"] is False
    assert "or --allow-large-delta to run anyway" in err and "allow_large_delta=True" not in err
    args = ["demo", "--delta", "0.5", "--allow-large-delta", "--out", str(tmp_path / "b")]
    assert cli.main(args) == 0 and seen["allow"] is True


def test_a_large_delta_without_an_override_flag_names_none(capsys):
    # An experiment has no --allow-large-delta: its message says what to change, nothing else.
    from dpmix_jax.privacy.validation import LargeDeltaError

    with pytest.raises(SystemExit), errors.one_line_errors("dpmix run enron"):
        raise LargeDeltaError(0.01, 148, "users", "delta")
    err = capsys.readouterr().err
    assert "delta = 0.01 >= 1/n" in err and "users" in err
    assert "allow" not in err and "anyway" not in err


# ---------------------------------------------------------------------------------------------
# What a new user meets: abbreviations, batch sizes, failed runs, what a guarantee is about.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "meant"),
    [
        (["demo", "--epsilon", "1"], "--epsilons"),
        (["demo", "--seed=0"], "--seeds"),
        (["generate", "--num-sample", "2"], "--num-samples"),
        (["run", "quickstart", "--step", "3"], "--steps"),
    ],
)
def test_an_abbreviated_option_is_refused_before_anything_runs(argv, meant, tmp_path, capsys):
    # `--epsilon 1` used to run as `--epsilons 1` and overwrite a 45-run grid with 15 runs.
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*argv, "--out", str(out)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "abbreviations are not accepted" in err and f"did you mean {meant}?" in err
    assert not out.exists()


def _fake_demo(monkeypatch):
    from dpmix_jax import pipeline

    seen = {}

    def fake_comparison(stages, **kwargs):
        seen.update(config=stages.config, **kwargs)
        (kwargs["out_dir"] / "results.md").write_text("")
        return {"runs": []}

    monkeypatch.setattr(pipeline, "run_comparison", fake_comparison)
    return seen


def test_demo_batch_sizes_and_privacy_unit_reach_the_run(monkeypatch, tmp_path):
    seen = _fake_demo(monkeypatch)
    argv = ["demo", "--batch-size", "96", "--mixture-batch-size", "64", "--out", str(tmp_path)]
    assert cli.main(argv) == 0
    assert seen["config"].finetune.batch_size == 96 and seen["config"].mixture.batch_size == 64
    assert seen["privacy_unit"] == "per image"
    assert cli.main(["demo", "text", "--out", str(tmp_path / "text")]) == 0
    assert seen["privacy_unit"].startswith("per user (user-level")


def test_a_batch_too_large_for_its_bands_names_the_demo_options(capsys):
    from dpmix_jax.privacy.plan import BatchTooLargeError

    options = "--batch-size (fine-tuning) or --mixture-batch-size (DP-MixMin), or --bands"
    with pytest.raises(ValueError) as info, errors.in_command_line_terms(None, options):
        raise BatchTooLargeError(120, 4, 331, "examples")
    assert str(info.value) == (
        "batch_size 120 x 4 bands > 331 examples: the rate q = batch_size / (n / bands) would "
        f"exceed 1; lower {options}."
    )


@pytest.mark.parametrize("experiment", ["nih_chexpert", "enron", "openwebmath"])
def test_paper_presets_without_data_fail_alike_and_leave_no_folder(experiment, tmp_path, capsys):
    out = tmp_path / "new" / "out"
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["run", experiment, "--preset", "paper", "--out", str(out)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"dpmix run {experiment}: error: missing ")
    assert not (tmp_path / "new").exists()  # the lock's folder and its parent are gone again


def test_the_folder_lock_is_owner_only(tmp_path):
    from dpmix_jax.pipeline import folders

    with folders.folder_lock(tmp_path / "out") as folder:
        assert (folder / folders.LOCK_NAME).stat().st_mode & 0o777 == 0o600
        (folder / "results.json").write_text("{}")
    assert (tmp_path / "out" / "results.json").exists()  # a folder with outputs stays
