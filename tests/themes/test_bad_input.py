"""Bad input ends in one clear error naming the file and row (or the argument), never silently.

Data files are tiny generated fixtures in the real layouts; the CLI is driven through `main`.
"""

import csv
import gzip
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from dpmix_jax import cli
from dpmix_jax.cli import arguments, demo, errors
from dpmix_jax.data import cxr, text
from dpmix_jax.mixing import objectives, solvers
from dpmix_jax.pate import accounting as pate_accounting
from dpmix_jax.pate import generation, samplers
from dpmix_jax.privacy import accounting, clipping, plan, sampling, validation

# ------------------------------------------------------------------------------------------
# Chest X-ray CSVs and images
# ------------------------------------------------------------------------------------------

NIH_HEADER = ["Image Index", "Finding Labels", "Follow-up #", "Patient ID", "Patient Age",
              "Patient Gender", "View Position", "OriginalImage[Width", "Height]"]  # fmt: skip
CHEXPERT_HEADER = ["Path", "Sex", "Age", "Frontal/Lateral", "AP/PA", *cxr.CHEXPERT_LABELS]


def _write_csv(path, header, rows):
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)


def _png(path, array):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array).save(path)


@pytest.fixture
def nih_root(tmp_path):
    rows = []
    for n, (findings, patient) in enumerate([("Cardiomegaly", 1), ("No Finding", 2)]):
        name = f"0000000{patient}_000.png"
        _png(tmp_path / "images_001" / "images" / name, np.full((10, 12), 40 * n, np.uint8))
        rows.append([name, findings, 0, patient, 50, "M", "PA", 12, 10])
    _write_csv(tmp_path / "Data_Entry_2017.csv", NIH_HEADER, rows)
    return tmp_path


def test_nih_row_with_too_few_fields_names_file_and_row(nih_root):
    csv_path = nih_root / "Data_Entry_2017.csv"
    lines = csv_path.read_text().splitlines()
    lines[2] = "00000002_000.png,No Finding"  # cut short: no Patient ID
    csv_path.write_text("\n".join(lines) + "\n")
    with pytest.raises(
        ValueError, match=r"Data_Entry_2017.csv row 3: 2 fields, but the header has 9"
    ):
        cxr.load_nih(nih_root)
    lines[2] += ",0,2,50,M,PA,12,10,extra"
    csv_path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"Data_Entry_2017.csv row 3: 10 fields"):
        cxr.load_nih(nih_root)


def test_non_utf8_csv_names_file_and_line(nih_root):
    csv_path = nih_root / "Data_Entry_2017.csv"
    data = csv_path.read_bytes().replace(b"No Finding", b"No Finding\xe9")
    csv_path.write_bytes(data)
    with pytest.raises(
        ValueError, match=r"Data_Entry_2017.csv line 3: not UTF-8 text \(byte 0xe9\)"
    ):
        cxr.load_nih(nih_root)


def test_utf8_byte_order_mark_is_accepted(nih_root):
    csv_path = nih_root / "Data_Entry_2017.csv"
    csv_path.write_bytes(b"\xef\xbb\xbf" + csv_path.read_bytes())
    assert len(cxr.load_nih(nih_root)) == 2


def _chexpert(root, label_rows):
    rows = []
    for n, labels in enumerate(label_rows):
        rel = f"train/patient0000{n + 1}/study1/view1_frontal.jpg"
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.full((8, 8), 50, np.uint8)).save(path, format="JPEG")
        rows.append([f"{root.name}/{rel}", "Female", 60, "Frontal", "AP", *labels])
    _write_csv(root / "train.csv", CHEXPERT_HEADER, rows)
    return rows


