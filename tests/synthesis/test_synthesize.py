"""Private synthetic text (`synthesis`, `synthesis.public_models`) and `dpmix generate`, on a tiny
GPT-2 saved locally in the transformers format with a locally trained tokenizer."""

from __future__ import annotations

import dataclasses
import json
import math

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import optimize, stats

from dpmix_jax import cli, synthesis
from dpmix_jax.data.tokenizer import train_bpe_tokenizer
from dpmix_jax.models.gpt2 import GPT2, GPT2Config
from dpmix_jax.pate.hot_pate_method import WeakReleaseError
from dpmix_jax.pate.method import Method
from dpmix_jax.pate.partition import teacher_parts
from dpmix_jax.privacy.parts import assign_parts
from dpmix_jax.synthesis import finetuned_teachers, public_models
from dpmix_jax.synthesis import run as synthesis_run

TEXTS = [
    f"Meeting {i} moved to room {i % 7}. Please bring the report on item {i}." for i in range(24)
]
USERS = [f"user{i % 6}" for i in range(len(TEXTS))]


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    """A transformers GPT-2 folder: config.json (model_type gpt2), safetensors, tokenizer.json."""
    transformers = pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("gpt2")
    tokenizer = train_bpe_tokenizer(TEXTS * 3, vocab_size=300)
    tokenizer.save(folder / "tokenizer.json")
    config = transformers.GPT2Config(
        vocab_size=tokenizer.vocab_size, n_positions=64, n_embd=32, n_layer=1, n_head=2
    )
    transformers.GPT2LMHeadModel(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def model(model_folder):
    return public_models.load_public_model(model_folder)


def _docs(with_users: bool = True) -> list[dict]:
    return [
        {"text": t, **({"user": u} if with_users else {})}
        for t, u in zip(TEXTS, USERS, strict=True)
    ]


def _run(model, **overrides):
    settings = dict(
        epsilon=2.0,
        delta=1e-5,
        num_samples=2,
        max_new_tokens=3,
        num_teachers=4,
        key=jax.random.key(7),
        stop_at_newline=False,
        min_unanimous_release=0.0,  # 4 tiny teachers: these tests check other properties
    )
    return synthesis.synthesize(_docs(), model, **{**settings, **overrides})


def _gaussian_epsilon(sigma: float, delta: float) -> float:
    """The exact ε of the Gaussian mechanism (sensitivity 1, noise σ) at δ (Balle & Wang 2018)."""

    def delta_of(eps: float) -> float:
        a, b = 1 / (2 * sigma), eps * sigma
        return stats.norm.cdf(a - b) - math.exp(eps) * stats.norm.cdf(-a - b)

    return optimize.brentq(lambda e: delta_of(e) - delta, 1e-9, 100.0, xtol=1e-12)


def test_transformers_folder_loads_with_its_weights_and_tokenizer(model_folder, model):
    torch = pytest.importorskip("torch")
    import transformers

    reference = transformers.GPT2LMHeadModel.from_pretrained(model_folder).eval()
    ids = model.tokenizer.encode("Please bring the report")
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits.numpy()
    np.testing.assert_allclose(model.model(jnp.asarray([ids])), expected, atol=1e-4)
    assert model.context_length == 64


def test_stored_model_reads_back_the_same(model, tmp_path):
    public_models.save_public_model(model, tmp_path / "stored")
    again = public_models.load_public_model(tmp_path / "stored")
    ids = jnp.asarray([model.tokenizer.encode("Meeting 3 moved")])
    np.testing.assert_array_equal(again.model(ids), model.model(ids))
    assert again.tokenizer.encode("room 5") == model.tokenizer.encode("room 5")


def test_gnmax_epsilon_is_the_gaussian_composition_of_the_calls_that_ran(model):
    result = _run(model, aggregator="confident_gnmax")
    m = result.mechanism
    # One call: Gaussian σ1 on the top count (sensitivity 1) and σ2 on the counts (L2 √2),
    # i.e. a Gaussian of 1/σ² = 1/σ1² + 2/σ2²; q calls: σ/√q. Exact, independent of the PLD.
    sigma = (1 / m["sigma1"] ** 2 + 2 / m["sigma2"] ** 2) ** -0.5 / math.sqrt(result.num_queries)
    exact = _gaussian_epsilon(sigma, 1e-5)
    assert exact <= result.epsilon <= exact * 1.002
    assert result.delta == 1e-5
    # Calibrated for the longest run (num_samples · max_new_tokens calls), tightly.
    assert m["max_calls"] == 6 and m["sigma1"] == 2 * m["sigma2"]
    assert 0.99 * 2.0 <= result.planned_epsilon <= 2.0
    assert result.epsilon <= result.planned_epsilon
    assert result.num_queries <= 6 and result.tokens_generated == result.num_queries
    # The data-dependent ε: each sample's private release composed at the common order λ.
    conversion = math.log(1e5) / (m["release_order"] - 1)
    released = result.released_epsilons
    assert len(released) == 2
    assert result.data_dependent_epsilon == pytest.approx(sum(released) - conversion)


def test_dpws_epsilon_and_delta_are_the_laplace_composition_plus_per_call_delta(model):
    result = _run(model, aggregator="dpws")
    m = result.mechanism
    assert m["report_delta"] == 5e-6 and m["per_call_delta"] == pytest.approx(5e-6 / 6)
    accountant = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-5)
    accountant.compose(dp_accounting.LaplaceDpEvent(1 / m["per_call_epsilon"]), result.num_queries)
    reference = accountant.get_epsilon(5e-6)
    assert result.epsilon == pytest.approx(reference, rel=2e-3)
    assert result.epsilon <= result.num_queries * m["per_call_epsilon"]  # basic composition
    assert result.delta == pytest.approx(5e-6 + result.num_queries * m["per_call_delta"])
    assert result.delta <= 1e-5 * (1 + 1e-12)
    assert result.data_dependent_epsilon is None and result.released_epsilons is None


