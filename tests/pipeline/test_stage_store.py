"""Stored stages against an adversary: owner-only files, nothing secret kept once a stage is done,
stages keyed by the data's content and the code, edited or damaged files refused."""

import dataclasses
import json
import shutil

import numpy as np
import pytest

from dpmix_jax.data.sources import ArraySource
from dpmix_jax.pipeline import ImagePipeline, budget, mixture_pipeline, presets, stage_store
from dpmix_jax.train import Checkpointer, checkpoint
from tests.pipeline.test_image import tiny_config


@pytest.fixture(scope="module")
def task():
    return presets.digit_task(image_size=8)


@pytest.fixture(scope="module")
def finished(task, tmp_path_factory):
    """A stage store after one finished DP-MixMin run (seed 0, ε = 1)."""
    root = tmp_path_factory.mktemp("finished")
    result = ImagePipeline(task, tiny_config(), root).run("dp_mixmin", 1.0, seed=0)
    return root, result


def _copy(finished, tmp_path):
    root, result = finished
    shutil.copytree(root, tmp_path / "store")
    return tmp_path / "store", result


def _run(task, root, stages=None):
    on_stage = None if stages is None else stages.append
    pipeline = ImagePipeline(task, tiny_config(), root, on_stage=on_stage)
    return pipeline, pipeline.run("dp_mixmin", 1.0, seed=0)


def _rewrite(path, change, *, checksum):
    content = json.loads(path.read_text())
    change(content)
    if checksum:  # what someone who knows the format writes
        content.pop("sha256", None)
        content["sha256"] = checkpoint.json_checksum(content)
    path.write_text(json.dumps(content))


def test_every_stored_file_is_owner_only_and_a_finished_stage_keeps_no_sampler_or_key(
    task, finished
):
    root, _ = finished
    pipeline = ImagePipeline(task, tiny_config(), root)
    settings = pipeline.settings_folder()
    paths = [settings, *settings.rglob("*")]
    assert len(paths) > 20
    loose = [p for p in paths if p.stat().st_mode & 0o777 != (0o700 if p.is_dir() else 0o600)]
    assert loose == []
    assert (root / "store_key").stat().st_mode & 0o777 == 0o600
    (finetune,) = pipeline.stage_folder(0).glob("finetune_*")
    assert [p.name for p in finetune.iterdir()] == ["final"]  # the running checkpoints are gone
    step = Checkpointer(finetune / "final").latest_step()
    meta = json.loads((finetune / "final" / str(step) / "meta" / "metadata").read_text())
    assert meta["sampler"] is None and meta["ledger"]["entries"]
    # Only the parameters: no optimizer state, so no noise key.
    stored = json.loads((finetune / "final" / str(step) / "checksums" / "metadata").read_text())
    assert stored["state"]
    assert not any("opt_state" in k for k in stored["state"])


