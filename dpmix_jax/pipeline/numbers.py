"""Numbers in the prose of README.md and docs/*.md, checked against the stored runs.

A paragraph that states measured numbers is followed by a hidden block that derives each of
them from the stored results (`docs/results/NAME.json` and the tables of its `NAME.md`):

    DP-MixMin is 8% below Uniform at ε = 1 (67.76 against 73.38).
    <!-- numbers openwebmath
    8 = 100 * (1 - cell("DP-MixMin", "ε = 1") / cell("Uniform", "ε = 1"))
    67.76 = cell("DP-MixMin", "ε = 1")
    73.38 = cell("Uniform", "ε = 1")
    -->

A block of declared numbers alone names no run (`<!-- numbers`). Each line is
`LITERAL = EXPRESSION`: the literal must appear in the paragraph above the block,
as written (a number token; `10,435` keeps its comma), and the expression's value, rounded to
the literal's decimals, must print as the literal. Three words declare a number that no
stored run gives: `paper` (a paper's value), `setting` (an input of the run) and `unstored`
(measured, but not kept in a stored run: say how in the text); `dpmix report` counts each kind.
Every number with a decimal point in the paragraph must be listed, and every paragraph of prose
with a decimal point must have a block, so that no measured decimal goes unchecked.

Expressions are arithmetic (`+ - * / **`, unary minus) over numbers, strings, lists and these
names: `r` (the first named file's JSON), `R["NAME"]` (any named file's JSON), `cell(row,
column, index=0, name=None)` (the index-th number of a cell of the stored markdown's tables,
found by the row's first cell and the column's header), `values(rows, field, **equal)` (the
field of each dict in `rows` whose items equal `equal`), `mean`, `std` (population), `min`,
`max`, `abs`, `sum`, `len`, `log`, `sqrt` (a formula's value needs no run). Nothing else is
evaluated: the block is data, not code.
"""

from __future__ import annotations

import ast
import collections
import json
import math
import operator
import pathlib
import re
from collections.abc import Callable
from typing import Any

import numpy as np

BLOCK = re.compile(r"<!-- numbers(?P<names>[\w.\- ]*)\n(?P<body>.*?)-->", re.S)
DECIMAL = re.compile(r"(?<![\w.,])-?\d[\d,]*\.\d+(?![\w.]*\d)")
DECLARED = ("paper", "setting", "unstored")
_MAX_EXPONENT = 64  # a block computes a number, not 9 ** 9 ** 9

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
}


class NumbersError(ValueError):
    """A block that cannot be read or evaluated (its message names the file and line)."""


def _table_cells(markdown: str) -> list[tuple[list[str], dict[str, list[str]]]]:
    """Each markdown table of `markdown` as (header cells, {first cell: row cells})."""
    tables, lines = [], markdown.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("|") and i + 1 < len(lines) and lines[i + 1].startswith("|---"):
            header = [c.strip() for c in lines[i].strip().strip("|").split("|")]
            rows = {}
            i += 2
            while i < len(lines) and lines[i].startswith("|"):
                cells = [c.strip() for c in lines[i].strip().strip("|").split("|")]
                rows.setdefault(cells[0], cells)
                i += 1
            tables.append((header, rows))
        else:
            i += 1
    return tables


def _numbers_in(text: str) -> list[float]:
    return [float(x.replace(",", "")) for x in re.findall(r"-?\d[\d,]*(?:\.\d+)?", text)]


class _Results:
    """The named stored runs of one block: their JSON and their markdown tables."""

    def __init__(self, names: list[str], results_dir: pathlib.Path):
        self.names = names
        self.json: dict[str, Any] = {}
        self.tables: dict[str, list] = {}
        for name in names:
            path = pathlib.Path(results_dir) / f"{name}.json"
            if not path.is_file():
                raise NumbersError(f"no stored run {path}")
            try:
                self.json[name] = json.loads(path.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                raise NumbersError(f"{path} is not valid JSON: {err}") from None
            markdown = path.with_suffix(".md")
            self.tables[name] = _table_cells(markdown.read_text()) if markdown.is_file() else []

    def cell(self, row: str, column: str, index: int = 0, name: str | None = None) -> float:
        name = name or self.names[0]
        found = []
        for header, rows in self.tables[name]:
            if row in rows and column in header:
                cells = rows[row]
                position = header.index(column)
                if position < len(cells):
                    found.append(cells[position])
        if not found:
            raise NumbersError(f"{name}.md has no cell in row {row!r}, column {column!r}")
        numbers = [_numbers_in(text) for text in found]
        if any(n != numbers[0] for n in numbers):
            raise NumbersError(
                f"{name}.md has different cells in row {row!r}, column {column!r}: {found}"
            )
        if index >= len(numbers[0]):
            raise NumbersError(f"{name}.md, row {row!r}, column {column!r}: no number {index}")
        return numbers[0][index]


def _values(rows: list[dict], field: str, **equal: Any) -> list[Any]:
    return [row[field] for row in rows if all(row.get(k) == v for k, v in equal.items())]


def evaluate(expression: str, results: _Results) -> Any:
    """The value of one block expression (see the module docstring for what it may use)."""
    names: dict[str, Any] = {
        "r": results.json[results.names[0]] if results.names else {},
        "R": results.json,
        "cell": results.cell,
        "values": _values,
        "mean": lambda x: float(np.mean(x)),
        "std": lambda x: float(np.std(x)),
        "min": min,
        "max": max,
        "abs": abs,
        "sum": sum,
        "len": len,
        "log": math.log,
        "sqrt": math.sqrt,
    }

    def value(node: ast.AST) -> Any:
        if isinstance(node, ast.Expression):
            return value(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, str)):
            return node.value
        if isinstance(node, ast.Name) and node.id in names:
            return names[node.id]
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
                raise NumbersError(f"an exponent above {_MAX_EXPONENT}: {ast.unparse(node)!r}")
            return _BINARY[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.Subscript):
            return value(node.value)[value(node.slice)]
        if isinstance(node, (ast.List, ast.Tuple)):
            return [value(item) for item in node.elts]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            function = value(node.func)
            kwargs = {k.arg: value(k.value) for k in node.keywords if k.arg is not None}
            return function(*[value(a) for a in node.args], **kwargs)
        raise NumbersError(f"not allowed in a numbers block: {ast.unparse(node)!r}")

    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as err:
        raise NumbersError(f"not an expression: {expression!r} ({err.msg})") from None
    try:
        return value(tree)
    except NumbersError:
        raise
    except (KeyError, IndexError, TypeError, ValueError, ZeroDivisionError) as err:
        raise NumbersError(f"{expression!r} fails: {type(err).__name__}: {err}") from None


