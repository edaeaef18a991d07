"""DP-MixMin end to end for shared-input sources (the chest X-ray setting).

One pool of public images carries k label functions (CheXpert's or MIMIC-CXR's 14 observations;
the embedded digits default's 12 rules); the sensitive task is a binary label on other images
(an NIH finding). Stages, each stored so that a rerun skips it:

1. split the sensitive train split into disjoint D_mix (fraction ρ) and D_ft;
2. train the multi-head proxy (one network, k sigmoid heads) on the public pool;
3. cache the `nll` proxy outputs P[j, i] = p_i(y_j | x_j) on D_mix;
4. learn λ with `mixing.dp_mixmin` at (ε, δ) on D_mix;
5. pretrain the downstream model on the public pool with the soft target Σ_i λ_i y_i (BCE);
6. DP-fine-tune it on D_ft at (ε, δ);
7. evaluate AUC on the test split.
The end-to-end budget is the parallel composition of stages 4 and 6 (disjoint data). With
`composition="sequential"` nothing is split: both stages read the whole train split, at
ε_mix = share·ε and ε_ft = (1 - share)·ε, and the end-to-end ε is the accountant's for both
stages' events composed (at most ε).

The privacy unit (`ImagePipelineConfig.privacy_unit`) is one image by default (the paper's
setting), or one patient: user-level DP, in which both private stages Poisson-sample patients,
average the gradients of up to G of a sampled patient's images and clip that average, so the
guarantee covers adding or removing a patient with all of their images (`with_privacy_unit`
sets the stages' level and G together; `privacy_unit_label` names the guarantee in outputs).

Each downstream task is its own private run with its own budget, as in the paper's per-task
experiments; releasing several tasks' models trained on the same patients composes.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
from collections.abc import Callable
from typing import Any, Literal

import jax
import numpy as np
from flax import nnx

from dpmix_jax.data.sources import Source
from dpmix_jax.models.mlp import MLP, MLPConfig
from dpmix_jax.models.resnet import ResNet, ResNetConfig
from dpmix_jax.pipeline.budget import Composition, check_allow_large_delta, stage_epsilons
from dpmix_jax.pipeline.mixture_config import MixtureConfig
from dpmix_jax.pipeline.mixture_pipeline import MixturePipeline
from dpmix_jax.pipeline.stage_store import canonical_json, weights_key
from dpmix_jax.privacy import validation
from dpmix_jax.train import Checkpointer, IndexedData, TrainConfig, Trainer, evaluate, fit, losses
from dpmix_jax.train.proxies import nll_matrix

PrivacyUnit = Literal["image", "patient"]
PRIVACY_UNITS: tuple[PrivacyUnit, ...] = ("image", "patient")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """Which network to build: an MLP (CPU presets) or a GroupNorm ResNet.

    Attributes:
        kind: "mlp" or "resnet".
        mlp_hidden: hidden widths of the MLP.
        resnet: the ResNet's config (its `in_channels` is set from the data).
    """

    kind: str = "mlp"
    mlp_hidden: tuple[int, ...] = (128, 64)
    resnet: ResNetConfig | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("mlp", "resnet"):
            raise ValueError(f"kind must be 'mlp' or 'resnet', got {self.kind!r}.")
        if self.kind == "resnet" and self.resnet is None:
            raise ValueError("a resnet ModelSpec needs a ResNetConfig.")

    def build(self, image_shape: tuple[int, ...], num_outputs: int, *, seed: int) -> nnx.Module:
        """A fresh model for (H, W, C) images with `num_outputs` logits, initialised from `seed`."""
        rngs = nnx.Rngs(seed)
        if self.kind == "mlp":
            config = MLPConfig(in_features=int(np.prod(image_shape)), hidden=self.mlp_hidden)
            return MLP(config, num_outputs, rngs=rngs)
        config = dataclasses.replace(self.resnet, in_channels=int(image_shape[-1]))
        return ResNet(config, num_outputs, rngs=rngs)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SharedInputTask:
    """A public pool with k label sources and a sensitive binary task.

    Attributes:
        name: for reports.
        public: source of {"image": (H, W, C), "labels": (k,)} public examples.
        source_names: the k label sources.
        train, val, test: sensitive splits, sources of {"image", "labels": (T,)}.
        task_index: which of the T sensitive labels is the downstream task.
        true_weights: the λ* that generated the sensitive labels, when known.
    """

    name: str
    public: Source
    source_names: tuple[str, ...]
    train: Source
    val: Source
    test: Source
    task_index: int = 0
    true_weights: np.ndarray | None = None

    @property
    def k(self) -> int:
        return len(self.source_names)

    @functools.cached_property
    def image_shape(self) -> tuple[int, ...]:
        return tuple(self.public.gather(np.array([0]))["image"].shape[1:])


@dataclasses.dataclass(frozen=True, kw_only=True)
class ImagePipelineConfig:
    """Public settings of the shared-input pipeline.

    Attributes:
        delta: δ of each private stage; below 1/n for the n units of each private stage
            (checked before any work) unless `allow_large_delta`.
        allow_large_delta: accept δ >= 1/n; every result of the run records it.
        mix_fraction: ρ, the fraction of the sensitive train split given to the mixture stage.
        composition: "parallel" (disjoint D_mix, D_ft: max) or "sequential" (no split; sum).
        sequential_mixture_share: with sequential composition, the mixture stage's share of ε.
        model: the downstream network.
        proxy_model: the proxy's network (k heads); None uses `model`'s architecture.
        proxy: public training of the multi-head proxy.
        mixture: the DP-MixMin stage.
        pretrain: public pretraining on the λ-mixture target.
        finetune: private fine-tuning; its `epsilon` and `delta` are replaced by each run's.
        random_search_candidates: m, the Random Search baseline's number of Dirichlet(1) draws.
        eval_batch_size: rows per evaluation batch.
        privacy_unit: what the guarantee protects: "image" (example-level DP, the paper's unit)
            or "patient" (user-level DP: both private stages sample patients and clip the mean
            gradient of up to `max_images_per_patient` of their images; `mixture` and
            `finetune` must then be user level with that G, see `with_privacy_unit`).
        max_images_per_patient: G, the images a sampled patient contributes per step (patient
            level only).
    """

    delta: float = 1e-5
    allow_large_delta: bool = False
    mix_fraction: float = 0.1
    composition: Composition = "parallel"
    sequential_mixture_share: float = 0.1
    model: ModelSpec = ModelSpec()
    proxy_model: ModelSpec | None = None
    proxy: TrainConfig
    mixture: MixtureConfig
    pretrain: TrainConfig
    finetune: TrainConfig
    random_search_candidates: int = 4
    eval_batch_size: int = 256
    privacy_unit: PrivacyUnit = "image"
    max_images_per_patient: int | None = None

    def __post_init__(self) -> None:
        validation.check_delta(self.delta)
        check_allow_large_delta(self.allow_large_delta)
        if not 0 < self.mix_fraction < 1:
            raise ValueError(f"mix_fraction must be in (0, 1), got {self.mix_fraction!r}.")
        stage_epsilons(1.0, self.composition, self.sequential_mixture_share)
        if self.proxy.private or self.pretrain.private:
            raise ValueError("proxy and pretrain stages train on public data: private=False.")
        if not self.finetune.private:
            raise ValueError("the finetune stage must be private (private=True).")
        if not isinstance(self.random_search_candidates, int) or self.random_search_candidates < 1:
            raise ValueError("random_search_candidates must be an integer >= 1.")
        self._check_privacy_unit()

    def _check_privacy_unit(self) -> None:
        """Refuses a unit whose private stages do not all run at its level with its G."""
        if self.privacy_unit not in PRIVACY_UNITS:
            raise ValueError(
                f"privacy_unit must be 'image' or 'patient', got {self.privacy_unit!r}."
            )
        patient_level = self.privacy_unit == "patient"
        limit = self.max_images_per_patient
        if patient_level and not (isinstance(limit, int) and limit >= 1):
            raise ValueError(
                f"max_images_per_patient must be an integer >= 1 at patient level, got {limit!r}."
            )
        if not patient_level and limit is not None:
            raise ValueError("max_images_per_patient is for privacy_unit='patient'; remove it.")
        level = "user" if patient_level else "example"
        stages = {
            "finetune.level": (self.finetune.level, level),
            "finetune.max_examples_per_user": (self.finetune.max_examples_per_user, limit),
            "mixture.max_examples_per_user": (self.mixture.max_examples_per_user, limit),
        }
        for name, (value, wanted) in stages.items():
            if value != wanted:
                raise ValueError(
                    f"{name} is {value!r} but privacy_unit {self.privacy_unit!r} needs {wanted!r};"
                    " set the unit with image.with_privacy_unit."
                )


def with_privacy_unit(
    config: ImagePipelineConfig, unit: PrivacyUnit, max_images_per_patient: int | None = None
) -> ImagePipelineConfig:
    """`config` with privacy unit `unit`, both private stages set to its level.

    Args:
        config: the pipeline settings (at either unit).
        unit: "image" (example-level DP) or "patient" (user-level DP).
        max_images_per_patient: G, required for "patient" and refused for "image".

    Privacy: at patient level DP-MixMin and DP-SGD sample patients and clip the mean gradient
    of up to G images per patient, so each stage's (ε, δ) holds per patient.
    """
    if unit not in PRIVACY_UNITS:
        raise ValueError(f"privacy unit must be 'image' or 'patient', got {unit!r}.")
    limit = max_images_per_patient if unit == "patient" else None
    if unit == "image" and max_images_per_patient is not None:
        raise ValueError("max_images_per_patient is for the patient unit; remove it.")
    level = "user" if unit == "patient" else "example"
    return dataclasses.replace(
        config,
        privacy_unit=unit,
        max_images_per_patient=limit,
        mixture=dataclasses.replace(config.mixture, max_examples_per_user=limit),
        finetune=dataclasses.replace(config.finetune, level=level, max_examples_per_user=limit),
    )


def privacy_unit_label(config: ImagePipelineConfig) -> str:
    """What one (ε, δ) of a run protects, for outputs: "per image" or "per patient (user-level,
    up to G images)"."""
    if config.privacy_unit == "patient":
        return f"per patient (user-level, up to {config.max_images_per_patient} images)"
    return "per image"


