"""Search cost: the privacy budget Random Search needs to match DP-MixMin, against k.

The paper's Lemma 4.1 contrast: private hyperparameter search over mixtures must try more
candidates as the number of sources k grows, and pays for every one of them, while DP-MixMin's
budget does not depend on k. On the synthetic exact-mixture problem
(`mixing.synthetic.mixture_problem`), for every k and seed:

* DP-MixMin at (ε, δ) (the k-scaling schedule: T_k, η_k, C_k from public data) and its excess
  MixMin loss over non-private MixMin on the same split;
* a pool of Dirichlet(1) candidates (Random Search's candidates), each scored by its excess
  MixMin loss; the expected excess of the best of m candidates (picked by the true loss: the
  most favourable, non-private selection) is computed exactly over the pool.

m*(k) is the smallest m whose expected best-of-m excess (mean over seeds) reaches DP-MixMin's
mean excess. Random Search fine-tunes every candidate on the same sensitive data, each run the
image demo's DP fine-tuning (`presets.image_demo_config().finetune`, σ calibrated to ε on D_ft
of the demo's size); its ε is the accountant's composition of m*(k) such runs
(`accounting.compose_ledgers`, PLD), shown beside the naive m·ε. Writes results.json,
results.md and search_cost.png.

    python -m experiments.search_cost --out DIR --reproducible
"""

from __future__ import annotations

import dataclasses
import pathlib
import time

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from dpmix_jax import mixing  # noqa: E402
from dpmix_jax.mixing import objectives  # noqa: E402
from dpmix_jax.mixing.scaling import public_clip_norm  # noqa: E402
from dpmix_jax.mixing.synthetic import mixture_problem  # noqa: E402
from dpmix_jax.pipeline import presets, splits  # noqa: E402
from dpmix_jax.pipeline.compare import provenance  # noqa: E402
from dpmix_jax.privacy import SEEDED_NOTE, accounting, randomness, validation  # noqa: E402
from dpmix_jax.privacy.plan import plan_dp_sgd  # noqa: E402
from experiments.common_args import experiment_main  # noqa: E402
from experiments.configs import search_cost as configs  # noqa: E402
from experiments.harness import Command, finish  # noqa: E402

TITLE = "Search cost: Random Search's privacy budget against DP-MixMin's, by number of sources k"


# --------------------------------------------------------------------------------------------
# Random Search's utility: the best of m Dirichlet(1) candidates.
# --------------------------------------------------------------------------------------------


def candidate_excesses(
    preds: np.ndarray, reference: np.ndarray, candidates: np.ndarray, *, chunk: int = 256
) -> np.ndarray:
    """`(N,)` excess MixMin losses F(λ_c) - F(λ_ref) of the `(N, k)` candidates.

    Privacy: not private; the scores read the sensitive split (the study's non-private,
    most favourable selection).
    """
    examples = objectives.prepare_examples(preds)
    reference_loss = objectives.mean_loss(jnp.asarray(reference, jnp.float32), examples, kind="nll")
    losses = jax.vmap(lambda w: objectives.mean_loss(w, examples, kind="nll"))
    scores = [
        np.asarray(losses(jnp.asarray(candidates[i : i + chunk], jnp.float32)))
        for i in range(0, len(candidates), chunk)
    ]
    return np.concatenate(scores) - float(reference_loss)


def expected_best_of(values: np.ndarray, count: int) -> float:
    """E[min of `count` draws with replacement from `values`], exactly.

    With the values sorted, x_(1) <= ... <= x_(N), the minimum of m uniform draws is >= x_(i)
    with probability ((N - i + 1)/N)^m, so E[min] = Σ_i x_(i) [((N-i+1)/N)^m - ((N-i)/N)^m].
    """
    values = np.sort(np.asarray(values, np.float64))
    if values.ndim != 1 or len(values) == 0:
        raise ValueError("values must be a non-empty 1-D array.")
    validation.check_steps(count, "count")
    n = len(values)
    at_least = (np.arange(n, 0, -1) / n) ** count  # P(min >= x_(i)), i = 1..N
    return float(np.sum(values * (at_least - np.append(at_least[1:], 0.0))))


def smallest_count(best: dict[int, float], target: float, counts: tuple[int, ...]) -> int | None:
    """The smallest m in `counts` with best[m] <= target, or None when none reaches it."""
    return next((m for m in counts if best[m] <= target), None)


# --------------------------------------------------------------------------------------------
# Random Search's privacy: m compositions of the demo's DP fine-tuning.
# --------------------------------------------------------------------------------------------


