"""What every DP-MixMin pipeline shares: methods, settings, splits, stage storage and budgets.

A pipeline run is one (method, ε, seed) of one experiment. Its stages (split, proxy, mixture,
pretraining, fine-tuning, evaluation) store their results under a run directory; a rerun finds
them there and skips the work, so a killed pipeline resumes where it stopped and reports the same
budget (training stages resume mid-run from their orbax checkpoints, see `train.checkpoint`).
Stored stages are keyed by everything that determines them: they live under
`root/<fingerprint of data set, full config, seed mode and package version>/seed<N>/` and are
named by stage, method and exact ε, so other settings never read them back.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import os
import pathlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, Protocol

import jax
import numpy as np

from dpmix_jax import parallel
from dpmix_jax.mixing import DEFAULT_SHIFT, dp_mixmin, mixmin
from dpmix_jax.privacy import accounting, assign_parts, randomness
from dpmix_jax.train import Checkpointer, IndexedData, TrainConfig, Trainer, fit

Method = Literal["dp_mixmin", "uniform", "random_init", "random_search", "nonprivate_mixmin"]
METHODS: tuple[Method, ...] = (
    "dp_mixmin",
    "uniform",
    "random_init",
    "random_search",
    "nonprivate_mixmin",
)
Composition = Literal["parallel", "sequential"]

# What each method reads of the sensitive train split, and whether its λ is private.
METHOD_NOTES: Mapping[str, str] = {
    "dp_mixmin": "λ by DP-MixMin on D_mix, pretrain on λ, DP fine-tune on D_ft (disjoint)",
    "uniform": "λ = 1/k, pretrain on λ, DP fine-tune on all of the train split",
    "random_init": "no pretraining, DP fine-tune on all of the train split",
    "random_search": (
        "Dirichlet(1) candidates, each pretrained and DP fine-tuned on D_ft; the best is picked "
        "on the validation split NON-PRIVATELY (overstates what a private search achieves)"
    ),
    "nonprivate_mixmin": (
        "λ by exact MixMin on D_mix (NOT private: an upper bound), DP fine-tune on all of train"
    ),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class MixtureConfig:
    """Public settings of the DP-MixMin stage (see `mixing.dp_mixmin`).

    Attributes:
        steps: T, mirror-descent (or Frank-Wolfe) steps.
        batch_size: expected examples (or users, at user level) per step.
        clip_norm: C of the per-unit λ-gradient.
        learning_rate: η (None for Frank-Wolfe).
        solver: "mirror_descent" or "frank_wolfe".
        shift: per-example gradient shift before clipping.
        max_examples_per_user: G for user-level runs.
        accountant: "pld" or "rdp".
        nonprivate_steps: steps of the exact (non-private) MixMin baseline.
    """

    steps: int
    batch_size: float
    clip_norm: float
    learning_rate: float | None
    solver: str = "mirror_descent"
    shift: str = DEFAULT_SHIFT
    max_examples_per_user: int | None = None
    accountant: accounting.Accountant = "pld"
    nonprivate_steps: int = 300

    def __post_init__(self) -> None:
        accounting.check_steps(self.steps)
        accounting.check_steps(self.nonprivate_steps, "nonprivate_steps")
        accounting.check_positive(self.batch_size, "batch_size")
        accounting.check_positive(self.clip_norm, "clip_norm")
        if self.solver not in ("mirror_descent", "frank_wolfe"):
            raise ValueError(
                f"solver must be 'mirror_descent' or 'frank_wolfe', got {self.solver!r}."
            )
        if (self.learning_rate is None) != (self.solver == "frank_wolfe"):
            raise ValueError(
                "learning_rate is required for mirror descent and unused by Frank-Wolfe."
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunResult:
    """One (method, ε, seed) of an experiment.

    Attributes:
        method: one of `METHODS`.
        epsilon: the target ε of the run.
        delta: δ.
        seed: the run's seed.
        utility: the experiment's metric on the test split.
        weights: the λ the run pretrained on (None for random init).
        spent: the end-to-end (ε, δ) the accountants report for what ran.
        stages: per-stage spent budgets ("mixture", "finetune").
        composition: how the stages' budgets were combined.
        private: False when some choice used sensitive data without accounting (random search's
            selection, non-private MixMin's λ).
        seeded: True when the run's seed drove its private randomness (split, noise, sampling):
            reproducible, and not private against anyone who knows the seed
            (`privacy.SEEDED_NOTE`). False: the randomness was a secret from the operating
            system and `seed` only numbers the repetition.
        extra: method-specific details (validation scores of candidates, σ, ...).
    """

    method: str
    epsilon: float
    delta: float
    seed: int
    utility: float
    weights: list[float] | None
    spent: accounting.PrivacyBudget
    stages: Mapping[str, accounting.PrivacyBudget]
    composition: Composition
    private: bool
    seeded: bool
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RunResult:
        """The inverse of `to_json`."""
        delta = float(data["delta"])
        return cls(
            method=data["method"],
            epsilon=data["epsilon"],
            delta=delta,
            seed=data["seed"],
            utility=data["utility"],
            weights=data["weights"],
            spent=accounting.PrivacyBudget(data["spent_epsilon"], data["spent_delta"]),
            stages={
                k: accounting.PrivacyBudget(v, delta) for k, v in data["stage_epsilons"].items()
            },
            composition=data["composition"],
            private=data["private"],
            seeded=data.get("noise_seeded", True),  # results stored before secret randomness
            extra=data["extra"],
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "epsilon": self.epsilon,
            "delta": self.delta,
            "seed": self.seed,
            "utility": self.utility,
            "weights": self.weights,
            "spent_epsilon": self.spent.epsilon,
            "spent_delta": self.spent.delta,
            "stage_epsilons": {k: v.epsilon for k, v in self.stages.items()},
            "composition": self.composition,
            "private": self.private,
            "noise_seeded": self.seeded,
            "extra": dict(self.extra),
        }


def stage_epsilons(
    epsilon: float, composition: Composition, mixture_share: float
) -> tuple[float, float]:
    """Target ε of the mixture and fine-tuning stages for an end-to-end target ε.

    Parallel composition (disjoint D_mix and D_ft): both stages get the whole ε. Sequential
    composition (both stages on the same, unsplit data): ε_mix = share·ε, ε_ft = (1 - share)·ε
    (the paper's sequential setting is share = 0.1).
    """
    accounting.check_epsilon(epsilon)
    if composition == "parallel":
        return epsilon, epsilon
    if composition == "sequential":
        if not 0 < mixture_share < 1:
            raise ValueError(f"mixture_share must be in (0, 1), got {mixture_share!r}.")
        return mixture_share * epsilon, (1 - mixture_share) * epsilon
    raise ValueError(f"composition must be 'parallel' or 'sequential', got {composition!r}.")


def end_to_end_budget(
    stages: Mapping[str, accounting.PrivacyBudget], composition: Composition
) -> accounting.PrivacyBudget:
    """Parallel composition (max, max) over disjoint splits, or sequential (sums) over the same."""
    if composition == "parallel":
        return accounting.compose_parallel(*stages.values())
    if composition == "sequential":
        return accounting.compose_sequential(*stages.values())
    raise ValueError(f"composition must be 'parallel' or 'sequential', got {composition!r}.")


def split_mixture(
    unit_ids: Sequence[Any] | np.ndarray, mix_fraction: float, *, key: bytes | int
) -> tuple[np.ndarray, np.ndarray]:
    """Disjoint (D_mix, D_ft) row positions: each unit's rows go to D_mix with probability ρ.

    Args:
        unit_ids: per row, the stable id of its privacy unit (the example's own id, or its
            user's or patient's id: rows of one unit always land in the same part).
        mix_fraction: ρ.
        key: the part-assignment key (`privacy.assign_parts`).

    Privacy: a unit's part is a keyed hash of its id alone (`privacy.assign_parts`), never a
    function of the other units, so adding or removing a unit moves no other unit and the two
    parts' budgets compose in parallel under add/remove.
    """
    if not 0 < mix_fraction < 1:
        raise ValueError(f"mix_fraction (ρ) must be in (0, 1), got {mix_fraction!r}.")
    parts = assign_parts(unit_ids, (mix_fraction, 1 - mix_fraction), key=key)
    mix, ft = np.flatnonzero(parts == 0), np.flatnonzero(parts == 1)
    if len(mix) == 0 or len(ft) == 0:
        raise ValueError(
            f"ρ = {mix_fraction} left a part of the {len(parts)} rows empty; change ρ."
        )
    return mix, ft


def dirichlet_candidates(k: int, count: int, *, seed: int) -> np.ndarray:
    """`count` mixture candidates λ ~ Dirichlet(1, ..., 1) over k sources (random search)."""
    return np.random.default_rng(seed).dirichlet(np.ones(k), size=count)


def derived_seed(seed: int, *names: object) -> int:
    """A 32-bit seed for one named use of the run seed (a different stream per full name).

    Every noisy stage derives its noise key and sampler seed from its own name, including the
    target ε, so runs at different ε or from different initialisations never share noise.
    """
    text = "/".join(str(n) for n in (seed, *names))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "little")


def weights_key(weights: np.ndarray | None) -> str:
    """A short stable name for a λ (stage directories are shared between runs with equal λ)."""
    if weights is None:
        return "none"
    rounded = np.round(np.asarray(weights, dtype=np.float64), 10)
    return hashlib.sha256(rounded.tobytes()).hexdigest()[:12]


def epsilon_name(epsilon: float) -> str:
    """ε exactly as it is (`repr`), for stage names: 1.0000004 and 1 are different runs."""
    return repr(float(epsilon))


def canonical_json(value: Any, **kwargs: Any) -> str:
    """`value` as JSON with sorted keys: dataclasses as their fields plus their type's name,
    floats exact (repr), NumPy values and dtypes as lists and strings."""
    return json.dumps(_canonical(value), sort_keys=True, **kwargs)


def fingerprint(value: Any) -> str:
    """SHA-256 (hex) of `canonical_json(value)`."""
    return hashlib.sha256(canonical_json(value).encode()).hexdigest()


def _canonical(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: _canonical(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return {"__type__": type(value).__qualname__, **fields}
    if isinstance(value, Mapping):
        return {str(k): _canonical(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_canonical(v) for v in value]
    if isinstance(value, np.ndarray | np.generic):
        return _canonical(value.tolist())
    if isinstance(value, np.dtype | type):
        return str(value)
    if isinstance(value, pathlib.PurePath):
        return str(value)
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise TypeError(f"cannot fingerprint a {type(value).__name__} setting: {value!r}")


def _package_version() -> str | None:
    try:
        return importlib.metadata.version("dpmix_jax")
    except importlib.metadata.PackageNotFoundError:
        return None


class StageStore:
    """JSON results of pipeline stages under one directory; computed once, then read back."""

    def __init__(self, root: str | os.PathLike):
        self.root = pathlib.Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, *parts: str) -> pathlib.Path:
        """A sub-directory for a stage's own files (checkpoints), created if needed."""
        path = self.root.joinpath(*parts)
        path.mkdir(parents=True, exist_ok=True)
        return path

    def json(self, name: str, compute: Callable[[], Mapping[str, Any]]) -> dict[str, Any]:
        """The stored result `name`, or `compute()` written atomically and returned."""
        target = self.root / f"{name}.json"
        if parallel.agree(target.exists()):  # one decision for all processes of a run
            return json.loads(target.read_text())
        result = dict(compute())

        def write():
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(result, indent=1, default=_json_default))
            tmp.replace(target)

        parallel.on_main_process(write)  # a multi-process run: process 0 writes, all wait
        return json.loads(target.read_text())


def use_compilation_cache(directory: str | os.PathLike) -> None:
    """Points JAX's persistent compilation cache (a process-wide setting) at `directory`, unless
    one is configured already: pipeline runs whose training steps share shapes and σ then compile
    once across runs and across reruns."""
    import jax

    if jax.config.jax_compilation_cache_dir is None:
        jax.config.update("jax_compilation_cache_dir", str(pathlib.Path(directory).absolute()))


def _json_default(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"cannot store {type(value).__name__} as JSON")


def budget_to_json(budget: accounting.PrivacyBudget) -> dict[str, float]:
    return {"epsilon": budget.epsilon, "delta": budget.delta}


def budget_from_json(data: Mapping[str, float]) -> accounting.PrivacyBudget:
    return accounting.PrivacyBudget(float(data["epsilon"]), float(data["delta"]))


class ProgressListener(Protocol):
    """What a progress display hears from a pipeline (see `MixturePipeline.add_listener`)."""

    def stage(self, name: str) -> None:
        """A stage (split, proxy, mixture, pretrain, finetune, ...) starts computing."""

    def step(self, done: int, total: int) -> None:
        """A training step of the current stage finished."""

    def reused(self, name: str) -> None:
        """A finished run was read back from the stage store instead of computed."""


class MixturePipeline(abc.ABC):
    """DP-MixMin and its baselines through one set of stages; subclasses provide the stages.

    A subclass defines `config` (with `delta`, `composition`, `mix_fraction`, `mixture`,
    `finetune`, `sequential_mixture_share`, `random_search_candidates`), `task` (with a `train`
    split), `k` (the number of public sources), `higher_is_better` and the abstract stages below;
    this class splits the data, runs the five methods, stores each run's result and composes the
    budgets.
    """

    higher_is_better: bool

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

    def dataset_identity(self) -> dict[str, Any]:
        """What identifies the data: the task's name, k and every split's size (subclasses may
        add more). Part of `settings_fingerprint`."""
        identity: dict[str, Any] = {"pipeline": type(self).__name__, "k": self.k}
        for attribute in ("name", "source_names"):
            identity[attribute] = getattr(self.task, attribute, None)
        for split in ("train", "val", "test", "public"):
            part = getattr(self.task, split, None)
            identity[f"{split}_size"] = None if part is None else len(part)
        domains = getattr(self.task, "public_domains", None)
        if domains is not None:
            identity["public_domain_sizes"] = {name: len(docs) for name, docs in domains.items()}
        return identity

    def settings(self) -> dict[str, Any]:
        """Everything besides (method, ε, seed) that determines a stored stage: the data set's
        identity, the full config, whether the randomness is seeded, and the package version.

        The composition is left out: every stage that depends on it has it in its name, so the
        stages that do not (tokenizer, proxies, pretraining) are shared by both compositions.
        """
        config = _canonical(self.config)
        config.pop("composition")
        return {
            "dataset": self.dataset_identity(),
            "config": config,
            "reproducible": self.reproducible,
            "version": _package_version(),
        }

    @functools.cached_property
    def settings_fingerprint(self) -> str:
        """A SHA-256 (hex) of `settings()`: names the folder of this pipeline's stage store."""
        return fingerprint(self.settings())

    def settings_folder(self) -> pathlib.Path:
        """`root/<settings fingerprint>/`: where everything stored under these settings lives,
        described by the `settings.json` in it."""
        folder = self.root / self.settings_fingerprint[:16]
        description = folder / "settings.json"
        if not parallel.agree(description.exists()):

            def write():
                folder.mkdir(parents=True, exist_ok=True)
                tmp = description.with_suffix(".json.tmp")
                tmp.write_text(canonical_json(self.settings(), indent=1))
                tmp.replace(description)

            parallel.on_main_process(write)
        return folder

    def _store(self, seed: int) -> StageStore:
        """The stage store of run `seed` under these settings: `settings_folder()/seed<seed>`.

        Its stages are named by stage, method and exact ε, so a stored result is only ever read
        back by a run with the same data set, config (δ included), seed mode and package
        version; other settings get a folder of their own.
        """
        return StageStore(self.settings_folder() / f"seed{seed}")

    def stage_folder(self, seed: int) -> pathlib.Path:
        """The folder of run `seed`'s stored stages (see `_store`)."""
        return self._store(seed).root

    def private_seed(self, seed: int, *names: object) -> int:
        """The seed of one named private random stream (split key, noise key, Poisson sampler)
        of run `seed`.

        With `reproducible` it is `derived_seed(seed, *names)`. Otherwise it derives (128 bits)
        from the run's secret, drawn once from the operating system and kept in the stage store
        as `secret_randomness.json` (owner-only), so a resumed run continues its own streams.

        Privacy: the secret file is as sensitive as the data (with it the noise can be
        recomputed); it is never logged or copied into results.
        """
        if self.reproducible:
            return derived_seed(seed, *names)
        path = self._store(seed).root / "secret_randomness.json"
        secret = ""
        if parallel.is_main_process():
            if not path.exists():
                tmp = path.with_suffix(".tmp")
                tmp.unlink(missing_ok=True)
                content = {
                    "secret": f"{randomness.secret_seed():032x}",
                    "note": "SENSITIVE: the root of this run's noise, sampling and split; never "
                    "share.",
                }
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "w") as f:
                    json.dump(content, f)
                tmp.replace(path)
            secret = json.loads(path.read_text())["secret"]
        # A multi-process run: every process derives its streams from process 0's secret.
        secret = f"{parallel.agree_int(int(secret or '0', 16)):032x}"
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

        stored = self._store(seed).json("split", compute)
        return np.asarray(stored["mix"], np.int64), np.asarray(stored["ft"], np.int64)

    def finetune(
        self, init: Any, init_name: str, part: str, epsilon: float, seed: int
    ) -> tuple[Any, accounting.PrivacyBudget]:
        """DP fine-tuning from `init` on D_ft (`part="ft"`) or the whole train split (`"all"`).

        Privacy: DP-SGD at (ε, δ) on the chosen part (`finetune_trainer`); the returned budget is
        the ledger's for the steps executed (restored, not re-spent, on resume). The noise key is
        distinct for every (init, part, ε), a private stream of the run (`private_seed`).
        """
        _, ft = self.split(seed)
        rows = ft if part == "ft" else np.arange(len(self.task.train))
        part = f"{part}_{self.config.composition}" if part == "ft" else part
        config = dataclasses.replace(self.config.finetune, epsilon=epsilon, delta=self.config.delta)
        name = f"finetune_{init_name}_{part}_eps{epsilon_name(epsilon)}"
        checkpointer = Checkpointer(self._store(seed).path(name))
        if checkpointer.latest_step() != config.steps:
            self._on_stage("finetune")
        noise_key = randomness.prng_key(self.private_seed(seed, name))
        trainer, data = self.finetune_trainer(init, config, rows, noise_key)
        rng = np.random.default_rng(self.private_seed(seed, name, "sampler"))
        result = fit(trainer, data, rng=rng, checkpointer=checkpointer, on_step=self._on_step)
        checkpointer.close()
        return result.model, result.ledger.budget(self.config.delta, config.accountant)

    def mixture(self, epsilon: float, seed: int) -> tuple[np.ndarray, accounting.PrivacyBudget]:
        """λ by DP-MixMin on D_mix at (ε, δ), and the budget its accountant reports.

        Privacy: reads D_mix only through `dp_mixmin` (Poisson-sampled examples, or users with up
        to G examples each, clipped, Gaussian noise), accounted for the rate, σ and steps it ran.
        """
        settings = self.config.mixture

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
                seed=self.private_seed(seed, "mixture", f"{epsilon:g}"),
                solver=settings.solver,
                shift=settings.shift,
                accountant=settings.accountant,
            )
            return {
                "weights": result.weights,
                "spent": budget_to_json(accounting.PrivacyBudget(result.epsilon, result.delta)),
                "noise_multiplier": result.noise_multiplier,
                "sampling_rate": result.sampling_rate,
                "num_units": result.num_units,
                "ledger": result.ledger.state_dict(),
            }

        name = f"mixture_{self.config.composition}_eps{epsilon_name(epsilon)}"
        stored = self._store(seed).json(name, compute)
        return np.asarray(stored["weights"]), budget_from_json(stored["spent"])

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
        accounting.check_epsilon(epsilon)
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}.")
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

    def _run(self, method: str, epsilon: float, seed: int) -> RunResult:
        if method == "random_search":
            return self._random_search(epsilon, seed)
        composition = self.config.composition
        stages = {}
        if method == "dp_mixmin":
            mix_epsilon, ft_epsilon = stage_epsilons(
                epsilon, composition, self.config.sequential_mixture_share
            )
            weights, stages["mixture"] = self.mixture(mix_epsilon, seed)
            part = "ft"
        else:
            ft_epsilon, part = epsilon, "all"
            weights = {
                "uniform": lambda: np.full(self.k, 1.0 / self.k),
                "random_init": lambda: None,
                "nonprivate_mixmin": lambda: self.nonprivate_weights(seed),
            }[method]()
        init = self.pretrained(weights, seed)
        model, stages["finetune"] = self.finetune(
            init, weights_key(weights), part, ft_epsilon, seed
        )
        return RunResult(
            method=method,
            epsilon=epsilon,
            delta=self.config.delta,
            seed=seed,
            utility=self.utility(model, "test"),
            weights=None if weights is None else [float(w) for w in weights],
            spent=end_to_end_budget(stages, composition),
            stages=stages,
            composition=composition,
            private=method != "nonprivate_mixmin",
            seeded=self.reproducible,
        )

    def _random_search(self, epsilon: float, seed: int) -> RunResult:
        candidates = dirichlet_candidates(
            self.k, self.config.random_search_candidates, seed=derived_seed(seed, "candidates")
        )
        scored = []
        for weights in candidates:
            init = self.pretrained(weights, seed)
            model, budget = self.finetune(init, weights_key(weights), "ft", epsilon, seed)
            scored.append((self.utility(model, "val"), weights, model, budget))
        pick = max if self.higher_is_better else min
        val_utility, weights, model, _ = pick(scored, key=lambda item: item[0])
        # All m candidates were fine-tuned on the same D_ft: what ran is their sequential
        # composition, and the selection on validation data is not accounted at all.
        spent = accounting.compose_sequential(*(s[3] for s in scored))
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
            extra={
                "validation_utilities": [s[0] for s in scored],
                "selected_validation_utility": val_utility,
            },
        )
