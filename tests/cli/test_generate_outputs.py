"""What `dpmix generate` shows a reader and its owner: no exact count of the data in the
publishable outputs, the data-dependent ε kept out of them, the teachers' share of the tokens,
a truthful Ctrl-C, the text default model trained once per user, `--allow-large-delta`, and the
documents that did not fit counted on the terminal."""

from __future__ import annotations

import json
import signal
import stat

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from dpmix_jax import cli, synthesis
from dpmix_jax.cli import errors, generate
from dpmix_jax.data.tokenizer import train_bpe_tokenizer
from dpmix_jax.models.gpt2 import GPT2, GPT2Config
from dpmix_jax.synthesis import public_models
from dpmix_jax.synthesis import run as synthesis_run

TEXTS = [f"Note {i}: water the bed {i % 5} and cut the roses in row {i % 3}." for i in range(48)]
PUBLIC_FILES = ("samples.jsonl", "report.json")


def _write_documents(folder, count: int):
    folder.mkdir(exist_ok=True)
    rows = [{"text": text} for text in TEXTS[:count]]
    (folder / "notes.jsonl").write_text("\n".join(json.dumps(row) for row in rows))
    return folder


@pytest.fixture(scope="module")
def tokenizer():
    return train_bpe_tokenizer(TEXTS * 3, vocab_size=300)


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory, tokenizer):
    """A stored tiny GPT-2 with random weights."""
    model = GPT2(GPT2Config.tiny(vocab_size=tokenizer.vocab_size, n_positions=64), rngs=nnx.Rngs(0))
    public = public_models.PublicTextModel(model=model, tokenizer=tokenizer, source="tiny")
    return public_models.save_public_model(public, tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def blind_model_folder(tmp_path_factory, tokenizer):
    """A stored tiny GPT-2 whose weights are all zero: every teacher's next-token distribution
    is uniform whatever its documents, so that the DP mechanism's outputs do not depend on the
    data and what else the outputs hold can be compared across data sets."""
    model = GPT2(GPT2Config.tiny(vocab_size=tokenizer.vocab_size, n_positions=64), rngs=nnx.Rngs(0))
    nnx.update(model, jax.tree.map(jnp.zeros_like, nnx.state(model)))
    public = public_models.PublicTextModel(model=model, tokenizer=tokenizer, source="blind")
    return public_models.save_public_model(public, tmp_path_factory.mktemp("blind"))


def _generate(documents, model, out, *extra: str) -> int:
    """`dpmix generate` on a tiny model; Hot PATE on its 2-4 teachers accepts any calibration
    unless `extra` sets the floor (the refusal has its own tests)."""
    method = extra[extra.index("--method") + 1] if "--method" in extra else "coordinated"
    floor_applies = method in synthesis.registry.HOT_PATE and "individual" not in extra
    if floor_applies and "--min-unanimous-release" not in extra:
        extra = (*extra, "--min-unanimous-release", "0")
    return cli.main(
        ["generate", "--documents", str(documents), "--model", str(model), "--out", str(out),
         "--num-samples", "2", "--max-new-tokens", "3", "--epsilon", "3", "--seed", "0",
         "--quiet", *extra]
    )  # fmt: skip


def _owner_report(out) -> dict:
    return json.loads((out / generate.OWNER_REPORT).read_text())


# --------------------------------------------------------------------------------------------
# No exact property of the data where a reader looks; the data-dependent ε kept out.
# --------------------------------------------------------------------------------------------


FINE_TUNING = ["--method", "dp_finetune", "--finetune-steps", "2", "--finetune-batch-size", "4"]


@pytest.mark.parametrize(
    "extra",
    [
        ["--num-teachers", "4"],
        ["--num-teachers", "4", "--method", "invisibleink_disjoint"],
        ["--accounting", "individual"],
        FINE_TUNING,
    ],
    ids=["standard", "invisibleink_disjoint", "individual", "dp_finetune"],
)
def test_a_reader_cannot_tell_40_documents_from_41(tmp_path, blind_model_folder, capsys, extra):
    """The same run on 40 and on 41 documents, where the mechanism's outputs do not depend on
    the data: samples.jsonl, report.json and stdout are the same byte for byte (they held the
    exact number of units and of documents read), the owner-only report tells them apart."""
    documents = tmp_path / "docs"
    public, owners = [], []
    for count in (40, 41):
        _write_documents(documents, count)
        out = tmp_path / f"out{count}"
        assert _generate(documents, blind_model_folder, out, *extra) == 0
        stdout = capsys.readouterr().out.replace(str(out), "OUT")
        public.append([stdout] + [(out / name).read_text() for name in PUBLIC_FILES])
        owners.append(_owner_report(out))
        assert stat.S_IMODE((out / generate.OWNER_REPORT).stat().st_mode) == 0o600
    assert public[0] == public[1]
    assert [owner["num_units"] for owner in owners] == [40, 41]
    assert [owner["num_documents"] for owner in owners] == [40, 41]
    assert all(owner["note"] == synthesis.result.OWNER_ONLY_NOTE for owner in owners)
    assert all(owner["seed"] == 0 for owner in owners)
    report = json.loads(public[0][2])
    assert "seed" not in report["settings"] and "seconds" not in report
    if "individual" in extra:  # n is the number of units: the owner's only
        assert "num_teachers" not in report and "num_teachers" not in report["settings"]
        assert [owner["num_teachers"] for owner in owners] == [40, 41]
        assert "queries of one teacher per unit" in public[0][0]
    if "invisibleink_disjoint" in extra:  # each text reads its own batch of the 4
        assert "queries of 4 teachers in one disjoint batch per text" in public[0][0]
        assert "aggregator" not in report["settings"]  # its own mechanism has none


def test_dp_fine_tuning_reports_its_steps_and_keeps_its_calibration_for_the_owner(
    tmp_path, model_folder, capsys
):
    documents = _write_documents(tmp_path / "docs", 24)
    out = tmp_path / "out"
    assert _generate(documents, model_folder, out, *FINE_TUNING) == 0
    captured = capsys.readouterr()
    stdout = captured.out
    report = json.loads((out / "report.json").read_text())
    assert report["method"] == "dp_finetune" and report["epsilon"] == 3.0
    # Every note is longer than 3 tokens: counted on the owner's terminal, not dropped silently.
    assert "24 of 24 documents are longer than --max-new-tokens 3" in captured.err
    assert _owner_report(out)["owner_mechanism"]["documents_truncated"] == 24
    assert "documents_truncated" not in json.dumps(report)
    assert report["mechanism"]["steps"] == 2 and report["settings"]["finetune_steps"] == 2
    assert "owner_mechanism" not in report and report["teacher_token_share"] is None
    teachers_only = {"aggregator", "public_candidates", "num_teachers", "teachers", "accounting"}
    assert teachers_only.isdisjoint(report["settings"])  # it has none of them
    owner = _owner_report(out)["owner_mechanism"]
    assert owner["sampling_rate"] == pytest.approx(4 / 24) and owner["accountant_epsilon"] <= 3.0
    assert "dp_finetune: 2 DP-SGD steps of LoRA adapters on the documents" in stdout
    assert stdout.splitlines()[-1].startswith("ε <= 3 at δ = 1e-05 spent (target 3;")
    samples = (out / "samples.jsonl").read_text().splitlines()
    assert len(samples) == 2


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ([*FINE_TUNING, "--num-teachers", "4"], "argument --num-teachers: applies to the teacher"),
        ([*FINE_TUNING, "--public-candidates", "8"], "argument --public-candidates: applies to"),
        ([*FINE_TUNING, "--accounting", "individual"], "argument --accounting: applies to the"),
        (["--num-teachers", "4", "--finetune-steps", "3"], "argument --finetune-steps: applies to"),
        ([*FINE_TUNING[:4], "--finetune-batch-size", "0"], "argument --finetune-batch-size"),
    ],
)
def test_options_of_the_other_kind_of_method_are_one_line(
    tmp_path, model_folder, capsys, extra, message
):
    documents = _write_documents(tmp_path / "docs", 24)
    with pytest.raises(SystemExit) as exit_info:
        _generate(documents, model_folder, tmp_path / "out", *extra)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "out" / "report.json").exists()