def test_a_user_field_makes_users_the_units(model):
    docs = _docs()
    parts = teacher_parts(docs, 3, key=b"secret")
    teacher = np.empty(len(docs), int)
    for t, part in enumerate(parts):
        teacher[part] = t
    for user in set(USERS):
        assert len({teacher[i] for i, u in enumerate(USERS) if u == user}) == 1
    expected = assign_parts(USERS, [1 / 3] * 3, key=b"secret")
    np.testing.assert_array_equal(teacher, expected)
    result = _run(model, num_samples=1)
    assert (result.unit, result.num_units) == ("users", 6)
    plain = synthesis.synthesize(
        _docs(with_users=False), model, epsilon=2.0, delta=1e-5, num_samples=1,
        max_new_tokens=2, key=jax.random.key(0), num_teachers=4, min_unanimous_release=0.0,
    )  # fmt: skip
    assert (plain.unit, plain.num_units) == ("documents", len(TEXTS))


def test_a_key_makes_the_run_reproducible(model):
    first, second = _run(model), _run(model)
    assert first.texts == second.texts and first.epsilon == second.epsilon
    assert first.released_epsilons == second.released_epsilons
    assert first.seeded and first.public_report()["randomness"].startswith("noise seeded")
    secret = _run(model, key=None, num_samples=1)
    assert not secret.seeded


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"epsilon": 0.0}, "epsilon must be a finite number > 0"),
        ({"epsilon": -1.0}, "epsilon must be a finite number > 0"),
        ({"delta": 0.5}, "delta = 0.5 >= 1/n"),
        ({"num_teachers": 7}, "num_teachers must be an integer from 2 to the 6 users"),
        ({"method": "lukewarm"}, "method must be one of coordinated, independent, invisibleink"),
        ({"max_new_tokens": 70}, "leave no room for documents"),
        ({"separator": ""}, "separator must be a non-empty string"),
        ({"teachers": "distilled"}, "teachers must be one of in_context, fine_tuned"),
        ({"tuning": finetuned_teachers.TeacherTuning()}, "tuning applies to teachers='fine_tuned'"),
    ],
)
def test_bad_settings_give_one_line(model, change, message):
    with pytest.raises(ValueError, match=message) as err:
        _run(model, **change)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("teachers", ["in_context", "fine_tuned"])
def test_hot_pate_below_the_release_floor_is_refused_before_any_teacher_is_built(
    model, monkeypatch, teachers
):
    def no_teachers(*args, **kwargs):
        raise AssertionError("the teachers were built before the refusal")

    monkeypatch.setattr(synthesis_run, "build_ensemble", no_teachers)
    with pytest.raises(WeakReleaseError) as refused:
        _run(model, min_unanimous_release=synthesis.MIN_UNANIMOUS_RELEASE, teachers=teachers)
    assert refused.value.run.num_teachers == 4 and refused.value.needed > 4
    assert "min_unanimous_release" in str(refused.value) and "\n" not in str(refused.value)


