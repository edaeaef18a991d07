"""Numbers in the prose, derived from stored runs by hidden blocks (`pipeline.numbers`)."""

from __future__ import annotations

import collections
import json
import pathlib

import pytest

from dpmix_jax import cli
from dpmix_jax.pipeline import numbers, report

ROOT = pathlib.Path(__file__).resolve().parents[2]

STORED_MD = """# toy

| method | ε = 1 | ε = 2 |
|---|---|---|
| DP-MixMin | 67.76 ± 1.06 | 10,435.5 |
| Uniform | 73.38 ± 1.05 | 2 |
"""


@pytest.fixture
def results_dir(tmp_path: pathlib.Path) -> pathlib.Path:
    folder = tmp_path / "results"
    folder.mkdir()
    (folder / "toy.json").write_text(
        json.dumps({"seconds": 400.7, "runs": [{"m": "a", "u": 1.0}, {"m": "a", "u": 3.0}]})
    )
    (folder / "toy.md").write_text(STORED_MD)
    (folder / "other.json").write_text(json.dumps({"value": 0.25}))
    return folder


def page(paragraph: str, *lines: str, names: str = "toy") -> str:
    return (
        "# Page\n\nAbove.\n\n"
        + paragraph
        + f"\n<!-- numbers {names}\n"
        + "\n".join(lines)
        + "\n-->\n"
    )


def check(text: str, results_dir: pathlib.Path):
    return numbers.check_text(text, results_dir, where="page.md")


def test_numbers_that_match_their_stored_runs_pass_and_are_counted(results_dir):
    text = page(
        "It took 7 minutes; DP-MixMin is 8% below Uniform (67.76 ± 1.06 against 73.38), "
        "10,435.5 at ε = 2, mean 2.0, half of 0.5, the paper's 12.22.",
        '7 = r["seconds"] / 60',
        '8 = 100 * (1 - cell("DP-MixMin", "ε = 1") / cell("Uniform", "ε = 1"))',
        '67.76 = cell("DP-MixMin", "ε = 1")',
        '1.06 = cell("DP-MixMin", "ε = 1", index=1)',
        '73.38 = cell("Uniform", "ε = 1")',
        '10,435.5 = cell("DP-MixMin", "ε = 2")',
        '2.0 = mean(values(r["runs"], "u", m="a"))',
        '0.5 = R["other"]["value"] * 2',
        "12.22 = paper",
        names="toy other",
    )
    problems, counts = check(text, results_dir)
    assert problems == []
    assert counts == {"derived": 8, "paper": 1}


def test_a_number_that_differs_from_its_run_names_the_line_and_the_stored_value(results_dir):
    text = page("DP-MixMin reached 67.75.", '67.75 = cell("DP-MixMin", "ε = 1")')
    (problem,) = check(text, results_dir)[0]
    assert (
        problem.startswith("page.md:7: ") and "says 67.75" in problem and "gives 67.76" in problem
    )


def test_every_decimal_of_the_paragraph_needs_a_line_and_every_line_its_number(results_dir):
    problems, _ = check(page("Reached 67.76 at ρ = 0.3.", "67.76 = paper"), results_dir)
    assert problems == ["page.md:6: 0.3 in the paragraph above has no line in its numbers block"]
    problems, _ = check(page("Reached 67.76.", "67.76 = paper", "73.38 = paper"), results_dir)
    assert problems == ["page.md:8: 73.38 is not in the paragraph above the block"]
    # A number inside a longer one is not that number.
    problems, _ = check(page("Reached 167.76.", "67.76 = paper"), results_dir)
    assert "67.76 is not in the paragraph" in problems[0]