def test_the_data_dependent_epsilon_is_not_published_and_the_printed_one_is_the_reports(
    tmp_path, model_folder, capsys
):
    """Confident-GNMax's data-dependent ε is released by smooth sensitivity at a cost the
    printed ε does not include: it is in the owner-only report, nowhere a reader looks."""
    documents = _write_documents(tmp_path / "docs", 24)
    out = tmp_path / "out"
    assert _generate(documents, model_folder, out, "--num-teachers", "4") == 0
    stdout = capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    assert report["aggregator"] == "confident_gnmax"
    for name in ("data_dependent_epsilon", "released_epsilons"):
        assert name not in report
    assert "data-dependent" not in stdout
    assert stdout.splitlines()[-1].startswith(f"ε = {report['epsilon']:.3g} at δ = ")
    owner = _owner_report(out)
    assert owner["data_dependent_epsilon"] > 0 and len(owner["released_epsilons"]) == 2
    assert "not included in epsilon" in owner["data_dependent_epsilon_note"]


def test_the_teachers_share_of_the_tokens_is_printed_and_stored(tmp_path, model_folder, capsys):
    documents = _write_documents(tmp_path / "docs", 24)
    out = tmp_path / "out"
    assert _generate(documents, model_folder, out, "--num-teachers", "4") == 0
    report = json.loads((out / "report.json").read_text())
    teacher, total = report["steps_with_output"], report["tokens_generated"]
    assert total > 0 and report["teacher_token_share"] == teacher / total
    assert "finetune_steps" not in report["settings"]  # DP fine-tuning's, not this method's
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    marked = "".join(sample["marked_text"] for sample in samples)
    assert marked.count("[") <= total - teacher  # the public model's tokens, marked
    line = f"{teacher} of {total} tokens came from the teachers, the rest from the public model"
    assert line in capsys.readouterr().out