def test_a_run_at_the_named_number_of_teachers_passes_the_floor(model):
    """The teachers the refusal names do reach the floor in a real run (with the tiny model's
    vocabulary, all of it counted: no public candidates)."""
    floor = dict(min_unanimous_release=0.5, epsilon=5.0, num_samples=1, max_new_tokens=1)
    with pytest.raises(WeakReleaseError) as refused:
        _run(model, num_teachers=2, **floor)
    needed = refused.value.needed
    assert needed is not None and 3 < needed <= 6, needed
    with pytest.raises(WeakReleaseError):
        _run(model, num_teachers=needed - 1, **floor)
    result = _run(model, num_teachers=needed, **floor)
    assert result.mechanism["unanimous_release_probability"] >= 0.5


@pytest.mark.parametrize(
    ("documents", "message"),
    [
        ([{"text": "one", "user": "a"}, {"text": "two", "user": "a"}], "only one unit"),
        ([{"text": "the same"}, {"text": "the same"}], "only one unit"),
        (
            [{"text": "x " * 200}, {"text": "short"}],
            r"document 0 has \d+ tokens; a teacher's context of 48 tokens",
        ),
        ([{"text": "a", "user": "u"}, {"text": "b"}], "document 1 has no user"),
        ([{"text": "a", "user": 1.5}, {"text": "b", "user": 2}], "user must be a string"),
        ([{"text": " "}, {"text": "b"}], "document 0 has no text"),
        ([], "documents is empty"),
    ],
)
def test_bad_documents_give_one_line_naming_the_document(model, documents, message):
    with pytest.raises(ValueError, match=message) as err:
        synthesis.synthesize(
            documents, model, epsilon=1.0, delta=1e-5, num_samples=1, num_teachers=2,
            min_unanimous_release=0.0,
        )  # fmt: skip
    assert "\n" not in str(err.value)


def test_documents_load_from_txt_jsonl_and_parquet(tmp_path):
    (tmp_path / "a.txt").write_text("A whole file is one document.\nSecond line.")
    rows = [{"text": "first", "user": "u1"}, {"text": "second", "user": 2}]
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    records = synthesis.load_documents(tmp_path)
    assert [r["text"] for r in records] == [
        "A whole file is one document.\nSecond line.", "first", "second"
    ]  # fmt: skip
    assert records[2] == {"text": "second", "user": 2, "source": "b.jsonl:2"}
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["p1", "p2"], "user": ["x", "y"]}), tmp_path / "c.parquet")
    loaded = synthesis.load_documents(tmp_path)
    assert [(r["text"], r.get("user")) for r in loaded[3:]] == [("p1", "x"), ("p2", "y")]


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ({}, "holds no documents"),
        ({"bad.txt": b"caf\xe9 au lait"}, r"bad.txt: byte 3 \(0xe9\) is not UTF-8"),
        ({"notes.csv": b"text\nhello"}, "notes.csv: documents are .txt, .jsonl, .parquet"),
        ({"d.jsonl": b'{"text": "ok"}\n{"body": "no text"}'}, "d.jsonl:2: need a JSON object"),
        ({"d.jsonl": b"{not json"}, "d.jsonl:1: not a JSON object"),
    ],
)
def test_bad_document_folders_give_one_line_naming_the_file(tmp_path, files, message):
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    with pytest.raises(ValueError, match=message) as err:
        synthesis.load_documents(tmp_path)
    assert "\n" not in str(err.value)