def demo_finetune_ledger(epsilon: float, delta: float) -> tuple[accounting.PrivacyLedger, dict]:
    """The ledger of one DP fine-tuning run of the image demo, calibrated to (ε, δ).

    The run is `image_demo_config().finetune` (its C, b, T) on D_ft, the demo's train split
    less the mixture fraction ρ (the split's expected size, round((1 - ρ)·n_train)); σ is
    calibrated by `plan_dp_sgd` for that rate and T, and the ledger records the T step events
    the trainer records.

    Privacy: D_ft's size fixes the sampling rate; under add/remove DP it is itself sensitive,
    as in every run of the pipeline.
    """
    demo = presets.image_demo_config()
    finetune = dataclasses.replace(demo.finetune, epsilon=epsilon, delta=delta)
    train_size = len(presets.digit_task().train)
    units = round((1.0 - demo.mix_fraction) * train_size)
    plan = plan_dp_sgd(finetune.dp_sgd_config(), num_units=units)
    ledger = accounting.PrivacyLedger()
    ledger.record(plan.step_event(), plan.config.accounted_steps)
    event = {
        "num_units": units,
        "train_size": train_size,
        "mix_fraction": demo.mix_fraction,
        "steps": plan.config.accounted_steps,
        "batch_size": finetune.batch_size,
        "clip_norm": finetune.clip_norm,
        "sampling_rate": plan.sampling_rate,
        "noise_multiplier": plan.noise_multiplier,
        "epsilon": ledger.epsilon(delta),
    }
    return ledger, event


def random_search_epsilon(ledger: accounting.PrivacyLedger, count: int, delta: float) -> float:
    """The accountant's ε at δ of `count` runs of `ledger` on the same data (PLD composition).

    Privacy: every candidate is fine-tuned on the same D_ft, so the runs compose sequentially;
    the selection of the best candidate is not accounted (it would only add to this).
    """
    return accounting.compose_ledgers(*([ledger] * count)).epsilon(delta)


# --------------------------------------------------------------------------------------------
# The study.
# --------------------------------------------------------------------------------------------


def run_problem(
    config: configs.SearchCostConfig,
    k: int,
    seed: int,
    noise_multiplier: dict[int, float],
    *,
    reproducible: bool,
) -> dict:
    """DP-MixMin and the candidate pool on the (k, seed) problem; returns its row.

    Privacy: the DP-MixMin run is (ε, δ)-DP on the problem's sensitive split; the reference,
    the candidates' scores and the excess losses are non-private study measurements.
    """
    problem = config.problem()
    shape = dict(
        num_features=config.num_features, support=config.support, proxy_scale=config.proxy_scale
    )
    public, _ = mixture_problem(
        num_examples=config.public_examples, num_sources=k, seed=config.public_seed, **shape
    )
    preds, _ = mixture_problem(num_examples=config.num_examples, num_sources=k, seed=seed, **shape)
    clip_norm = public_clip_norm([public], quantile=config.clip_quantile, scale=config.clip_scale)
    steps, learning_rate = problem.schedule(k, config.solver, clip_norm)
    reference = np.asarray(
        mixing.mixmin(
            preds, steps=config.reference_steps, learning_rate=config.reference_learning_rate
        )
    )
    result = mixing.dp_mixmin(
        preds,
        noise_multiplier=noise_multiplier[steps],
        delta=config.delta,
        steps=steps,
        batch_size=config.batch_size,
        clip_norm=clip_norm,
        learning_rate=learning_rate,
        seed=seed * 1000 + k if reproducible else randomness.secret_seed(),
        solver=config.solver,
    )
    candidates = splits.dirichlet_candidates(k, config.candidate_pool, seed=seed * 1000 + k)
    pool = candidate_excesses(preds, reference, candidates)
    return {
        "k": k,
        "seed": seed,
        "clip_norm": clip_norm,
        "steps": steps,
        "learning_rate": learning_rate,
        "dp_mixmin_excess": mixing.excess_loss(result.weights, reference, preds),
        "dp_mixmin_epsilon": result.epsilon,
        "uniform_excess": mixing.excess_loss(np.full(k, 1.0 / k), reference, preds),
        "best_of": {str(m): expected_best_of(pool, m) for m in config.candidate_counts},
    }


