"""δ against the number of units, and splits of sensitive units that depend on each unit alone."""

import numpy as np
import pytest

from dpmix_jax.data.text import UserDocuments
from dpmix_jax.pate import accounting as pate_accounting
from dpmix_jax.pipeline import text_data
from dpmix_jax.privacy import plan, validation


def _config(**overrides):
    settings = dict(epsilon=None, noise_multiplier=1.0, delta=0.5, clip_norm=1.0, batch_size=10)
    return plan.DpSgdConfig(steps=5, **(settings | overrides))


@pytest.mark.parametrize(
    ("delta", "num_units", "level", "message"),
    [
        (0.5, 100, "example", r"delta = 0.5 >= 1/n = 0.01 for n = 100 examples"),
        (0.01, 100, "example", r"delta = 0.01 >= 1/n = 0.01 for n = 100 examples"),
        (1e-3, 1000, "user", r"delta = 0.001 >= 1/n = 0.001 for n = 1000 users"),
    ],
)
def test_plan_refuses_delta_of_one_over_n_or_more(delta, num_units, level, message):
    users = {"max_examples_per_user": 2} if level == "user" else {}
    with pytest.raises(ValueError, match=message + r".*allow_large_delta=True"):
        plan.plan_dp_sgd(_config(delta=delta, **users), num_units=num_units)
    with pytest.raises(ValueError, match=message):
        plan.plan_dp_sgd(
            _config(epsilon=1.0, noise_multiplier=None, delta=delta, **users), num_units=num_units
        )
    assert plan.plan_dp_sgd(_config(delta=0.5 / num_units, **users), num_units=num_units)


def test_an_explicit_override_runs_and_the_plan_carries_it():
    resolved = plan.plan_dp_sgd(_config(allow_large_delta=True), num_units=100)
    assert resolved.config.allow_large_delta and resolved.spent().delta == 0.5
    with pytest.raises(ValueError, match="allow_large_delta must be True or False"):
        _config(allow_large_delta="yes")


def test_pate_budget_refuses_a_total_delta_of_one_over_n_or_more():
    ledger = pate_accounting.PateLedger()
    ledger.record(pate_accounting.dpws_event(1.0), count=10, delta=1e-3)
    # 10 calls at δ = 1e-3 plus δ' = 1e-5: total 0.01001 >= 1/100.
    message = r"^delta \+ per-call delta = 0.01001 >= 1/n = 0.01 for n = 100 records"
    with pytest.raises(ValueError, match=message):
        ledger.budget(1e-5, num_units=100)
    assert ledger.budget(1e-5, num_units=100, allow_large_delta=True).delta == pytest.approx(
        0.01001
    )
    assert ledger.budget(1e-5, num_units=99).delta == pytest.approx(0.01001)
    with pytest.raises(ValueError, match=r"delta must be in \[0, 1\)"):
        ledger.record(pate_accounting.dpws_event(1.0), delta=1.5)
    with pytest.raises(ValueError, match=r"delta must be in the open interval \(0, 1\)"):
        pate_accounting.PateLedger().budget(0.0)


def _documents(names):
    # Users listed in sorted order, so a newcomer shifts the index of every later user.
    users = tuple(sorted(set(names)))
    index = {u: i for i, u in enumerate(users)}
    return UserDocuments(
        texts=tuple(f"a message from {u}" for u in names),
        user_ids=np.array([index[u] for u in names], dtype=np.int64),
        users=users,
    )


def _split_of_users(documents, fractions, seed=0):
    parts = documents.split_by_user(fractions, seed=seed)
    return {part.users[u]: j for j, part in enumerate(parts) for u in part.user_ids.tolist()}


def test_adding_one_text_user_moves_no_other_user():
    names = [f"user{i:04d}" for i in range(1000) for _ in range(2)]
    before = _split_of_users(_documents(names), (0.6, 0.2, 0.2))
    after = _split_of_users(_documents(["newcomer", *names]), (0.6, 0.2, 0.2))
    assert {u for u, part in before.items() if after[u] != part} == set()
    sizes = np.bincount(list(before.values()), minlength=3) / 1000
    assert np.all(np.abs(sizes - (0.6, 0.2, 0.2)) < 0.06)


def test_text_task_splits_keep_every_user_in_place_when_a_user_joins():
    names = [f"user{i:04d}" for i in range(300)]
    domains = {"a": ["public a"], "b": ["public b"]}

    def splits(documents):
        task = text_data.from_user_documents(documents, domains, name="t", seed=3)
        return {
            docs.users[u]: split
            for split, docs in (("train", task.train), ("val", task.val), ("test", task.test))
            for u in docs.user_ids.tolist()
        }

    before = splits(_documents(names))
    after = splits(_documents([*names, "user0150x"]))
    assert all(after[u] == split for u, split in before.items())


def test_delta_helper_names_the_argument_and_the_numbers():
    with pytest.raises(ValueError, match=r"^report_delta = 0.2 >= 1/n = 0.1 for n = 10 records"):
        validation.check_delta_for_units(0.2, 10, unit="records", name="report_delta")
    assert validation.check_delta_for_units(0.2, 10, allow_large_delta=True) == 0.2
    with pytest.raises(ValueError, match="open interval"):
        validation.check_delta_for_units(1.0, 10, allow_large_delta=True)