def test_model_folders_that_are_not_gpt2_name_what_is_missing(model_folder, tmp_path):
    with pytest.raises(ValueError, match="config.json .* is missing"):
        public_models.load_public_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ValueError, match="model_type is 'bert'; need gpt2 or a Llama-family"):
        public_models.load_public_model(tmp_path)
    config = json.loads((model_folder / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no tokenizer: tokenizer.json, or vocab.json"):
        public_models.load_public_model(tmp_path)
    (tmp_path / "tokenizer.json").write_bytes((model_folder / "tokenizer.json").read_bytes())
    with pytest.raises(ValueError, match="holds none of model.safetensors"):
        public_models.load_public_model(tmp_path)
    with pytest.raises(ValueError, match="does not exist or is not a folder"):
        public_models.load_public_model(tmp_path / "absent")


def test_text_default_model_is_trained_once_then_read_back(tmp_path):
    settings = public_models.TextDefaultModel(
        vocab_size=300, width=16, depth=1, heads=2, seq_len=32, train_steps=2, batch_size=4,
        max_public_per_domain=20,
    )  # fmt: skip
    trained = public_models.text_default_model(tmp_path, settings)
    (folder,) = tmp_path.iterdir()
    assert folder.name == f"public_model-{settings.key()}"
    again = public_models.text_default_model(tmp_path, settings)
    ids = jnp.asarray([trained.tokenizer.encode("Dear team, the report")])
    np.testing.assert_array_equal(again.model(ids), trained.model(ids))
    assert again.model.config.n_embd == 16 and again.context_length == 32


def test_text_default_documents_are_its_sentences_cut_to_max_chars():
    documents = synthesis.text_default_documents(min_chars=20, max_chars=50)
    assert len(documents) > 1000
    assert all(20 <= len(d["text"]) <= 50 and "user" not in d for d in documents)


def test_dpmix_generate_writes_samples_and_the_spent_epsilon(model_folder, tmp_path, capsys):
    documents = tmp_path / "docs"
    documents.mkdir()
    for i, text in enumerate(TEXTS[:8]):
        (documents / f"note{i}.txt").write_text(text)
    rows = [{"text": t, "user": f"j{i % 4}"} for i, t in enumerate(TEXTS[8:])]
    (documents / "more.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "out"
    argv = ["generate", "--documents", str(documents), "--model", str(model_folder),
            "--out", str(out), "--epsilon", "3", "--num-samples", "2", "--max-new-tokens", "3",
            "--prompt", "Meeting", "--seed", "0", "--num-teachers", "4", "--quiet",
            "--min-unanimous-release", "0"]  # fmt: skip
    # .txt files carry no user while the .jsonl rows do: every document needs one, or none.
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dpmix: error: document 16 (note0.txt) has no user but document 0")
    assert "\n" not in err
    (documents / "more.jsonl").write_text("\n".join(json.dumps({"text": r["text"]}) for r in rows))
    assert cli.main(argv) == 0
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 2
    assert all(s["text"].startswith("Meeting") and s["stop_reason"] for s in samples)
    report = json.loads((out / "report.json").read_text())
    assert report["settings"]["epsilon"] == 3.0 and "seed" not in report["settings"]
    assert 0 < report["epsilon"] <= report["planned_epsilon"] <= 3.0
    assert "num_units" not in report and report["unit"] == "documents"
    assert report["randomness"].startswith("noise seeded")
    owner = json.loads((out / "owner_only_report.json").read_text())
    assert owner["num_units"] == len(TEXTS) and owner["seed"] == 0
    assert f"ε = {report['epsilon']:.3g}" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--epsilon", "0"], "argument --epsilon must be a finite number > 0"),
        (["--epsilon", "-2"], "argument --epsilon must be a finite number > 0"),
        (["--num-samples", "0"], "argument --num-samples"),
        (["--epsilon", "500"], "argument --epsilon must be in [0.01, 100]"),
        (["--delta", "0.6"], "argument --delta: delta = 0.6 >= 1/n"),
        (["--model", "{tmp}"], "holds no model: config.json"),
        (["--documents", "{tmp}"], "holds no documents"),
        (["--num-teachers", ""], "argument --num-teachers: required with --documents"),
        (["--tuning-steps", "3"], "argument --tuning-steps: applies to --teachers fine-tuned"),
        (
            ["--teachers", "fine-tuned", "--tuning-steps", "0"],
            "argument --tuning-steps must be an integer >= 1",
        ),
    ],
)
def test_dpmix_generate_bad_input_is_one_line(tmp_path, capsys, extra, message):
    empty = tmp_path / "empty"
    empty.mkdir()
    extra = [e.replace("{tmp}", str(empty)) for e in extra]
    teachers = [] if "--num-teachers" in extra else ["--num-teachers", "2"]
    extra = [e for e in extra if e not in ("--num-teachers", "")]
    documents = [] if "--documents" in extra else ["--documents", str(tmp_path / "docs")]
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("hello")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(
            ["generate", *documents, *teachers, "--out", str(tmp_path / "out"), "--quiet", *extra]
        )
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dpmix: error:") and message in err and "\n" not in err


def test_the_public_fallback_sees_only_the_prompt():
    model = GPT2(GPT2Config.tiny(vocab_size=64, n_positions=16), rngs=nnx.Rngs(0))
    fallback = public_models.make_public_model(model, [0, 5, 7])
    direct = model(jnp.asarray([[0, 5, 7, 9, 3]], jnp.int32))[0, -1]
    np.testing.assert_allclose(fallback([9, 3]), direct, rtol=1e-5, atol=1e-5)
    for length in range(6):
        prefix = list(range(1, length + 1))
        expected = model(jnp.asarray([[0, 5, 7, *prefix]], jnp.int32))[0, -1]
        np.testing.assert_allclose(fallback(prefix), expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="more than the model's 16 positions"):
        fallback(list(range(14)))


@pytest.mark.parametrize("method", synthesis.PEER_METHODS)
def test_peers_run_on_the_same_teachers_within_the_target(model, method):
    from dpmix_jax.pate.peers import amin, invisibleink, pmixed

    peer = {"invisibleink": invisibleink, "amin": amin, "pmixed": pmixed}[method]
    result = _run(model, method=method, num_samples=3, max_new_tokens=4)
    assert result.method == method and len(result.texts) == 3
    assert result.teacher_forward_passes == 4 * result.num_queries
    assert 0 < result.epsilon <= result.planned_epsilon <= result.target_epsilon * (1 + 1e-9)
    # Calibrated for all 3 texts at full length: within 5% of the target, not per text.
    assert result.planned_epsilon >= 0.95 * result.target_epsilon
    settings = {}
    if method == "amin":  # half of the budget to the sparse-vector test
        settings["svt_noise"] = amin.svt_noise_for(
            epsilon=1.0, delta=1e-5, runs=3 * 4, num_teachers=4
        )
    config = peer.calibrate(
        epsilon=2.0, delta=1e-5, max_new_tokens=3 * 4, num_teachers=4, temperature=1.0, **settings
    )
    assert {k: v for k, v in result.mechanism.items() if k != "max_calls"} == (
        dataclasses.asdict(config)
    )
    again = _run(model, method=method, num_samples=3, max_new_tokens=4)
    assert again.texts == result.texts and again.epsilon == result.epsilon


@pytest.mark.parametrize("prompt", ["", "Dear team"])
def test_teachers_read_their_documents_each_followed_by_the_separator_then_the_prompt_once(
    model, prompt
):
    docs = [{"text": "Meeting 1 moved.", "user": "a"}, {"text": "Report due.", "user": "b"}]
    key = jax.random.key(3)
    ensemble = synthesis.build_ensemble(
        docs, model, num_teachers=2, max_new_tokens=4, key=key, separator="\n\n", prompt=prompt
    )
    parts = teacher_parts(docs, 2, key=np.asarray(jax.random.key_data(key)).tobytes())
    tokenizer = model.tokenizer
    prefix = [*ensemble.prompt_ids, tokenizer.encode(" the")[0]]  # how a sample decodes
    logits = ensemble.teachers(prefix)
    for teacher, part in enumerate(parts):
        context = [i for index in part for i in tokenizer.encode(docs[index]["text"] + "\n\n")]
        context = context or [tokenizer.eos_id]
        direct = model.model(jnp.asarray([context + prefix], jnp.int32))[0, -1]
        np.testing.assert_allclose(logits[teacher], direct, rtol=1e-4, atol=1e-4)
    public_direct = model.model(jnp.asarray([[tokenizer.eos_id, *prefix]], jnp.int32))[0, -1]
    np.testing.assert_allclose(ensemble.public_model(prefix), public_direct, rtol=1e-4, atol=1e-4)


def test_fine_tuned_teachers_read_every_document_and_stay_within_the_target(model):
    tuning = finetuned_teachers.TeacherTuning(steps=2, chunk=2)
    result = _run(model, teachers="fine_tuned", tuning=tuning, prompt="Meeting")
    assert result.teachers == "fine_tuned" and result.documents_in_prompts == len(TEXTS)
    assert all(text.startswith("Meeting") for text in result.texts)
    assert 0 < result.epsilon <= result.planned_epsilon <= 2.0
    again = _run(model, teachers="fine_tuned", tuning=tuning, prompt="Meeting")
    assert again.texts == result.texts  # the key fixes the partition, training and noise


def test_fine_tuned_teachers_are_trained_on_their_own_units(model):
    """Teacher i of the fine-tuned ensemble equals, bit for bit, teacher i of an ensemble of the
    same size in which every other teacher has no documents: the partition is the in-context
    one, and no other unit reaches its adapter (not even through the padded shapes)."""
    tuning = finetuned_teachers.TeacherTuning(steps=3, chunk=2)
    key = jax.random.key(3)
    ensemble = synthesis.build_ensemble(
        _docs(), model, num_teachers=3, max_new_tokens=4, key=key, teachers="fine_tuned",
        tuning=tuning, separator="\n",
    )  # fmt: skip
    partition_key = np.asarray(jax.random.key_data(key)).tobytes()
    parts = teacher_parts(_docs(), 3, key=partition_key)
    encoded = model.tokenizer.encode_batch(TEXTS)
    context = [model.tokenizer.eos_id]
    end = model.tokenizer.encode("\n")
    logits = ensemble.teachers([5, 6])
    for i, part in enumerate(parts):  # the same n and chunks, every other teacher empty
        only_i = [list(part) if j == i else [] for j in range(3)]
        alone = finetuned_teachers.finetune_teachers(
            model.model, encoded, only_i, context=context, end=end, tuning=tuning
        )
        np.testing.assert_array_equal(logits[i], alone([5, 6])[i])


def test_every_registered_method_satisfies_the_protocol_under_its_name():
    assert synthesis.METHODS[:2] == ("coordinated", "independent")
    own_settings = tuple(synthesis.registry.OWN_SETTINGS)
    assert synthesis.METHODS[2:] == (*synthesis.PEER_METHODS, *own_settings)
    assert own_settings == ("invisibleink_disjoint",)
    for name, method in synthesis.REGISTRY.items():
        assert isinstance(method, Method) and method.name == name and method.label


def test_dpmix_generate_offers_the_names_of_the_library(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["generate", "--help"])
    assert exit_info.value.code == 0
    usage = capsys.readouterr().out
    kinds = tuple(kind.replace("_", "-") for kind in synthesis.TEACHER_KINDS)
    for names in (synthesis.GENERATORS, synthesis.AGGREGATORS, synthesis.ACCOUNTINGS, kinds):
        assert "{" + ",".join(names) + "}" in usage


def test_invisibleink_disjoint_one_users_documents_move_only_their_texts_batch(model):
    """Units go to teachers by the keyed hash, teachers to texts by `text_batches`: changing
    every document of one user leaves the other texts bit for bit; the run is charged its
    costliest text and its public report names the setting without the data's size."""
    from dpmix_jax.pate.peers import invisibleink

    key = jax.random.key(7)
    settings = dict(method="invisibleink_disjoint", num_teachers=6, num_samples=3, key=key)
    before = _run(model, **settings)
    docs = [
        {"text": "Lunch at noon today, bring the slides.", "user": u} if u == "user0" else d
        for d, u in zip(_docs(), USERS, strict=True)
    ]
    after = synthesis.synthesize(
        docs, model, epsilon=2.0, delta=1e-5, max_new_tokens=3, stop_at_newline=False, **settings,
        min_unanimous_release=0.0,
    )  # fmt: skip
    partition_key = np.asarray(jax.random.key_data(jax.random.fold_in(key, 0))).tobytes()
    parts = teacher_parts(_docs(), 6, key=partition_key)
    teacher = next(t for t, part in enumerate(parts) if USERS.index("user0") in part)
    batches = invisibleink.text_batches(6, 3)
    text = next(i for i, rows in enumerate(batches) if teacher in rows)
    for other in range(3):
        if other != text:
            assert after.texts[other] == before.texts[other]
    assert before.method == "invisibleink_disjoint" and before.mechanism["num_teachers"] == 2
    assert 0 < before.epsilon <= before.planned_epsilon <= 2.0
    report = before.public_report()
    assert report["mechanism"]["batches"] == "disjoint" and "num_units" not in report
    with pytest.raises(ValueError, match="num_teachers must be at least num_samples = 5"):
        _run(model, method="invisibleink_disjoint", num_teachers=4, num_samples=5)
