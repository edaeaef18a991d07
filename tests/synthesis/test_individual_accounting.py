"""Individual (per-unit) accounting in `synthesis.individual_accounting` and `dpmix generate
--accounting individual`, on the tiny GPT-2 of `test_synthesize`."""

from __future__ import annotations

import json
import math

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpmix_jax import cli
from dpmix_jax.pate import individual
from dpmix_jax.synthesis import individual_accounting
from dpmix_jax.synthesis.ensemble import build_unit_ensemble
from tests.synthesis import test_synthesize as test_synthesize
from tests.synthesis.test_synthesize import TEXTS, _docs

UNITS = 6  # the users of `_docs()`
# The tiny GPT-2 fixtures (module scope: built once here).
model_folder = test_synthesize.model_folder
model = test_synthesize.model


def _run(model, **overrides):
    """`test_synthesize._run` with individual accounting, 3 samples of up to 4 tokens."""
    settings = dict(num_teachers=None, num_samples=3, max_new_tokens=4, accounting="individual")
    return test_synthesize._run(model, **{**settings, **overrides})


def _rdp_epsilon(sigma: float, count: int, delta: float) -> float:
    accountant = dp_accounting.rdp.RdpAccountant()
    accountant.compose(dp_accounting.GaussianDpEvent(sigma), count)
    return accountant.get_epsilon(delta)


def _setup(model, charges_per_teacher: int, *, max_new_tokens: int):
    ensemble = build_unit_ensemble(
        _docs(), model, num_teachers=None, prompt="Meeting", max_new_tokens=max_new_tokens,
        batch_size=64, stop_at_newline=False, separator="\n", on_step=None,
    )  # fmt: skip
    config = individual_accounting._individual_config(
        epsilon=2.0, delta=1e-5, charges_per_teacher=charges_per_teacher,
        vocab_size=int(model.model.config.vocab_size), temperature=1.0,
    )  # fmt: skip
    ledger = individual.IndividualLedger.start(config, UNITS, max_charges=charges_per_teacher)
    return ensemble, config, ledger


def test_individual_run_gives_the_m_guarantee_and_releases_no_charges(model):
    compiled = individual_accounting._individual_step._cache_size()
    result = _run(model)
    assert individual_accounting._individual_step._cache_size() - compiled <= 1  # one compile
    assert len(result.texts) == len(result.marked_texts) == len(result.stop_reasons) == 3
    assert (result.method, result.aggregator) == ("individual", "individual_gaussian")
    assert (result.num_teachers, result.num_units, result.unit) == (UNITS, UNITS, "users")
    m = result.mechanism
    # Default M: the longest run's 3 · 4 steps over 4; σ the smallest (to 0.1%) that fits.
    assert m["charges_per_teacher"] == math.ceil(3 * 4 / 4) == 3
    assert m["accounting"] == "individual" and m["max_calls"] == 12
    sigma, charges = m["sigma"], m["charges_per_teacher"]
    assert result.epsilon == pytest.approx(_rdp_epsilon(sigma, charges, 1e-5), rel=1e-9)
    assert result.epsilon <= 2.0 and result.delta == 1e-5
    assert _rdp_epsilon(sigma / 1.002, charges, 1e-5) > 2.0
    assert result.planned_epsilon == result.epsilon
    assert m["threshold"] == pytest.approx(sigma * math.sqrt(2 * math.log(300 / m["eta"])))
    assert result.tokens_generated == result.steps_with_output + result.steps_without_output
    assert result.num_queries == result.tokens_generated
    assert result.teacher_forward_passes == UNITS * result.num_queries
    report = result.public_report()
    assert "num_teachers" not in report and "teacher_forward_passes" not in report
    assert result.owner_report()["num_teachers"] == UNITS
    flat = json.dumps(report)
    assert "max_charge" not in flat and "mean_charge" not in flat
    assert [k for k in m if "charge" in k] == ["charges_per_teacher"]
    again = _run(model)
    assert again.texts == result.texts and again.marked_texts == result.marked_texts
    secret = _run(model, key=None, num_samples=1)
    assert not secret.seeded and len(secret.texts) == 1