def formatted(value: float, literal: str) -> str:
    """`value` printed as `literal` is: the same decimals, a thousands comma if it has one."""
    decimals = len(literal.split(".")[1]) if "." in literal else 0
    comma = "," if "," in literal else ""
    return f"{value:{comma}.{decimals}f}"


def _occurs(literal: str, text: str) -> bool:
    return re.search(rf"(?<![\w.,]){re.escape(literal)}(?!\d|\.\d|,\d)", text) is not None


def _paragraph_before(text: str, start: int) -> str:
    """The paragraph (blank-line separated) that ends where a block starts."""
    before = text[:start].rstrip("\n")
    return re.split(r"\n[ \t]*\n", before)[-1]


def check_text(
    text: str, results_dir: pathlib.Path, *, where: str
) -> tuple[list[str], collections.Counter]:
    """(one line per problem, how many numbers were derived or declared of each kind) for every
    block of `text`; "derived" counts the numbers that match their stored runs."""
    problems, counts = [], collections.Counter()
    for match in BLOCK.finditer(text):
        line_of_block = text.count("\n", 0, match.start()) + 1
        paragraph = _paragraph_before(text, match.start())
        try:
            results = _Results(match["names"].split(), results_dir)
        except NumbersError as err:
            problems.append(f"{where}:{line_of_block}: {err}")
            continue
        listed = set()
        for offset, line in enumerate(match["body"].splitlines(), start=1):
            if not line.strip():
                continue
            at = f"{where}:{line_of_block + offset}"
            literal, sep, expression = (part.strip() for part in line.partition("="))
            if not sep or not re.fullmatch(r"-?\d[\d,]*(\.\d+)?", literal):
                problems.append(f"{at}: a line is `NUMBER = EXPRESSION`, got {line.strip()!r}")
                continue
            listed.add(literal)
            if not _occurs(literal, paragraph):
                problems.append(f"{at}: {literal} is not in the paragraph above the block")
                continue
            if expression in DECLARED:
                counts[expression] += 1
                continue
            try:
                got = evaluate(expression, results)
                shown = formatted(float(got), literal)
            except (NumbersError, TypeError, ValueError) as err:
                problems.append(f"{at}: {err}")
                continue
            if shown == literal:
                counts["derived"] += 1
            else:
                problems.append(
                    f"{at}: the text says {literal}, the stored run gives {shown} "
                    f"({expression}); update the text"
                )
        for literal in DECIMAL.findall(paragraph):
            if literal not in listed:
                problems.append(
                    f"{where}:{line_of_block}: {literal} in the paragraph above has no line in "
                    "its numbers block"
                )
    problems.extend(f"{where}:{line}" for line in _paragraphs_without_block(text))
    return problems, counts


def _paragraphs_without_block(text: str) -> list[str]:
    """'LINE: ...' for each prose paragraph with a decimal number and no numbers block after it.

    Generated tables, code, hidden comments and markdown tables are not prose (a hand-written
    table's numbers are checked by the test that generates it, or are settings)."""
    hidden = re.compile(r"<!-- table:.*?<!-- /table -->|```.*?```|<!--.*?-->", re.S)
    masked = hidden.sub(lambda m: re.sub(r"[^\n]", " ", m[0]), text)
    found = []
    for chunk in re.finditer(r"(?:[^\n]*\S[^\n]*(?:\n|$))+", masked):
        lines = [line for line in chunk[0].splitlines() if line.strip()]
        if lines[0].lstrip().startswith("|") or all(line.startswith("    ") for line in lines):
            continue
        decimals = DECIMAL.findall(chunk[0])
        if decimals and not text.startswith("<!-- numbers", chunk.end()):
            line = text.count("\n", 0, chunk.start()) + 1
            found.append(
                f"{line}: a paragraph with {', '.join(decimals[:3])} has no numbers block "
                "(derive its measured numbers; declare settings and the papers' values)"
            )
    return found


def check_file(
    path: pathlib.Path, results_dir: pathlib.Path
) -> tuple[list[str], collections.Counter]:
    """`check_text` of the markdown file at `path`."""
    path = pathlib.Path(path)
    return check_text(path.read_text(), results_dir, where=str(path))
