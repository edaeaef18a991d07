"""Methods × ε × seeds through one pipeline: `results.json`, a markdown table and plots.

`results.json` has the shape
`{"dataset", "metric", "higher_is_better", "runs": [{"method", "epsilon", "delta", "seed",
"utility", "weights", "private", ...}], "true_weights", "methods", "source_names", "seconds",
"reused_runs", "provenance"}`; every ε in it is the ε the accountants reported for what ran
(`spent_epsilon`), beside the target (`epsilon`). `provenance` records the command, date, commit,
package version and machine of this command, and each run's `origin` the command that computed
that run (`{"provenance", "seconds"}`; `provenance` None: this command), so that a number copied
from it can be traced: a run read back from stored stages keeps the origin it was computed with,
which the output folder's `run_origins.json` remembers across commands (an empty origin: read
back, origin not recorded). A command that replaces the results of another grid says so.
`noise_seeded` (per run, and overall when any run was) is True when the seeds drove the private
randomness: reproducible, and not private against anyone who knows the seed (`results.md` then
says `privacy.SEEDED_NOTE`); otherwise the randomness was secret and `seed` only numbers the
repetition. `privacy_unit`, when the caller names it, says what each (ε, δ) protects ("per image",
"per patient (user-level, up to 4 images)"); the tables' caption repeats it.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.metadata
import itertools
import json
import math
import os
import pathlib
import resource
import shlex
import sys
import time
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import tqdm

from dpmix_jax import checkout, interrupt, parallel
from dpmix_jax.mixing import cosine_similarity, l1_distance
from dpmix_jax.pipeline import folders
from dpmix_jax.pipeline.progress import ProgressListener
from dpmix_jax.pipeline.results import METHOD_NOTES, METHODS, Method, RunResult
from dpmix_jax.privacy import SEEDED_NOTE
from dpmix_jax.privacy.accounting import format_epsilon

METHOD_NAMES = {
    "dp_mixmin": "DP-MixMin",
    "uniform": "Uniform",
    "random_init": "Random Init",
    "random_search": "Random Search",
    "nonprivate_mixmin": "non-private MixMin",
}
# Why a method is only a reference point (its runs carry `"private": false`).
REFERENCE_NOTES = {
    "random_search": "non-private selection",
    "nonprivate_mixmin": "λ not private, only its fine-tuning is DP",
}

_STAGE_LABELS = {
    "split": "split",
    "tokenizer": "tokenizer",
    "proxy": "proxy",
    "proxy_outputs": "proxy outputs",
    "mixture": "mixture (DP-MixMin)",
    "nonprivate_mixture": "mixture (non-private)",
    "pretrain": "pretrain on λ",
    "finetune": "DP fine-tune",
}


class Pipeline(Protocol):
    root: pathlib.Path

    def run(self, method: Method, epsilon: float, seed: int) -> RunResult: ...

    def add_listener(self, listener: ProgressListener) -> None: ...

    def remove_listener(self, listener: ProgressListener) -> None: ...


class _GridProgress:
    """One bar over the grid whose text names the run, its stage and the stage's step; also
    counts the runs read back from the stage store (a resumed comparison)."""

    def __init__(self, total: int, desc: str, *, enabled: bool, store: pathlib.Path):
        self._bar = tqdm.tqdm(total=total, desc=desc, disable=not enabled, unit="run")
        self._enabled = enabled
        self._store = store
        self._run = ""
        self._stage = ""
        self._shown = 0.0
        self.reused_runs = 0
        self._announced = 0

    def start_run(self, label: str) -> None:
        self._run, self._stage = label, ""
        self._show()

    def stage(self, name: str) -> None:
        if not self._announced:
            self._announce_reuse()
        base = "pretrain" if name.startswith("pretrain") else name
        # The first steps of a stage compile (several seconds on CPU) before they run.
        self._stage = f"{_STAGE_LABELS.get(base, base)} (compiling)"
        self._show()

    def step(self, done: int, total: int) -> None:
        compiled = self._stage.endswith(" (compiling)")
        label = self._stage.removesuffix(" (compiling)").rsplit(" step ", 1)[0]
        self._stage = f"{label} step {done}/{total}"
        if compiled or done == total or time.monotonic() - self._shown > 0.25:
            self._show()

    def reused(self, name: str) -> None:
        self.reused_runs += 1

    def finish_run(self) -> None:
        self._bar.update(1)

    def close(self) -> None:
        self._announce_reuse()
        self._bar.close()

    def _announce_reuse(self) -> None:
        """Says how many finished runs were read back: when the first stage must be computed,
        and at the end if more were read back since."""
        if self.reused_runs > self._announced:
            again = " in all" if self._announced else ""
            self._announced = self.reused_runs
            plural = "" if self.reused_runs == 1 else "s"
            message = (
                f"reused {self.reused_runs} finished run{plural} (read back from the stage store "
                f"{self._store}){again}"
            )
            if self._enabled:
                self._bar.write(message)
            else:
                print(message, flush=True)

    def _show(self) -> None:
        self._shown = time.monotonic()
        text = f"{self._run}: {self._stage}" if self._stage else self._run
        self._bar.set_postfix_str(text)


def peak_memory_gib() -> float:
    """The largest resident memory of this process and its finished children so far, in GiB."""
    peak_kib = max(
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss,
    )
    return peak_kib / 2**20


def provenance() -> dict[str, Any]:
    """Where a result comes from: command, UTC date, commit, package version, machine, and the
    peak resident memory so far (the run's peak when called as the run ends)."""
    import jax

    try:
        version = importlib.metadata.version("dpmix_jax")
    except importlib.metadata.PackageNotFoundError:
        version = None
    return {
        "command": _command_line(),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
        "commit": checkout.commit(),
        "version": version,
        "backend": jax.default_backend(),
        "devices": jax.device_count(),
        "cpu_count": os.cpu_count(),
        "peak_memory_gib": round(peak_memory_gib(), 2),
    }


def _command_line() -> str:
    program = pathlib.Path(sys.argv[0])
    if program.suffix == ".py" and program.parent.name == "experiments":
        words = ["python", "-m", f"experiments.{program.stem}"]
    else:
        words = [program.name]
    return shlex.join([*words, *sys.argv[1:]])


def run_comparison(
    pipeline: Pipeline,
    *,
    dataset: str,
    metric: str,
    higher_is_better: bool,
    methods: Sequence[str],
    epsilons: Sequence[float],
    seeds: Sequence[int],
    out_dir: str | pathlib.Path,
    true_weights: np.ndarray | None = None,
    source_names: Sequence[str] | None = None,
    reference_method: str | None = "nonprivate_mixmin",
    progress: bool = True,
    privacy_unit: str | None = None,
) -> dict[str, Any]:
    """Runs every (method, ε, seed), then writes `results.json`, `results.md` and plots.

    Args:
        pipeline: a `mixture_pipeline.MixturePipeline` (stages stored, so an interrupted comparison
            resumes; the runs it reads back are counted and reported).
        dataset, metric, higher_is_better: describe the utility in the outputs.
        methods, epsilons, seeds: the grid.
        out_dir: where the outputs go. It is locked for the run (`folders.folder_lock`: a
            second run on it stops, naming this one's process), and it holds one data set's
            results: a `results.json` of another data set there is an error, not overwritten.
        true_weights: the λ* that generated the sensitive data, when known.
        source_names: names of the k public sources (for the weights plot).
        reference_method: whose λ DP-MixMin's is compared with per seed (cosine, L1).
        progress: show a progress bar (run, stage and step).
        privacy_unit: what each (ε, δ) protects, e.g. "per image" (stored and shown when given).

    Returns:
        The `results.json` content.
    """
    for method in methods:
        if method not in METHODS:
            raise ValueError(f"unknown method {method!r}; choose from {METHODS}.")
    if not epsilons or not seeds or not methods:
        raise ValueError("methods, epsilons and seeds must be non-empty.")
    out_dir = pathlib.Path(out_dir)
    # One writer per folder; the stage store is locked too when it lives elsewhere. The
    # processes of one multi-process run share the folders: process 0 holds the locks.
    lock = folders.folder_lock if parallel.is_main_process() else contextlib.nullcontext
    with lock(out_dir), lock(pipeline.root):
        _check_one_dataset(out_dir, dataset)
        grid = list(itertools.product(seeds, epsilons, methods))
        _say_if_replacing_another_grid(out_dir / "results.json", grid)
        origins = _read_origins(out_dir / ORIGINS_FILE)
        start = time.perf_counter()
        bar = _GridProgress(len(grid), dataset, enabled=progress, store=pipeline.root)
        pipeline.add_listener(bar)
        runs = []
        try:
            for seed, epsilon, method in grid:
                interrupt.raise_if_interrupted()
                bar.start_run(f"{method} ε={epsilon:g} seed={seed}")
                reused, run_start = bar.reused_runs, time.perf_counter()
                run = pipeline.run(method, float(epsilon), int(seed)).to_json()
                if bar.reused_runs > reused:
                    run["origin"] = origins.get(_run_key(run), {})
                else:
                    run["origin"] = {"provenance": None, "seconds": time.perf_counter() - run_start}
                runs.append(run)
                bar.finish_run()
        finally:
            pipeline.remove_listener(bar)
            bar.close()
        results = {
            "dataset": dataset,
            "metric": metric,
            "higher_is_better": higher_is_better,
            "noise_seeded": any(run["noise_seeded"] for run in runs),
            "runs": runs,
            "true_weights": None if true_weights is None else np.asarray(true_weights).tolist(),
            "methods": {m: METHOD_NOTES[m] for m in methods},
            "source_names": None if source_names is None else list(source_names),
            "seconds": time.perf_counter() - start,
            "reused_runs": bar.reused_runs,
            "provenance": provenance(),
        }
        if privacy_unit is not None:
            results["privacy_unit"] = privacy_unit
        _add_weight_quality(results, reference_method)

        def write():
            _remember_origins(out_dir / ORIGINS_FILE, origins, runs, results["provenance"])
            (out_dir / "results.json").write_text(json.dumps(results, indent=1))
            (out_dir / "results.md").write_text(markdown_table(results))
            plot_results(results, out_dir)

        parallel.on_main_process(write)  # a multi-process run: process 0 writes the results
        return results


# The output folder's record of which command computed each run (key: `_run_key`).
ORIGINS_FILE = "run_origins.json"
# What a command that computed nothing keeps of the results file it rewrites.
_COMPUTING_RUN_KEYS = ("provenance", "seconds", "reused_runs")


def _numbers(value: Any) -> Any:
    """`value` without what says where its numbers come from (provenance, wall times, run
    origins), at any depth: what two runs must share to be the same results."""
    if isinstance(value, dict):
        return {
            k: _numbers(v) for k, v in value.items() if k not in (*_COMPUTING_RUN_KEYS, "origin")
        }
    if isinstance(value, list):
        return [_numbers(v) for v in value]
    return value


def _run_key(run: dict[str, Any]) -> str:
    """A run's identity: its grid point and everything it reports (a rerun of the same stages
    reports the same numbers)."""
    fields = {k: v for k, v in run.items() if k not in ("origin", "weight_quality")}
    as_stored = json.loads(json.dumps(fields, default=_builtin))  # NumPy scalars as read back
    return json.dumps(as_stored, sort_keys=True)


def _builtin(value: Any) -> Any:
    return value.tolist() if isinstance(value, np.ndarray | np.generic) else str(value)


def _read_origins(path: pathlib.Path) -> dict[str, dict[str, Any]]:
    try:
        origins = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not a record of run origins ({err}); delete it") from err
    if not isinstance(origins, dict):
        raise ValueError(f"{path} is not a record of run origins; delete it")
    return origins


def _remember_origins(
    path: pathlib.Path,
    origins: dict[str, dict[str, Any]],
    runs: list[dict[str, Any]],
    command: dict[str, Any],
) -> None:
    """Adds the runs computed now to the folder's record (earlier entries are kept)."""
    for run in runs:
        origin = run["origin"]
        if origin and origin["provenance"] is None:
            origins[_run_key(run)] = {"provenance": command, "seconds": origin["seconds"]}
    path.write_text(json.dumps(origins, indent=1))


def _say_if_replacing_another_grid(path: pathlib.Path, grid: list[tuple]) -> None:
    """Prints one line when `path` holds the results of another (method, ε, seed) grid."""
    try:
        previous = json.loads(path.read_text())["runs"]
    except (FileNotFoundError, json.JSONDecodeError, KeyError, TypeError):
        return
    old = {(r["seed"], float(r["epsilon"]), r["method"]) for r in previous}
    new = {(seed, float(eps), method) for seed, eps, method in grid}
    if old != new:
        print(
            f"replacing {path}: it holds {len(old)} runs ({_grid_text(old)}); this command "
            f"writes {len(new)} ({_grid_text(new)})",
            flush=True,
        )


def _grid_text(points: set[tuple]) -> str:
    seeds = sorted({p[0] for p in points})
    epsilons = sorted({p[1] for p in points})
    methods = sorted({p[2] for p in points})
    return (
        f"ε {' '.join(f'{e:g}' for e in epsilons)}; seeds {' '.join(map(str, seeds))}; "
        f"{len(methods)} method{'s' if len(methods) != 1 else ''}"
    )


def keep_provenance_of_computing_run(
    results: dict[str, Any], path: str | os.PathLike, *, key: str = "runs"
) -> None:
    """Gives `results`, which computed nothing new, the provenance (command, commit, date), wall
    time and read-back count of the results file `path` when that file holds the same
    `results[key]`: its numbers are those of the run that computed them, and a rerun that only
    reads them back must not rewrite their origin. Without such a file (runs computed by several
    earlier commands), `results` keeps its own provenance, which says that every run was read
    back."""
    try:
        previous = json.loads(pathlib.Path(path).read_text())
    except (FileNotFoundError, json.JSONDecodeError):  # nothing to keep: it is rewritten
        return
    same = json.dumps(_numbers(previous.get(key)), sort_keys=True, default=str) == json.dumps(
        _numbers(results[key]), sort_keys=True, default=str
    )
    if same and "provenance" in previous:
        for name in _COMPUTING_RUN_KEYS:
            if name in previous:
                results[name] = previous[name]
            else:
                results.pop(name, None)


def _check_one_dataset(out_dir: pathlib.Path, dataset: str) -> None:
    """Refuses to write a data set's results over another data set's `results.json`."""
    path = out_dir / "results.json"
    if not path.exists():
        return
    try:
        previous = json.loads(path.read_text()).get("dataset")
    except (json.JSONDecodeError, AttributeError) as err:
        raise ValueError(
            f"{path} is not a results file ({err}); move it or choose another folder"
        ) from err
    if previous != dataset:
        raise ValueError(
            f"{out_dir} holds the results of {previous!r}; this run is on {dataset!r}. Give each "
            "data set its own output folder"
        )


def _add_weight_quality(results: dict[str, Any], reference_method: str | None) -> None:
    """Cosine and L1 of each run's λ to λ* and to the reference method's λ of the same seed."""
    reference = {
        (r["seed"], r["epsilon"]): r["weights"]
        for r in results["runs"]
        if r["method"] == reference_method and r["weights"] is not None
    }
    for run in results["runs"]:
        if run["weights"] is None:
            continue
        quality = {}
        if results["true_weights"] is not None:
            quality["cosine_true"] = cosine_similarity(run["weights"], results["true_weights"])
            quality["l1_true"] = l1_distance(run["weights"], results["true_weights"])
        ref = reference.get((run["seed"], run["epsilon"]))
        if ref is not None:
            quality["cosine_reference"] = cosine_similarity(run["weights"], ref)
            quality["l1_reference"] = l1_distance(run["weights"], ref)
        run["weight_quality"] = {k: float(v) for k, v in quality.items()}


def summarize(results: dict[str, Any]) -> dict[tuple[str, float], dict[str, float]]:
    """Mean and standard deviation of utility (and λ quality) per (method, ε) over seeds."""
    table: dict[tuple[str, float], dict[str, float]] = {}
    keys = sorted({(r["method"], r["epsilon"]) for r in results["runs"]}, key=lambda x: x[1])
    for method, eps in keys:
        runs = [r for r in results["runs"] if r["method"] == method and r["epsilon"] == eps]
        utility = np.array([r["utility"] for r in runs])
        row = {
            "mean": float(utility.mean()),
            "std": float(utility.std()),
            "seeds": len(runs),
            "spent": max(r["spent_epsilon"] for r in runs),
            "private": all(r.get("private", True) for r in runs),
        }
        for quality in ("cosine_true", "cosine_reference"):
            values = [
                r["weight_quality"][quality] for r in runs if quality in r.get("weight_quality", {})
            ]
            if values:
                row[quality] = float(np.mean(values))
        table[(method, eps)] = row
    return table


def _methods(table: dict[tuple[str, float], dict[str, float]]) -> list[str]:
    return [m for m in METHODS if any(key[0] == m for key in table)]


def is_reference(method: str, table: dict[tuple[str, float], dict[str, float]]) -> bool:
    """Whether some run of `method` is not private end to end (its runs say `"private": false`)."""
    return not all(row["private"] for (m, _), row in table.items() if m == method)


def method_label(method: str, table: dict[tuple[str, float], dict[str, float]]) -> str:
    """The method's name; for a reference (non-private) method, why, and what it spends when
    that is more than the target ε (Random Search: the composition of m fine-tunings)."""
    rows = {eps: row for (m, eps), row in table.items() if m == method}
    name = METHOD_NAMES.get(method, method)
    if not is_reference(method, table):
        return name
    notes = [REFERENCE_NOTES.get(method, "not private")]
    ratio = max(row["spent"] / eps for eps, row in rows.items())
    if ratio > 1.05:
        notes.append(f"spends {round(ratio, 1):g}ε")
    return f"{name} ({', '.join(notes)})"


def seed_count(results: dict[str, Any]) -> int:
    return len({r["seed"] for r in results["runs"]})


def utility_table(results: dict[str, Any]) -> str:
    """Markdown: utility (mean ± std over seeds) per method (rows) and target ε (columns), with
    as many decimals as four significant digits of the largest mean need."""
    table = summarize(results)
    epsilons = sorted({eps for _, eps in table})
    largest = max(abs(row["mean"]) for row in table.values()) or 1.0
    decimals = max(0, 3 - math.floor(math.log10(largest)))
    lines = [
        "| method | " + " | ".join(f"ε = {e:g}" for e in epsilons) + " |",
        "|---|" + "---|" * len(epsilons),
    ]
    for method in _methods(table):
        cells = []
        for eps in epsilons:
            row = table.get((method, eps))
            cells.append(
                "" if row is None else f"{row['mean']:.{decimals}f} ± {row['std']:.{decimals}f}"
            )
        lines.append(f"| {method_label(method, table)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def budget_table(results: dict[str, Any]) -> str:
    """Markdown: target and spent ε (max over seeds) and mean λ quality per method and ε."""
    table = summarize(results)
    lines = [
        "| method | ε target | ε spent | cos(λ, λ*) | cos(λ, non-private λ) |",
        "|---|---|---|---|---|",
    ]
    for (method, eps), row in sorted(table.items(), key=lambda x: (x[0][1], x[0][0])):
        cos_true = f"{row['cosine_true']:.3f}" if "cosine_true" in row else ""
        cos_ref = f"{row['cosine_reference']:.3f}" if "cosine_reference" in row else ""
        spent = format_epsilon(row["spent"], ".3f")
        name = METHOD_NAMES.get(method, method)
        lines.append(f"| {name} | {eps:g} | {spent} | {cos_true} | {cos_ref} |")
    return "\n".join(lines) + "\n"


def utility_caption(results: dict[str, Any]) -> str:
    """The tables' caption: the metric, the seeds, and what each (ε, δ) is: δ and the privacy
    unit (when the results name it)."""
    arrow = "higher is better" if results["higher_is_better"] else "lower is better"
    metric = results["metric"][:1].upper() + results["metric"][1:]
    deltas = sorted({run["delta"] for run in results["runs"]})
    guarantee = f"; (ε, δ = {', '.join(f'{d:g}' for d in deltas)})" if deltas else ""
    if results.get("privacy_unit"):
        guarantee += f" {results['privacy_unit']}"
    return f"{metric}, mean ± std over {seed_count(results)} seeds ({arrow}){guarantee}:"


def provenance_line(results: dict[str, Any]) -> str:
    """How the numbers were made: command, runs, time, machine, date, commit (what is known).

    Runs that carry their `origin` are grouped by the command that computed them; a results
    file without per-run origins is described by its own provenance, `seconds` and
    `reused_runs`.
    """
    runs = results.get("runs") or []
    if not runs or "origin" not in runs[0]:
        return _origin_text(results)
    groups: dict[str, list[dict[str, Any]]] = {}
    unknown = 0
    for run in runs:
        origin = run.get("origin") or {}
        if not origin:
            unknown += 1
            continue
        command = origin["provenance"] or results.get("provenance") or {}
        groups.setdefault(json.dumps(command, sort_keys=True), []).append(origin)
    texts = [
        _origin_text(
            {
                "provenance": json.loads(command),
                "runs": origins,
                "seconds": sum(o["seconds"] for o in origins),
            }
        )
        for command, origins in groups.items()
    ]
    if unknown:
        plural = "s" if unknown != 1 else ""
        texts.append(f"{unknown} run{plural} read back from stored stages of unrecorded origin.")
    return " ".join(texts)


def _origin_text(results: dict[str, Any]) -> str:
    origin = results.get("provenance") or {}
    parts = []
    if origin.get("command"):
        parts.append(f"`{origin['command']}`")
    if "seconds" in results:
        reused = results.get("reused_runs", 0)
        reuse = f", {reused} of them read back from stored stages" if reused else ""
        count = len(results["runs"])
        runs = f"{count} run{'s' if count != 1 else ''}"
        parts.append(f"{runs} in {results['seconds']:.0f} s{reuse}")
    if origin.get("backend"):
        machine = (
            f"{origin['cpu_count']} CPU cores"
            if origin["backend"] == "cpu"
            else (f"{origin['devices']} {origin['backend'].upper()} device(s)")
        )
        parts.append(f"on {machine}")
    if origin.get("peak_memory_gib"):
        parts.append(f"peak memory {origin['peak_memory_gib']:.1f} GiB")
    for key, label in (("date", ""), ("commit", "commit "), ("version", "dpmix_jax ")):
        if origin.get(key):
            parts.append(f"{label}{origin[key]}")
    return "Measured with " + ", ".join(parts) + "." if parts else ""


def randomness_line(results: dict[str, Any]) -> str:
    """Whether the private randomness was seeded (`SEEDED_NOTE`) or secret."""
    runs = results["runs"]
    seeded = sum(bool(r.get("noise_seeded", True)) for r in runs)
    if not seeded:
        return "Private randomness secret (from the operating system); seeds number the runs."
    scope = "" if seeded == len(runs) else f" ({seeded} of {len(runs)} runs)"
    return f"{SEEDED_NOTE}{scope}."


def markdown_table(results: dict[str, Any]) -> str:
    """`results.md`: utility (mean ± std over seeds) per method and ε, spent ε and λ quality,
    what each method does, and where the numbers come from."""
    table = summarize(results)
    references = [METHOD_NAMES.get(m, m) for m in _methods(table) if is_reference(m, table)]
    lines = [
        f"# {results['dataset']}: {results['metric']}",
        "",
        utility_caption(results),
        "",
        utility_table(results),
        "Spent ε (max over seeds, from the accountants) and λ quality (mean cosine over seeds):",
        "",
        budget_table(results),
    ]
    if references:
        lines += [
            "Reference methods (" + ", ".join(references) + ") are not private end to end: "
            "points of comparison, not private methods at the same ε (see Methods).",
            "",
        ]
    lines += [randomness_line(results), "", "Methods:", ""]
    lines += [f"- `{m}`: {note}" for m, note in results["methods"].items()]
    line = provenance_line(results)
    if line:
        lines += ["", line]
    return "\n".join(lines) + "\n"


def _off_scale(means: dict[str, float]) -> list[str]:
    """Methods whose mean utility is more than 3 times farther from the median of the means than
    the spread of the others (Random Init's perplexity beside pretrained models' ones): they go
    on an axis of their own, so that the others' differences stay readable."""
    if len(means) < 3:
        return []
    values = np.array(list(means.values()))
    centre = np.median(values)
    far = []
    for method, mean in means.items():
        others = values[values != mean]
        spread = max(np.ptp(others), 1e-12)
        if abs(mean - centre) > 3 * spread:
            far.append(method)
    return far if len(far) < len(means) - 1 else []


def plot_results(results: dict[str, Any], out_dir: pathlib.Path) -> None:
    """`utility_vs_epsilon.png` and, when DP-MixMin ran, `weights.png`.

    Private methods are drawn solid with filled markers; reference (non-private) methods dashed
    with hollow markers, their legend entry saying why and what they spend. Points are mean ±
    std over seeds, nudged sideways per method so that error bars do not hide each other. A
    method far from all the others (`_off_scale`) gets a narrow panel of its own.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = summarize(results)
    methods = _methods(table)
    seeds = seed_count(results)
    delta = results["runs"][0]["delta"]
    means = {m: np.mean([r["mean"] for (mm, _), r in table.items() if mm == m]) for m in methods}
    far = _off_scale(means)
    panels = [[m for m in methods if m not in far]] + ([far] if far else [])
    fig, axes = plt.subplots(
        1,
        len(panels),
        figsize=(7 + 2.2 * (len(panels) - 1), 5.2),
        gridspec_kw={"width_ratios": [3, 1][: len(panels)]},
        squeeze=False,
    )
    styles = dict(zip(methods, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))
    nudges = dict(zip(methods, np.exp(np.linspace(-0.035, 0.035, len(methods))), strict=True))
    all_eps = sorted({eps for _, eps in table})
    for ax, panel in zip(axes[0], panels, strict=True):
        for method in panel:
            points = sorted((eps, row) for (m, eps), row in table.items() if m == method)
            reference = not all(row["private"] for _, row in points)
            ax.errorbar(
                [eps * nudges[method] for eps, _ in points],
                [row["mean"] for _, row in points],
                yerr=[row["std"] for _, row in points],
                color=styles.get(method),
                marker="s" if reference else "o",
                markerfacecolor="none" if reference else None,
                linestyle="--" if reference else "-",
                capsize=3,
                label=method_label(method, table),
            )
        ax.set_xscale("log")
        ax.set_xticks(all_eps, [f"{e:g}" for e in all_eps])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
    ax = axes[0][0]
    delta = results["runs"][0]["delta"]
    ax.set_xlabel(f"target ε, end to end (δ = {delta:g}); dashed, hollow: not private")
    arrow = "higher is better" if results["higher_is_better"] else "lower is better"
    ax.set_ylabel(f"{results['metric']} ({arrow})")
    ax.set_title(
        f"{results['dataset']}\nmean ± std over {seeds} seeds (points nudged sideways)",
        fontsize=10,
    )
    if far:
        axes[0][1].set_title("far from the others:\nits own axis", fontsize=9)
        axes[0][1].set_xlabel("target ε")
    handles = [h for a in axes[0] for h in a.get_legend_handles_labels()[0]]
    labels = [label for a in axes[0] for label in a.get_legend_handles_labels()[1]]
    ax.legend(
        handles,
        labels,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.15),
        ncol=2,
        fontsize=8,
        frameon=False,
    )
    fig.savefig(out_dir / "utility_vs_epsilon.png", dpi=120, bbox_inches="tight")
    plt.close(fig)

    dp_runs = [r for r in results["runs"] if r["method"] == "dp_mixmin"]
    reference = [r for r in results["runs"] if r["method"] == "nonprivate_mixmin"]
    if not dp_runs:
        return
    k = len(dp_runs[0]["weights"])
    bars: list[tuple[str, np.ndarray, np.ndarray | None, dict]] = []
    if results["true_weights"] is not None:
        true = np.asarray(results["true_weights"]).reshape(-1, k)[0]
        bars.append(("true λ*", true, None, {"color": "black"}))
    if reference:
        weights = np.array([r["weights"] for r in reference])
        style = {"color": "white", "edgecolor": "gray", "hatch": "//"}
        bars.append(("non-private MixMin (reference)", weights.mean(0), weights.std(0), style))
    colors = plt.get_cmap("viridis")
    dp_epsilons = sorted({r["epsilon"] for r in dp_runs})
    for index, eps in enumerate(dp_epsilons):
        weights = np.array([r["weights"] for r in dp_runs if r["epsilon"] == eps])
        color = colors(0.15 + 0.7 * index / max(1, len(dp_epsilons) - 1))
        bars.append((f"DP-MixMin ε = {eps:g}", weights.mean(0), weights.std(0), {"color": color}))
    width = 0.8 / len(bars)
    fig, ax = plt.subplots(figsize=(max(7.0, 0.6 * k + 2), 4.8))
    for i, (label, mean, std, style) in enumerate(bars):
        # λ_i >= 0: the lower error bar stops at 0.
        yerr = None if std is None else np.stack([np.minimum(std, mean), std])
        ax.bar(
            np.arange(k) + i * width,
            mean,
            width,
            yerr=yerr,
            capsize=2,
            error_kw={"elinewidth": 0.8, "ecolor": "0.25"},
            label=label,
            **style,
        )
    ax.set_xticks(np.arange(k) + width * (len(bars) - 1) / 2)
    names = results.get("source_names") or [str(i) for i in range(k)]
    ax.set_xticklabels(names, rotation=45, ha="right", fontsize=8)
    ax.set_xlabel("public source")
    ax.set_ylabel("λ_i")
    ax.set_title(
        f"{results['dataset']}: mixture weights λ over the {k} public sources\n"
        f"bars: mean over {seeds} seeds; error bars: ± std over seeds (cut at 0)",
        fontsize=10,
    )
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.savefig(out_dir / "weights.png", dpi=120, bbox_inches="tight")
    plt.close(fig)