def test_the_loop_equals_a_naive_loop_and_charges_stay_within_m(model):
    ensemble, config, ledger = _setup(model, 5, max_new_tokens=4)
    key = jax.random.key(11)
    decoded = individual_accounting._decode_individual(
        ensemble, config, ledger, num_samples=3, max_new_tokens=4,
        eos_id=model.tokenizer.eos_id, key=key,
    )  # fmt: skip
    # Naive: individual_step on the teachers' and the public model's logits, step by step,
    # the charges carried across samples.
    charges = jnp.zeros(UNITS, jnp.int32)
    expected_tokens, expected_sources = [], []
    for _ in range(3):
        tokens, sources = [], []
        while len(tokens) < 4:
            prefix = [*ensemble.prompt_ids, *tokens]
            key, sub = jax.random.split(key)
            token, charges, info = individual.individual_step(
                sub,
                ensemble.teachers(prefix),
                ensemble.public_model(prefix),
                charges,
                config,
                5,
            )
            tokens.append(int(token))
            sources.append("public" if bool(info.from_public) else "private")
            if int(token) == model.tokenizer.eos_id:
                break
        expected_tokens.append(tokens)
        expected_sources.append(sources)
    assert [d.tokens for d in decoded] == expected_tokens
    assert [d.sources for d in decoded] == expected_sources
    np.testing.assert_array_equal(ledger.charges, np.asarray(charges))
    assert ledger.steps == sum(len(t) for t in expected_tokens)
    assert ledger.max_charge <= 5 and ledger.budget == 5
    assert ledger.epsilon == pytest.approx(_rdp_epsilon(config.sigma, 5, 1e-5), rel=1e-9)


def test_the_filter_binds_with_one_charge_and_the_run_completes(model):
    ensemble, config, ledger = _setup(model, 1, max_new_tokens=8)
    decoded = individual_accounting._decode_individual(
        ensemble, config, ledger, num_samples=4, max_new_tokens=8, eos_id=None,
        key=jax.random.key(2),
    )  # fmt: skip
    assert [len(d.tokens) for d in decoded] == [8] * 4  # no step fails: public vote
    assert ledger.steps == 32 and ledger.max_charge <= 1
    assert ledger.max_charge == 1  # some teacher disagreed with the public vote once
    result = _run(model, charges_per_teacher=1, num_samples=4, max_new_tokens=8)
    assert len(result.texts) == 4
    sigma = result.mechanism["sigma"]
    assert result.epsilon == pytest.approx(_rdp_epsilon(sigma, 1, 1e-5), rel=1e-9)
    assert result.epsilon <= 2.0
    # More charges need more noise for the same target.
    wide = _run(model, charges_per_teacher=32, num_samples=4, max_new_tokens=8)
    assert wide.mechanism["sigma"] > 2 * sigma and wide.epsilon <= 2.0


def test_public_tokens_are_marked(model):
    result = _run(model, charges_per_teacher=1, num_samples=2, max_new_tokens=6)
    assert result.steps_without_output > 0  # with M = 1 most tokens are the public vote
    assert any("[" in marked for marked in result.marked_texts)
    for text, marked in zip(result.texts, result.marked_texts, strict=True):
        if "[" not in text and "]" not in text:
            assert marked.replace("[", "").replace("]", "") == text


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"accounting": "fancy"}, "accounting must be one of standard, individual"),
        ({"method": "independent"}, "does not apply to method='independent'"),
        ({"method": "amin"}, "does not apply to method='amin'"),
        ({"aggregator": "dpws"}, "does not apply to aggregator='dpws'"),
        ({"threshold_fraction": 0.5}, "does not apply to threshold_fraction"),
        ({"max_retries": 1}, "does not apply to max_retries"),
        ({"public_fallback": False}, "does not apply to public_fallback=False"),
        ({"teachers": "fine_tuned"}, "does not apply to teachers='fine_tuned'"),
        ({"num_teachers": 4}, "num_teachers must be None or the 6 users"),
        ({"charges_per_teacher": 0}, "charges_per_teacher must be from 1 to the 12 steps"),
        ({"charges_per_teacher": 13}, "charges_per_teacher must be from 1 to the 12 steps"),
        ({"charges_per_teacher": 1.5}, "charges_per_teacher must be an integer >= 1"),
        ({"charges_per_teacher": True}, "charges_per_teacher must be an integer >= 1"),
        ({"delta": 0.5}, r"delta = 0.5 >= 1/n"),
        ({"epsilon": 500.0}, r"epsilon must be in \[0.01, 100\]"),
        (
            {"accounting": "standard", "num_teachers": 4, "charges_per_teacher": 3},
            "charges_per_teacher applies to accounting='individual'",
        ),
    ],
)
def test_bad_individual_settings_give_one_line(model, change, message):
    with pytest.raises(ValueError, match=message) as err:
        _run(model, **change)
    assert "\n" not in str(err.value)