# --------------------------------------------------------------------------------------------
# Ctrl-C
# --------------------------------------------------------------------------------------------


def test_ctrl_c_says_nothing_was_released_or_kept(tmp_path, model_folder, monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(synthesis, "synthesize", interrupted)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        _generate(_write_documents(tmp_path / "docs", 8), model_folder, out, "--num-teachers", "2")
    assert exit_info.value.code == errors.INTERRUPTED_STATUS
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line == f"dpmix: {errors.GENERATE_INTERRUPTED}"
    assert "nothing of this run was released" in line and "spends its ε anew" in line
    assert "ledger is kept" not in line
    assert not out.exists()  # no output, not even the folder


def test_ctrl_c_while_the_outputs_are_written_lets_the_run_finish(
    tmp_path, model_folder, monkeypatch
):
    write = generate._write_owner_only

    def interrupted_write(path, text):
        signal.raise_signal(signal.SIGINT)  # Ctrl-C, twice: no grace left
        signal.raise_signal(signal.SIGINT)
        write(path, text)

    monkeypatch.setattr(generate, "_write_owner_only", interrupted_write)
    out = tmp_path / "out"
    documents = _write_documents(tmp_path / "docs", 8)
    assert _generate(documents, model_folder, out, "--num-teachers", "2") == 0
    assert all((out / name).is_file() for name in (*PUBLIC_FILES, generate.OWNER_REPORT))


# --------------------------------------------------------------------------------------------
# The text default model, once per user.
# --------------------------------------------------------------------------------------------


def test_the_text_default_model_is_trained_once_per_user(tmp_path, monkeypatch):
    calls = []

    def quick_training(config, tokenizer, documents, *, seed, **settings):
        calls.append(config)
        return GPT2(config, rngs=nnx.Rngs(seed)), [(1, 1.0)]

    monkeypatch.setattr(public_models, "train_public_gpt2", quick_training)
    cache = tmp_path / "cache"
    monkeypatch.setenv(public_models.CACHE_ENV, str(cache))
    documents = _write_documents(tmp_path / "docs", 8)
    for out in ("first", "second"):
        argv = ["--num-teachers", "2", "--num-samples", "1", "--max-new-tokens", "2"]
        assert _generate(documents, "text-default", tmp_path / out, *argv) == 0
        assert not (tmp_path / out / "stages").exists()
    assert len(calls) == 1
    stored = cache / f"public_model-{public_models.TextDefaultModel().key()}"
    assert sorted(p.name for p in cache.iterdir()) == [stored.name]  # no temporary folder left
    report = json.loads((tmp_path / "second" / "report.json").read_text())
    assert str(stored) in report["settings"]["model"]


def test_a_model_another_run_stored_first_stays_and_no_temporary_folder_is_left(
    tmp_path, model_folder
):
    stored = public_models.load_public_model(model_folder)
    folder = public_models.save_public_model(stored, tmp_path / "public_model-key")
    before = (folder / "params.npz").read_bytes()
    training = public_models.PublicTraining(
        train_loss=((1, 1.0),), heldout_perplexity=None, train_seconds=0.0, cached=False
    )
    config = GPT2Config.tiny(vocab_size=stored.tokenizer.vocab_size, n_positions=16)
    model = GPT2(config, rngs=nnx.Rngs(1))
    other = public_models.PublicTextModel(
        model=model, tokenizer=stored.tokenizer, source="other", training=training
    )
    public_models._store_trained(other, folder)
    assert (folder / "params.npz").read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == [folder.name]


def test_the_user_cache_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(public_models.CACHE_ENV, str(tmp_path / "mine"))
    assert public_models.user_cache() == tmp_path / "mine"
    monkeypatch.delenv(public_models.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert public_models.user_cache() == tmp_path / "xdg" / "dpmix_jax"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert public_models.user_cache() == tmp_path / "home" / ".cache" / "dpmix_jax"


# --------------------------------------------------------------------------------------------
# --allow-large-delta
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra",
    [["--num-teachers", "2"], ["--accounting", "individual"]],
    ids=["standard", "individual"],
)
def test_a_delta_of_one_over_n_is_refused_naming_the_flag_that_allows_it(
    tmp_path, model_folder, capsys, extra
):
    documents = _write_documents(tmp_path / "docs", 4)
    with pytest.raises(SystemExit) as exit_info:
        _generate(documents, model_folder, tmp_path / "a", "--delta", "0.6", *extra)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dpmix: error: argument --delta: delta = 0.6 >= 1/n") and "\n" not in err
    assert "or --allow-large-delta to run anyway" in err and "allow_large_delta=True" not in err
    out = tmp_path / "b"
    assert (
        _generate(documents, model_folder, out, "--delta", "0.6", "--allow-large-delta", *extra)
        == 0
    )
    report = json.loads((out / "report.json").read_text())
    assert report["settings"]["allow_large_delta"] is True and report["allow_large_delta"] is True


@pytest.mark.parametrize("method", synthesis.PEER_METHODS)
def test_every_peer_takes_a_large_delta_when_allowed(tmp_path, model_folder, method):
    documents = _write_documents(tmp_path / "docs", 4)
    extra = ["--num-teachers", "2", "--method", method, "--delta", "0.6", "--allow-large-delta"]
    assert _generate(documents, model_folder, tmp_path / "out", *extra) == 0


# --------------------------------------------------------------------------------------------
# Documents that do not fit.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("quiet", [True, False])
def test_documents_that_do_not_fit_are_counted_on_the_terminal(
    tmp_path, model_folder, capsys, quiet
):
    documents = _write_documents(tmp_path / "docs", 24)
    out = tmp_path / "out"
    extra = ["--num-teachers", "2", "--context-width", "40", "--min-unanimous-release", "0"]
    argv = ["generate", "--documents", str(documents), "--model", str(model_folder), "--out",
            str(out), "--num-samples", "1", "--max-new-tokens", "2", "--seed", "0", *extra,
            *(["--quiet"] if quiet else [])]  # fmt: skip
    assert cli.main(argv) == 0
    read = _owner_report(out)["documents_in_prompts"]
    assert 0 < read < 24
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "did not fit" in line]
    assert line == (
        f"[generate] {24 - read} of 24 documents did not fit the teachers' prompts (context "
        "width 40 tokens) and were not read (exact counts: for you, not for publication)"
    )
    report = json.loads((out / "report.json").read_text())
    assert report["context_width"] == 40 and "documents_in_prompts" not in report


