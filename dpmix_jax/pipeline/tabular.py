"""DP-MixMin end to end for tabular sources with their own rows (`data.tabular.TabularTask`).

Each of the k public sources is a table of (features, label) rows sharing the sensitive task's
label; the stages are those of `MixturePipeline`:

1. split the sensitive train split into disjoint D_mix (fraction ρ) and D_ft (keyed by the row's
   index in the original table);
2. train one proxy per source (an MLP on that source's rows, public);
3. cache the `nll` proxy outputs P[j, i] = p_i(y_j | x_j) on D_mix;
4. learn λ with `mixing.dp_mixmin` at (ε, δ) on D_mix;
5. pretrain the downstream MLP on public rows drawn from the mixture: source i with probability
   λ_i, a row uniformly within it;
6. DP-fine-tune it on D_ft at (ε, δ);
7. evaluate AUC on the test split.

The shift-aware variant (`run_density_ratio`, method `dp_mixmin_ratio`) adds a private
domain classifier: a logistic regression trained by DP-SGD to tell D_mix's sensitive rows from
the public rows, whose odds estimate the density ratio p_sensitive(x) / p_public(x). Pretraining
then draws source i with probability λ_i as before, but a row within it with probability
proportional to its estimated ratio (log-ratio clipped to ±`max_log_ratio`), so the public data
resembles the sensitive covariates. The classifier and DP-MixMin both read D_mix: one noise
multiplier σ for both is calibrated so that the accountant's ε of their composition is the run's
ε, and the fine-tuning on the disjoint D_ft spends ε as well (parallel composition: the total is
ε, the same as DP-MixMin's).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from typing import Any

import dp_accounting
import jax
import numpy as np
from flax import nnx

from dpmix_jax.data.sources import ArraySource, Source
from dpmix_jax.data.tabular import TabularTask
from dpmix_jax.mixing import dp_mixmin
from dpmix_jax.pipeline.budget import (
    Composition,
    budget_from_json,
    budget_to_json,
    check_allow_large_delta,
)
from dpmix_jax.pipeline.image import ModelSpec, row_digests
from dpmix_jax.pipeline.mixture_config import MixtureConfig
from dpmix_jax.pipeline.mixture_pipeline import MixturePipeline
from dpmix_jax.pipeline.results import RunResult
from dpmix_jax.pipeline.splits import derived_seed
from dpmix_jax.pipeline.stage_store import canonical_json, epsilon_name, weights_key
from dpmix_jax.privacy import accounting, randomness, validation
from dpmix_jax.train import Checkpointer, IndexedData, TrainConfig, Trainer, evaluate, fit, losses
from dpmix_jax.train.proxies import nll_matrix

RATIO_METHOD = "dp_mixmin_ratio"
RATIO_NOTE = (
    "DP domain classifier (public vs D_mix) and DP-MixMin on D_mix at one calibrated σ, their "
    "composition at ε; pretrain on λ with rows reweighted by the estimated density ratio; DP "
    "fine-tune on D_ft"
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DensityRatioConfig:
    """Public settings of the private domain classifier (logistic regression, DP-SGD).

    Attributes:
        steps: DP-SGD steps.
        batch_size: expected rows per step (public and D_mix rows are sampled alike).
        clip_norm: C of the per-row gradient.
        learning_rate: Adam's step size.
        max_log_ratio: the estimated log density ratio is clipped to ± this before weighting.
    """

    steps: int = 100
    batch_size: int = 256
    clip_norm: float = 1.0
    learning_rate: float = 0.05
    max_log_ratio: float = 3.0

    def __post_init__(self) -> None:
        validation.check_steps(self.steps)
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {self.batch_size!r}.")
        for name in ("clip_norm", "learning_rate", "max_log_ratio"):
            validation.check_positive(getattr(self, name), name)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TabularPipelineConfig:
    """Public settings of the tabular pipeline.

    Attributes:
        delta: δ of each private stage (below 1/n for the n rows of each, unless
            `allow_large_delta`).
        allow_large_delta: accept δ >= 1/n; every result records it.
        mix_fraction: ρ, the share of the sensitive train split given to D_mix.
        composition: "parallel" only (D_mix and D_ft disjoint).
        sequential_mixture_share: unused with parallel composition (kept for the base class).
        model: the downstream MLP (and each proxy's).
        proxy: public training of each source's proxy.
        mixture: the DP-MixMin stage.
        pretrain: public pretraining on the λ-mixture of sources.
        finetune: private fine-tuning; its `epsilon` and `delta` are replaced by each run's.
        density_ratio: the shift-aware variant's domain classifier.
        pretrain_pool_factor: the pretraining draws this many times the public row count from
            the mixture before training on them.
        random_search_candidates: m of the Random Search baseline.
        eval_batch_size: rows per evaluation batch.
    """

    delta: float = 1e-5
    allow_large_delta: bool = False
    mix_fraction: float = 0.3
    composition: Composition = "parallel"
    sequential_mixture_share: float = 0.1
    model: ModelSpec = ModelSpec(kind="mlp", mlp_hidden=(32,))
    proxy: TrainConfig
    mixture: MixtureConfig
    pretrain: TrainConfig
    finetune: TrainConfig
    density_ratio: DensityRatioConfig = DensityRatioConfig()
    pretrain_pool_factor: int = 4
    random_search_candidates: int = 4
    eval_batch_size: int = 512

    def __post_init__(self) -> None:
        validation.check_delta(self.delta)
        check_allow_large_delta(self.allow_large_delta)
        if not 0 < self.mix_fraction < 1:
            raise ValueError(f"mix_fraction must be in (0, 1), got {self.mix_fraction!r}.")
        if self.composition != "parallel":
            raise ValueError(
                f"composition must be 'parallel' for the tabular pipeline, got "
                f"{self.composition!r}."
            )
        if self.model.kind != "mlp":
            raise ValueError(f"model.kind must be 'mlp' for tabular rows, got {self.model.kind!r}.")
        if self.proxy.private or self.pretrain.private:
            raise ValueError("proxy and pretrain stages train on public data: private=False.")
        if not self.finetune.private:
            raise ValueError("the finetune stage must be private (private=True).")
        if self.mixture.max_examples_per_user is not None or self.finetune.level != "example":
            raise ValueError("the tabular pipeline is example level: one row is one unit.")
        if not isinstance(self.pretrain_pool_factor, int) or self.pretrain_pool_factor < 1:
            raise ValueError(
                f"pretrain_pool_factor must be an integer >= 1, got {self.pretrain_pool_factor!r}."
            )
        if not isinstance(self.random_search_candidates, int) or self.random_search_candidates < 1:
            raise ValueError("random_search_candidates must be an integer >= 1.")


def _rows_gather(source: Source, rows: np.ndarray):
    """`gather(indices)` over `source`'s `rows` as model batches (-1 stays padding)."""

    def gather(indices: np.ndarray) -> dict[str, np.ndarray]:
        indices = np.asarray(indices)
        picked = np.where(indices >= 0, rows[np.maximum(indices, 0)], -1)
        example = source.gather(picked)
        return {"inputs": example["features"], "labels": example["labels"]}

    return gather


def composed_event(
    noise_multiplier: float,
    *,
    classifier_rate: float,
    classifier_steps: int,
    mixture_rate: float,
    mixture_steps: int,
) -> dp_accounting.DpEvent:
    """The event of the variant's D_mix side: the domain classifier's DP-SGD, then DP-MixMin,
    both with noise multiplier σ."""
    return dp_accounting.ComposedDpEvent(
        [
            accounting.dpsgd_event(
                noise_multiplier=noise_multiplier,
                sampling_rate=classifier_rate,
                steps=classifier_steps,
            ),
            accounting.dpsgd_event(
                noise_multiplier=noise_multiplier, sampling_rate=mixture_rate, steps=mixture_steps
            ),
        ]
    )


def ratio_row_weights(
    logits: np.ndarray, source_ids: np.ndarray, max_log_ratio: float
) -> np.ndarray:
    """Per public row, its probability within its source: exp(clipped logit), normalised per
    source (the classifier's odds estimate the density ratio up to a constant).

    Privacy: the logits are post-processing of the DP domain classifier.
    """
    ratio = np.exp(np.clip(np.asarray(logits, np.float64), -max_log_ratio, max_log_ratio))
    totals = np.bincount(source_ids, weights=ratio)
    return ratio / totals[source_ids]


class TabularPipeline(MixturePipeline):
    """DP-MixMin, its baselines and the density-ratio variant on one `TabularTask`, with stages
    stored under `root` (see `MixturePipeline` for the arguments)."""

    higher_is_better = True
    task: TabularTask
    config: TabularPipelineConfig

    @property
    def k(self) -> int:
        return self.task.k

    @functools.cached_property
    def _public(self) -> tuple[Source, np.ndarray]:
        """All public rows as one source, and each row's source index."""
        parts = [s.gather(np.arange(len(s))) for s in self.task.sources]
        merged = {key: np.concatenate([p[key] for p in parts]) for key in ("features", "labels")}
        source_ids = np.concatenate([np.full(len(s), i) for i, s in enumerate(self.task.sources)])
        return ArraySource(merged), source_ids

    def data_digest(self) -> str:
        """SHA-256 (hex) of every row of the sources and sensitive splits with their table ids.

        Privacy: a digest of sensitive rows, kept owner-only (see `MixturePipeline`).
        """
        digest = hashlib.sha256(b"tabular")
        splits = {f"source{i}": s for i, s in enumerate(self.task.sources)}
        splits.update(train=self.task.train, val=self.task.val, test=self.task.test)
        for name, source in splits.items():
            digest.update(f"/{name}/{len(source)}/".encode())
            for row in row_digests(source):
                digest.update(row)
            digest.update(canonical_json({"group_ids": source.group_ids}).encode())
        return digest.hexdigest()

    def split_unit_ids(self) -> np.ndarray:
        """Each train row's index in the original table (its stable identity)."""
        return np.asarray(self.task.train.group_ids)

    def _fit_public(
        self, name: str, seed: int, config: TrainConfig, model: nnx.Module, data: IndexedData
    ) -> nnx.Module:
        checkpointer = Checkpointer(self._store(seed).path(name))
        if checkpointer.latest_step() != config.steps:
            self._on_stage("pretrain" if name.startswith("pretrain") else "proxy")
        trainer = Trainer(config, model, losses.sigmoid_bce(target_key="labels"))
        result = fit(
            trainer,
            data,
            rng=np.random.default_rng(derived_seed(seed, name)),
            checkpointer=checkpointer,
            on_step=self._on_step,
        )
        checkpointer.close()
        return result.model

    def _new_model(self, seed: int, *names: object) -> nnx.Module:
        return self.config.model.build(
            (self.task.num_features,), 1, seed=derived_seed(seed, *names) % 2**31
        )

    def proxies(self, seed: int) -> list[nnx.Module]:
        """One proxy per source, trained on that source's public rows."""
        models = []
        for i, source in enumerate(self.task.sources):
            data = IndexedData(
                gather=_rows_gather(source, np.arange(len(source))), num_examples=len(source)
            )
            model = self._new_model(seed, "proxy", i)
            models.append(self._fit_public(f"proxy_{i}", seed, self.config.proxy, model, data))
        return models

    def proxy_outputs(self, seed: int) -> np.ndarray:
        """The `nll` matrix (|D_mix|, k) of the k proxies on D_mix.

        Privacy: computed from sensitive labels on D_mix; consumed only by the accounted mixture
        stages (and by the labelled non-private MixMin baseline).
        """

        def compute():
            models = self.proxies(seed)
            mix, _ = self.split(seed)
            self._on_stage("proxy_outputs")
            gather = _rows_gather(self.task.train, mix)
            columns, labels = [], None
            for model in models:
                logits, labels = evaluate.model_outputs(
                    model,
                    evaluate.outputs_and_labels("inputs", "labels"),
                    gather,
                    len(mix),
                    batch_size=self.config.eval_batch_size,
                )
                columns.append(np.asarray(logits).reshape(-1))
            targets = np.asarray(labels).reshape(-1).round().astype(int)
            return {"nll": nll_matrix(np.stack(columns, axis=1), targets)}

        return np.asarray(self._store(seed).json("proxy_outputs_parallel", compute)["nll"])

    def mixture_inputs(self, seed: int) -> dict[str, Any]:
        return {"preds": self.proxy_outputs(seed), "kind": "nll"}

    def pretrained(
        self,
        weights: np.ndarray | None,
        seed: int,
        *,
        row_weights: np.ndarray | None = None,
        name: str | None = None,
    ) -> nnx.Module:
        """The downstream MLP pretrained on public rows drawn from the mixture λ: source i with
        probability λ_i, a row within it uniformly or, given `row_weights` (each source's rows
        summing to 1), with those probabilities. A fresh initialisation for `weights=None`.

        Privacy: `row_weights`, when given, are post-processing of the DP domain classifier.
        """
        model = self._new_model(seed, "downstream")
        if weights is None:
            return model
        public, source_ids = self._public
        if row_weights is None:
            sizes = np.bincount(source_ids, minlength=self.k)
            row_weights = 1.0 / sizes[source_ids]
        probabilities = np.asarray(weights, np.float64)[source_ids] * row_weights
        probabilities /= probabilities.sum()
        count = self.config.pretrain_pool_factor * len(public)
        rng = np.random.default_rng(derived_seed(seed, "pretrain_draw"))
        drawn = rng.choice(len(public), size=count, p=probabilities)
        data = IndexedData(gather=_rows_gather(public, drawn), num_examples=count)
        name = name or f"pretrain_{weights_key(weights)}"
        return self._fit_public(name, seed, self.config.pretrain, model, data)

    def finetune_trainer(
        self, init: nnx.Module, config: TrainConfig, rows: np.ndarray, noise_key: jax.Array
    ) -> tuple[Trainer, IndexedData]:
        """DP-SGD on the BCE of the task's label at the train `rows`.

        Privacy: one unit per row; the rows are read only by the accounted trainer.
        """
        trainer = Trainer(
            config,
            init,
            losses.sigmoid_bce(target_key="labels"),
            num_units=len(rows),
            noise_key=noise_key,
        )
        data = IndexedData(gather=_rows_gather(self.task.train, rows), num_examples=len(rows))
        return trainer, data

    def utility(self, model: nnx.Module, split: str) -> float:
        """AUC on the "val" or "test" split. Evaluation only, not released."""
        source = getattr(self.task, split)
        report = evaluate.auc_report(
            model,
            _rows_gather(source, np.arange(len(source))),
            len(source),
            batch_size=self.config.eval_batch_size,
        )
        return report["macro_auc"]

    # ------------------------------------------------------- the density-ratio variant
    def ratio_plan(self, epsilon: float, seed: int) -> dict[str, float]:
        """The variant's D_mix side: both Poisson rates, steps and the one σ whose composed ε
        (`composed_event`, the PLD accountant) is at most `epsilon`."""
        mix, _ = self.split(seed)
        public, _ = self._public
        settings, mixture = self.config.density_ratio, self.config.mixture
        rates = {
            "classifier_rate": settings.batch_size / (len(public) + len(mix)),
            "classifier_steps": settings.steps,
            "mixture_rate": mixture.batch_size / len(mix),
            "mixture_steps": mixture.steps,
        }
        for name in ("classifier_rate", "mixture_rate"):
            if rates[name] > 1:
                raise ValueError(
                    f"the {name.split('_')[0]} batch exceeds its {len(mix)} D_mix rows; lower it."
                )
        sigma = accounting.calibrate(
            lambda s: composed_event(s, **rates),
            target_epsilon=epsilon,
            delta=self.config.delta,
            accountant=mixture.accountant,
        )
        return {"noise_multiplier": sigma, **rates}

    def density_ratio_mixture(self, epsilon: float, seed: int) -> dict[str, Any]:
        """The variant's D_mix side: the DP domain classifier's log-ratio on every public row,
        λ by DP-MixMin, and the composed ledger (stored).

        Privacy: both mechanisms read D_mix at the calibrated σ (`ratio_plan`); the classifier
        reads only D_mix's features, DP-MixMin its proxy outputs; the returned ledger holds both
        mechanisms' executed events and its ε is the stage's. Their noise and sampling are
        private streams named by this stage and ε.
        """
        name = f"mixture_ratio_parallel_eps{epsilon_name(epsilon)}"

        def compute():
            plan = self.ratio_plan(epsilon, seed)
            mix, _ = self.split(seed)
            public, _ = self._public
            settings = self.config.density_ratio
            self._on_stage("mixture")
            features = np.concatenate(
                [
                    public.gather(np.arange(len(public)))["features"],
                    self.task.train.gather(mix)["features"],
                ]
            )
            domain = np.r_[np.zeros(len(public)), np.ones(len(mix))].astype(np.float32)[:, None]
            combined = ArraySource({"features": features, "labels": domain})
            config = TrainConfig(
                steps=settings.steps,
                batch_size=settings.batch_size,
                learning_rate=settings.learning_rate,
                private=True,
                clip_norm=settings.clip_norm,
                noise_multiplier=plan["noise_multiplier"],
                delta=self.config.delta,
                allow_large_delta=self.config.allow_large_delta,
                accountant=self.config.mixture.accountant,
                progress=False,
                log_every=None,
            )
            classifier = nnx.Linear(self.task.num_features, 1, rngs=nnx.Rngs(0))
            trainer = Trainer(
                config,
                classifier,
                losses.sigmoid_bce(target_key="labels"),
                num_units=len(features),
                noise_key=randomness.prng_key(self.private_seed(seed, name, self.config_key)),
            )
            data = IndexedData(
                gather=_rows_gather(combined, np.arange(len(features))),
                num_examples=len(features),
            )
            rng = np.random.default_rng(self.private_seed(seed, name, self.config_key, "sampler"))
            fitted = fit(trainer, data, rng=rng)
            logits, _ = evaluate.model_outputs(
                fitted.model,
                evaluate.outputs_and_labels("inputs", "labels"),
                _rows_gather(public, np.arange(len(public))),
                len(public),
                batch_size=self.config.eval_batch_size,
            )
            mixture = self.config.mixture
            result = dp_mixmin(
                **self.mixture_inputs(seed),
                noise_multiplier=plan["noise_multiplier"],
                delta=self.config.delta,
                steps=mixture.steps,
                batch_size=mixture.batch_size,
                clip_norm=mixture.clip_norm,
                learning_rate=mixture.learning_rate,
                seed=self.private_seed(seed, name, self.config_key, "mixmin"),
                solver=mixture.solver,
                shift=mixture.shift,
                accountant=mixture.accountant,
                allow_large_delta=self.config.allow_large_delta,
            )
            ledger = accounting.PrivacyLedger()
            for event, count in (*fitted.ledger.entries, *result.ledger.entries):
                ledger.record(event, count)
            spent = ledger.budget(self.config.delta, mixture.accountant)
            return {
                "weights": result.weights,
                "log_ratio": np.asarray(logits, np.float64).reshape(-1),
                "plan": plan,
                "classifier_epsilon": fitted.ledger.epsilon(self.config.delta, mixture.accountant),
                "mixmin_epsilon": result.epsilon,
                "spent": budget_to_json(spent),
                "ledger": ledger.state_dict(),
            }

        return self._store(seed).json(name, compute)

    def run_density_ratio(self, epsilon: float, seed: int) -> RunResult:
        """The shift-aware variant at target ε end to end (stored, so a rerun is free).

        Privacy: the D_mix side (domain classifier and DP-MixMin, composed) and the fine-tuning
        on the disjoint D_ft each spend at most ε; `spent` is their parallel composition.
        """
        validation.check_epsilon(epsilon)
        self.check_delta(seed)
        name = f"run_{RATIO_METHOD}_parallel_eps{epsilon_name(epsilon)}"

        def compute():
            stage = self.density_ratio_mixture(epsilon, seed)
            weights = np.asarray(stage["weights"])
            _, source_ids = self._public
            row_weights = ratio_row_weights(
                stage["log_ratio"], source_ids, self.config.density_ratio.max_log_ratio
            )
            key = f"ratio_{weights_key(weights)}_eps{epsilon_name(epsilon)}"
            init = self.pretrained(weights, seed, row_weights=row_weights, name=f"pretrain_{key}")
            model, finetune_budget = self.finetune(init, key, "ft", epsilon, seed)
            stages = {
                "mixture": budget_from_json(stage["spent"]),
                "finetune": finetune_budget,
            }
            # Kish's effective sample size of the reweighted rows, summed over the sources.
            effective = np.sum(1.0 / np.bincount(source_ids, weights=row_weights**2))
            return RunResult(
                method=RATIO_METHOD,
                epsilon=epsilon,
                delta=self.config.delta,
                seed=seed,
                utility=self.utility(model, "test"),
                weights=[float(w) for w in weights],
                spent=accounting.compose_parallel(*stages.values()),
                stages=stages,
                composition="parallel",
                private=True,
                seeded=self.reproducible,
                allow_large_delta=self.config.allow_large_delta,
                extra={
                    "noise_multiplier": stage["plan"]["noise_multiplier"],
                    "classifier_epsilon": stage["classifier_epsilon"],
                    "mixmin_epsilon": stage["mixmin_epsilon"],
                    "effective_public_rows": float(effective),
                },
            ).to_json()

        return RunResult.from_json(self._store(seed).json(name, compute))
