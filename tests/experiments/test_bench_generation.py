"""The generation-step benchmark on a tiny random GPT-2: a row per method and for the reference,
ratios taken round by round, and the settings refused in one line."""

import dataclasses

import numpy as np
import pytest
from flax import nnx

from dpmix_jax import synthesis
from dpmix_jax.data.tokenizer import train_bpe_tokenizer
from dpmix_jax.models.gpt2 import GPT2, GPT2Config
from dpmix_jax.synthesis import public_models
from experiments import bench_generation
from experiments.configs import bench_generation as configs


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    texts = [d["text"] for d in bench_generation.topic_documents(configs.get_config())[:200]]
    tokenizer = train_bpe_tokenizer(texts, vocab_size=300)
    model = GPT2(
        GPT2Config.tiny(vocab_size=tokenizer.vocab_size, n_positions=160), rngs=nnx.Rngs(0)
    )
    public = public_models.PublicTextModel(model=model, tokenizer=tokenizer, source="tiny")
    return str(public_models.save_public_model(public, tmp_path_factory.mktemp("tiny")))


def test_every_method_and_the_reference_have_a_row(tmp_path, model_folder, monkeypatch):
    config = dataclasses.replace(configs.get_config("tiny"), model=model_folder)
    written = []
    generate_nonprivate = bench_generation.reference.generate_nonprivate

    def counted(*args, **kwargs):
        written.append(1)
        return generate_nonprivate(*args, **kwargs)

    monkeypatch.setattr(bench_generation.reference, "generate_nonprivate", counted)
    results = bench_generation.main(config, tmp_path)
    rows = {row["method"]: row for row in results["rows"]}
    assert set(rows) == {*synthesis.METHODS, bench_generation.REFERENCE}
    assert len(written) == config.rounds + 1  # one untimed round, then the timed ones
    reference = rows[bench_generation.REFERENCE]
    assert reference["time_vs_forward"] == 1 == reference["time_vs_forward_max"]
    for name in synthesis.METHODS:
        row = rows[name]
        assert row["seconds_per_token"] > 0, name
        assert row["time_vs_forward_min"] <= row["time_vs_forward"] <= row["time_vs_forward_max"]
        assert 0 < row["tokens"] <= config.rounds * config.max_new_tokens, name
    markdown = (tmp_path / "results.md").read_text()
    for method in synthesis.METHODS:
        assert f"| {synthesis.REGISTRY[method].label} |" in markdown


def test_ratios_are_taken_round_by_round():
    """A method twice as slow as the reference in each round has ratio 2, however much the
    machine's speed drifts between rounds; a text with no token counts as one."""
    timed = {
        bench_generation.REFERENCE: [(1.0, 10), (3.0, 10), (0.5, 5)],
        "coordinated": [(2.0, 10), (6.0, 10), (1.0, 5)],
        "pmixed": [(0.3, 0), (0.3, 10), (0.1, 5)],
    }
    rows = {row["method"]: row for row in bench_generation.ratios(timed)}
    assert rows["coordinated"]["time_vs_forward"] == pytest.approx(2.0)
    assert rows["coordinated"]["time_vs_forward_max"] == pytest.approx(2.0)
    assert rows["coordinated"]["seconds_per_token"] == pytest.approx(0.2)
    expected = np.array([0.3 / 1 / 0.1, 0.03 / 0.3, 0.02 / 0.1])
    assert rows["pmixed"]["time_vs_forward"] == pytest.approx(np.median(expected))
    assert rows["pmixed"]["time_vs_forward_min"] == pytest.approx(expected.min())
    assert rows["pmixed"]["time_vs_forward_max"] == pytest.approx(expected.max())
    assert rows["pmixed"]["tokens"] == 15


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(methods=("lukewarm",)), "methods must be a non-empty subset"),
        (dict(methods=()), "methods must be a non-empty subset"),
        (dict(topic="weather"), "topic must be one of"),
        (dict(rounds=0), "rounds"),
        (dict(num_teachers=1), "num_teachers must be >= 2"),
        (dict(epsilon=0.0), "epsilon"),
    ],
)
def test_bad_settings_are_one_line(change, message):
    with pytest.raises(ValueError, match=message) as err:
        configs.BenchGenerationConfig(**change)
    assert "\n" not in str(err.value)