# ---------------------------------------------------------------------------------------------
# The public model's candidates.
# ---------------------------------------------------------------------------------------------


def test_hot_pate_counts_the_public_candidates_and_says_how_likely_a_vote_is_carried(
    tmp_path, model_folder, capsys
):
    documents = _write_documents(tmp_path / "docs", 16)
    out = tmp_path / "out"
    assert _generate(documents, model_folder, out, "--num-teachers", "4") == 0
    report = json.loads((out / "report.json").read_text())
    assert report["settings"]["public_candidates"] == 16
    assert report["settings"]["min_unanimous_release"] == 0
    assert report["mechanism"]["public_candidates"] == 16
    carried = report["mechanism"]["unanimous_release_probability"]
    assert 0 < carried < 0.5  # 4 teachers at ε = 3: a unanimous vote is mostly lost
    assert f"released with probability {carried:.2g}" in capsys.readouterr().err
    whole = tmp_path / "whole"
    assert _generate(documents, model_folder, whole, "--num-teachers", "4",
                     "--public-candidates", "all") == 0  # fmt: skip
    mechanism = json.loads((whole / "report.json").read_text())["mechanism"]
    assert mechanism["public_candidates"] is None
    assert mechanism["unanimous_release_probability"] < carried


def test_a_weak_release_is_refused_before_any_teacher_is_built(
    tmp_path, model_folder, capsys, monkeypatch
):
    """The default floor refuses 4 teachers at ε = 3 in one line naming the options and the
    fewest teachers that reach it, before the teachers' prefill, with no output written."""

    def no_prefill(*args, **kwargs):
        raise AssertionError("the teachers were built before the refusal")

    monkeypatch.setattr(synthesis_run, "build_ensemble", no_prefill)
    documents = _write_documents(tmp_path / "docs", 16)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as stop:
        _generate(documents, model_folder, out, "--num-teachers", "4",
                  "--min-unanimous-release", "0.5")  # fmt: skip
    err = capsys.readouterr().err
    assert stop.value.code == 2
    assert "argument --num-teachers: at ε = 3 over 6 calls a token all 4 teachers" in err
    assert "teachers (--num-teachers)" in err and "--min-unanimous-release" in err
    assert len(err.strip().splitlines()) == 1
    assert not any((out / name).exists() for name in PUBLIC_FILES)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--min-unanimous-release", "1.5"), "argument --min-unanimous-release: must be in"),
        (("--method", "pmixed", "--min-unanimous-release", "0.2"), "applies to --method coord"),
        (("--method", "dp_finetune", "--min-unanimous-release", "0.2"), "applies to the teacher"),
        (("--accounting", "individual", "--min-unanimous-release", "0.2"), "applies to --accou"),
    ],
)
def test_the_release_floor_is_refused_where_it_does_not_apply(
    tmp_path, model_folder, capsys, extra, message
):
    documents = _write_documents(tmp_path / "docs", 8)
    teachers = () if {"dp_finetune", "individual"} & set(extra) else ("--num-teachers", "4")
    with pytest.raises(SystemExit) as stop:
        _generate(documents, model_folder, tmp_path / "out", *teachers, *extra)
    assert stop.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--method", "amin", "--public-candidates", "8"), "applies to --method coordinated"),
        (("--public-candidates", "0"), "expected a positive integer or 'all', got '0'"),
        (("--method", "pmixed", "--aggregator", "dpws"), "argument --aggregator: applies to"),
    ],
)
def test_public_candidates_are_refused_where_they_do_not_apply(
    tmp_path, model_folder, capsys, extra, message
):
    documents = _write_documents(tmp_path / "docs", 8)
    with pytest.raises(SystemExit) as stop:
        _generate(documents, model_folder, tmp_path / "out", "--num-teachers", "4", *extra)
    assert stop.value.code == 2 and message in capsys.readouterr().err
