"""The two files every experiment run writes: `results.json` and `results.md`."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import numpy as np


def _plain(value: Any) -> Any:
    """A NumPy scalar as its Python value; anything else JSON cannot write as its text."""
    return value.item() if isinstance(value, np.generic) else str(value)


def write_results(out: pathlib.Path, results: dict[str, Any], markdown: str) -> None:
    """Writes `results` to `out/results.json` and `markdown` (one final newline) to
    `out/results.md`, creating `out`; `dpmix report --add NAME=OUT` stores both."""
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=_plain))
    (out / "results.md").write_text(markdown.rstrip("\n") + "\n")