def test_a_finished_stage_is_reused_and_an_interrupted_one_resumes_without_respending(
    task, finished, tmp_path, monkeypatch
):
    root, reference = _copy(finished, tmp_path)
    stages = []
    assert _run(task, root, stages)[1] == reference and stages == []

    store = ImagePipeline(task, tiny_config(), root).stage_folder(0)
    (store / "run_dp_mixmin_parallel_eps1.0.json").unlink()
    (finetune,) = store.glob("finetune_*")
    shutil.rmtree(finetune)
    real_fit = mixture_pipeline.fit

    def killed_after_two_steps(*args, **kwargs):
        real_fit(*args, until=2, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(mixture_pipeline, "fit", killed_after_two_steps)
    with pytest.raises(KeyboardInterrupt):
        _run(task, root)
    # Interrupted: one running checkpoint (owner-only), no final parameters.
    assert [p.name for p in finetune.iterdir()] == ["checkpoints"]
    assert [p.name for p in (finetune / "checkpoints").iterdir()] == ["2"]
    monkeypatch.setattr(mixture_pipeline, "fit", real_fit)
    resumed = _run(task, root, stages)[1]
    assert stages == ["finetune"]
    assert resumed.spent == reference.spent  # the ledger's 2 steps restored, not re-recorded
    assert resumed.utility == pytest.approx(reference.utility, abs=1e-6)
    assert [p.name for p in finetune.iterdir()] == ["final"]
    # A damaged final checkpoint, deleted as its error says: the stage is recomputed.
    (step,) = (finetune / "final").iterdir()
    shutil.rmtree(step)
    (store / "run_dp_mixmin_parallel_eps1.0.json").unlink()
    stages.clear()
    again = _run(task, root, stages)[1]
    assert stages == ["finetune"] and again.spent == reference.spent
    assert again.utility == pytest.approx(reference.utility, abs=1e-6)


def test_the_mixture_noise_differs_between_compositions_at_the_same_stage_epsilon(
    task, tmp_path, monkeypatch
):
    # A parallel ε = 1 run and a sequential ε = 10 run (share 0.1) both run DP-MixMin at ε = 1.
    seeds = []
    real = mixture_pipeline.dp_mixmin

    def recording(**kwargs):
        seeds.append(kwargs["seed"])
        return real(**kwargs)

    monkeypatch.setattr(mixture_pipeline, "dp_mixmin", recording)
    preds = np.random.default_rng(0).uniform(0.05, 0.95, size=(200, task.k))
    for composition, epsilon in (("parallel", 1.0), ("sequential", 10.0)):
        for reproducible in (False, True):
            root = tmp_path / str(reproducible)
            pipeline = ImagePipeline(
                task, tiny_config(composition=composition), root, reproducible=reproducible
            )
            pipeline.mixture_inputs = lambda seed: {"preds": preds, "kind": "nll"}
            mix_epsilon, _ = budget.stage_epsilons(epsilon, composition, 0.1)
            assert mix_epsilon == pytest.approx(1.0)
            pipeline.mixture(mix_epsilon, seed=0)
    # Seeded runs of another config (here its proxy) draw other noise from the same seed too.
    proxy = dataclasses.replace(tiny_config().proxy, steps=31)
    pipeline = ImagePipeline(task, tiny_config(proxy=proxy), tmp_path / "True", reproducible=True)
    pipeline.mixture_inputs = lambda seed: {"preds": preds, "kind": "nll"}
    pipeline.mixture(1.0, seed=0)
    assert len(set(seeds)) == 5


def _relabelled(task):
    """The task with every sensitive training label flipped (same sizes, names and sources)."""
    rows = task.train.gather(np.arange(len(task.train)))
    rows["labels"] = 1 - rows["labels"]
    train = ArraySource(rows, group_ids=task.train.group_ids, user_ids=task.train.user_ids)
    return dataclasses.replace(task, train=train)


def test_stages_are_recomputed_when_the_data_or_the_code_changes(task, tmp_path, monkeypatch):
    def run(data, stages):
        pipeline = ImagePipeline(data, tiny_config(), tmp_path, on_stage=stages.append)
        return pipeline, pipeline.run("random_init", 1.0, seed=0)

    stages = []
    first_pipeline, first = run(task, stages)
    assert stages == ["split", "finetune"]
    stages.clear()
    flipped_pipeline, flipped = run(_relabelled(task), stages)
    assert stages == ["split", "finetune"]  # nothing of the original data is reused
    assert flipped.utility != first.utility
    assert flipped_pipeline.settings_folder() != first_pipeline.settings_folder()
    stages.clear()
    assert run(task, stages)[1] == first and stages == []  # the original's stages are kept

    monkeypatch.setattr(mixture_pipeline, "code_fingerprint", lambda: "other code")
    stages.clear()
    changed_pipeline, _ = run(task, stages)
    assert stages == ["split", "finetune"]
    assert changed_pipeline.settings_folder() != first_pipeline.settings_folder()


def test_folder_names_are_keyed_so_they_do_not_fingerprint_the_data(task, tmp_path):
    a = ImagePipeline(task, tiny_config(), tmp_path / "a").settings_folder().name
    b = ImagePipeline(task, tiny_config(), tmp_path / "b").settings_folder().name
    plain = stage_store.fingerprint(ImagePipeline(task, tiny_config(), tmp_path / "a").settings())
    assert a != b and not plain.startswith(a)
    assert ImagePipeline(task, tiny_config(), tmp_path / "a").settings_folder().name == a


@pytest.mark.parametrize(
    ("stage", "change", "checksum", "message"),
    [
        ("run_dp_mixmin_parallel_eps1.0", lambda r: r.update(utility=0.999), False, "checksum"),
        (
            "run_dp_mixmin_parallel_eps1.0",
            lambda r: r.update(spent_epsilon=0.123),
            False,
            "checksum",
        ),
        ("split", lambda r: r["ft"].extend(r["mix"]), False, "checksum"),
        ("split", lambda r: r["ft"].extend(r["mix"]), True, "D_mix and D_ft share"),
        ("split", lambda r: r["mix"].append(10**9), True, "outside"),
    ],
)
def test_an_edited_stage_file_is_refused_naming_it(
    task, finished, tmp_path, stage, change, checksum, message
):
    root, _ = _copy(finished, tmp_path)
    path = ImagePipeline(task, tiny_config(), root).stage_folder(0) / f"{stage}.json"
    _rewrite(path, change, checksum=checksum)
    pipeline = ImagePipeline(task, tiny_config(), root)
    with pytest.raises(ValueError, match=message) as error:
        pipeline.split(0)
        pipeline.run("dp_mixmin", 1.0, seed=0)
    text = str(error.value)
    assert text.startswith(f"stage file {path} ") and "delete it to recompute" in text
    assert "\n" not in text


def test_a_truncated_stage_file_is_refused_naming_it(task, finished, tmp_path):
    root, _ = _copy(finished, tmp_path)
    path = ImagePipeline(task, tiny_config(), root).stage_folder(0) / "mixture_parallel_eps1.0.json"
    text = path.read_text()
    path.write_text(text[: len(text) // 2])
    with pytest.raises(ValueError, match=f"stage file {path} cannot be read") as error:
        ImagePipeline(task, tiny_config(), root).mixture(1.0, seed=0)
    assert "delete it to recompute" in str(error.value)
    path.unlink()  # deleting it recomputes the stage, with the same noise
    weights, _ = ImagePipeline(task, tiny_config(), root).mixture(1.0, seed=0)
    assert weights.tolist() == pytest.approx(json.loads(text)["weights"])