def test_chexpert_truncated_row_is_an_error_but_blank_labels_are_allowed(tmp_path):
    root = tmp_path / "CheXpert-v1.0-small"
    blank_and_uncertain = ["1.0", "", "-1.0", "0.0", *[""] * 9, "1.0"]
    full = ["", "1.0", *[""] * 12]
    _chexpert(root, [blank_and_uncertain, full])
    ds = cxr.load_chexpert(root, image_size=(4, 4))
    np.testing.assert_array_equal(ds.labels[0], [1] + [0] * 12 + [1])  # blank, -1 -> 0
    np.testing.assert_array_equal(ds.labels[1], [0, 1] + [0] * 12)
    # The same file with the last four label fields of row 3 missing (not blank).
    csv_path = root / "train.csv"
    lines = csv_path.read_text().splitlines()
    lines[2] = lines[2].rsplit(",", 4)[0]
    csv_path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"train.csv row 3: 15 fields, but the header has 19"):
        cxr.load_chexpert(root)


def test_sixteen_bit_png_is_scaled_by_its_bit_depth(tmp_path):
    ramp = np.linspace(0, 65535, 12 * 10).reshape(10, 12).astype(np.uint16)
    _png(tmp_path / "a16.png", ramp)
    _png(tmp_path / "b16.png", np.full((10, 12), 32768, np.uint16))
    _png(tmp_path / "c8.png", np.full((10, 12), 128, np.uint8))
    ds = cxr.CxrDataset(
        paths=[tmp_path / n for n in ("a16.png", "b16.png", "c8.png")],
        labels=np.zeros((3, 14)),
        label_names=cxr.NIH_LABELS,
        patient_ids=np.arange(3),
        views=["frontal"] * 3,
        image_size=(10, 12),
    )
    assert Image.open(tmp_path / "a16.png").mode.startswith("I")
    np.testing.assert_allclose(ds.image(0)[..., 0], ramp / 65535.0, atol=1e-5)
    np.testing.assert_allclose(ds.image(1), 32768 / 65535.0, atol=1e-5)
    np.testing.assert_allclose(ds.image(2), 128 / 255.0, atol=1e-6)
    resized = cxr.CxrDataset(
        paths=ds.paths[:1],
        labels=np.zeros((1, 14)),
        label_names=cxr.NIH_LABELS,
        patient_ids=np.zeros(1),
        views=["frontal"],
        image_size=(5, 6),
    ).image(0)
    assert resized.shape == (5, 6, 1) and 0.0 <= resized.min() < 0.2 and 0.8 < resized.max() <= 1
    assert np.all(np.diff(resized[0, :, 0]) > 0)  # the ramp survives: not saturated to white


# ------------------------------------------------------------------------------------------
# Document streams
# ------------------------------------------------------------------------------------------


def test_non_utf8_jsonl_names_file_and_line(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"docs.jsonl line 2: not UTF-8 text \(byte 0xe9\)"):
        list(text.iter_documents(path))


def test_truncated_jsonl_gz_names_the_file(tmp_path):
    path = tmp_path / "docs.jsonl.gz"
    lines = "".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(200))
    path.write_bytes(gzip.compress(lines.encode())[:-300])
    with pytest.raises(ValueError, match=r"docs.jsonl.gz: cannot read past line \d+ .*truncated"):
        list(text.iter_documents(path))
    path.write_bytes(b"not gzip at all\n")
    with pytest.raises(ValueError, match=r"docs.jsonl.gz: cannot read past line 0"):
        list(text.iter_documents(path))


def test_corrupt_parquet_names_the_file(tmp_path):
    path = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"text": [f"document {i}" for i in range(100)]}), path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"docs.parquet: not a readable Parquet file"):
        list(text.iter_documents(path))
    path.write_bytes(b"PAR1" + b"\x00" * 64 + b"PAR1")
    with pytest.raises(ValueError, match=r"docs.parquet: not a readable Parquet file"):
        list(text.iter_documents(tmp_path))


# ------------------------------------------------------------------------------------------
# The command line: one line, exit status 2, no traceback
# ------------------------------------------------------------------------------------------


def _one_line_error(capsys, argv, match):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("dpmix") and " error: " in last and match in last, err
    return err


