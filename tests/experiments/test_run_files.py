"""Tests of the files experiment runs write and of the randomness of their stored stages."""

import dataclasses

import jax
import pytest

from experiments import run_files


@dataclasses.dataclass(frozen=True)
class Setting:
    method: str
    epsilon: float | None = None


PLAN = [("a", 1.0), ("a", 10.0), ("b", 1.0), ("public", None)]


def test_a_run_in_the_default_plan_keeps_its_place_in_any_smaller_study():
    assert [run_files.run_slot(run, PLAN) for run in PLAN] == [0, 1, 2, 3]
    assert run_files.run_slot(("b", 1.0), PLAN) == 2  # whatever runs come before it
    assert run_files.run_slot(("a", 10), PLAN) == 1  # an int ε is the same run
    settings = [Setting("public"), Setting("a", 1.0)]
    assert run_files.run_slot(Setting("a", 1.0), settings) == 1


def test_a_run_outside_the_plan_gets_its_own_number_above_it():
    slots = {run: run_files.run_slot(run, PLAN) for run in [("a", 3.0), ("b", 3.0), ("c", 1.0)]}
    assert all(len(PLAN) <= slot < 2**32 for slot in slots.values())
    assert len(set(slots.values())) == 3
    assert run_files.run_slot(("a", 3.0), PLAN) == slots[("a", 3.0)]
    jax.random.fold_in(jax.random.key(0), max(slots.values()))  # in fold_in's range


def test_a_damaged_stage_is_one_line_naming_the_file(tmp_path):
    stage = tmp_path / "run.json"
    run_files.write_stage(stage, {"lines": ["x"]})
    assert run_files.read_stage(stage) == {"lines": ["x"]}
    assert not list(tmp_path.glob("*.tmp"))
    stage.write_text('{"lines": [')
    with pytest.raises(ValueError, match="run.json: not a finished run") as raised:
        run_files.read_stage(stage)
    assert "\n" not in str(raised.value)
