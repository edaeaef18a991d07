"""The files every experiment run writes: `results.json` and `results.md` (or `NAME.json` and
`NAME.md`)."""

from __future__ import annotations

import json
import pathlib
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