def test_cli_out_that_is_a_file(tmp_path, capsys):
    out = tmp_path / "results.txt"
    out.write_text("not a folder")
    err = _one_line_error(capsys, ["demo", "--out", str(out)], "is a file, not a folder")
    assert err.count("\n") == 1 and str(out) in err
    _one_line_error(capsys, ["demo", "--out", str(out / "sub")], "cannot be written")


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write to read-only folders")
def test_cli_out_that_is_read_only(tmp_path, capsys):
    out = tmp_path / "locked"
    out.mkdir()
    out.chmod(0o500)
    try:
        _one_line_error(capsys, ["demo", "--out", str(out)], "cannot be written")
    finally:
        out.chmod(0o700)


def test_cli_out_that_cannot_be_written_to(tmp_path, capsys, monkeypatch):
    """The same check as for a read-only folder, where the tests run as root."""

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(tmp_path))

    monkeypatch.setattr(arguments.tempfile, "TemporaryFile", refuse)
    _one_line_error(
        capsys, ["demo", "--out", str(tmp_path)], "cannot be written (Permission denied)"
    )


@pytest.mark.parametrize("seed", ["-1", "x", str(2**32)])
def test_cli_rejects_bad_seeds(seed, capsys):
    _one_line_error(capsys, ["demo", "--seeds", "0", seed], "argument --seeds: must be an integer")


@pytest.mark.parametrize(
    "error,match",
    [
        (ValueError("train.csv row 3: 15 fields"), "dpmix: error: train.csv row 3: 15 fields"),
        (FileNotFoundError(2, "No such file or directory", "data/nih"), "data/nih"),
    ],
)
def test_cli_turns_library_errors_into_one_line(error, match, capsys, monkeypatch):
    def fail(args):
        raise error

    monkeypatch.setattr(demo, "_demo", fail)
    err = _one_line_error(capsys, ["demo"], match)
    assert err.count("\n") == 1
    monkeypatch.setenv(errors.DEBUG_ENV, "1")
    with pytest.raises(type(error)):
        cli.main(["demo"])


# ------------------------------------------------------------------------------------------
# Proxy outputs of the mixture stage
# ------------------------------------------------------------------------------------------


def _mixmin(preds, solver="mirror_descent", **kwargs):
    return solvers.dp_mixmin(
        preds,
        epsilon=1.0,
        delta=1e-5,
        steps=4,
        batch_size=20,
        clip_norm=1.0,
        learning_rate=1.0 if solver == "mirror_descent" else None,
        solver=solver,
        seed=0,
        **kwargs,
    )


@pytest.mark.parametrize("solver", ["mirror_descent", "frank_wolfe"])
def test_all_zero_nll_proxies_are_an_error(solver):
    with pytest.raises(ValueError, match="every nll pred is 0.*noise alone"):
        _mixmin(np.zeros((100, 3)), solver)
    with pytest.raises(ValueError, match="every nll pred is 0"):
        solvers.mixmin(np.zeros((10, 3)))


def test_all_zero_mse_and_sequence_proxies_are_an_error():
    with pytest.raises(ValueError, match="every mse pred is 0"):
        objectives.prepare_examples(np.zeros((5, 2)), kind="mse", targets=np.ones(5))
    with pytest.raises(ValueError, match="every sequence pred is 0"):
        objectives.prepare_examples(np.zeros((5, 2)), kind="sequence", lengths=np.ones(5))


def test_overflowing_proxies_are_an_error():
    n = 100
    with pytest.raises(ValueError, match="mse preds and targets .* overflow float32"):
        _mixmin(np.full((n, 3), 1e30), kind="mse", targets=np.zeros(n))
    with pytest.raises(ValueError, match="sequence preds exceed the float32 range"):
        _mixmin(np.full((n, 3), -1e39), kind="sequence", lengths=np.ones(n))
    # Large but safe values pass.
    preds = np.random.default_rng(0).normal(size=(n, 3)) * 1e6
    examples = objectives.prepare_examples(preds, kind="mse", targets=preds[:, 0])
    assert np.isfinite(objectives.per_example_grads(jnp.ones(3) / 3, examples, kind="mse")).all()


