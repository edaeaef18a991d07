"""The stages every DP-MixMin pipeline shares (`MixturePipeline`): the split, the private mixture,
DP fine-tuning, the five methods through them, stored runs and their composed budgets.

A pipeline run is one (method, ε, seed) of one experiment. Its stages (split, proxy, mixture,
pretraining, fine-tuning, evaluation) store their results under a run directory (see
`stage_store`); a rerun finds them there and skips the work, so a killed pipeline resumes where it
stopped and reports the same budget (training stages resume mid-run from their orbax checkpoints,
see `train.checkpoint`). A finished fine-tuning stage keeps only its parameters and ledger
(`final/`); its running checkpoints (noise key, sampler) are deleted.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import hashlib
import hmac
import json
import os
import pathlib
import secrets
import shutil
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from dpmix_jax import interrupt, parallel
from dpmix_jax.mixing import dp_mixmin, mixmin
from dpmix_jax.pipeline import folders
from dpmix_jax.pipeline.budget import (
    budget_from_json,
    budget_to_json,
    end_to_end_budget,
    stage_epsilons,
)
from dpmix_jax.pipeline.progress import ProgressListener
from dpmix_jax.pipeline.results import METHODS, Method, RunResult
from dpmix_jax.pipeline.splits import derived_seed, dirichlet_candidates, split_mixture
from dpmix_jax.pipeline.stage_store import (
    StageStore,
    canonical_form,
    canonical_json,
    code_fingerprint,
    epsilon_name,
    fingerprint,
    weights_key,
)
from dpmix_jax.privacy import accounting, randomness, validation
from dpmix_jax.train import Checkpointer, IndexedData, TrainConfig, Trainer, TrainState, fit


class MixturePipeline(abc.ABC):
    """DP-MixMin and its baselines through one set of stages; subclasses provide the stages.

    A subclass defines `config` (with `delta`, `composition`, `mix_fraction`, `mixture`,
    `finetune`, `sequential_mixture_share`, `random_search_candidates`), `task` (with a `train`
    split), `k` (the number of public sources), `higher_is_better` and the abstract stages below;
    this class splits the data, runs the five methods, stores each run's result and composes the
    budgets.
    """

    higher_is_better: bool
    unit_name: str = "units"  # what the δ check counts (e.g. "patients"), for its message

    def __init__(
        self,
        task: Any,
        config: Any,
        root: str | os.PathLike,
        *,
        on_stage: Callable[[str], None] | None = None,
        reproducible: bool = False,
    ):
        """Args:
        task: the data.
        config: public settings.
        root: directory of the stage store (one sub-directory per seed).
        on_stage: called with a stage name whenever a stage is computed (not when it is
            loaded); for progress reports and tests.
        reproducible: derive the private randomness (split key, noise keys, Poisson sampling)
            from each run's seed, so runs reproduce exactly but are not private against anyone
            who knows the seed. False (default): a run's seed only numbers the repetition and
            its private randomness comes from a secret drawn from the operating system.
        """
        self.task = task
        self.config = config
        self.root = pathlib.Path(root)
        self._stage_callback = on_stage
        self._listeners: list[ProgressListener] = []
        self.reproducible = bool(reproducible)

    def add_listener(self, listener: ProgressListener) -> None:
        """Reports stages, training steps and reused runs to `listener` (a progress bar)."""
        self._listeners.append(listener)

    def remove_listener(self, listener: ProgressListener) -> None:
        self._listeners.remove(listener)

    def _on_stage(self, name: str) -> None:
        interrupt.raise_if_interrupted()
        if self._stage_callback is not None:
            self._stage_callback(name)
        for listener in self._listeners:
            listener.stage(name)

    def _on_step(self, done: int, total: int) -> None:
        for listener in self._listeners:
            listener.step(done, total)

    @property
    @abc.abstractmethod
    def k(self) -> int:
        """The number of public sources."""

    @abc.abstractmethod
    def mixture_inputs(self, seed: int) -> dict[str, Any]:
        """D_mix's cached proxy outputs as keyword arguments of `mixing.dp_mixmin`: `preds`,
        `kind` and, where the kind or level needs them, `lengths` and `user_ids`."""

    @abc.abstractmethod
    def pretrained(self, weights: np.ndarray | None, seed: int) -> Any:
        """The downstream model pretrained on λ (fresh initialisation for None)."""

    @abc.abstractmethod
    def split_unit_ids(self) -> Sequence[Any] | np.ndarray:
        """Per train row, the stable id (int, str or bytes) of the unit that D_mix and D_ft must
        not share: the patient or user where rows are grouped, else the row's own identity in the
        source data (never its position after filtering or shuffling)."""

    @abc.abstractmethod
    def finetune_trainer(
        self, init: Any, config: TrainConfig, rows: np.ndarray, noise_key: jax.Array
    ) -> tuple[Trainer, IndexedData]:
        """The DP trainer and its data for fine-tuning `init` on the train rows `rows`.

        Privacy: the data holds the sensitive rows; the trainer's `num_units` must count the
        privacy units among them (examples, or users at user level).
        """

    @abc.abstractmethod
    def utility(self, model: Any, split: str) -> float:
        """The metric on the "val" or "test" split (evaluation only, not released)."""

    @abc.abstractmethod
    def data_digest(self) -> str:
        """SHA-256 (hex) of the data's content: every row of every split and the public data,
        with what groups them into units. One changed label changes it.

        Privacy: a deterministic function of the sensitive data; it is stored only in the
        owner-only `settings.json` and enters folder names only keyed (`settings_fingerprint`).
        """

    @functools.cached_property
    def _content_digest(self) -> str:
        return self.data_digest()

    def dataset_identity(self) -> dict[str, Any]:
        """What identifies the data: the task's name, k, every split's size and the digest of
        the content (`data_digest`). Part of `settings_fingerprint`."""
        identity: dict[str, Any] = {
            "pipeline": type(self).__name__,
            "k": self.k,
            "content": self._content_digest,
        }
        for attribute in ("name", "source_names"):
            identity[attribute] = getattr(self.task, attribute, None)
        for split in ("train", "val", "test", "public"):
            part = getattr(self.task, split, None)
            identity[f"{split}_size"] = None if part is None else len(part)
        domains = getattr(self.task, "public_domains", None)
        if domains is not None:
            identity["public_domain_sizes"] = {name: len(docs) for name, docs in domains.items()}
        return identity

    def _config_settings(self) -> dict[str, Any]:
        """The full config without the composition: every stage that depends on the
        composition has it in its name, so the stages that do not (tokenizer, proxies,
        pretraining) are shared by both compositions."""
        config = canonical_form(self.config)
        config.pop("composition")
        return config

    def settings(self) -> dict[str, Any]:
        """Everything besides (method, ε, seed) that determines a stored stage: the data set's
        identity (content included), the full config, whether the randomness is seeded, and the
        code (`code_fingerprint`)."""
        return {
            "dataset": self.dataset_identity(),
            "config": self._config_settings(),
            "reproducible": self.reproducible,
            "code": code_fingerprint(),
        }

    @functools.cached_property
    def settings_fingerprint(self) -> str:
        """HMAC-SHA-256 (hex) of `settings()` under the store's key (`root/store_key`): names
        the folder of this pipeline's stage store.

        Privacy: the settings hold a digest of the sensitive data, which anyone could test
        candidate data sets against; keyed, the name reveals nothing without the owner-only key.
        """
        return hmac.new(
            self._store_key(), canonical_json(self.settings()).encode(), "sha256"
        ).hexdigest()

    def _store_key(self) -> bytes:
        """The stage store's 256-bit key, drawn once and kept owner-only at `root/store_key`."""
        if not self.root.exists():
            folders.private_folder(self.root)
        path = self.root / "store_key"
        if not parallel.agree(path.exists()):
            parallel.on_main_process(lambda: folders.write_private(path, secrets.token_hex(32)))
        try:
            return bytes.fromhex(path.read_text().strip())
        except (OSError, UnicodeDecodeError, ValueError) as err:
            raise ValueError(
                f"{path} is not a store key ({err}); delete it (every stage under {self.root} "
                "is then recomputed)"
            ) from err

    def settings_folder(self) -> pathlib.Path:
        """`root/<settings fingerprint>/`: where everything stored under these settings lives,
        described by the `settings.json` in it (owner-only)."""
        folder = self.root / self.settings_fingerprint[:16]
        description = folder / "settings.json"
        if not parallel.agree(description.exists()):
            text = canonical_json(self.settings(), indent=1)
            parallel.on_main_process(lambda: folders.write_private(description, text))
        return folder

    def _store(self, seed: int) -> StageStore:
        """The stage store of run `seed` under these settings: `settings_folder()/seed<seed>`.

        Its stages are named by stage, composition, method and exact ε, so a stored result is
        only ever read back by a run with the same data, config (δ included), seed mode and
        code; other settings get a folder of their own.
        """
        return StageStore(self.settings_folder() / f"seed{seed}")

    def stage_folder(self, seed: int) -> pathlib.Path:
        """The folder of run `seed`'s stored stages (see `_store`)."""
        return self._store(seed).root

    @functools.cached_property
    def config_key(self) -> str:
        """A fingerprint of the full config (composition aside), for the names of noise streams:
        with `reproducible`, two configs run with one seed must not share noise either."""
        return fingerprint(self._config_settings())

    def private_seed(self, seed: int, *names: object) -> int:
        """The seed of one named private random stream (split key, noise key, Poisson sampler)
        of run `seed`.

        `names` must name everything that defines the stream's stage, so that no two stages
        share noise: noisy stages pass their stage name (composition, exact ε, initialisation)
        and `config_key`. With `reproducible` it is `derived_seed(seed, *names)`. Otherwise it
        derives (128 bits) from the run's secret, drawn once from the operating system and kept
        in the stage store (of these settings) as `secret_randomness.json` (owner-only), so a
        resumed run continues its own streams.

        Privacy: the secret file is as sensitive as the data (with it the noise can be
        recomputed); it is never logged or copied into results. The streams never depend on the
        data's content: the split key must not move a unit when another one is added.
        """
        if self.reproducible:
            return derived_seed(seed, *names)
        path = self._store(seed).root / "secret_randomness.json"
        secret = ""
        if parallel.is_main_process():
            if not path.exists():
                content = {
                    "secret": f"{randomness.secret_seed():032x}",
                    "note": "SENSITIVE: the root of this run's noise, sampling and split; never "
                    "share.",
                }
                folders.write_private(path, json.dumps(content))
            try:
                secret = json.loads(path.read_text())["secret"]
                int(secret, 16)
            except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as err:
                raise ValueError(
                    f"{path} is not a run secret ({err}); delete the folder {path.parent} to "
                    "recompute the run"
                ) from err
        # A multi-process run: every process derives its streams from process 0's secret.
        secret = f"{randomness.agree_secret(int(secret or '0', 16)):032x}"
        text = "/".join(str(n) for n in (secret, *names))
        return int.from_bytes(hashlib.sha256(text.encode()).digest()[:16], "little")

    def split(self, seed: int) -> tuple[np.ndarray, np.ndarray]:
        """Disjoint (D_mix, D_ft) positions of the sensitive train split, disjoint in the units of
        `split_unit_ids`; with sequential composition both are the whole split.

        Privacy: each unit's part is a keyed hash of its id (`split_mixture`), the key a private
        stream of the run (`private_seed`), so the two parts' stages compose in parallel under
        add/remove at the level's unit.
        """
        if self.config.composition == "sequential":
            everything = np.arange(len(self.task.train))
            return everything, everything

        def compute():
            self._on_stage("split")
            mix, ft = split_mixture(
                self.split_unit_ids(),
                self.config.mix_fraction,
                key=self.private_seed(seed, "split"),
            )
            return {"mix": mix, "ft": ft}

        stored = self._store(seed).json("split", compute, check=self._check_split)
        return np.asarray(stored["mix"], np.int64), np.asarray(stored["ft"], np.int64)

    def check_delta(self, seed: int) -> None:
        """Refuses δ >= 1/n for the n units of either private stage, before any work.

        D_mix (DP-MixMin) and D_ft (fine-tuning) each count their own units, the level's unit
        (examples, or users); Uniform, Random Init and non-private MixMin fine-tune on the whole
        train split, which is larger. `allow_large_delta` lets such a δ through.

        Privacy: an (ε, δ) guarantee with δ >= 1/n allows publishing one unit in the clear.
        """
        unit_ids = np.asarray(self.split_unit_ids())
        for part, rows in zip(("D_mix", "D_ft"), self.split(seed), strict=True):
            validation.check_delta_for_units(
                self.config.delta,
                len(np.unique(unit_ids[rows])),
                unit=f"{self.unit_name} in {part}",
                name="delta",
                allow_large_delta=self.config.allow_large_delta,
            )

    def _check_split(self, stored: Mapping[str, Any]) -> None:
        """Raises a ValueError unless `stored` holds two disjoint sets of train positions.

        Privacy: the parallel composition of the two stages needs D_mix ∩ D_ft = ∅.
        """
        n = len(self.task.train)
        parts = {}
        for part in ("mix", "ft"):
            rows = np.asarray(stored[part])
            if rows.ndim != 1 or not np.issubdtype(rows.dtype, np.integer) or len(rows) == 0:
                raise ValueError(f"D_{part} is not a non-empty list of row positions")
            if rows.min() < 0 or rows.max() >= n or len(np.unique(rows)) != len(rows):
                raise ValueError(f"D_{part} holds positions outside [0, {n}) or repeats")
            parts[part] = rows
        if shared := len(np.intersect1d(parts["mix"], parts["ft"])):
            raise ValueError(f"D_mix and D_ft share {shared} rows; they must be disjoint")

    def finetune(
        self, init: Any, init_name: str, part: str, epsilon: float, seed: int
    ) -> tuple[Any, accounting.PrivacyBudget]:
        """DP fine-tuning (`finetune_with_ledger`), with the (ε, δ) its ledger reports.

        Privacy: as `finetune_with_ledger`.
        """
        model, ledger = self.finetune_with_ledger(init, init_name, part, epsilon, seed)
        return model, ledger.budget(self.config.delta, self.config.finetune.accountant)

    def finetune_with_ledger(
        self, init: Any, init_name: str, part: str, epsilon: float, seed: int
    ) -> tuple[Any, accounting.PrivacyLedger]:
        """DP fine-tuning from `init` on D_ft (`part="ft"`) or the whole train split (`"all"`).

        Privacy: DP-SGD at (ε, δ) on the chosen part (`finetune_trainer`); the returned ledger
        holds the steps executed (restored, not re-spent, on resume). The noise key is
        distinct for every (init, part, composition, ε), a private stream of the run
        (`private_seed`). While it runs, the stage folder holds one owner-only checkpoint
        (`checkpoints/`, with the noise key and sampler, to resume); once finished, only the
        parameters and the ledger (`final/`), and a rerun reads them back.
        """
        _, ft = self.split(seed)
        rows = ft if part == "ft" else np.arange(len(self.task.train))
        part = f"{part}_{self.config.composition}" if part == "ft" else part
        config = dataclasses.replace(
            self.config.finetune,
            epsilon=epsilon,
            delta=self.config.delta,
            allow_large_delta=self.config.allow_large_delta,
        )
        name = f"finetune_{init_name}_{part}_eps{epsilon_name(epsilon)}"
        folder = self._store(seed).path(name)
        noise_key = randomness.prng_key(self.private_seed(seed, name, self.config_key))
        trainer, data = self.finetune_trainer(init, config, rows, noise_key)
        running, final = folder / "checkpoints", folder / "final"
        if not self._has_checkpoint(final):  # `final/` appears only once it is complete
            self._on_stage("finetune")
            checkpointer = Checkpointer(running)
            rng = np.random.default_rng(self.private_seed(seed, name, self.config_key, "sampler"))
            result = fit(trainer, data, rng=rng, checkpointer=checkpointer, on_step=self._on_step)
            checkpointer.close()
            partial = folder / "final.partial"
            parallel.on_main_process(lambda: shutil.rmtree(partial, ignore_errors=True))
            saver = Checkpointer(partial)
            saver.save(config.steps, result.state.params, rng=None, ledger=result.ledger)
            saver.close()
            parallel.on_main_process(lambda: partial.rename(final))
        parallel.on_main_process(lambda: shutil.rmtree(running, ignore_errors=True))
        template = trainer.init_state()
        reader = Checkpointer(final)
        params, _, ledger = reader.restore(template.params)
        reader.close()
        model = trainer.model(TrainState(template.step, params, template.opt_state))
        return model, ledger

    @staticmethod
    def _has_checkpoint(folder: pathlib.Path) -> bool:
        """Whether `folder` holds a committed checkpoint; an emptied one (its damaged checkpoint
        deleted, as the error asked) is removed so that the stage is recomputed."""
        if not parallel.agree(folder.is_dir()):
            return False
        checkpointer = Checkpointer(folder)
        found = checkpointer.latest_step() is not None
        checkpointer.close()
        if not found:
            parallel.on_main_process(lambda: shutil.rmtree(folder, ignore_errors=True))
        return found

    def mixture(self, epsilon: float, seed: int) -> tuple[np.ndarray, accounting.PrivacyBudget]:
        """λ by DP-MixMin on D_mix at (ε, δ), and the budget its accountant reports.

        Privacy: reads D_mix only through `dp_mixmin` (Poisson-sampled examples, or users with up
        to G examples each, clipped, Gaussian noise), accounted for the rate, σ and steps it ran.
        Its noise and sampling are the private stream of the stage's full name (composition and
        exact ε), shared with no other stage.
        """
        weights, _, spent = self._mixture(epsilon, seed)
        return weights, spent

    def _mixture(
        self, epsilon: float, seed: int
    ) -> tuple[np.ndarray, accounting.PrivacyLedger, accounting.PrivacyBudget]:
        """`mixture`'s λ and budget, with the ledger of the steps it ran (stored with them)."""
        settings = self.config.mixture
        name = f"mixture_{self.config.composition}_eps{epsilon_name(epsilon)}"

        def compute():
            inputs = self.mixture_inputs(seed)
            self._on_stage("mixture")
            user_level = inputs.get("user_ids") is not None
            result = dp_mixmin(
                **inputs,
                max_examples_per_user=settings.max_examples_per_user if user_level else None,
                epsilon=epsilon,
                delta=self.config.delta,
                steps=settings.steps,
                batch_size=settings.batch_size,
                clip_norm=settings.clip_norm,
                learning_rate=settings.learning_rate,
                seed=self.private_seed(seed, name, self.config_key),
                solver=settings.solver,
                shift=settings.shift,
                accountant=settings.accountant,
                allow_large_delta=self.config.allow_large_delta,
                noise=settings.noise,
                bands=settings.bands,
                adaptive_clipping=settings.adaptive_clipping,
            )
            return {
                "weights": result.weights,
                "spent": budget_to_json(accounting.PrivacyBudget(result.epsilon, result.delta)),
                "noise_multiplier": result.noise_multiplier,
                "sampling_rate": result.sampling_rate,
                "num_units": result.num_units,
                "ledger": result.ledger.state_dict(),
            }

        stored = self._store(seed).json(name, compute)
        return (
            np.asarray(stored["weights"]),
            accounting.PrivacyLedger.from_state_dict(stored["ledger"]),
            budget_from_json(stored["spent"]),
        )

    def nonprivate_weights(self, seed: int) -> np.ndarray:
        """λ by exact MixMin on D_mix.

        Privacy: NOT private (no clipping, no noise): the labelled upper-bound baseline only.
        """

        def compute():
            inputs = self.mixture_inputs(seed)
            inputs.pop("user_ids", None)
            self._on_stage("nonprivate_mixture")
            weights = mixmin(**inputs, steps=self.config.mixture.nonprivate_steps)
            return {"weights": np.asarray(weights)}

        name = f"mixture_nonprivate_{self.config.composition}"
        return np.asarray(self._store(seed).json(name, compute)["weights"])

    def run(self, method: Method, epsilon: float, seed: int) -> RunResult:
        """One method at target ε (end to end) and one seed; stored, so a rerun is free.

        Privacy: the result's `spent` is the accountants' (ε, δ) for what ran, composed as
        configured; `private` is False for random search and non-private MixMin.
        """
        validation.check_epsilon(epsilon)
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}.")
        self.check_delta(seed)
        name = f"run_{method}_{self.config.composition}_eps{epsilon_name(epsilon)}"
        computed = False

        def compute():
            nonlocal computed
            computed = True
            return self._run(method, epsilon, seed).to_json()

        stored = self._store(seed).json(name, compute)
        if not computed:
            for listener in self._listeners:
                listener.reused(name)
        return RunResult.from_json(stored)

    @property
    def end_to_end_accountant(self) -> accounting.Accountant:
        """The accountant of the end-to-end ε: the stages' when they agree, else PLD."""
        mixture, finetune = self.config.mixture.accountant, self.config.finetune.accountant
        return finetune if mixture == finetune else "pld"

    def _run(self, method: str, epsilon: float, seed: int) -> RunResult:
        if method == "random_search":
            return self._random_search(epsilon, seed)
        composition = self.config.composition
        stages, ledgers = {}, {}
        if method == "dp_mixmin":
            mix_epsilon, ft_epsilon = stage_epsilons(
                epsilon, composition, self.config.sequential_mixture_share
            )
            weights, ledgers["mixture"], stages["mixture"] = self._mixture(mix_epsilon, seed)
            part = "ft"
        else:
            ft_epsilon, part = epsilon, "all"
            weights = {
                "uniform": lambda: np.full(self.k, 1.0 / self.k),
                "random_init": lambda: None,
                "nonprivate_mixmin": lambda: self.nonprivate_weights(seed),
            }[method]()
        init = self.pretrained(weights, seed)
        model, ledgers["finetune"] = self.finetune_with_ledger(
            init, weights_key(weights), part, ft_epsilon, seed
        )
        stages["finetune"] = ledgers["finetune"].budget(
            self.config.delta, self.config.finetune.accountant
        )
        return RunResult(
            method=method,
            epsilon=epsilon,
            delta=self.config.delta,
            seed=seed,
            utility=self.utility(model, "test"),
            weights=None if weights is None else [float(w) for w in weights],
            spent=end_to_end_budget(
                ledgers,
                composition,
                delta=self.config.delta,
                accountant=self.end_to_end_accountant,
            ),
            stages=stages,
            composition=composition,
            private=method != "nonprivate_mixmin",
            seeded=self.reproducible,
            allow_large_delta=self.config.allow_large_delta,
        )

    def _random_search(self, epsilon: float, seed: int) -> RunResult:
        candidates = dirichlet_candidates(
            self.k, self.config.random_search_candidates, seed=derived_seed(seed, "candidates")
        )
        scored = []
        for weights in candidates:
            init = self.pretrained(weights, seed)
            model, ledger = self.finetune_with_ledger(
                init, weights_key(weights), "ft", epsilon, seed
            )
            scored.append((self.utility(model, "val"), weights, model, ledger))
        pick = max if self.higher_is_better else min
        val_utility, weights, model, _ = pick(scored, key=lambda item: item[0])
        # All m candidates were fine-tuned on the same D_ft: what ran is the m-fold composition
        # of the fine-tuning events, accounted as one; the selection on validation data is not
        # accounted at all.
        spent = accounting.compose_ledgers(*(s[3] for s in scored)).budget(
            self.config.delta, self.config.finetune.accountant
        )
        return RunResult(
            method="random_search",
            epsilon=epsilon,
            delta=self.config.delta,
            seed=seed,
            utility=self.utility(model, "test"),
            weights=[float(w) for w in weights],
            spent=spent,
            stages={"finetune": spent},
            composition=self.config.composition,
            private=False,
            seeded=self.reproducible,
            allow_large_delta=self.config.allow_large_delta,
            extra={
                "validation_utilities": [s[0] for s in scored],
                "selected_validation_utility": val_utility,
            },
        )
