"""`synthesize` with individual (per-unit) accounting.

Every unit is its own in-context teacher (`ensemble.build_unit_ensemble`) and each is accounted
for on its own by a Rényi filter (`pate.individual`): a teacher whose vote agrees with the
public model's is not charged, and none is charged more than `charges_per_teacher` (M) times;
the ε reported is the per-unit guarantee of M Gaussian releases, fixed before the run.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from dpmix_jax.pate import individual
from dpmix_jax.privacy import accounting as privacy
from dpmix_jax.privacy import randomness, validation
from dpmix_jax.synthesis import public_models
from dpmix_jax.synthesis.ensemble import Ensemble
from dpmix_jax.synthesis.result import SynthesisResult, sample_fields

__all__ = [
    "ACCOUNTINGS",
    "INDIVIDUAL_ETA",
    "INDIVIDUAL_STEPS_PER_CHARGE",
    "check_individual_accounting",
    "default_charges_per_teacher",
    "synthesize_individual",
]

ACCOUNTINGS = ("standard", "individual")
# η of the threshold T = σ·sqrt(2·ln(V/η)) (`individual.threshold_for`): at a step, some token
# no teacher voted for passes T with probability at most η/2.
INDIVIDUAL_ETA = 0.01
# The default M is the longest run's steps divided by this factor (`default_charges_per_teacher`).
INDIVIDUAL_STEPS_PER_CHARGE = 4

# One compile per run shape: the config is static, the budget M a traced scalar.
_individual_step = jax.jit(individual.individual_step, static_argnames="config")


def default_charges_per_teacher(num_samples: int, max_new_tokens: int) -> int:
    """The default M of individual accounting: ceil(num_samples · max_new_tokens /
    `INDIVIDUAL_STEPS_PER_CHARGE`), a teacher charged at most at a quarter of the longest run's
    steps.

    Privacy:
        Public: a function of public settings only.
    """
    steps = validation.check_steps(num_samples, "num_samples") * validation.check_steps(
        max_new_tokens, "max_new_tokens"
    )
    return max(1, -(-steps // INDIVIDUAL_STEPS_PER_CHARGE))


def check_individual_accounting(
    *,
    accounting: str,
    charges_per_teacher: int | None,
    num_samples: int,
    max_new_tokens: int,
    method: str = "coordinated",
    aggregator: str = "confident_gnmax",
    threshold_fraction: float | None = None,
    max_retries: int = 0,
    public_fallback: bool = True,
    teachers: str = "in_context",
) -> int | None:
    """The M of a run (`charges_per_teacher`, or `default_charges_per_teacher` when None) with
    `accounting="individual"`, None otherwise; refuses in one line `charges_per_teacher`
    without individual accounting, an M outside 1 to num_samples · max_new_tokens, and the
    settings individual accounting does not apply to. `synthesize` and `dpmix generate` (before
    any model is loaded) call it.

    Privacy:
        Public: reads public settings only.
    """
    if accounting not in ACCOUNTINGS:
        raise ValueError(f"accounting must be one of {', '.join(ACCOUNTINGS)}, got {accounting!r}")
    if accounting != "individual":
        if charges_per_teacher is not None:
            raise ValueError("charges_per_teacher applies to accounting='individual'")
        return None
    refused = [
        (method != "coordinated", f"method={method!r} (it uses coordinated votes)"),
        (aggregator != "confident_gnmax", f"aggregator={aggregator!r} (it has its own)"),
        (threshold_fraction is not None, "threshold_fraction (T is set from σ and η)"),
        (max_retries != 0, "max_retries (a step never fails: it falls back to the public vote)"),
        (not public_fallback, "public_fallback=False (a token below T is the public vote)"),
        (teachers != "in_context", f"teachers={teachers!r} (one in-context teacher per unit)"),
    ]
    for bad, what in refused:
        if bad:
            raise ValueError(f"accounting='individual' does not apply to {what}")
    if charges_per_teacher is None:
        return default_charges_per_teacher(num_samples, max_new_tokens)
    if isinstance(charges_per_teacher, bool) or not isinstance(
        charges_per_teacher, int | np.integer
    ):
        raise ValueError(
            f"charges_per_teacher must be an integer >= 1, got {charges_per_teacher!r}"
        )
    steps = num_samples * max_new_tokens
    if not 1 <= charges_per_teacher <= steps:
        raise ValueError(
            f"charges_per_teacher must be from 1 to the {steps} steps of the longest run "
            f"(num_samples · max_new_tokens; more only adds noise), got {charges_per_teacher!r}"
        )
    return int(charges_per_teacher)


def _individual_config(
    *, epsilon: float, delta: float, charges_per_teacher: int, vocab_size: int, temperature: float
) -> individual.IndividualConfig:
    """σ = `sigma_for_steps(M, ε, δ)` (the smallest σ, to 0.1%, whose M Gaussian compositions
    are within (ε, δ) by RDP), T = `threshold_for(σ, V, INDIVIDUAL_ETA)`.

    Privacy:
        Public: a function of public settings only.
    """
    sigma = individual.sigma_for_steps(charges_per_teacher, epsilon, delta)
    return individual.IndividualConfig(
        sigma=sigma,
        threshold=individual.threshold_for(sigma, vocab_size, INDIVIDUAL_ETA),
        epsilon=epsilon,
        delta=delta,
        temperature=temperature,
    )


@dataclasses.dataclass(frozen=True)
class _Decoded:
    tokens: list[int]
    sources: list[str]
    stop_reason: str


def _decode_individual(
    ensemble: Ensemble,
    config: individual.IndividualConfig,
    ledger: individual.IndividualLedger,
    *,
    num_samples: int,
    max_new_tokens: int,
    eos_id: int | None,
    key: jax.Array,
) -> list[_Decoded]:
    """Decodes `num_samples` texts with `individual.individual_step`, one step at a time.

    Each step splits `key` (`key, step_key = jax.random.split(key)`), queries the teachers and
    the public model on the prompt and the sample so far, and takes the step's token ("public"
    when no noisy count passed T). The charges start at the ledger's and are carried across
    steps and samples, never reset; every sample is recorded in `ledger`, whose `budget` is the
    M passed to the step. A sample ends at EOS, a stop sequence or `max_new_tokens`
    (`generation.generate`'s rules).

    Privacy:
        Reads the teachers only through `individual_step`; the ledger's charges are sensitive.
    """
    teachers = ensemble.teachers
    charges = jnp.asarray(ledger.charges, jnp.int32)
    budget = ledger.budget
    decoded = []
    for _ in range(num_samples):
        tokens: list[int] = []
        sources: list[str] = []
        stop_reason = "max_new_tokens"
        while len(tokens) < max_new_tokens:
            prefix = [*ensemble.prompt_ids, *tokens]
            key, step_key = jax.random.split(key)
            teacher_logits = jnp.asarray(teachers(prefix), jnp.float32)
            public_logits = jnp.asarray(ensemble.public_model(prefix), jnp.float32)
            token, charges, info = _individual_step(
                step_key, teacher_logits, public_logits, charges, config, budget
            )
            token = int(token)
            tokens.append(token)
            sources.append("public" if bool(info.from_public) else "private")
            if eos_id is not None and token == eos_id:
                stop_reason = "eos"
                break
            if any(tuple(tokens[-len(s) :]) == tuple(s) for s in ensemble.stop_sequences):
                stop_reason = "stop_sequence"
                break
        ledger.record(np.asarray(charges), steps=len(tokens))
        decoded.append(_Decoded(tokens, sources, stop_reason))
    return decoded


def synthesize_individual(
    ensemble: Ensemble,
    model: public_models.PublicTextModel,
    *,
    epsilon: float,
    delta: float,
    num_samples: int,
    charges_per_teacher: int,
    prompt: str,
    key: jax.Array | None,
    max_new_tokens: int,
    temperature: float,
    stop_at_newline: bool,
    allow_large_delta: bool = False,
) -> SynthesisResult:
    """`synthesize` with individual (per-unit) accounting on a one-teacher-per-unit ensemble.

    σ is the smallest whose M = `charges_per_teacher` Gaussian compositions are within
    (ε, δ) by dp-accounting's RDP (`individual.sigma_for_steps`), T =
    `individual.threshold_for(σ, V, INDIVIDUAL_ETA)`; every step is `individual.individual_step`
    with the budget M, the charges carried across all steps and samples. The result's ε is
    `individual.rdp_epsilon(σ, M, δ)` <= ε whatever the run did (`epsilon` =
    `planned_epsilon`); tokens from the public vote are marked like the public fallback's.

    Privacy:
        Per unit (each unit is one teacher): (ε, δ)-DP under adding or removing one unit, by
        the Rényi filter (`pate.individual`'s module docstring); δ < 1/units is required, as
        for n teachers. With M = num_samples · max_new_tokens the filter never binds and the
        guarantee is that of charging every teacher at every step. The realised charges are
        sensitive: the result holds none of them (nor their max or mean); the counts of
        private and public tokens are those of the released marked texts. n is the number of
        units: only the result's `owner_report` holds it.
    """
    low, high = privacy.CALIBRATION_EPSILON_RANGE
    if not low <= epsilon <= high:
        raise ValueError(f"epsilon must be in [{low:g}, {high:g}], got {epsilon!r}")
    n = ensemble.teachers.num_teachers
    validation.check_delta_for_units(
        delta,
        n,
        unit=f"teachers (one per {ensemble.unit[:-1]})",
        allow_large_delta=allow_large_delta,
    )
    tokenizer = model.tokenizer
    vocab = int(model.model.config.vocab_size)
    config = _individual_config(
        epsilon=epsilon,
        delta=delta,
        charges_per_teacher=charges_per_teacher,
        vocab_size=vocab,
        temperature=temperature,
    )
    ledger = individual.IndividualLedger.start(config, n, max_charges=charges_per_teacher)
    seeded = key is not None
    key = key if seeded else randomness.prng_key(randomness.secret_seed())
    decoded = _decode_individual(
        ensemble,
        config,
        ledger,
        num_samples=num_samples,
        max_new_tokens=max_new_tokens,
        eos_id=tokenizer.eos_id,
        key=key,
    )
    guarantee = ledger.epsilon  # from M alone: rdp_epsilon(σ, M, δ)
    sources = [s for d in decoded for s in d.sources]
    mechanism = {
        "accounting": "individual",
        "sigma": config.sigma,
        "threshold": config.threshold,
        "eta": INDIVIDUAL_ETA,
        "charges_per_teacher": charges_per_teacher,
        "max_calls": num_samples * max_new_tokens,
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "stop_at_newline": stop_at_newline,
        "public_fallback": True,
    }
    return SynthesisResult(
        **sample_fields(ensemble, tokenizer, prompt, decoded),
        steps_without_output=sources.count("public"),
        epsilon=guarantee,
        delta=delta,
        target_epsilon=epsilon,
        target_delta=delta,
        planned_epsilon=guarantee,
        data_dependent_epsilon=None,
        released_epsilons=None,
        aggregator="individual_gaussian",
        method="individual",
        num_teachers=n,
        num_queries=len(sources),
        teacher_forward_passes=ensemble.teachers.calls * n,
        mechanism=mechanism,
        allow_large_delta=allow_large_delta,
        seeded=seeded,
    )
