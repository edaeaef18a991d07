"""The teacher-share study on a tiny random GPT-2: a row per (n, generator) within its budget,
the unanimous-release probability rising with n, samples beside the results, a resumed run that
generates nothing again, and one-line refusals of bad settings."""

import json

import pytest
from flax import nnx

from dpmix_jax import synthesis
from dpmix_jax.data.tokenizer import train_bpe_tokenizer
from dpmix_jax.models.gpt2 import GPT2, GPT2Config
from dpmix_jax.synthesis import public_models
from experiments import teacher_share
from experiments.configs import teacher_share as configs


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    texts = [d["text"] for d in synthesis.text_default_documents()]
    tokenizer = train_bpe_tokenizer(texts[:400], vocab_size=300)
    model = GPT2(
        GPT2Config.tiny(vocab_size=tokenizer.vocab_size, n_positions=256), rngs=nnx.Rngs(0)
    )
    public = public_models.PublicTextModel(model=model, tokenizer=tokenizer, source="tiny")
    return str(public_models.save_public_model(public, tmp_path_factory.mktemp("tiny")))


def tiny_config(model_folder) -> configs.TeacherShareConfig:
    return configs.TeacherShareConfig(
        model=model_folder,
        teacher_counts=(4, 32),
        generators=(
            configs.Generator(method="coordinated", epsilon=5.0, public_candidates=8),
            configs.Generator(method="independent", epsilon=5.0, public_candidates=8),
        ),
        num_samples=2,
        max_new_tokens=4,
        context_width=160,
        progress=False,
    )


def test_every_run_has_its_row_its_budget_and_its_samples(tmp_path, model_folder, monkeypatch):
    config = tiny_config(model_folder)
    results = teacher_share.main(config, tmp_path, reproducible=True)
    rows = {(r["num_teachers"], r["method"]): r for r in results["rows"]}
    assert set(rows) == {(n, m) for n in (4, 32) for m in ("coordinated", "independent")}
    for row in rows.values():
        assert 0 < row["epsilon"] <= 5.0
        assert 0 <= row["teacher_tokens"] <= row["tokens"] <= 2 * 4
        assert row["teacher_share"] == pytest.approx(row["teacher_tokens"] / row["tokens"])
    # A function of public settings: σ is fixed by the budget, the unanimous count is n.
    for method in ("coordinated", "independent"):
        small, large = rows[4, method], rows[32, method]
        assert small["unanimous_release_probability"] < large["unanimous_release_probability"]
    samples = (tmp_path / "samples.jsonl").read_text().splitlines()
    assert len(samples) == 4 * 2 and all("marked_text" in json.loads(s) for s in samples)
    assert (tmp_path / "teacher_share.png").stat().st_size > 0
    assert "| 32 | coordinated (ε = 5, top 8) |" in (tmp_path / "results.md").read_text()

    # An interrupted study resumes: every finished run is read back, nothing is generated.
    def refuse(*args, **kwargs):
        raise AssertionError("a stored run was generated again")

    monkeypatch.setattr(synthesis, "synthesize_with", refuse)
    monkeypatch.setattr(synthesis, "build_ensemble", refuse)
    again = teacher_share.main(config, tmp_path, reproducible=True)
    assert again["rows"] == results["rows"]


def test_a_damaged_stage_is_named(tmp_path, model_folder):
    config = tiny_config(model_folder)
    digest = synthesis.load_public_model(model_folder).digest()
    name = teacher_share.run_key(config, digest, 4, config.generators[0], 0)
    stage = tmp_path / "stages" / f"{name}.json"
    stage.parent.mkdir(parents=True)
    stage.write_text("{not json")
    with pytest.raises(ValueError, match=f"{name}.json: not a finished run"):
        teacher_share.main(config, tmp_path, reproducible=True)


def test_run_keys_change_with_what_determines_a_run(model_folder):
    config = tiny_config(model_folder)
    coordinated, independent = config.generators
    other = configs.TeacherShareConfig(**{**config.__dict__, "delta": 1e-6})
    keys = {
        teacher_share.run_key(config, "a", 4, coordinated, 0),
        teacher_share.run_key(config, "b", 4, coordinated, 0),  # other weights, same name
        teacher_share.run_key(config, "a", 32, coordinated, 0),
        teacher_share.run_key(config, "a", 4, independent, 0),
        teacher_share.run_key(config, "a", 4, coordinated, 1),
        teacher_share.run_key(other, "a", 4, coordinated, 0),
    }
    assert len(keys) == 6


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"teacher_counts": ()}, "must not be empty"),
        ({"teacher_counts": (1,)}, "at least 2"),
        ({"teacher_counts": (8.5,)}, "teacher_counts must be an integer"),
        ({"context_width": 0}, "context_width must be an integer"),
        ({"delta": 1.5}, "delta"),
    ],
)
def test_bad_settings_are_refused_in_one_line(settings, message):
    with pytest.raises(ValueError, match=message) as error:
        configs.TeacherShareConfig(**settings)
    assert "\n" not in str(error.value)


def test_bad_generators_are_refused_in_one_line():
    with pytest.raises(ValueError, match="method must be one of coordinated, independent"):
        configs.Generator(method="pmixed", epsilon=1.0)
    with pytest.raises(ValueError, match="epsilon"):
        configs.Generator(method="coordinated", epsilon=0.0)
