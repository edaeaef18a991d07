"""DP fine-tuning as a generator (`synthesis.dp_finetuning`): DP-LoRA of a tiny chat Llama on the
documents through the Trainer, then sampling. Its ε against dp_accounting's PLD on the events it
ran, its training rows (the document alone is scored, after the public chat turn), what it
learns when the noise is small, its reports (no exact count in the public one), its user level,
its determinism under a key, and its one-line refusals."""

import dataclasses
import shutil

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpmix_jax import synthesis
from dpmix_jax.models.gpt2 import generate
from dpmix_jax.models.lora import LoraConfig
from dpmix_jax.synthesis import dp_finetuning
from dpmix_jax.synthesis.dp_finetuning import GeneratorTuning
from dpmix_jax.synthesis.ensemble import prompt_layout
from dpmix_jax.train.losses import sequence_log_prob
from tests.synthesis.test_public_models import llama, llama_folder  # noqa: F401 (fixtures)

DOCUMENTS = [{"text": f"Water the plants in bed {i} before noon."} for i in range(24)]
FAST = GeneratorTuning(steps=4, batch_size=4, lora=LoraConfig(rank=2, alpha=4.0))


def _run(model, documents=DOCUMENTS, **overrides):
    settings = dict(
        epsilon=2.0, delta=1e-3, num_samples=5, method="dp_finetune", max_new_tokens=12,
        key=jax.random.key(0), finetuning=FAST,
    )  # fmt: skip
    return synthesis.synthesize(documents, model, **{**settings, **overrides})


def test_epsilon_is_the_pld_accountant_of_the_steps_that_ran(llama):  # noqa: F811
    result = _run(llama)
    assert result.method == "dp_finetune" and result.aggregator == "dp_sgd"
    assert len(result.texts) == 5 and result.num_teachers is None
    sigma = result.owner_mechanism["noise_multiplier"]
    rate = result.owner_mechanism["sampling_rate"]
    assert rate == pytest.approx(FAST.batch_size / len(DOCUMENTS))
    direct = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    event = dp_accounting.PoissonSampledDpEvent(rate, dp_accounting.GaussianDpEvent(sigma))
    direct.compose(event, FAST.steps)
    spent = result.owner_mechanism["accountant_epsilon"]
    assert spent == pytest.approx(direct.get_epsilon(1e-3), rel=1e-3)
    assert 1.9 < spent <= 2.0 + 1e-9  # calibrated to the target
    assert result.epsilon == 2.0  # what a reader sees: the target, which the accountant's bounds
    assert result.num_queries == FAST.steps and result.teacher_token_share is None
    assert result.public_report()["teacher_token_share"] is None  # no teachers to have a share


def test_the_public_report_holds_no_exact_count(llama):  # noqa: F811
    result = _run(llama)
    public, owner = result.public_report(), result.owner_report()
    for name in ("num_units", "documents_in_prompts", "owner_mechanism"):
        assert name not in public and name in owner
    assert owner["num_units"] == len(DOCUMENTS)
    assert public["mechanism"]["steps"] == FAST.steps
    assert "noise_multiplier" not in str(public)  # σ is a function of the unit count


def test_a_training_row_scores_the_document_and_its_separator_only(llama):  # noqa: F811
    _, prompt_ids, public_context = prompt_layout(llama, "Note:")
    context = [*public_context, *prompt_ids]
    tokenizer = llama.tokenizer
    encoded = tokenizer.encode_batch(["a short one", "a much longer document than the width"])
    end = tokenizer.encode("\n")
    width = len(encoded[0]) + len(end) + 1
    assert len(encoded[1]) > width
    rows = dp_finetuning._training_rows(encoded, context, end, width=width)
    np.testing.assert_array_equal(rows["tokens"][:, : len(context)], [context, context])
    _, counted = sequence_log_prob(
        jnp.zeros((*rows["tokens"].shape, llama.model.config.vocab_size)),
        jnp.asarray(rows["tokens"]),
        jnp.asarray(rows["scored"]),
    )
    expected = [min(len(ids) + len(end), width) for ids in encoded]
    np.testing.assert_array_equal(np.asarray(counted), expected)
    first = len(context) + len(encoded[0])
    np.testing.assert_array_equal(rows["tokens"][0, first : first + len(end)], end)
    assert not rows["attention"][0, first + len(end) :].any()