def _subset_gather(source: Source, rows: np.ndarray, task_index: int | None):
    """`gather(indices)` over `source` restricted to `rows`, as model batches (-1 stays padding)."""

    def gather(indices: np.ndarray) -> dict[str, np.ndarray]:
        indices = np.asarray(indices)
        picked = np.where(indices >= 0, rows[np.maximum(indices, 0)], -1)
        example = source.gather(picked)
        labels = example["labels"]
        if task_index is not None:
            labels = labels[:, task_index : task_index + 1]
        return {"inputs": example["image"], "labels": labels}

    return gather


def row_digests(source: Source, *, chunk: int = 1024) -> list[bytes]:
    """A SHA-256 digest of every row's arrays (names, dtypes, shapes and bytes): an identifier
    of each example that depends on that example alone."""
    digests = []
    for start in range(0, len(source), chunk):
        rows = source.gather(np.arange(start, min(start + chunk, len(source))))
        for i in range(len(next(iter(rows.values())))):
            digest = hashlib.sha256()
            for name in sorted(rows):
                value = np.ascontiguousarray(rows[name][i])
                digest.update(f"{name}/{value.dtype.str}/{value.shape}".encode())
                digest.update(value.tobytes())
            digests.append(digest.digest())
    return digests


class ImagePipeline(MixturePipeline):
    """DP-MixMin and its baselines on one `SharedInputTask` (`ImagePipelineConfig`), with stages
    stored under `root` (see `MixturePipeline` for the arguments).

    Raises:
        ValueError: a patient-level config on a task whose train split has no patient ids
            (`user_ids`).
    """

    higher_is_better = True

    def __init__(
        self,
        task: SharedInputTask,
        config: ImagePipelineConfig,
        root: str | os.PathLike,
        *,
        on_stage: Callable[[str], None] | None = None,
        reproducible: bool = False,
    ):
        super().__init__(task, config, root, on_stage=on_stage, reproducible=reproducible)
        if self.patient_level and task.train.user_ids is None:
            raise ValueError(
                f"privacy_unit 'patient' needs the patient of every train image (user_ids), "
                f"which {task.name!r} does not have; use privacy_unit 'image'."
            )

    @property
    def patient_level(self) -> bool:
        """Whether the privacy unit is a patient (user-level DP in both private stages)."""
        return self.config.privacy_unit == "patient"

    @property
    def unit_name(self) -> str:
        """What the δ check counts: patients at patient level, else the split's units."""
        return "patients" if self.patient_level else "units"

    @property
    def k(self) -> int:
        return self.task.k

    def data_digest(self) -> str:
        """SHA-256 (hex) of every row of the public pool and the three sensitive splits
        (`row_digests`), their patient and user ids, and the task's label index.

        Privacy: a digest of sensitive rows, kept owner-only (see `MixturePipeline`).
        """
        digest = hashlib.sha256(f"task_index/{self.task.task_index}".encode())
        for split in ("public", "train", "val", "test"):
            source = getattr(self.task, split)
            digest.update(f"/{split}/{len(source)}/".encode())
            for row in row_digests(source):
                digest.update(row)
            ids = {"group_ids": source.group_ids, "user_ids": source.user_ids}
            digest.update(canonical_json(ids).encode())
        return digest.hexdigest()

    # ------------------------------------------------------------------ stages
    def split_unit_ids(self) -> np.ndarray | list[bytes]:
        """The patient of each image at patient level; otherwise patient ids where the source
        has them (D_mix and D_ft are then patient-disjoint), else a digest of each example's
        content (`row_digests`)."""
        if self.patient_level:
            return self._patients(np.arange(len(self.task.train)))
        groups = self.task.train.group_ids
        return row_digests(self.task.train) if groups is None else groups

    def _patients(self, rows: np.ndarray) -> np.ndarray:
        """The patient (user id) of the train images at `rows`.

        Privacy: patient ids only decide the grouping, which is what patient-level DP protects.
        """
        return np.asarray(self.task.train.user_ids)[rows]

    def _fit_public(self, name: str, seed: int, config: TrainConfig, model, loss) -> nnx.Module:
        store = self._store(seed)
        checkpointer = Checkpointer(store.path(name))
        if checkpointer.latest_step() != config.steps:
            self._on_stage(name)
        data = IndexedData(
            gather=_subset_gather(self.task.public, np.arange(len(self.task.public)), None),
            num_examples=len(self.task.public),
        )
        trainer = Trainer(config, model, loss)
        result = fit(
            trainer,
            data,
            rng=np.random.default_rng(seed),
            checkpointer=checkpointer,
            on_step=self._on_step,
        )
        checkpointer.close()
        return result.model

    def proxy_outputs(self, seed: int) -> np.ndarray:
        """The `nll` matrix (|D_mix|, k) of the multi-head proxy on D_mix.

        Privacy: computed from sensitive labels on D_mix; consumed only by the accounted mixture
        stage (and by the non-private MixMin baseline, which is labelled as such).
        """

        def compute():
            spec = self.config.proxy_model or self.config.model
            model = spec.build(self.task.image_shape, self.task.k, seed=seed)
            proxy = self._fit_public(
                "proxy", seed, self.config.proxy, model, losses.sigmoid_bce(target_key="labels")
            )
            mix, _ = self.split(seed)
            self._on_stage("proxy_outputs")
            logits, labels = evaluate.model_outputs(
                proxy,
                evaluate.outputs_and_labels("inputs", "labels"),
                _subset_gather(self.task.train, mix, self.task.task_index),
                len(mix),
                batch_size=self.config.eval_batch_size,
            )
            return {"nll": nll_matrix(logits, labels.reshape(-1).round().astype(int))}

        name = f"proxy_outputs_{self.config.composition}"
        return np.asarray(self._store(seed).json(name, compute)["nll"])

    def mixture_inputs(self, seed: int) -> dict[str, Any]:
        """The `nll` proxy outputs on D_mix (and at patient level each row's patient, the unit
        `dp_mixmin` samples), as `dp_mixmin` / `mixmin` arguments."""
        inputs: dict[str, Any] = {"preds": self.proxy_outputs(seed), "kind": "nll"}
        if self.patient_level:
            mix, _ = self.split(seed)
            inputs["user_ids"] = self._patients(mix)
        return inputs

    def pretrained(self, weights: np.ndarray | None, seed: int) -> nnx.Module:
        """The downstream model pretrained on the public pool with target Σ λ_i y_i (or a fresh
        initialisation for `weights=None`)."""
        model = self.config.model.build(self.task.image_shape, 1, seed=seed)
        if weights is None:
            return model
        name = f"pretrain_{weights_key(weights)}"
        return self._fit_public(
            name, seed, self.config.pretrain, model, losses.mixture_bce(weights)
        )

    def finetune_trainer(
        self, init: nnx.Module, config: TrainConfig, rows: np.ndarray, noise_key: jax.Array
    ) -> tuple[Trainer, IndexedData]:
        """DP-SGD on the multi-label BCE of the task's labels at `rows`.

        Privacy: one unit per image, or at patient level per patient (Poisson-sampled patients,
        the mean gradient of up to G of their images clipped; `num_units` counts the patients
        among `rows`); the rows are read only by the accounted trainer.
        """
        patients = self._patients(rows) if self.patient_level else None
        trainer = Trainer(
            config,
            init,
            losses.sigmoid_bce(target_key="labels"),
            num_units=len(rows) if patients is None else len(np.unique(patients)),
            noise_key=noise_key,
        )
        data = IndexedData(
            gather=_subset_gather(self.task.train, rows, self.task.task_index),
            num_examples=len(rows),
            user_ids=patients,
        )
        return trainer, data

    def utility(self, model: nnx.Module, split: str) -> float:
        """Test (or validation) AUC of the downstream model. Evaluation only, not released."""
        source = getattr(self.task, split)
        report = evaluate.auc_report(
            model,
            _subset_gather(source, np.arange(len(source)), self.task.task_index),
            len(source),
            batch_size=self.config.eval_batch_size,
        )
        return report["macro_auc"]