def summarise(
    config: configs.SearchCostConfig,
    rows: list[dict],
    ledger: accounting.PrivacyLedger,
) -> dict:
    """Per k: DP-MixMin's excess (mean, std), the expected best-of-m excess (mean, std over
    seeds), m*(k) and Random Search's ε for m*(k) (composed, and naive m·ε)."""
    counts = config.candidate_counts
    single = ledger.epsilon(config.delta)
    composed = {m: random_search_epsilon(ledger, m, config.delta) for m in counts}
    per_k = []
    for k in config.ks:
        mine = [r for r in rows if r["k"] == k]
        dp = np.array([r["dp_mixmin_excess"] for r in mine])
        best = {m: np.array([r["best_of"][str(m)] for r in mine]) for m in counts}
        best_mean = {m: float(v.mean()) for m, v in best.items()}
        m_star = smallest_count(best_mean, float(dp.mean()), counts)
        per_k.append(
            {
                "k": k,
                "dp_mixmin_excess": {"mean": float(dp.mean()), "std": float(dp.std())},
                "dp_mixmin_epsilon": max(r["dp_mixmin_epsilon"] for r in mine),
                "uniform_excess": float(np.mean([r["uniform_excess"] for r in mine])),
                "best_of": {
                    str(m): {"mean": best_mean[m], "std": float(best[m].std())} for m in counts
                },
                "m_star": m_star,
                "random_search_epsilon": None if m_star is None else composed[m_star],
                "naive_epsilon": None if m_star is None else m_star * single,
            }
        )
    return {
        "per_k": per_k,
        "finetune_epsilon": single,
        "composed_epsilon": {str(m): composed[m] for m in counts},
        "naive_epsilon": {str(m): m * single for m in counts},
    }


def main(
    config: configs.SearchCostConfig,
    out: pathlib.Path | None = None,
    *,
    reproducible: bool = False,
) -> dict:
    """Runs the study; returns (and, with `out`, writes) the results.

    The seeds make the data and the candidate pools; DP-MixMin's noise and sampling are secret
    unless `reproducible`.
    """
    start = time.time()
    problem = config.problem()
    q = min(1.0, config.batch_size / config.num_examples)
    all_steps = sorted({problem.schedule(k, config.solver, 1.0)[0] for k in config.ks})
    noise_multiplier = {
        steps: accounting.calibrate_noise_multiplier(
            target_epsilon=config.epsilon, delta=config.delta, sampling_rate=q, steps=steps
        )
        for steps in all_steps
    }
    ledger, finetune_event = demo_finetune_ledger(config.epsilon, config.delta)
    rows = []
    for seed in config.seeds:
        for k in config.ks:
            rows.append(run_problem(config, k, seed, noise_multiplier, reproducible=reproducible))
            row = rows[-1]
            if not config.progress:
                continue
            print(
                f"seed {seed} k = {k:3d}: DP-MixMin excess {row['dp_mixmin_excess']:.2e}, best"
                f" of {max(config.candidate_counts)} candidates"
                f" {row['best_of'][str(max(config.candidate_counts))]:.2e}"
                f" [{time.time() - start:.0f}s]",
                flush=True,
            )
    results = {
        "config": dataclasses.asdict(config),
        "noise_multipliers": {str(t): s for t, s in noise_multiplier.items()},
        "finetune_event": finetune_event,
        "noise_seeded": reproducible,
        "rows": rows,
        **summarise(config, rows, ledger),
    }
    results["seconds"] = time.time() - start
    results["provenance"] = provenance()
    return finish(out, results, markdown(config, results), plots={"search_cost.png": plot})


def _count(m: int | None, counts: tuple[int, ...]) -> str:
    return f"> {max(counts)}" if m is None else str(m)


def _epsilon(value: float | None, bound: float) -> str:
    return f"> {bound:.3g}" if value is None else f"{value:.3g}"


