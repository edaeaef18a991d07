"""The topic-generation study on a tiny random GPT-2: every generator's row and the references',
samples beside the results, DP fine-tuning on neutrally labelled sentences, the share of the
gap each keeps, and a resumed run that generates nothing again."""

import dataclasses
import json

import jax
import numpy as np
import pytest
from flax import nnx

from dpmix_jax import synthesis
from dpmix_jax.data.tokenizer import train_bpe_tokenizer
from dpmix_jax.models.gpt2 import GPT2, GPT2Config
from dpmix_jax.synthesis import public_models, quality
from experiments import topic_generation
from experiments.configs import topic_generation as configs

TOPICS = ("sports", "tech")


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    config = configs.TopicGenerationConfig(topics=TOPICS)
    data = topic_generation.topic_data(config)
    texts = [d["text"] for topic in TOPICS for d in data[topic].documents[:200]]
    tokenizer = train_bpe_tokenizer(texts, vocab_size=300)
    model = GPT2(
        GPT2Config.tiny(vocab_size=tokenizer.vocab_size, n_positions=192), rngs=nnx.Rngs(0)
    )
    public = public_models.PublicTextModel(model=model, tokenizer=tokenizer, source="tiny")
    return str(public_models.save_public_model(public, tmp_path_factory.mktemp("tiny")))


def tiny_config(model_folder, **overrides) -> configs.TopicGenerationConfig:
    settings = dict(
        model=model_folder,
        epsilons=(5.0,),
        seeds=(0,),
        topics=TOPICS,
        num_teachers=4,
        context_width=128,
        lines_per_topic=4,
        max_new_tokens=4,
        public_candidates=4,
        finetuning=synthesis.GeneratorTuning(steps=2, batch_size=4),
        test_per_topic=12,
        max_chars=80,
        progress=False,
    )
    return configs.TopicGenerationConfig(**{**settings, **overrides})


def test_every_generator_and_reference_has_its_row_and_its_samples(tmp_path, model_folder):
    config = tiny_config(model_folder)
    results = topic_generation.main(config, tmp_path, reproducible=True)
    rows = {row["generator"]: row for row in results["rows"]}
    assert set(rows) == {*configs.GENERATORS, *configs.REFERENCES}
    for name in synthesis.METHODS:
        assert 0 < rows[name]["epsilon"] <= 5.0 * (1 + 1e-9), name
        assert 0 <= rows[name]["teacher_tokens"] <= rows[name]["tokens"] <= 2 * 4 * 4, name
    assert rows["dp_finetune"]["epsilon"] == 5.0 and rows["dp_finetune"]["teacher_share"] is None
    assert rows["dp_finetune"]["time_vs_forward"] is None  # its time is its training's
    assert rows["nonprivate"]["time_vs_forward"] == 1 and rows["coordinated"]["time_vs_forward"] > 0
    assert rows["public"]["teacher_share"] == 0 and rows["nonprivate"]["teacher_share"] == 1
    assert 0 < rows["coordinated"]["unanimous_release_probability"] < 1
    summary = {entry["generator"]: entry for entry in results["summary"]}
    for name in topic_generation.GAP_MEASURES:
        # On a tiny model the references may tie on a measure; the share is then undefined.
        tied = summary["public"][name]["mean"] == summary["nonprivate"][name]["mean"]
        kept = [summary[reference]["gap_kept"][name] for reference in ("public", "nonprivate")]
        assert kept == ([None, None] if tied else [0, 1]), name
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == (len(rows) - 1) * 2 * 4
    # The real reference's lines are the sensitive sentences: measured, never in the samples.
    assert all(s["generator"] != "real" for s in samples)
    assert all(s["text"].startswith(config.prompt) for s in samples), samples
    assert rows["real"]["epsilon"] == float("inf") and rows["real"]["time_vs_forward"] is None
    data = topic_generation.topic_data(config)
    model = synthesis.load_public_model(model_folder)
    real = topic_generation.real_run(config, model, data, jax.random.key(0))
    assert len(real["lines"]) == len(TOPICS) * config.lines_per_topic
    for line, topic in zip(real["lines"], real["labels"], strict=True):
        own = [d["text"].strip() for d in data[topic].documents]
        assert any(text.startswith(line) for text in own), line
        assert len(model.tokenizer.encode(line)) <= config.max_new_tokens
    markdown = (tmp_path / "results.md").read_text()
    assert markdown.count("| DP fine-tuning (DP-LoRA) | 5 | 5 |") == 1
    assert (tmp_path / "topic_generation.png").stat().st_size > 0
    # The accuracies are the classifiers named: on the model's mean token states, and TF-IDF.
    test = topic_generation.real_test_sentences(config, data)
    test_labels = [topic for topic in config.topics for _ in data[topic].test]
    lines = [s for s in samples if s["generator"] == "nonprivate" and quality.words(s["text"])]
    texts, labels = [s["text"] for s in lines], [s["topic"] for s in lines]
    max_tokens = min(64, int(model.model.config.n_positions))
    embed = quality.mean_token_features(model.model, model.tokenizer, max_tokens=max_tokens)
    for name, featurize in (("accuracy", embed), ("tfidf_accuracy", None)):
        expected = quality.downstream_accuracy(
            texts, labels, test, test_labels, seed=config.mauve_seed, featurize=featurize
        )
        assert rows["nonprivate"][name] == pytest.approx(expected.accuracy), name


