"""Results tables of README.md and docs/*.md, rebuilt from checked-in results files.

A generated table sits between two markers:

    <!-- table:NAME VIEW -->
    ... generated, do not edit ...
    <!-- /table -->

NAME names `docs/results/NAME.json`, a copy of the `results.json` a run wrote (a comparison of
`compare.run_comparison` or an experiment; copied with `add_results`, or `dpmix report --add
NAME=RUN_DIR`, with the run's `results.md` as NAME.md and its plots), and VIEW is one of `VIEWS`:
the comparison views, the `ablation_*` views of `experiments.ablations`' file, or
`markdown`, the run's own `results.md`. `update_markdown` rewrites
every block from its file (`dpmix report`); `check_markdown` lists the blocks that differ from
their files (`dpmix report --check`, and a test), so a number in the docs is always the number
its run wrote, next to the command, date and commit that produced it. Numbers in the prose are
derived from the same files by hidden blocks, checked by `check_markdown` too (`numbers`).
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
from typing import Any

import numpy as np

from dpmix_jax.pipeline import compare, numbers
from dpmix_jax.pipeline.results import METHODS
from dpmix_jax.privacy.accounting import format_epsilon

MARKER = re.compile(
    r"(?P<open><!-- table:(?P<name>[\w.-]+) (?P<view>\w+) -->\n)"
    r"(?P<body>.*?)(?P<close><!-- /table -->)",
    re.S,
)


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
    for method in METHODS:
        rows = [table.get((method, eps), {}) for eps in epsilons]
        if not any("cosine_true" in row for row in rows):
            continue
        cells = [f"{row['cosine_true']:.3f}" if "cosine_true" in row else "" for row in rows]
        lines.append(f"| {compare.method_label(method, table)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _stored_markdown(results: dict[str, Any], source: str) -> str:
    """The run's own `results.md` (stored as NAME.md), its title dropped, its headings moved
    down so that the highest is level 4 (inside the "###" section of a page that shows it),
    its line on seeded noise dropped (the footer says it), then where it comes from."""
    seeded = results.get("noise_seeded")
    lines = results[MARKDOWN_KEY].strip("\n").splitlines()
    if lines and lines[0].startswith("# "):
        lines = lines[1:]
    if seeded is not None:
        lines = [line for line in lines if line.rstrip(".") != compare.SEEDED_NOTE]
    levels = [len(line) - len(line.lstrip("#")) for line in lines if line.startswith("#")]
    shift = "#" * (4 - min(levels, default=4))
    body = "\n".join(shift + line if line.startswith("#") else line for line in lines)
    body = re.sub(r"\n{3,}", "\n\n", body).strip("\n")
    origin = run_provenance(results)
    randomness = (
        f" {compare.SEEDED_NOTE[:1].upper()}{compare.SEEDED_NOTE[1:]}."
        if seeded
        else " Private randomness secret (from the operating system)."
        if seeded is False
        else ""
    )
    return (
        f"{body}\n\n{compare.provenance_line({'provenance': origin})}{randomness} Rebuilt by "
        f"`dpmix report` from `{source}` and its `.md`.\n"
    )


def _ablation_rows(results: dict[str, Any], study: str) -> list[tuple[dict, list[dict]]]:
    """(setting, its runs) of one study of an ablations file, Uniform's reference row first."""
    rows = []
    for setting in results["settings"]:
        if setting["study"] in ("uniform", study):
            runs = [r for r in results["runs"] if r["setting"] == setting["setting"]]
            rows.append((setting, runs))
    return rows


def _auc_cell(runs: list[dict]) -> str:
    utility = np.array([r["utility"] for r in runs])
    return f"{utility.mean():.4f} ± {utility.std():.4f}"


def _spent_cell(runs: list[dict]) -> str:
    return format_epsilon(max(r["spent_epsilon"] for r in runs), ".3f")


