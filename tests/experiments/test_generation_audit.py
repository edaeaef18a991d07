"""The canary audit of the text generators: its canaries (rare, distinct, each first in its
own teacher), its scores, a bound that sees a generator copying the included canaries and none
where nothing is copied, and a tiny end-to-end run that resumes without generating again."""

import dataclasses
import types

import jax
import numpy as np
import pytest

from dpmix_jax import synthesis
from dpmix_jax.privacy import audit
from experiments import generation_audit
from experiments.configs import generation_audit as configs
from tests.experiments.test_topic_generation import model_folder  # noqa: F401 (a fixture)

CONFIG = configs.GenerationAuditConfig(num_canaries=32)


def test_canaries_are_distinct_rare_words_drawn_from_the_seed():
    canaries = generation_audit.draw_canaries(CONFIG)
    words = [w for pair in canaries.words for w in pair]
    assert len(set(words)) == 64 and all(w.isalpha() and 7 <= len(w) <= 10 for w in words)
    assert generation_audit.draw_canaries(CONFIG) == canaries
    other = generation_audit.draw_canaries(dataclasses.replace(CONFIG, seed=1))
    assert other.words != canaries.words
    assert 8 <= sum(canaries.included) <= 24  # fair coins


def test_each_included_canary_is_first_in_its_own_teacher_and_fillers_are_not_shared():
    canaries = generation_audit.draw_canaries(CONFIG)
    documents = generation_audit.teacher_documents(CONFIG, canaries)
    by_user: dict[int, list[str]] = {}
    for document in documents:
        by_user.setdefault(document["user"], []).append(document["text"])
    assert sorted(by_user) == list(range(32))
    for i, texts in by_user.items():
        canary = generation_audit.canary_text(CONFIG, canaries.words[i])
        assert (texts[0] == canary) == canaries.included[i]
        assert canary not in texts[1:] and len(texts) == 3 + canaries.included[i]
    fillers = [d["text"] for d in documents if not d["text"].startswith(CONFIG.canary_prefix)]
    assert len(set(fillers)) == len(fillers)


def test_the_bound_sees_a_generator_that_copies_the_included_canaries_and_nothing_else():
    canaries = generation_audit.draw_canaries(CONFIG)
    copied = [
        f"{CONFIG.canary_prefix} {a} {b}."
        for (a, b), included in zip(canaries.words, canaries.included, strict=True)
        if included
    ]
    leaky = generation_audit.bound(CONFIG, {"texts": copied}, canaries)
    included = np.asarray(canaries.included)
    expected = audit.one_run_epsilon_lower_bound(
        included.astype(float), included, delta=CONFIG.delta, confidence=CONFIG.confidence
    )
    assert leaky["epsilon_lower_bound"] == pytest.approx(expected.epsilon)
    assert leaky["epsilon_lower_bound"] > 1.0 and leaky["correct"] == leaky["guesses"]
    assert leaky["included_seen"] == sum(canaries.included) and leaky["excluded_seen"] == 0
    silent = generation_audit.bound(CONFIG, {"texts": ["My secret code is safe."] * 8}, canaries)
    assert silent["epsilon_lower_bound"] == 0.0 and silent["included_seen"] == 0


def test_the_control_writes_each_text_from_one_teacher_alone():
    class Teachers:
        """Teacher i always says token i: a text names the one teacher it came from."""

        num_teachers = 5

        def __call__(self, prefix):
            return np.where(np.eye(5, 7, dtype=bool), 0.0, -1e9)

    class Tokenizer:
        eos_id = 6

        def decode(self, tokens):
            return " ".join(str(t) for t in tokens)

    ensemble = types.SimpleNamespace(teachers=Teachers(), prompt_ids=[6], stop_sequences=())
    model = types.SimpleNamespace(tokenizer=Tokenizer())
    config = dataclasses.replace(CONFIG, num_texts=40, max_new_tokens=3)
    key = jax.random.key(0)
    texts = generation_audit.reference_texts(config, model, ensemble, "single_teacher", key)
    assert len(texts) == 40 and all(len(set(t.split())) == 1 for t in texts)
    assert {t.split()[0] for t in texts} == {"0", "1", "2", "3", "4"}  # every teacher drawn
    average = generation_audit.reference_texts(config, model, ensemble, "nonprivate", key)
    assert any(len(set(t.split())) > 1 for t in average)  # the average mixes teachers per token


def test_a_canary_scores_each_of_its_words_in_each_text():
    canaries = generation_audit.Canaries(
        words=(("aardvark", "zeppelin"), ("quixotic", "marmalade")), included=(True, False)
    )
    texts = ["An aardvark and a Zeppelin.", "aardvark!", "quixotic", "nothing here"]
    np.testing.assert_array_equal(generation_audit.scores(texts, canaries), [3.0, 1.0])


def test_a_tiny_audit_runs_every_generator_and_resumes(tmp_path, monkeypatch, model_folder):  # noqa: F811
    config = dataclasses.replace(
        configs.get_config("tiny"), model=model_folder, context_width=128, num_texts=12
    )
    first = generation_audit.main(config, tmp_path, reproducible=True)
    rows = {row["generator"]: row for row in first["rows"]}
    # InvisibleInk's own setting writes one text per teacher at most: 8 of the 12.
    samples = (tmp_path / "samples.jsonl").read_text().splitlines()
    assert sum('"invisibleink_disjoint"' in line for line in samples) == 8
    assert sum('"coordinated"' in line for line in samples) == 12
    assert set(rows) == {*configs.GENERATORS, *generation_audit.REFERENCES}
    for name, row in rows.items():
        assert row["epsilon_lower_bound"] >= 0, name
        if name not in generation_audit.REFERENCES:
            assert 0 < row["epsilon"] <= 10.0 * (1 + 1e-9), name
    for name in generation_audit.REFERENCES:
        assert rows[name]["epsilon"] == float("inf") and rows[name]["teacher_share"] == 1

    def refuse(*args, **kwargs):
        raise AssertionError("a finished run was generated again")

    monkeypatch.setattr(synthesis, "synthesize_with", refuse)
    monkeypatch.setattr(synthesis, "finetune_generator", refuse)
    monkeypatch.setattr(generation_audit.reference, "generate_nonprivate", refuse)
    monkeypatch.setattr(generation_audit.decoding, "decode", refuse)
    assert generation_audit.main(config, tmp_path, reproducible=True)["rows"] == first["rows"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(generators=("gpt4",)), "generators must be"),
        (dict(epsilons=(0.0,)), "epsilons must be"),
        (dict(num_canaries=2), "num_canaries must be >= 4"),
        (dict(canary_prefix="  "), "canary_prefix"),
        (dict(confidence=1.0), "confidence"),
    ],
)
def test_bad_settings_are_one_line(overrides, message):
    with pytest.raises(ValueError, match=message) as raised:
        configs.GenerationAuditConfig(**overrides)
    assert "\n" not in str(raised.value)