def test_dp_fine_tuning_trains_once_on_every_topic_behind_a_neutral_label(
    tmp_path, model_folder, monkeypatch
):
    config = tiny_config(model_folder, generators=("dp_finetune",), references=())
    trainings, prefixes = [], []
    original = synthesis.finetune_generator

    def record(documents, *args, **kwargs):
        trainings.append([d["text"] for d in documents])
        generator = original(documents, *args, **kwargs)
        sample = generator.sample

        def sample_recorded(num_samples, *, prefix="", **settings):
            prefixes.append(prefix)
            return sample(num_samples, prefix=prefix, **settings)

        object.__setattr__(generator, "sample", sample_recorded)
        return generator

    monkeypatch.setattr(synthesis, "finetune_generator", record)
    monkeypatch.setattr(synthesis, "build_ensemble", lambda *a, **k: pytest.fail("no teachers"))
    results = topic_generation.main(config, tmp_path, reproducible=True)
    data = topic_generation.topic_data(config)
    (documents,) = trainings
    assert documents == [
        f"Topic {index + 1}: {d['text']}"
        for index, topic in enumerate(TOPICS)
        for d in data[topic].documents
    ]
    assert prefixes == ["Topic 1: The", "Topic 2: The"]
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [s["topic"] for s in samples] == ["sports"] * 4 + ["tech"] * 4
    assert not any(s["text"].startswith("Topic") for s in samples)  # the label is dropped
    assert results["rows"][0]["epsilon"] == 5.0


def test_a_resumed_study_reads_finished_runs_back_and_a_new_setting_runs_anew(
    tmp_path, model_folder, monkeypatch
):
    config = tiny_config(model_folder, generators=("coordinated",), references=("public",))
    first = topic_generation.main(config, tmp_path, reproducible=True)

    def refuse(*args, **kwargs):
        raise AssertionError("a finished run was generated again")

    with monkeypatch.context() as patch:
        patch.setattr(synthesis, "synthesize_with", refuse)
        patch.setattr(topic_generation.reference, "generate_public", refuse)
        again = topic_generation.main(config, tmp_path, reproducible=True)
    assert again["rows"] == first["rows"]
    # A stage holds what the run generated; its measures are computed again from its lines.
    stages = sorted((tmp_path / "stages").glob("coordinated-*.json"))
    assert stages and all("accuracy" not in json.loads(stage.read_text()) for stage in stages)
    with monkeypatch.context() as patch:
        patch.setattr(topic_generation.quality, "distinct_n", lambda texts, n: 0.5)
        remeasured = topic_generation.main(config, tmp_path, reproducible=True)
    assert {row["distinct_2"] for row in remeasured["rows"]} == {0.5}
    # Another seed list reads the same stored runs: a stored seed is the same run in any list.
    with monkeypatch.context() as patch:
        patch.setattr(synthesis, "synthesize_with", refuse)
        patch.setattr(topic_generation.reference, "generate_public", refuse)
        topic_generation.main(dataclasses.replace(config, seeds=(0,)), tmp_path, reproducible=True)
    changed = dataclasses.replace(config, lines_per_topic=5)
    with monkeypatch.context() as patch, pytest.raises(AssertionError, match="generated again"):
        patch.setattr(synthesis, "synthesize_with", refuse)
        topic_generation.main(changed, tmp_path, reproducible=True)