def _ablation_caption(results: dict[str, Any], what: str) -> str:
    return (
        f"{what}, at end-to-end ε = {results['epsilon']:g} (δ = {results['delta']:g}) on "
        f"{results['dataset']}; test AUC mean ± std over {len(results['seeds'])} seed(s) "
        "(higher is better) and spent ε, the accountants' end-to-end ε (max over seeds). "
        "Uniform (λ uniform, no mixture stage) is the reference row:"
    )


def _ablation_footer(results: dict[str, Any], source: str) -> str:
    randomness = compare.randomness_line(results)
    return (
        f"{compare.provenance_line(results)} {randomness[:1].upper()}{randomness[1:]} Rebuilt "
        f"by `dpmix report` from `{source}`.\n"
    )


def _ablation_rho(results: dict[str, Any], source: str) -> str:
    lines = [
        _ablation_caption(
            results,
            "DP-MixMin against ρ, the share of the sensitive train split given to D_mix (the "
            "rest is D_ft), with the expected mixture batch b scaled with ρ to keep the rate",
        ),
        "",
        "| setting | D_mix examples (mean) | expected batch b | rate b / \\|D_mix\\| | test AUC "
        "| spent ε |",
        "|---|---|---|---|---|---|",
    ]
    for setting, runs in _ablation_rows(results, "rho"):
        sizes = [r["mixture_examples"] for r in runs if r.get("mixture_examples")]
        size = rate = batch = ""
        if setting["method"] == "dp_mixmin":
            batch = f"{setting['mixture_batch_size']:g}"
            size = f"{np.mean(sizes):.1f}"
            rate = f"{np.mean([setting['mixture_batch_size'] / n for n in sizes]):.3f}"
        lines.append(
            f"| {setting['setting']} | {size} | {batch} | {rate} | {_auc_cell(runs)} | "
            f"{_spent_cell(runs)} |"
        )
    return "\n".join(lines) + "\n\n" + _ablation_footer(results, source)


def _ablation_proxy(results: dict[str, Any], source: str) -> str:
    lines = [
        _ablation_caption(
            results,
            "DP-MixMin against the proxy models' training budget (steps and epochs "
            "over the public data)",
        ),
        "",
        "| setting | proxy epochs | test AUC | spent ε |",
        "|---|---|---|---|",
    ]
    for setting, runs in _ablation_rows(results, "proxy"):
        epochs = f"{setting['proxy_epochs']:.2f}" if setting["study"] == "proxy" else ""
        lines.append(
            f"| {setting['setting']} | {epochs} | {_auc_cell(runs)} | {_spent_cell(runs)} |"
        )
    return "\n".join(lines) + "\n\n" + _ablation_footer(results, source)


def _ablation_composition(results: dict[str, Any], source: str) -> str:
    lines = [
        _ablation_caption(
            results,
            "DP-MixMin's two private stages composed in parallel (disjoint D_mix and D_ft, each "
            "at ε) or sequentially (both stages on the whole train split, ε split between them), "
            "and non-private MixMin (λ not private, only its fine-tuning is DP)",
        ),
        "",
        "| setting | ε_mix | ε_ft | test AUC | spent ε |",
        "|---|---|---|---|---|",
    ]
    for setting, runs in _ablation_rows(results, "composition"):
        stages = [
            format_epsilon(max(r["stage_epsilons"][stage] for r in runs), ".3f")
            if all(stage in r["stage_epsilons"] for r in runs)
            else ""
            for stage in ("mixture", "finetune")
        ]
        lines.append(
            f"| {setting['setting']} | {stages[0]} | {stages[1]} | {_auc_cell(runs)} | "
            f"{_spent_cell(runs)} |"
        )
    return "\n".join(lines) + "\n\n" + _ablation_footer(results, source)


def _stored_table(results: dict[str, Any], source: str) -> str:
    """The markdown table an experiment stored in its JSON (`"table"`), then where it comes from."""
    origin = run_provenance(results)
    return (
        f"{results['table'].strip()}\n\n{compare.provenance_line({'provenance': origin})}"
        f" Rebuilt by `dpmix report` from `{source}`.\n"
    )