@pytest.fixture(scope="module")
def expressive(llama_folder, tmp_path_factory):  # noqa: F811
    """The tiny chat Llama with weights of std 0.3: with std 0.02 its frozen tied head cannot
    move a logit by more than about 0.6, whatever the adapters do."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    folder = tmp_path_factory.mktemp("expressive_llama")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(llama_folder / name, folder / name)
    config = transformers.LlamaConfig.from_pretrained(llama_folder)
    config.initializer_range = 0.3
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return synthesis.load_public_model(folder)


def test_with_little_noise_the_generator_writes_its_documents(expressive):
    documents = [{"text": "Water the plants.", "user": i} for i in range(100)]
    strong = GeneratorTuning(steps=40, batch_size=16, learning_rate=3e-2,
                             lora=LoraConfig(rank=4, alpha=8.0))  # fmt: skip
    settings = dict(epsilon=100.0, num_samples=16, temperature=0.5)
    tuned = _run(expressive, documents, finetuning=strong, **settings)
    untuned = _run(expressive, documents, **settings,
                   finetuning=dataclasses.replace(strong, learning_rate=1e-9))  # fmt: skip
    assert sum(text.startswith("Water the plants") for text in tuned.texts) >= 12, tuned.texts
    assert not any(text.startswith("Water the plants") for text in untuned.texts)


def test_user_level_reads_at_most_g_documents_of_a_user(llama):  # noqa: F811
    documents = [{"text": f"Line {i} of user {i % 6}.", "user": i % 6} for i in range(24)]
    tuning = dataclasses.replace(FAST, batch_size=2, max_documents_per_user=3)
    result = _run(llama, documents, finetuning=tuning)
    assert result.unit == "users" and result.owner_report()["num_units"] == 6
    assert result.mechanism["max_documents_per_user"] == 3
    assert result.owner_mechanism["sampling_rate"] == pytest.approx(2 / 6)


def test_a_key_reproduces_the_texts_and_another_changes_them(llama):  # noqa: F811
    first, again = _run(llama), _run(llama)
    assert first.texts == again.texts and first.seeded
    assert _run(llama, key=jax.random.key(1)).texts != first.texts


def test_samples_are_decoded_in_equal_chunks_and_cut_documents_counted(llama):  # noqa: F811
    calls = []
    original = dp_finetuning.generate

    def record(model, prompts, **kwargs):
        calls.append(prompts.shape)
        return original(model, prompts, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dp_finetuning, "generate", record)
        result = _run(llama, num_samples=5, batch_size=2, max_new_tokens=6)
    assert len(result.texts) == len(result.stop_reasons) == 5
    assert len(calls) == 3 and len(set(calls)) == 1  # one shape: one compiled program
    encoded = llama.tokenizer.encode_batch([d["text"] for d in DOCUMENTS])
    end = llama.tokenizer.encode("\n")
    cut = sum(len(ids) + len(end) > 6 for ids in encoded)
    assert cut > 0 and result.owner_mechanism["documents_truncated"] == cut
    assert "owner_mechanism" not in result.public_report()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"num_teachers": 4}, 'num_teachers applies to the teacher methods, not to method="dp_f'),
        ({"accounting": "individual"}, "accounting applies to the teacher methods"),
        ({"public_candidates": 8}, "public_candidates applies to the teacher methods"),
        (
            {"method": "coordinated", "num_teachers": 4},
            'finetuning applies to method="dp_finetune"',
        ),
        ({"finetuning": GeneratorTuning(batch_size=24)}, "batch_size 24 must be below the 24 doc"),
        ({"delta": 0.1}, "delta"),
        ({"max_new_tokens": 10_000}, "exceed the model's 256 positions"),
        ({"temperature": 0.0}, "temperature must be a finite number > 0"),
    ],
)
def test_bad_settings_are_one_line(llama, overrides, message):  # noqa: F811
    with pytest.raises(ValueError, match=message) as error:
        _run(llama, **overrides)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"steps": 0}, "steps"),
        ({"learning_rate": -1.0}, "learning_rate must be a finite number > 0"),
        ({"clip_norm": float("inf")}, "clip_norm must be a finite number > 0"),
        ({"lora": 4}, "lora must be a LoraConfig"),
    ],
)
def test_bad_tuning_is_one_line(settings, message):
    with pytest.raises(ValueError, match=message):
        GeneratorTuning(**settings)


def test_one_training_samples_what_synthesize_samples_and_any_prefix(llama):  # noqa: F811
    key = jax.random.key(3)
    generator = synthesis.finetune_generator(
        DOCUMENTS, llama, epsilon=2.0, delta=1e-3, max_new_tokens=12, key=key, tuning=FAST
    )
    direct = _run(llama, key=key)
    sampled = generator.sample(5, key=jax.random.split(key, 3)[2])
    assert sampled.texts == direct.texts and sampled.epsilon == direct.epsilon == 2.0
    assert sampled.owner_mechanism == direct.owner_mechanism
    prefixed = generator.sample(7, prefix="Bed 3:", key=jax.random.key(9))
    assert len(prefixed.texts) == 7 and all(t.startswith("Bed 3:") for t in prefixed.texts)
    assert prefixed.public_report()["epsilon"] == 2.0  # sampling again costs nothing more
    assert "num_units" not in prefixed.public_report()
    assert not generator.sample(2).seeded  # no key: secret decoding


@pytest.fixture(scope="module")
def trained(llama):  # noqa: F811
    return synthesis.finetune_generator(
        DOCUMENTS, llama, epsilon=2.0, delta=1e-3, max_new_tokens=12, tuning=FAST
    )


def test_a_prefix_is_read_by_the_model_after_the_training_context(trained, llama):  # noqa: F811
    key = jax.random.key(4)
    texts = trained.sample(3, prefix="Bed 3:", key=key, stop_at_newline=False).texts
    context = [*trained.context, *llama.tokenizer.encode("Bed 3:")]
    _, chunk_key = jax.random.split(key)
    expected = generate(
        trained.model, jnp.asarray([context] * 3, jnp.int32), max_new_tokens=12, key=chunk_key
    )
    decoded = []
    for row in np.asarray(expected).tolist():
        cut = row.index(llama.tokenizer.eos_id) if llama.tokenizer.eos_id in row else len(row)
        decoded.append("Bed 3:" + llama.tokenizer.decode(row[:cut]))
    assert list(texts) == decoded


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (dict(num_samples=0), "num_samples"),
        (dict(prefix=3), "prefix must be a string"),
        (dict(temperature=0.0), "temperature"),
        (dict(batch_size=0), "batch_size"),
        (dict(prefix="x " * 300), "exceed the model's"),
    ],
)
def test_bad_sampling_settings_are_one_line(trained, arguments, message):
    settings = {"num_samples": 2, **arguments}
    with pytest.raises(ValueError, match=message) as raised:
        trained.sample(settings.pop("num_samples"), **settings)
    assert "\n" not in str(raised.value)