@pytest.mark.parametrize(
    "expression, message",
    [
        ('__import__("os").system("true")', "not allowed"),
        ("r.keys()", "not allowed"),
        ("[x for x in r]", "not allowed"),
        ('cell("Nobody", "ε = 1")', "no cell in row 'Nobody'"),
        ('r["missing"]', "KeyError"),
        ("1 +", "not an expression"),
        ("9 ** 9 ** 9", "an exponent above 64"),
    ],
)
def test_a_bad_expression_is_one_line_and_never_runs_code(results_dir, expression, message):
    (problem,) = check(page("Reached 67.76.", f"67.76 = {expression}"), results_dir)[0]
    assert problem.startswith("page.md:7: ") and message in problem
    assert "\n" not in problem


def test_a_missing_run_or_a_malformed_line_is_named(results_dir):
    (problem,) = check(page("Reached 67.76.", "67.76 = paper", names="gone"), results_dir)[0]
    assert problem.startswith("page.md:6: no stored run") and "gone.json" in problem
    (results_dir / "broken.json").write_text('{"seconds": 40')
    (problem,) = check(page("Reached 67.76.", "67.76 = paper", names="broken"), results_dir)[0]
    assert "broken.json is not valid JSON" in problem and "\n" not in problem
    problems, _ = check(page("Reached 67.76.", "67.76 is the paper's"), results_dir)
    assert "a line is `NUMBER = EXPRESSION`" in problems[0]


def test_check_markdown_and_the_command_fail_on_a_stale_prose_number(results_dir, tmp_path, capsys):
    good = tmp_path / "good.md"
    good.write_text(page("Reached 67.76.", '67.76 = cell("DP-MixMin", "ε = 1")'))
    stale = tmp_path / "stale.md"
    stale.write_text(page("Reached 67.70.", '67.70 = cell("DP-MixMin", "ε = 1")'))
    assert report.check_markdown(good, results_dir) == []
    (line,) = report.check_markdown(stale, results_dir)
    assert "the text says 67.70" in line
    for mode in ([], ["--check"]):
        arguments = ["report", *mode, "--results", str(results_dir), "--readme"]
        assert cli.main([*arguments, str(good), str(stale)]) == 1
        out, err = capsys.readouterr()
        assert "the text says 67.70" in err
        assert "numbers in the prose: 1 derived from stored runs or formulas" in out
    assert (
        cli.main(["report", "--check", "--results", str(results_dir), "--readme", str(good)]) == 0
    )


def test_the_documents_derive_their_measured_numbers_from_stored_runs():
    """The repository's README and docs: blocks exist and every one matches (the full check of
    tables and prose is `tests/themes/test_readme.py`)."""
    counts = sum(
        (numbers.check_file(path, ROOT / "docs" / "results")[1] for path in report.documents(ROOT)),
        start=collections.Counter(),
    )
    assert counts["derived"] >= 4


def test_a_number_followed_by_a_unit_or_a_power_is_found_and_must_be_listed(results_dir):
    text = page("Took 1.06x and N(0, 0.5²) noise.", '1.06 = cell("DP-MixMin", "ε = 1", index=1)')
    assert check(text, results_dir)[0] == [
        "page.md:6: 0.5 in the paragraph above has no line in its numbers block"
    ]
    text = page("Took 1.06x and N(0, 0.5²) noise.", "1.06 = paper", "0.5 = setting")
    assert check(text, results_dir) == ([], {"paper": 1, "setting": 1})


def test_every_paragraph_of_prose_with_a_decimal_needs_a_block(results_dir):
    text = (
        "# Page\n\nIt reached 0.93 on the test set.\n\n"
        "```\nprint(0.5)\n```\n\n"
        "    x = 0.25  # indented code\n\n"
        "| a | b |\n|---|---|\n| 0.7 | 1 |\n\n"
        "<!-- table:toy markdown -->\n0.9\n<!-- /table -->\n\n"
        "A formula: 1.155 is 2/sqrt(3).\n<!-- numbers\n1.155 = 2 / sqrt(3)\n-->\n\n"
        "No decimals here, 3 of them.\n"
    )
    problems, counts = check(text, results_dir)
    assert problems == [
        "page.md:3: a paragraph with 0.93 has no numbers block (derive its measured numbers; "
        "declare settings and the papers' values)"
    ]
    assert counts == {"derived": 1}