VIEWS = {
    "utility": _utility,
    "budget": _budget,
    "weights": _weights,
    "ablation_rho": _ablation_rho,
    "ablation_proxy": _ablation_proxy,
    "ablation_composition": _ablation_composition,
    "markdown": _stored_markdown,
    "table": _stored_table,
}
MARKDOWN_KEY = "__markdown__"


def run_provenance(results: dict[str, Any]) -> dict[str, Any]:
    """A stored result's provenance (command, date, commit, machine), whether its writer nested
    it under "provenance" or wrote it at the top level."""
    origin = dict(results.get("provenance") or {})
    keys = ("command", "date", "commit", "version", "backend", "devices", "cpu_count")
    for key in (*keys, "peak_memory_gib"):
        if key in results and key not in origin:
            origin[key] = results[key]
    return origin


def render(view: str, results: dict[str, Any], source: str) -> str:
    """The markdown of one VIEW of a results file (`source` is how the text names the file)."""
    if view not in VIEWS:
        raise ValueError(f"unknown table view {view!r}; choose from {sorted(VIEWS)}.")
    if view.startswith("ablation_") and not {"settings", "runs", "seeds"} <= results.keys():
        raise ValueError(
            f"table view {view!r} needs the ablations.json of experiments.ablations; {source} "
            "has no 'settings', 'runs' and 'seeds'."
        )
    return VIEWS[view](results, source)


def add_results(name: str, run_dir: pathlib.Path, results_dir: pathlib.Path) -> list[pathlib.Path]:
    """Copies `run_dir/results.json` (or the folder's one results JSON, such as `rho_guide.json`)
    to `results_dir/NAME.json`, the markdown beside it to NAME.md and the run's plots to
    `results_dir/NAME_<plot>.png`; returns the written paths."""
    if not re.fullmatch(r"[\w.-]+", name):
        raise ValueError(f"a results name uses letters, digits, '_', '-' and '.', got {name!r}.")
    source = _results_file(pathlib.Path(run_dir))
    json.loads(source.read_text())  # a truncated file fails here, not in the README
    results_dir = pathlib.Path(results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    written = [results_dir / f"{name}.json"]
    shutil.copyfile(source, written[0])
    if source.with_suffix(".md").is_file():
        written.append(results_dir / f"{name}.md")
        shutil.copyfile(source.with_suffix(".md"), written[-1])
    for plot in sorted(pathlib.Path(run_dir).glob("*.png")):
        written.append(results_dir / f"{name}_{plot.name}")
        shutil.copyfile(plot, written[-1])
    return written


def _results_file(run_dir: pathlib.Path) -> pathlib.Path:
    """`run_dir/results.json`, or the run folder's one other JSON file (`rho_guide.json`, ...)."""
    if (run_dir / "results.json").is_file():
        return run_dir / "results.json"
    candidates = sorted(run_dir.glob("*.json"))
    if len(candidates) == 1:
        return candidates[0]
    found = ", ".join(p.name for p in candidates) or "none"
    raise ValueError(
        f"{run_dir / 'results.json'} does not exist and the folder has not exactly one other "
        f"results file (found: {found}): run the experiment into {run_dir} first."
    )


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
            if path.with_suffix(".md").is_file():
                cache[name][MARKDOWN_KEY] = path.with_suffix(".md").read_text()
        if view == "markdown" and MARKDOWN_KEY not in cache[name]:
            raise ValueError(f"table {name!r} (markdown) needs {path.with_suffix('.md')}.")
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
    """One line per marked table of `path` that differs from what its results file gives, and
    per number of its prose that its numbers block does not derive from the stored runs
    (`numbers.check_file`)."""
    return [*stale_tables(path, results_dir), *numbers.check_file(path, results_dir)[0]]


def stale_tables(path: pathlib.Path, results_dir: pathlib.Path) -> list[str]:
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
