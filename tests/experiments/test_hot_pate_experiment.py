"""The Hot PATE experiment end to end on the `tiny` preset (text default, in-context teachers)."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dpmix_jax.data.builtin import load_text_mixture_task
from dpmix_jax.data.tokenizer import train_bpe_tokenizer
from dpmix_jax.models.gpt2 import GPT2, GPT2Config
from dpmix_jax.privacy import SEEDED_NOTE
from dpmix_jax.synthesis import public_models
from experiments import hot_pate
from experiments.configs.hot_pate import get_config
from experiments.harness import finish

CONFIG = get_config("tiny")
STORED = pathlib.Path(__file__).resolve().parents[2] / "docs" / "results" / "hot_pate.json"


@pytest.fixture(scope="module")
def tokenizer():
    texts = ["Hello there. How are you?\nFine, thanks!", "def f(x):\n    return x\n"] * 20
    return train_bpe_tokenizer(texts, vocab_size=300)


# Seeded (--reproducible): the statistical checks below see the same draws on every run.
@pytest.fixture(scope="module")
def task():
    return hot_pate.build_natural_task(CONFIG, reproducible=True)


@pytest.fixture(scope="module")
def result(task, tmp_path_factory):
    result = hot_pate.run_experiments(CONFIG, task, reproducible=True)
    out = tmp_path_factory.mktemp("hot_pate")
    finish(out, result, hot_pate.markdown(result), name="hot_pate", plots=hot_pate.plots(result))
    return result, out


def test_sensitive_records_are_the_long_sentences_cut_to_max_tokens(tokenizer):
    texts = ["Short. This sentence is long enough!\nAnother line that is kept", "Tiny?\n\n"]
    records = hot_pate.sensitive_records(texts, tokenizer, min_chars=10, max_tokens=4)
    expected = ["This sentence is long enough!", "Another line that is kept"]
    assert records == [tokenizer.encode(s)[:4] for s in expected]


def test_newline_tokens_are_exactly_the_tokens_holding_a_newline(tokenizer):
    stops = set(hot_pate.newline_tokens(tokenizer))
    for t in range(tokenizer.vocab_size):
        assert (t in stops) == ("\n" in tokenizer.decode([t]))
    assert stops & set(tokenizer.encode("Fine, thanks!\nHello"))


def test_public_model_reads_only_its_public_context():
    model = GPT2(GPT2Config.tiny(vocab_size=64, n_positions=16), rngs=nnx.Rngs(0))
    public = hot_pate.make_public_model(model, [0, 5, 7])
    direct = model(jnp.asarray([[0, 5, 7, 9, 3]], jnp.int32))[0, -1]
    np.testing.assert_allclose(public([9, 3]), direct, rtol=1e-5, atol=1e-5)


def test_config_rejects_prompts_longer_than_the_trained_positions():
    with pytest.raises(ValueError, match="seq_len"):
        dataclasses.replace(CONFIG.natural, seq_len=20)
    with pytest.raises(ValueError, match="preset"):
        get_config("huge")


def test_tokenizer_and_model_are_public_and_teachers_hold_disjoint_records(task):
    public = load_text_mixture_task(
        seed=CONFIG.seed,
        num_users=CONFIG.natural.num_users,
        max_public_per_domain=CONFIG.natural.max_public_per_domain,
    )
    # Retraining the tokenizer on the public documents alone reproduces it exactly.
    again = train_bpe_tokenizer(
        (d for name in public.domain_names for d in public.public_domains[name]),
        vocab_size=CONFIG.natural.vocab_size,
    )
    probe = public.sensitive.texts[0]
    assert again.encode(probe) == task.tokenizer.encode(probe)
    assert task.train_loss[-1][1] < task.train_loss[0][1]
    n = CONFIG.natural.num_teachers
    assert task.teachers.num_teachers == n
    parts = task.parts
    assert len(parts) == n and sum(map(len, parts)) == task.num_records
    used = np.concatenate([p[: CONFIG.natural.records_per_teacher] for p in parts])
    assert len(np.unique(used)) == len(used)  # no record in two teachers' prompts
    # Teacher i's logits are the model's after its own records (one per line) + the instruction.
    records = hot_pate.sensitive_records(
        public.sensitive.texts,
        task.tokenizer,
        min_chars=CONFIG.natural.min_record_chars,
        max_tokens=CONFIG.natural.max_record_tokens,
    )
    newline = task.tokenizer.encode("\n")
    logits = task.teachers([])
    for i in (0, n - 1):
        prompt = [
            t
            for r in parts[i][: CONFIG.natural.records_per_teacher]
            for t in (*records[r], *newline)
        ] + task.instruction
        direct = task.model(jnp.asarray([prompt], jnp.int32))[0, -1]
        np.testing.assert_allclose(logits[i], direct, rtol=1e-4, atol=1e-4)


def test_natural_task_metrics_are_consistent_and_coordination_helps(result):
    result, _ = result
    nat = result["natural"]
    n, r = nat["num_teachers"], CONFIG.natural.num_histograms
    assert np.isclose(nat["thresholds"][0], n / 16) and np.isclose(nat["thresholds"][-1], n / 2)
    for i, step in enumerate(nat["steps"]):
        assert len(step["prefix"]) == i  # the same prefix for both samplers, one token per step
        for sampler in ("coordinated", "independent"):
            m = step[sampler]
            coverage = np.asarray(m["coverage"])
            assert np.all((coverage >= 0) & (coverage <= 1)) and np.all(np.diff(coverage) <= 1e-9)
            assert m["support"][-1] <= 2 * r  # at most two tokens hold >= n/2 of n votes
            tries = m["max_passing_threshold"]
            assert tries["1"][0] <= tries["5"][0] <= tries["10"][0] <= n
    hot, cold = nat["mean"]["coordinated"], nat["mean"]["independent"]
    assert hot["coverage"][-1] > cold["coverage"][-1]
    assert hot["max_passing_threshold"]["1"] > cold["max_passing_threshold"]["1"]


def test_generation_accounting_and_fallback(result):
    result, _ = result
    cfg = CONFIG.generation
    rows = result["generation"]["rows"]
    assert {(r["aggregator"], r["sampler"]) for r in rows} == {
        (a, s)
        for a in ("dpws", "dpargmax_laplace", "confident_gnmax")
        for s in ("coordinated", "independent")
    }
    for row in rows:
        assert all(t.startswith(CONFIG.natural.instruction) for t in row["texts"])
        # No retries: one query per token, and every failed query became a public token.
        assert row["queries"] == sum(len(t) for t in row["tokens"])
        assert np.isclose(row["fallback_fraction"], 1 - row["yield"])
        if row["aggregator"] == "dpargmax_laplace":  # pure ε per call composes to at most qε
            assert cfg.epsilon <= row["epsilon"] <= row["queries"] * cfg.epsilon + 1e-9
    by_key = {(r["aggregator"], r["sampler"]): r for r in rows}
    for aggregator in ("dpws", "dpargmax_laplace", "confident_gnmax"):
        hot, cold = by_key[aggregator, "coordinated"], by_key[aggregator, "independent"]
        if hot["queries"] == cold["queries"]:  # data-independent accounting
            assert np.isclose(hot["epsilon"], cold["epsilon"])


def test_report_files(result):
    result, out = result
    saved = json.loads((out / "hot_pate.json").read_text())
    assert saved["natural"]["mean"] == result["natural"]["mean"]
    text = (out / "hot_pate.md").read_text()
    assert "## (b) Natural task" in text and "## (c) Private generation" in text
    assert "## (d) Diversity preservation" in text
    assert saved["noise_seeded"] is True and SEEDED_NOTE in text
    assert (out / "natural.png").stat().st_size > 0
    assert (out / "diversity_n32.png").stat().st_size > 0
    files = {"hot_pate.json", "hot_pate.md", "natural.png", "diversity_n32.png"}
    assert {p.name for p in out.iterdir()} == files


def test_plots_follow_the_parts_that_ran_and_draw_from_the_stored_run(tmp_path):
    assert hot_pate.plots({"parts": ["guarantees"]}) == {}
    stored = json.loads(STORED.read_text())
    plots = hot_pate.plots(stored)
    assert set(plots) == {"diversity_n128.png", "diversity_n512.png", "natural.png"}
    for name, plot in plots.items():
        plot(stored, tmp_path / name)
        assert (tmp_path / name).stat().st_size > 10_000


def test_parts_outside_the_four_end_like_a_bad_option(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        hot_pate.cli(["--preset", "tiny", "--parts", "natural,nope", "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(
        "error: --parts must list some of diversity,guarantees,natural,generation,"
        " got 'natural,nope'"
    )
    assert not any(tmp_path.iterdir())


def test_guarantee_table_meets_the_theorem_for_coordinated_tws(result):
    result, _ = result
    table = {(row["aggregator"], row["gamma"]): row for row in result["guarantees"]["table"]}
    tws = table[("tws", 1.0)]
    assert tws["coordinated"]["beta"] >= 0.17
    assert tws["coordinated"]["gamma_lower"] <= 1.0  # relevance, up to 4 standard errors
    assert tws["independent"]["beta"] < tws["coordinated"]["beta"]
    assert ("dpws", 1.0) in table
    released = [r for r in result["generation"]["rows"] if r["aggregator"] == "confident_gnmax"]
    assert all(len(r["per_sequence_epsilon"]["released"]) >= 1 for r in released)


def test_public_split_holds_out_every_kth_document_of_each_domain():
    domains = [[f"a{i}" for i in range(7)], [f"b{i}" for i in range(3)]]
    train, heldout = public_models.split_public(domains, every=3)
    assert heldout == [["a2", "a5"], ["b2"]]
    assert train == [["a0", "a1", "a3", "a4", "a6"], ["b0", "b1"]]


def test_heldout_perplexity_of_an_untrained_model_is_about_the_vocabulary_size(tokenizer):
    # Initial GPT-2 logits are nearly uniform: perplexity ~ V (an independent check of the sum).
    model = GPT2(GPT2Config.tiny(vocab_size=tokenizer.vocab_size, n_positions=16), rngs=nnx.Rngs(0))
    docs = ["Hello there. How are you?\nFine, thanks!"] * 6
    perplexity = public_models.heldout_perplexity(model, tokenizer, docs, seq_len=16)
    assert 0.8 * tokenizer.vocab_size < perplexity < 1.25 * tokenizer.vocab_size


def test_public_model_is_stored_under_its_settings_and_read_back(tmp_path):
    first = hot_pate.public_model(CONFIG, tmp_path)
    assert not first.cached and 1 < first.heldout_perplexity < CONFIG.natural.vocab_size
    second = hot_pate.public_model(CONFIG, tmp_path)
    assert second.cached and second.heldout_perplexity == first.heldout_perplexity
    assert second.train_loss == first.train_loss
    ids = jnp.asarray([first.tokenizer.encode("The sales rose.")], jnp.int32)
    np.testing.assert_array_equal(np.asarray(second.model(ids)), np.asarray(first.model(ids)))
    assert second.tokenizer.encode("def f(x):") == first.tokenizer.encode("def f(x):")
    # Other settings never read this model back.
    longer = dataclasses.replace(
        CONFIG, natural=dataclasses.replace(CONFIG.natural, train_steps=21)
    )
    assert hot_pate._public_settings(longer) != hot_pate._public_settings(CONFIG)
    assert len(list(tmp_path.iterdir())) == 1
