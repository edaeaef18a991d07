"""The files every experiment run writes: `results.json` and `results.md` (or `NAME.json` and
`NAME.md`), and the stored stages a resumed run reads back."""

from __future__ import annotations

import hashlib
import json
import pathlib
from collections.abc import Hashable, Sequence
from typing import Any


def _plain(value: Any) -> Any:
    """A NumPy scalar as its Python value; anything else JSON cannot write as its text."""
    import numpy as np

    return value.item() if isinstance(value, np.generic) else str(value)


def as_json(value: Any) -> Any:
    """`value` as `results.json` stores it and reads it back (tuples as lists, NumPy scalars as
    numbers, anything else JSON cannot write as its text)."""
    return json.loads(json.dumps(value, default=_plain))


def write_results(
    out: pathlib.Path, results: dict[str, Any], markdown: str | None, *, name: str = "results"
) -> None:
    """Writes `results` to `out/NAME.json` and `markdown` (one final newline) to `out/NAME.md`,
    creating `out`; `dpmix report --add NAME=OUT` stores both.

    Args:
        out: the run's folder.
        results: the run's results, JSON-ready (`as_json`'s rules for anything else).
        markdown: the run's tables; None writes no markdown file.
        name: the files' name.
    """
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(results, indent=1, default=_plain))
    if markdown is not None:
        (out / f"{name}.md").write_text(markdown.rstrip("\n") + "\n")


def write_samples(out: pathlib.Path, samples: list[dict[str, Any]]) -> None:
    """Writes every generated text's record, one JSON object a line, to `out/samples.jsonl`,
    creating `out`."""
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with (out / "samples.jsonl").open("w") as f:
        for sample in samples:
            f.write(json.dumps(sample, ensure_ascii=False) + "\n")


def read_stage(path: pathlib.Path) -> dict[str, Any]:
    """A finished run stored by `write_stage`; one line naming the file if it is damaged."""
    try:
        return json.loads(pathlib.Path(path).read_text())
    except ValueError as err:
        message = f"{path}: not a finished run ({err}); delete it to run it again"
        raise ValueError(message) from None


def write_stage(path: pathlib.Path, run: dict[str, Any]) -> None:
    """Stores a finished run at `path` at once (a temporary file renamed into place), so that an
    interrupted run leaves no partial stage behind."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(run))
    temporary.replace(path)


def run_slot(run: Hashable, plan: Sequence[Hashable]) -> int:
    """The number a run's random key is folded from, the same whichever other runs a study holds.

    A stage's name leaves out the study's other runs, so its randomness must not depend on them
    either: a run takes its place in `plan`, its study's full default plan, and a run outside
    that plan a number above it derived from the run's text (`repr`).

    Args:
        run: what the run is, e.g. a (generator, ε) pair or a frozen dataclass of its settings.
        plan: the study's full default plan, of runs of the same kind.

    Returns:
        An int below 2**32 (`jax.random.fold_in`'s range).
    """
    plan = list(plan)
    if run in plan:
        return plan.index(run)
    digest = hashlib.sha256(repr(run).encode()).digest()
    return len(plan) + int.from_bytes(digest[:3], "big")