def test_all_zero_proxy_columns_and_rows_warn():
    preds = np.random.default_rng(0).uniform(0.1, 0.9, size=(100, 3))
    preds[:, 2] = 0.0
    with pytest.warns(UserWarning, match=r"column\(s\) \[2\] \(source\(s\)\) are all 0"):
        weights = solvers.mixmin(preds, steps=3)
    assert np.isfinite(weights).all()
    preds = np.random.default_rng(1).uniform(0.1, 0.9, size=(100, 3))
    preds[[3, 7]] = 0.0
    with pytest.warns(UserWarning, match="2 of 100 examples have probability 0 under every source"):
        objectives.prepare_examples(preds)


# ------------------------------------------------------------------------------------------
# Hot PATE teachers
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sample",
    [
        samplers.coordinated_histograms,
        lambda key, logits, r: samplers.coordinated_histograms(key, logits, r, top_k=2),
        samplers.independent_histograms,
    ],
    ids=["coordinated", "coordinated_top_k", "independent"],
)
def test_teacher_with_all_minus_inf_logits_is_an_error(sample):
    logits = np.log(np.random.default_rng(0).dirichlet(np.ones(40), size=4)).astype(np.float32)
    logits[2] = -np.inf
    with pytest.raises(ValueError, match=r"teacher 2 has no finite logit"):
        sample(jax.random.key(0), jnp.asarray(logits), 3)
    logits[2] = 0.0
    logits[1, 5] = np.nan
    with pytest.raises(ValueError, match=r"teacher 1 has a NaN or \+inf logit"):
        sample(jax.random.key(0), jnp.asarray(logits), 3)
    logits[1, 5] = -np.inf  # probability 0 for one token is fine
    if sample is samplers.independent_histograms:  # (the other samplers share the check)
        assert (
            np.asarray(sample(jax.random.key(0), jnp.asarray(logits), 3)).sum(axis=1).tolist()
            == [4] * 3
        )


@pytest.mark.parametrize("position", [0, 130, 2999])
@pytest.mark.parametrize(
    "sample",
    [
        lambda key, logits: samplers.coordinated_histograms(key, logits, 1),
        lambda key, logits: samplers.coordinated_histograms(key, logits, 16, top_k=4),
        lambda key, logits: samplers.independent_histograms(key, logits, 1),
    ],
    ids=["coordinated_step", "coordinated_top_k", "independent_step"],
)
def test_a_nan_logit_is_an_error_on_long_rows(sample, position):
    # XLA:CPU's fast row maxima skip NaN: the check must still see it, wherever it sits.
    logits = np.random.default_rng(1).normal(size=(5, 3000)).astype(np.float32)
    logits[:, ::7] = -np.inf  # probability-0 tokens beside the NaN
    logits[3, position] = np.nan
    with pytest.raises(ValueError, match=r"teacher 3 has a NaN or \+inf logit"):
        sample(jax.random.key(0), jnp.asarray(logits))
    logits[3, position] = np.inf
    with pytest.raises(ValueError, match=r"teacher 3 has a NaN or \+inf logit"):
        sample(jax.random.key(0), jnp.asarray(logits))
    logits[3, position] = 0.0
    assert np.asarray(sample(jax.random.key(0), jnp.asarray(logits))).sum(axis=1).min() == 5


def test_generation_names_the_teacher_with_all_minus_inf_logits():
    class Teachers:
        num_teachers, vocab_size = 3, 5

        def __call__(self, prefix):
            logits = jnp.zeros((3, 5)).at[1].set(-jnp.inf)
            return logits

    with pytest.raises(ValueError, match="teacher 1 has no finite logit"):
        generation.generate(
            Teachers(), [0], generation.GenerationConfig(max_new_tokens=2), key=jax.random.key(0)
        )


# ------------------------------------------------------------------------------------------
# NumPy scalars wherever Python numbers are accepted
# ------------------------------------------------------------------------------------------


