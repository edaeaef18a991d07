"""Every command README.md and docs/*.md quote parses and starts; every generated table matches its
file; every linked page and image exists; the front page stays short."""

from __future__ import annotations

import argparse
import pathlib
import re
import shlex
import tomllib

import pytest

from dpmix_jax import cli, parallel, pipeline
from dpmix_jax.cli import arguments, generate, run
from dpmix_jax.cli import report as report_command
from dpmix_jax.pipeline import report

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCUMENTS = report.documents(ROOT)
RESULTS = ROOT / "docs" / "results"
# A quoted command with a placeholder (`dpmix run NAME [args]`, `--bands B`) is a template, not a
# command.
PLACEHOLDER = re.compile(r"\[|\b[A-Z][A-Z_]{2,}\b|(?<=\s)[A-Z](?=\s|$)")
COMMAND_START = re.compile(r"^(time |\.venv/bin/)?(dpmix( |$)|python3? -m experiments\.)")
# A command may ask for more devices (`--mesh data=8`) or processes (`--distributed`) than the
# test has: the mesh is parsed and checked for form only, and no process group is joined.
# Commands cheap enough to run to the end here (with tiny settings where a flag allows).
RUN_FULLY = {
    ("experiments",): [],
    ("run", "quickstart"): ["--steps", "10"],
    ("report", "--check"): [],
}


def _bash_lines(text: str) -> list[str]:
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        joined = block.replace("\\\n", " ")
        for line in joined.splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith("#"):
                lines.extend(part.strip() for part in line.split("&&"))
    return lines


def _inline_commands(text: str) -> list[str]:
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    return [c.strip() for c in re.findall(r"`([^`\n]+)`", prose) if COMMAND_START.match(c.strip())]


def readme_commands() -> list[str]:
    text = "\n".join(path.read_text() for path in DOCUMENTS)
    seen: dict[object, str] = {}
    for command in _bash_lines(text) + _inline_commands(text):
        argv = dpmix_argv(command)
        seen.setdefault(command if argv is None else tuple(argv), command)
    return list(seen.values())


def dpmix_argv(command: str) -> list[str] | None:
    """The `dpmix` arguments equivalent to a README command, or None for a set-up command."""
    words = shlex.split(command)
    while words and re.fullmatch(r"\w+=\S*", words[0]):  # VAR=value dpmix ...
        words = words[1:]
    if words[0] == "time":
        words = words[1:]
    program = pathlib.PurePosixPath(words[0]).name
    if program == "dpmix":
        return words[1:]
    if program.startswith("python") and words[1] == "-m" and words[2].startswith("experiments."):
        return ["run", words[2].removeprefix("experiments."), *words[3:]]
    return None


def test_the_readme_quotes_the_main_commands():
    commands = readme_commands()
    assert len(commands) >= 15, commands
    argvs = [dpmix_argv(c) for c in commands]
    for expected in (["demo"], ["audit", "--preset", "cpu"], ["run", "enron", "--preset", "cpu"]):
        assert expected in argvs, expected


def _check_setup_command(command: str) -> None:
    """Set-up lines (venv, pip, pytest) are not run here; what they name must exist."""
    words = shlex.split(command)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    if words[:3] == ["python3", "-m", "venv"]:
        return
    if pathlib.PurePosixPath(words[0]).name == "pip":
        for target in words[words.index("install") + 1 :]:
            match = re.fullmatch(r"\.(?:\[(\w+)\])?", target)
            if match and match[1]:
                assert match[1] in project["project"]["optional-dependencies"], command
        return
    if words[1:3] == ["-m", "pytest"]:
        if "-m" in words[3:]:
            expression = words[words.index("-m", 3) + 1]
            declared = {
                m.split(":")[0] for m in project["tool"]["pytest"]["ini_options"]["markers"]
            }
            used = set(re.findall(r"\w+", expression)) - {"and", "or", "not"}
            assert used <= declared, (command, used - declared)
        return
    raise AssertionError(
        f"the README command {command!r} is neither dpmix, an experiment nor set-up"
    )


class _Started(Exception):
    """Raised once an experiment's parser has accepted its arguments."""


@pytest.mark.parametrize("command", readme_commands())
def test_readme_command_parses_and_starts(command, monkeypatch, tmp_path, capsys):
    argv = dpmix_argv(command)
    if argv is None:
        _check_setup_command(command)
        return
    if PLACEHOLDER.search(shlex.join(argv)):
        pytest.skip(f"template with placeholders: {command}")
    full = next((extra for key, extra in RUN_FULLY.items() if tuple(argv) == key), None)
    if full is not None:
        monkeypatch.chdir(ROOT)
        assert cli.main(argv + full) == 0, capsys.readouterr()
        return
    monkeypatch.chdir(tmp_path)  # nothing the command starts writes into the checkout
    parse_args = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, *args, **kwargs):
        namespace = parse_args(self, *args, **kwargs)
        raise _Started(self.prog, namespace)

    real_run = run.run

    def start_experiment(args: argparse.Namespace) -> int:
        monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
        with pytest.raises(_Started):
            real_run(args)
        return 0

    def fake_comparison(stages, **kwargs):
        assert kwargs["methods"] and kwargs["epsilons"] and kwargs["seeds"]
        (kwargs["out_dir"] / "results.md").write_text("")
        return {"runs": []}

    # The demo builds its task and pipeline, then stops; generate and report do not start.
    monkeypatch.setattr(run, "run", start_experiment)
    monkeypatch.setattr(pipeline, "run_comparison", fake_comparison)
    monkeypatch.setattr(generate, "run", lambda args: 0)
    monkeypatch.setattr(report_command, "run", lambda args: 0)
    monkeypatch.setattr(
        arguments, "use_mesh", lambda args: args.mesh and parallel.parse_mesh(args.mesh)
    )
    try:
        assert cli.main(argv) == 0
    except SystemExit as exit_info:  # `--help` and `--version` exit 0 after printing
        assert exit_info.code == 0, capsys.readouterr().err


def test_readme_tables_match_their_results_files():
    assert report.MARKER.search(README.read_text()), "the README has no generated table"
    for path in DOCUMENTS:
        assert report.check_markdown(path, RESULTS) == [], path


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: p.name)
def test_linked_pages_and_images_exist(path):
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
        if not target.startswith(("http://", "https://")):
            assert (path.parent / target).exists(), f"{path.name} links to missing {target}"


def test_the_front_page_is_short():
    assert len(README.read_text().splitlines()) <= 250
