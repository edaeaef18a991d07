"""What every DP-MixMin pipeline shares: methods, settings, splits, stage storage and budgets.

A pipeline run is one (method, ε, seed) of one experiment. Its stages (split, proxy, mixture,
pretraining, fine-tuning, evaluation) store their results under a run directory; a rerun finds
them there and skips the work, so a killed pipeline resumes where it stopped and reports the same
budget (training stages resume mid-run from their orbax checkpoints, see `train.checkpoint`).

Stored stages are keyed by everything that determines them: they live under
`root/<fingerprint of the data's content, full config, seed mode and code>/seed<N>/` and are named
by stage, composition, method and exact ε, so other settings, other data (one changed label) or
other code (one changed line of the package) never read them back. The folder name is keyed by
`root/store_key` (owner-only), so it says nothing about the data to whoever can list `root`.

Everything under a settings folder is owner-only (folders 0700, files 0600): the split, the run's
secret, the proxy outputs and the running checkpoints reveal sensitive data, sampling or noise.
Every stage JSON holds the SHA-256 of its result; a file that does not match (edited, truncated)
is refused with one line naming it, never reused. A finished fine-tuning stage keeps only its
parameters and ledger (`final/`); its running checkpoints (noise key, sampler) are deleted.
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
from typing import Any, Literal, Protocol

import jax
import numpy as np

import dpmix_jax
from dpmix_jax import interrupt, parallel
from dpmix_jax.mixing import DEFAULT_SHIFT, dp_mixmin, mixmin
from dpmix_jax.pipeline import folders
from dpmix_jax.privacy import accounting, assign_parts, plan, randomness, validation
from dpmix_jax.privacy.adaptive_clipping import AdaptiveClipping
from dpmix_jax.train import Checkpointer, IndexedData, TrainConfig, Trainer, TrainState, fit
from dpmix_jax.train.checkpoint import json_checksum

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
        noise: "independent" (default) or "bandmf" (correlated noise, cyclic Poisson sampling;
            see `mixing.dp_mixmin`).
        bands: b for noise="bandmf" (1 <= b <= steps).
        adaptive_clipping: None, or adaptive clipping of the λ-gradients (`clip_norm` is then
            the initial C; same σ and ε, see `privacy.adaptive_clipping`).
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
    noise: plan.Noise = "independent"
    bands: int | None = None
    adaptive_clipping: AdaptiveClipping | None = None

    def __post_init__(self) -> None:
        validation.check_steps(self.steps)
        plan.check_noise_settings(self.noise, self.bands, self.steps)
        validation.check_steps(self.nonprivate_steps, "nonprivate_steps")
        validation.check_positive(self.batch_size, "batch_size")
        validation.check_positive(self.clip_norm, "clip_norm")
        if self.solver not in ("mirror_descent", "frank_wolfe"):
            raise ValueError(
                f"solver must be 'mirror_descent' or 'frank_wolfe', got {self.solver!r}."
            )
        if (self.learning_rate is None) != (self.solver == "frank_wolfe"):
            raise ValueError(
                "learning_rate is required for mirror descent and unused by Frank-Wolfe."
            )
        if self.adaptive_clipping is not None and not isinstance(
            self.adaptive_clipping, AdaptiveClipping
        ):
            raise ValueError(
                f"adaptive_clipping must be None or an AdaptiveClipping, got "
                f"{self.adaptive_clipping!r}."
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
        allow_large_delta: True when the run accepted a δ >= 1/n for some private stage's n
            units (the user's explicit override; such a δ protects nobody).
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
    allow_large_delta: bool = False

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
            allow_large_delta=data.get("allow_large_delta", False),
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
            "allow_large_delta": self.allow_large_delta,
        }


def check_allow_large_delta(value: Any) -> None:
    """Refuses an `allow_large_delta` setting that is not exactly True or False."""
    if not isinstance(value, bool):
        raise ValueError(f"allow_large_delta must be True or False, got {value!r}.")


def stage_epsilons(
    epsilon: float, composition: Composition, mixture_share: float
) -> tuple[float, float]:
    """Target ε of the mixture and fine-tuning stages for an end-to-end target ε.

    Parallel composition (disjoint D_mix and D_ft): both stages get the whole ε. Sequential
    composition (both stages on the same, unsplit data): ε_mix = share·ε, ε_ft = (1 - share)·ε
    (the paper's sequential setting is share = 0.1). The split calibrates each stage's noise
    by basic composition (the targets sum to ε); the reported end-to-end ε is the accountant's
    for the composition of the two stages' events (`end_to_end_budget`), at most ε.
    """
    validation.check_epsilon(epsilon)
    if composition == "parallel":
        return epsilon, epsilon
    if composition == "sequential":
        if not 0 < mixture_share < 1:
            raise ValueError(f"mixture_share must be in (0, 1), got {mixture_share!r}.")
        return mixture_share * epsilon, (1 - mixture_share) * epsilon
    raise ValueError(f"composition must be 'parallel' or 'sequential', got {composition!r}.")


def end_to_end_budget(
    ledgers: Mapping[str, accounting.PrivacyLedger],
    composition: Composition,
    *,
    delta: float,
    accountant: accounting.Accountant = "pld",
) -> accounting.PrivacyBudget:
    """The end-to-end (ε, δ) of a run's private stages, from their ledgers.

    Parallel composition (stages on disjoint splits): (max ε, δ) of the stages' ε at δ.
    Sequential composition (stages on the same data): the accountant's ε at δ of the
    composition of all the stages' events (`accounting.compose_ledgers`), not the sum of their
    ε. Both are computed by `accountant`.

    Privacy: parallel composition needs the stages' data disjoint in the privacy unit.
    """
    if not ledgers:
        raise ValueError("end_to_end_budget needs at least one stage ledger.")
    if composition == "parallel":
        return accounting.compose_parallel(
            *(ledger.budget(delta, accountant) for ledger in ledgers.values())
        )
    if composition == "sequential":
        return accounting.compose_ledgers(*ledgers.values()).budget(delta, accountant)
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


@functools.cache
def code_fingerprint() -> str:
    """SHA-256 (hex) of the package's source: every `.py` file under `dpmix_jax/`, by relative
    path and bytes. Computed once per process; part of `MixturePipeline.settings`, so a stage
    stored by other code is never read back (the version number does not change with a fix)."""
    package = pathlib.Path(dpmix_jax.__file__).parent
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        content = path.read_bytes()
        digest.update(f"{path.relative_to(package).as_posix()}/{len(content)}/".encode())
        digest.update(content)
    return digest.hexdigest()


class StageStore:
    """JSON results of pipeline stages under one owner-only directory; computed once, then read
    back after checking them.

    Each `NAME.json` is the result with one more key, `"sha256"`: the checksum of the rest as
    JSON with sorted keys (`train.checkpoint.json_checksum`).

    Privacy: the results include the split and proxy outputs on sensitive rows; every folder is
    0700 and every file 0600.
    """

    def __init__(self, root: str | os.PathLike):
        self.root = folders.private_folder(root)

    def path(self, *parts: str) -> pathlib.Path:
        """An owner-only sub-directory for a stage's own files (checkpoints), created if needed."""
        return folders.private_folder(self.root.joinpath(*parts))

    def json(
        self,
        name: str,
        compute: Callable[[], Mapping[str, Any]],
        check: Callable[[Mapping[str, Any]], None] | None = None,
    ) -> dict[str, Any]:
        """The stored result `name`, or `compute()` written atomically and returned.

        Args:
            name: the stage's file name, without `.json`.
            compute: what computes the result when none is stored.
            check: raises a ValueError (without the path) for a result that is not valid.

        Raises:
            ValueError: the stored file cannot be read, does not match its checksum, or fails
                `check`: one line naming it and saying to delete it to recompute.
            OSError: the result cannot be written (`folders.write_private`).
        """
        target = self.root / f"{name}.json"
        if parallel.agree(target.exists()):  # one decision for all processes of a run
            return self._read(target, check)
        result = json.loads(json.dumps(dict(compute()), default=_json_default))
        content = {**result, "sha256": json_checksum(result)}
        parallel.on_main_process(  # a multi-process run: process 0 writes, all wait
            lambda: folders.write_private(target, json.dumps(content, indent=1))
        )
        return self._read(target, check)

    @staticmethod
    def _read(
        target: pathlib.Path, check: Callable[[Mapping[str, Any]], None] | None
    ) -> dict[str, Any]:
        def refuse(problem: str) -> ValueError:
            return ValueError(f"stage file {target} {problem}; delete it to recompute the stage")

        try:
            content = json.loads(target.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise refuse(f"cannot be read ({err})") from err
        if not isinstance(content, dict):
            raise refuse("is not a stage result")
        expected = content.pop("sha256", None)
        if json_checksum(content) != expected:
            raise refuse("does not match its checksum (edited or damaged)")
        if check is not None:
            try:
                check(content)
            except (KeyError, TypeError, ValueError) as err:
                raise refuse(f"is not valid ({err})") from err
        return content


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
        config = _canonical(self.config)
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