def test_samplers_accept_numpy_scalars():
    # 20 tokens: with top_k the lazy sampler validates its arguments, then (head too large for
    # the vocabulary) runs the full scan, which keeps the test fast.
    logits = jnp.log(jnp.asarray(np.random.default_rng(1).dirichlet(np.ones(20), size=5)))
    key = jax.random.key(3)
    for sample, extra in [
        (samplers.coordinated_histograms, {}),
        (samplers.coordinated_histograms, {"top_k": 4, "fallback_rows": 2}),
        (samplers.independent_histograms, {}),
    ]:
        expected = sample(key, logits, 6, temperature=0.5, batch_size=2, **extra)
        numpy_extra = {name: np.int64(value) for name, value in extra.items()}
        got = sample(
            key, logits, np.int64(6), temperature=np.float32(0.5), batch_size=np.int32(2),
            **numpy_extra,
        )  # fmt: skip
        np.testing.assert_array_equal(got, expected)


def test_pate_settings_accept_numpy_scalars():
    config = generation.GenerationConfig(
        temperature=np.float32(0.8),
        epsilon=np.float64(2.0),
        top_k=np.int64(2),
        max_new_tokens=np.int64(3),
        sigma1=np.float32(1.5),
    )
    assert config.max_new_tokens == 3
    assert pate_accounting.dpws_event(np.float32(1.0)) == pate_accounting.dpws_event(1.0)
    assert pate_accounting.confident_gnmax_event(
        np.float32(2.0), np.int64(3)
    ) == pate_accounting.confident_gnmax_event(2.0, 3)
    ledger = pate_accounting.PateLedger()
    ledger.record(pate_accounting.dpws_event(1.0), np.int64(2), delta=np.float32(0.0))
    assert ledger.count == 2


def test_privacy_functions_accept_numpy_scalars():
    event = accounting.dpsgd_event(
        noise_multiplier=np.float32(1.5), sampling_rate=np.float64(0.01), steps=np.int64(10)
    )
    assert event == accounting.dpsgd_event(noise_multiplier=1.5, sampling_rate=0.01, steps=10)
    assert validation.check_steps(np.int64(5)) == 5 and validation.check_steps(np.float64(5.0)) == 5
    for bad in (np.float64(5.5), np.float64(np.inf), np.float64(np.nan), np.bool_(True), True):
        with pytest.raises(ValueError, match="steps must be an integer >= 1"):
            validation.check_steps(bad)
    assert validation.check_epsilon(np.float32(2.0)) == 2.0
    assert validation.check_delta(np.float64(1e-5)) == 1e-5
    ledger = accounting.PrivacyLedger()
    ledger.record(event, np.int64(3))
    assert ledger.count == 3
    budget = accounting.PrivacyBudget(np.float32(1.0), np.float64(1e-6))
    assert budget.epsilon == 1.0
    config = plan.DpSgdConfig(
        epsilon=None,
        noise_multiplier=np.float32(1.0),
        delta=np.float64(1e-5),
        clip_norm=np.float32(1.0),
        batch_size=np.int64(10),
        steps=np.int64(5),
        max_examples_per_user=np.int64(2),
    )
    dp_plan = plan.plan_dp_sgd(config, num_units=np.int64(100))
    assert dp_plan.sampling_rate == pytest.approx(0.1)
    sampler = sampling.PoissonSampler(sampling_rate=np.float32(0.1), pad_multiple=np.int64(8))
    batch = sampler.sample(np.random.default_rng(0), np.int64(50))
    assert len(batch.indices) % 8 == 0
    sampling.UserPoissonSampler(sampling_rate=0.5, max_examples_per_user=np.int64(2))
    grad_sum = clipping.clipped_grad_sum(
        lambda w, x: jnp.sum(w * x), clip_norm=np.float32(1.0), microbatch_size=np.int64(2)
    )
    total, _ = grad_sum(jnp.ones(3), jnp.ones((4, 3)), jnp.ones(4, bool))
    np.testing.assert_allclose(total, 4 / np.sqrt(3), rtol=1e-5)