def test_a_run_draws_the_same_lines_whichever_other_runs_the_study_holds(tmp_path, model_folder):
    # Stage names leave the other runs out, so their randomness must leave them out too.
    full = tiny_config(
        model_folder, generators=("coordinated", "independent"), references=("public",),
        epsilons=(1.0, 10.0),
    )  # fmt: skip
    fewer = dataclasses.replace(full, generators=("independent",), epsilons=(10.0,))

    def lines(config, out):
        topic_generation.main(config, out, reproducible=True)
        samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
        runs = {}
        for sample in samples:
            runs.setdefault((sample["generator"], sample["target_epsilon"]), []).append(
                sample["text"]
            )
        return runs

    everything, some = lines(full, tmp_path / "full"), lines(fewer, tmp_path / "fewer")
    assert set(some) == {("independent", 10.0), ("public", None)}
    assert all(some[run] == everything[run] for run in some)


def test_the_share_of_the_gap_kept_is_taken_from_the_references_means():
    def row(generator, epsilon, seed, accuracy):
        measures = dict.fromkeys(topic_generation.MEASURES, 0.5)
        return {"generator": generator, "target_epsilon": epsilon, "seed": seed,
                "epsilon": epsilon or 0.0, **measures, "accuracy": accuracy,
                "topic_fidelity": 1 - accuracy}  # fmt: skip

    rows = [
        row("public", None, 0, 0.2), row("public", None, 1, 0.3),
        row("nonprivate", None, 0, 0.8), row("nonprivate", None, 1, 0.6),
        row("coordinated", 1.0, 0, 0.3), row("coordinated", 1.0, 1, 0.4),
    ]  # fmt: skip
    summary = {e["generator"]: e for e in topic_generation.summarise(rows)}
    kept = summary["coordinated"]["gap_kept"]
    assert kept["accuracy"] == pytest.approx((0.35 - 0.25) / (0.7 - 0.25))
    assert kept["topic_fidelity"] == pytest.approx((0.65 - 0.75) / (0.3 - 0.75))
    assert summary["coordinated"]["accuracy"] == pytest.approx({"mean": 0.35, "std": 0.05})
    no_references = topic_generation.summarise(rows[4:])[0]["gap_kept"]
    assert no_references == {"topic_fidelity": None, "accuracy": None}


def test_the_test_sentences_features_are_computed_once_and_other_texts_every_time():
    calls = []

    def featurize(texts):
        calls.append(tuple(texts))
        return np.array([[len(t), ord(t[0])] for t in texts], dtype=np.float32)

    test = ["a real line", "another one"]
    remembering = topic_generation.remembering(featurize, test)
    first = remembering(list(test))
    again = remembering(tuple(test))
    generated = remembering(["a synthetic line"])
    remembering(["a synthetic line"])
    np.testing.assert_array_equal(first, featurize(test))
    np.testing.assert_array_equal(again, first)
    with pytest.raises(ValueError, match="read-only"):
        again[0, 0] = 0.0  # a caller cannot change what later runs are scored against
    np.testing.assert_array_equal(generated, featurize(["a synthetic line"]))
    assert calls.count(tuple(test)) == 2  # once remembered, once by the check above
    assert calls.count(("a synthetic line",)) == 3
    assert remembering(test[::-1]).tolist() == featurize(test[::-1]).tolist()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(generators=("gpt4",)), "generators must be"),
        (dict(references=("oracle",)), "references must be"),
        (dict(epsilons=(0.0,)), "epsilons must be"),
        (dict(topics=("sports",)), "topics must be"),
        (dict(num_teachers=1), "num_teachers"),
        (dict(lines_per_topic=0), "lines_per_topic"),
        (dict(min_chars=100, max_chars=50), "min_chars"),
    ],
)
def test_bad_settings_are_one_line(overrides, message):
    with pytest.raises(ValueError, match=message) as raised:
        configs.TopicGenerationConfig(**overrides)
    assert "\n" not in str(raised.value)
