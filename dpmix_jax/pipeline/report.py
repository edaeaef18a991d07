"""Results tables of README.md and docs/*.md, rebuilt from checked-in results files.

A generated table sits between two markers:

    <!-- table:NAME VIEW -->
    ... generated, do not edit ...
    <!-- /table -->

NAME names `docs/results/NAME.json`, a copy of the `results.json` a comparison wrote
(`compare.run_comparison`; copied with `add_results`, or `dpmix report --add NAME=RUN_DIR`), and
VIEW is one of `VIEWS`. `update_markdown` rewrites every block from its file (`dpmix report`);
`check_markdown` lists the blocks that differ from their files (`dpmix report --check`, and a
test), so a number in the README is always the number its run wrote, next to the command, date
and commit that produced it.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
from typing import Any

from dpmix_jax.pipeline import common, compare

MARKER = re.compile(
    r"(?P<open><!-- table:(?P<name>[\w.-]+) (?P<view>\w+) -->\n)"
    r"(?P<body>.*?)(?P<close><!-- /table -->)",
    re.S,
)
PLOTS = ("utility_vs_epsilon.png", "weights.png")


def _utility(results: dict[str, Any], source: str) -> str:
    randomness = compare.randomness_line(results)
    return (
        f"{compare.utility_caption(results)}\n\n{compare.utility_table(results)}\n"
        f"{compare.provenance_line(results)} {randomness[:1].upper()}{randomness[1:]} Rebuilt "
        f"by `dpmix report` from `{source}`.\n"
    )


def _budget(results: dict[str, Any], source: str) -> str:
    return (
        "Spent ε (the accountants', max over seeds) and λ quality (mean cosine over seeds to the "
        "true λ* and to non-private MixMin's λ on the same split):\n\n"
        f"{compare.budget_table(results)}"
    )


def _weights(results: dict[str, Any], source: str) -> str:
    table = compare.summarize(results)
    epsilons = sorted({eps for _, eps in table})
    lines = [
        f"λ's cosine to the true mixture λ*, mean over {compare.seed_count(results)} seeds:",
        "",
        "| method | " + " | ".join(f"ε = {e:g}" for e in epsilons) + " |",
        "|---|" + "---|" * len(epsilons),
    ]
    for method in common.METHODS:
        rows = [table.get((method, eps), {}) for eps in epsilons]
        if not any("cosine_true" in row for row in rows):
            continue
        cells = [f"{row['cosine_true']:.3f}" if "cosine_true" in row else "" for row in rows]
        lines.append(f"| {compare.method_label(method, table)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


VIEWS = {"utility": _utility, "budget": _budget, "weights": _weights}


def render(view: str, results: dict[str, Any], source: str) -> str:
    """The markdown of one VIEW of a results file (`source` is how the text names the file)."""
    if view not in VIEWS:
        raise ValueError(f"unknown table view {view!r}; choose from {sorted(VIEWS)}.")
    return VIEWS[view](results, source)


def add_results(name: str, run_dir: pathlib.Path, results_dir: pathlib.Path) -> list[pathlib.Path]:
    """Copies `run_dir/results.json` to `results_dir/NAME.json` and its plots to
    `results_dir/NAME_<plot>.png`; returns the written paths."""
    if not re.fullmatch(r"[\w.-]+", name):
        raise ValueError(f"a results name uses letters, digits, '_', '-' and '.', got {name!r}.")
    source = pathlib.Path(run_dir) / "results.json"
    if not source.is_file():
        raise ValueError(f"{source} does not exist: run the comparison into {run_dir} first.")
    json.loads(source.read_text())  # a truncated file fails here, not in the README
    results_dir = pathlib.Path(results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    written = [results_dir / f"{name}.json"]
    shutil.copyfile(source, written[0])
    for plot in PLOTS:
        if (pathlib.Path(run_dir) / plot).is_file():
            written.append(results_dir / f"{name}_{plot}")
            shutil.copyfile(pathlib.Path(run_dir) / plot, written[-1])
    return written


def rebuild(
    text: str, results_dir: pathlib.Path, *, relative_to: pathlib.Path
) -> tuple[str, list[str]]:
    """`text` with every marked table rendered from its results file, and the tables' names.

    Raises:
        ValueError: a marked table's results file is missing or not JSON (naming it).
    """
    names = []
    cache: dict[str, dict[str, Any]] = {}

    def replace(match: re.Match) -> str:
        name, view = match["name"], match["view"]
        path = pathlib.Path(results_dir) / f"{name}.json"
        source = pathlib.Path(os.path.relpath(path, relative_to)).as_posix()
        if name not in cache:
            if not path.is_file():
                raise ValueError(
                    f"table {name!r} needs {path}: run its command and "
                    f"`dpmix report --add {name}=RUN_DIR`."
                )
            try:
                cache[name] = json.loads(path.read_text())
            except json.JSONDecodeError as err:
                raise ValueError(f"{path} is not valid JSON: {err}") from err
        names.append(f"{name}:{view}")
        return match["open"] + render(view, cache[name], source) + match["close"]

    return MARKER.sub(replace, text), names


def documents(root: pathlib.Path) -> list[pathlib.Path]:
    """The markdown files whose tables `dpmix report` rebuilds: README.md and docs/*.md."""
    root = pathlib.Path(root)
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def update_markdown(path: pathlib.Path, results_dir: pathlib.Path) -> list[str]:
    """Rewrites every marked table of the file at `path`; returns their names."""
    path = pathlib.Path(path)
    text = path.read_text()
    new, names = rebuild(text, results_dir, relative_to=path.parent)
    if new != text:
        path.write_text(new)
    return names


def check_markdown(path: pathlib.Path, results_dir: pathlib.Path) -> list[str]:
    """One line per marked table of `path` that differs from what its results file gives."""
    path = pathlib.Path(path)
    stale = []
    for match in MARKER.finditer(path.read_text()):
        expected, _ = rebuild(match[0], results_dir, relative_to=path.parent)
        if expected != match[0]:
            stale.append(
                f"{path}: table {match['name']} ({match['view']}) differs from "
                f"{pathlib.Path(results_dir) / (match['name'] + '.json')}; run `dpmix report`."
            )
    return stale