def test_num_teachers_may_be_the_number_of_units(model):
    result = _run(model, num_teachers=UNITS, num_samples=1, max_new_tokens=2)
    assert result.num_teachers == UNITS


def _folder(tmp_path):
    documents = tmp_path / "docs"
    documents.mkdir()
    rows = [{"text": t, "user": f"j{i % 4}"} for i, t in enumerate(TEXTS)]
    (documents / "notes.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    return documents


def test_dpmix_generate_with_individual_accounting(model_folder, tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["generate", "--documents", str(_folder(tmp_path)), "--model", str(model_folder),
            "--out", str(out), "--epsilon", "3", "--num-samples", "2", "--max-new-tokens", "3",
            "--prompt", "Meeting", "--seed", "0", "--accounting", "individual",
            "--quiet"]  # fmt: skip
    assert cli.main(argv) == 0
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 2 and all(s["text"].startswith("Meeting") for s in samples)
    report = json.loads((out / "report.json").read_text())
    assert report["settings"]["accounting"] == "individual"
    assert report["settings"]["charges_per_teacher"] is None
    assert report["method"] == "individual" and "num_teachers" not in report
    owner = json.loads((out / "owner_only_report.json").read_text())
    assert owner["num_teachers"] == 4  # one teacher per unit: n is the number of units
    assert report["mechanism"]["charges_per_teacher"] == 2  # ceil(2 · 3 / 4)
    assert 0 < report["epsilon"] == report["planned_epsilon"] <= 3.0
    assert "max_charge" not in json.dumps(report)
    assert f"ε = {report['epsilon']:.3g}" in capsys.readouterr().out
    again = tmp_path / "again"
    argv[argv.index(str(out))] = str(again)
    assert cli.main([*argv, "--charges-per-teacher", "6", "--num-teachers", "4"]) == 0
    report = json.loads((again / "report.json").read_text())
    assert report["mechanism"]["charges_per_teacher"] == 6
    assert report["settings"]["charges_per_teacher"] == 6


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--charges-per-teacher", "3"], "argument --accounting standard: charges_per_teacher"),
        (
            ["--accounting", "individual", "--charges-per-teacher", "0"],
            "argument --accounting individual: charges_per_teacher must be from 1 to the 6",
        ),
        (
            ["--accounting", "individual", "--charges-per-teacher", "100"],
            "argument --accounting individual: charges_per_teacher must be from 1 to the 6",
        ),
        (
            ["--accounting", "individual", "--method", "independent"],
            "does not apply to method='independent'",
        ),
        (
            ["--accounting", "individual", "--aggregator", "dpws"],
            "does not apply to aggregator='dpws'",
        ),
        (
            ["--accounting", "individual", "--teachers", "fine-tuned"],
            "does not apply to teachers='fine_tuned'",
        ),
    ],
)
def test_dpmix_generate_bad_individual_input_is_one_line(tmp_path, capsys, extra, message):
    argv = ["generate", "--documents", str(_folder(tmp_path)), "--out", str(tmp_path / "out"),
            "--num-samples", "2", "--max-new-tokens", "3", "--quiet", *extra]  # fmt: skip
    if "--accounting" not in extra:
        argv += ["--num-teachers", "2"]
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dpmix: error: argument --accounting") and message in err
    assert "\n" not in err


def test_a_ledger_with_its_own_m_checks_it_against_the_configs_budget():
    config = individual.IndividualConfig(sigma=6.0, threshold=30.0, epsilon=8.0, delta=1e-6)
    ledger = individual.IndividualLedger.start(config, 2, max_charges=3)
    assert ledger.budget == 3 and ledger.epsilon == individual.rdp_epsilon(6.0, 3, 1e-6)
    ledger.record([3, 0], steps=3)
    with pytest.raises(ValueError, match="the filter was bypassed"):
        ledger.record([4, 0])
    with pytest.raises(ValueError, match="max_charges = 76 exceeds the budget M = 75"):
        individual.IndividualLedger.start(config, 2, max_charges=config.budget + 1)
