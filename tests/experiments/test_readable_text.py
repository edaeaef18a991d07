"""The readable-text study on a tiny random GPT-2: every generator's row, the held-out
reference, samples beside the results, and a resumed run that generates nothing again."""

import dataclasses
import json

import pytest
from flax import nnx

from dpmix_jax import synthesis
from dpmix_jax.data.tokenizer import train_bpe_tokenizer
from dpmix_jax.models.gpt2 import GPT2, GPT2Config
from dpmix_jax.synthesis import public_models
from experiments import readable_text
from experiments.configs import readable_text as configs


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    notes, heldout = readable_text.documents("notes")
    tokenizer = train_bpe_tokenizer([n["text"] for n in notes] + heldout, vocab_size=300)
    model = GPT2(
        GPT2Config.tiny(vocab_size=tokenizer.vocab_size, n_positions=128), rngs=nnx.Rngs(0)
    )
    public = public_models.PublicTextModel(model=model, tokenizer=tokenizer, source="tiny")
    return str(public_models.save_public_model(public, tmp_path_factory.mktemp("tiny")))


def tiny_config(model_folder, **overrides) -> configs.ReadableTextConfig:
    settings = dict(
        model=model_folder,
        document_sets=(
            configs.DocumentSet(name="notes", num_teachers=4, context_width=64, heldout=20),
        ),
        generators=(
            configs.Generator(method="public"),
            configs.Generator(method="nonprivate"),
            configs.Generator(method="coordinated", epsilon=5.0, public_candidates=8),
        ),
        num_samples=4,
        max_new_tokens=5,
        progress=False,
    )
    return configs.ReadableTextConfig(**{**settings, **overrides})


def test_every_generator_has_its_row_and_its_samples(tmp_path, model_folder):
    results = readable_text.main(tiny_config(model_folder), tmp_path, reproducible=True)
    rows = {row["generator"]: row for row in results["rows"]}
    assert set(rows) == {"public", "nonprivate", "coordinated (ε = 5, top 8)", "held-out real text"}
    assert rows["public"]["epsilon"] == 0 and rows["public"]["teacher_tokens"] == 0
    assert rows["nonprivate"]["epsilon"] == float("inf")
    assert rows["nonprivate"]["teacher_tokens"] == rows["nonprivate"]["tokens"] > 0
    private = rows["coordinated (ε = 5, top 8)"]
    assert 0 < private["epsilon"] <= 5.0
    assert 0 <= private["teacher_tokens"] <= private["tokens"] <= 4 * 5
    assert 0 < private["unanimous_release_probability"] < 1
    # Too few texts for MAUVE in the runs; the held-out text against itself is 1.
    assert private["mauve"] is None and rows["held-out real text"]["mauve"] == pytest.approx(1.0)
    assert rows["held-out real text"]["english_share"] > 0.8  # the notes are English
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 3 * 4
    assert (tmp_path / "results.md").read_text().count("| coordinated (ε = 5, top 8) |") == 1


def test_a_resumed_study_reads_finished_runs_back_and_a_new_setting_runs_anew(
    tmp_path, model_folder, monkeypatch
):
    config = tiny_config(model_folder)
    first = readable_text.main(config, tmp_path, reproducible=True)

    def refuse(*args, **kwargs):
        raise AssertionError("a finished run was generated again")

    with monkeypatch.context() as patch:
        patch.setattr(synthesis, "synthesize_with", refuse)
        again = readable_text.main(config, tmp_path, reproducible=True)
    assert again["rows"] == first["rows"]
    changed = dataclasses.replace(config, max_new_tokens=6)
    with monkeypatch.context() as patch, pytest.raises(AssertionError, match="generated again"):
        patch.setattr(synthesis, "synthesize_with", refuse)
        readable_text.main(changed, tmp_path, reproducible=True)


def test_dp_fine_tuning_runs_on_the_teachers_documents_without_teachers(
    tmp_path, model_folder, monkeypatch
):
    generator = configs.Generator(method="dp_finetune", epsilon=5.0)
    config = tiny_config(model_folder, generators=(generator,), finetune_steps=2)
    seen = []
    original = synthesis.synthesize

    def record(documents, *args, **kwargs):
        seen.append((len(documents), kwargs["finetuning"]))
        return original(documents, *args, **kwargs)

    monkeypatch.setattr(synthesis, "synthesize", record)
    monkeypatch.setattr(synthesis, "build_ensemble", lambda *a, **k: pytest.fail("no teachers"))
    results = readable_text.main(config, tmp_path, reproducible=True)
    row = next(r for r in results["rows"] if r["generator"] == "dp_finetune (ε = 5)")
    assert row["epsilon"] == 5.0 and row["teacher_tokens"] is None and row["tokens"] > 0
    teachers_documents, _ = readable_text.documents("notes")
    assert seen == [(len(teachers_documents), synthesis.GeneratorTuning(steps=2, batch_size=8))]
    assert "| dp_finetune (ε = 5) | 5.000 |" in (tmp_path / "results.md").read_text()
    more_steps = dataclasses.replace(config, finetune_steps=3)
    readable_text.main(more_steps, tmp_path, reproducible=True)
    assert len(seen) == 2  # another number of steps is another run


def test_a_generator_is_validated_on_construction():
    with pytest.raises(ValueError, match="takes no epsilon"):
        configs.Generator(method="public", epsilon=1.0)
    with pytest.raises(ValueError, match="method must be one of"):
        configs.Generator(method="gpt4", epsilon=1.0)
    with pytest.raises(ValueError, match="name must be one of"):
        configs.DocumentSet(name="emails", num_teachers=4, context_width=64, heldout=4)


def test_a_corrupted_stage_is_one_line_naming_its_file(tmp_path, model_folder):
    config = tiny_config(model_folder, generators=(configs.Generator(method="public"),))
    readable_text.main(config, tmp_path, reproducible=True)
    (stage,) = (tmp_path / "stages").glob("notes-public-*.json")
    stage.write_text('{"texts": [')
    with pytest.raises(ValueError, match=f"{stage.name}: not a finished run"):
        readable_text.main(config, tmp_path, reproducible=True)