def markdown(config: configs.SearchCostConfig, results: dict) -> str:
    """The results as a titled markdown page: the cost table, the best-of-m table, the setting."""
    counts = config.candidate_counts
    largest = str(max(counts))
    lines = [
        f"# {TITLE}",
        "",
        "| k | DP-MixMin excess | DP-MixMin ε | m*(k) | Random Search ε (composed) |"
        " Random Search m·ε |",
        "|---|---|---|---|---|---|",
    ]
    composed_bound = results["composed_epsilon"][largest]
    naive_bound = results["naive_epsilon"][largest]
    for row in results["per_k"]:
        dp = row["dp_mixmin_excess"]
        lines.append(
            f"| {row['k']} | {dp['mean']:.2e} ± {dp['std']:.1e} | {row['dp_mixmin_epsilon']:.3g} |"
            f" {_count(row['m_star'], counts)} |"
            f" {_epsilon(row['random_search_epsilon'], composed_bound)}"
            f" | {_epsilon(row['naive_epsilon'], naive_bound)} |"
        )
    lines += [
        "",
        "Expected excess MixMin loss of the best of m Dirichlet(1) candidates (mean over seeds),"
        " and Random Search's ε for m fine-tunings:",
        "",
        "| m | " + " | ".join(f"k = {row['k']}" for row in results["per_k"]) + " | ε composed"
        " | m·ε |",
        "|---" * (len(results["per_k"]) + 3) + "|",
    ]
    for m in counts:
        cells = [f"{row['best_of'][str(m)]['mean']:.2e}" for row in results["per_k"]]
        lines.append(
            f"| {m} | " + " | ".join(cells) + f" | {results['composed_epsilon'][str(m)]:.3g}"
            f" | {results['naive_epsilon'][str(m)]:.3g} |"
        )
    event = results["finetune_event"]
    lines += [
        "",
        f"Setting: synthetic exact-mixture proxies (n = {config.num_examples},"
        f" {len(config.seeds)} seeds, {config.support} active sources); DP-MixMin"
        f" ({config.solver}) at ε = {config.epsilon}, δ = {config.delta}, b ="
        f" {config.batch_size}, T_k, η_k and C_k from the k-scaling schedule; excess over"
        f" non-private MixMin on the same split. Random Search: the best of m candidates from"
        f" {config.candidate_pool} Dirichlet(1) draws per k and seed, picked by the true loss"
        " (non-private, the most favourable selection); m*(k) = the smallest m whose mean"
        " expected best-of-m excess is at most DP-MixMin's mean excess.",
        f"Each Random Search candidate costs one DP fine-tuning of the image demo on D_ft"
        f" ({event['num_units']} examples, T = {event['steps']}, b = {event['batch_size']},"
        f" C = {event['clip_norm']}, σ = {event['noise_multiplier']:.3f}; accountant ε"
        f" {event['epsilon']:.3f} at δ = {config.delta}); composed = the PLD accountant's ε of"
        " the m runs on the same data, m·ε = basic composition. Every ε is the accountant's.",
        SEEDED_NOTE if results.get("noise_seeded") else "DP noise and sampling secret.",
    ]
    return "\n".join(lines)


def plot(results: dict, path: pathlib.Path) -> None:
    """Random Search's ε against DP-MixMin's, and m*(k), against k.

    Draws from `results` alone (`results.json` read back will do).
    """
    config = results["config"]
    counts = config["candidate_counts"]
    per_k = results["per_k"]
    ks = np.array([row["k"] for row in per_k])
    found = np.array([row["m_star"] is not None for row in per_k])
    largest = str(max(counts))
    fig, (cost, count) = plt.subplots(1, 2, figsize=(11, 5))
    composed = np.array([row["random_search_epsilon"] or np.nan for row in per_k])
    naive = np.array([row["naive_epsilon"] or np.nan for row in per_k])
    cost.plot(ks[found], composed[found], "o-", color="C1", label="Random Search, composed")
    cost.plot(ks[found], naive[found], "D--", color="C1", label="Random Search, m·ε")
    if (~found).any():
        for key, marker, label in (
            ("composed_epsilon", "o", "composed"),
            ("naive_epsilon", "D", "m·ε"),
        ):
            cost.plot(
                ks[~found],
                np.full((~found).sum(), results[key][largest]),
                marker,
                color="C1",
                fillstyle="none",
                label=f"{label} of {largest}: lower bound (m* > {largest})",
            )
    cost.plot(
        ks,
        [row["dp_mixmin_epsilon"] for row in per_k],
        "s-",
        color="C0",
        label="DP-MixMin",
    )
    cost.set(xscale="log", yscale="log", xlabel="number of sources k", ylabel="ε spent")
    cost.set_title(f"ε to match DP-MixMin's excess at ε = {config['epsilon']}", fontsize=10)
    cost.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=2)
    count.plot(ks[found], [row["m_star"] for row in per_k if row["m_star"]], "o-", color="C1")
    if (~found).any():
        count.plot(
            ks[~found], np.full((~found).sum(), int(largest)), "^", color="C1", fillstyle="none"
        )
    count.set(xscale="log", yscale="log", xlabel="number of sources k", ylabel="m*(k)")
    count.set_title("candidates Random Search needs", fontsize=10)
    for ax in (cost, count):
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xticks(ks, [str(k) for k in ks])
    count.set_yticks(counts, [str(m) for m in counts])
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


cli = Command(
    name="search_cost",
    description=__doc__.splitlines()[0],
    writes="results.json, results.md, search_cost.png",
    examples=("--out runs/search_cost --reproducible", "--preset tiny --out runs/tiny"),
    presets=configs.PRESETS,
    quiet=True,
    config=lambda args: configs.get_config(args.preset),
    run=lambda config, args: main(config, args.out, reproducible=args.reproducible),
)


if __name__ == "__main__":
    with experiment_main("search_cost"):
        cli()
