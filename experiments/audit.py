"""Canary audits of every release and a white-box tightness check: empirical lower bounds on ε.

For each configuration, many independent runs of the mechanism with and without one canary
(`trials` per world) are scored, and `privacy.audit.epsilon_lower_bound` turns the two score samples
into a 95% lower bound ε_LB. With noise calibrated to the claimed ε, ε_LB must stay below it; the
no-noise control (σ = 0) must show leakage far above it, which proves that the audit has power.

- λ audit: DP-MixMin (`dp_mixmin`, mirror descent) on synthetic `nll` proxy outputs of k sources.
  `dp_mixmin` calibrates σ for the run and reports the claimed ε; the trials then vmap its jitted
  core `run_mirror_descent` over noise keys and Poisson batches (`mixing.audit`). By
  default a "with" trial with seed s is exactly `dp_mixmin(data with canary, seed=s)`; its
  "without" twin uses the same public rate q and normaliser b with the canary's row removed from
  every batch (the add/remove neighbour the accountant analyses). With `known_batches`, trials
  share the other rows' batches (`audit_runs.sample_trial_batches`). The table's σ and q are
  those of the max-clip data set (n + 1 rows). Canaries: a natural one (a random real row) and a
  max-clip one (`max_clip_nll_canary`, built at the non-private MixMin optimum, which the
  adversary may know). Score: the released log-weights along the canary's logit direction
  (`logit_score`).
- DP-SGD audit: binary logistic regression (digit >= 5) on scikit-learn's digits, DP-SGD from the
  privacy core (`clipped_grad_sum`, `private_optimizer`), vmapped over trials
  (`audit_runs.dpsgd_trials`). Canaries: a dirac gradient canary on the parameter that the data
  moves least (score: that parameter), and an input-space outlier with a flipped label (score:
  the model's logit for the flipped label at the outlier minus its logit at 0).

The other releases (one-run DP-SGD audits at example and user level, a canary user, the
end-to-end pipeline, the Hot PATE aggregators) and the white-box tightness check are in
`experiments/audit_releases.py`; `main` runs everything and writes one summary table.

Run `python -m experiments.audit --preset cpu --out DIR` (see `experiments/configs/audit.py`).
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
from sklearn.linear_model import LogisticRegression

from dpmix_jax.mixing import audit as mixmin_audit
from dpmix_jax.mixing import dp_mixmin
from dpmix_jax.pipeline.compare import provenance
from dpmix_jax.privacy import audit, audit_runs, plan
from experiments import audit_releases
from experiments.common_args import experiment_main
from experiments.configs.audit import PRESETS, AuditConfig, get_config
from experiments.harness import Command, finish

# --------------------------------------------------------------------------------------------
# Shared: the bound.
# --------------------------------------------------------------------------------------------


def _bound(with_: np.ndarray, without: np.ndarray, delta: float, config: AuditConfig) -> float:
    result = audit.epsilon_lower_bound(
        with_,
        without,
        delta=delta,
        confidence=config.confidence,
        method=config.method,
        seed=config.seed,
    )
    return result.epsilon


def _known_batches_seed(config: AuditConfig) -> int | None:
    return config.seed + 1 if config.known_batches else None


# --------------------------------------------------------------------------------------------
# The λ audit.
# --------------------------------------------------------------------------------------------


def synthetic_proxy_outputs(num_examples: int, num_sources: int, seed: int) -> np.ndarray:
    """`nll` proxy outputs `(n, k)`: each example belongs to one source (drawn from a random
    Dirichlet(2) mixture), whose proxy gives its label probability ~ Beta(5, 2); the others
    give ~ Beta(2, 5)."""
    rng = np.random.default_rng(seed)
    mixture = rng.dirichlet(np.full(num_sources, 2.0))
    source = rng.choice(num_sources, size=num_examples, p=mixture)
    preds = rng.beta(2.0, 5.0, size=(num_examples, num_sources))
    preds[np.arange(num_examples), source] = rng.beta(5.0, 2.0, size=num_examples)
    return preds


def audit_lambda(config: AuditConfig) -> list[dict]:
    """The λ audit: a row per (task, claimed ε), with ε_LB per canary with and without noise."""
    settings = config.mixmin
    rng = np.random.default_rng(config.seed)
    rows = []
    for task in range(settings.num_tasks):
        preds = synthetic_proxy_outputs(
            settings.mixture_size, settings.num_sources, seed=config.seed + task
        )
        canaries, reference = mixmin_audit.lambda_canaries(
            preds, clip_norm=settings.clip_norm, seed=config.seed + task
        )
        for eps in settings.epsilons:
            row = {"task": task, "claimed_epsilon": eps, "reference_max_weight": reference.max()}
            for canary in canaries:
                run = dp_mixmin(
                    canary.preds,
                    epsilon=eps,
                    delta=settings.delta,
                    steps=settings.steps,
                    batch_size=settings.batch_size,
                    clip_norm=settings.clip_norm,
                    learning_rate=settings.learning_rate,
                    seed=config.seed,
                    shift=settings.shift,
                )
                row.update(
                    noise_multiplier=run.noise_multiplier,
                    sampling_rate=run.sampling_rate,
                    accounted_epsilon=run.epsilon,
                )
                for label, sigma in (("", run.noise_multiplier), ("no_noise_", 0.0)):
                    scores = {}
                    for present in (True, False):
                        seeds = rng.integers(2**31 - 1, size=config.trials)
                        scores[present], weights = mixmin_audit.lambda_scores(
                            canary,
                            steps=settings.steps,
                            learning_rate=settings.learning_rate,
                            clip_norm=settings.clip_norm,
                            shift=settings.shift,
                            noise_multiplier=sigma,
                            rate=run.sampling_rate,
                            expected_batch_size=run.expected_batch_size,
                            seeds=seeds,
                            present=present,
                            chunk=config.chunk,
                            known_batches_seed=_known_batches_seed(config),
                        )
                        if present and canary.name == "max_clip" and sigma > 0:
                            row["max_clip_reach"] = _max_clip_reach(weights, reference, settings)
                    bound = _bound(scores[True], scores[False], settings.delta, config)
                    row[f"{label}{canary.name}"] = bound
            rows.append(row)
    return rows


def _max_clip_reach(weights: np.ndarray, reference: np.ndarray, settings) -> float:
    """Fraction of released λ at which the max-clip canary's gradient still reaches C."""
    source, k = int(np.argmax(reference)), settings.num_sources
    return float(np.mean(np.sqrt(1 - 1 / k) / weights[:, source] >= settings.clip_norm))


# --------------------------------------------------------------------------------------------
# The DP-SGD audit.
# --------------------------------------------------------------------------------------------


def audit_dpsgd(config: AuditConfig) -> list[dict]:
    """The DP-SGD audit: one row per claimed ε with ε_LB for each canary, with and without noise."""
    settings = config.dpsgd
    rng = np.random.default_rng(config.seed + 1)
    x, y = audit_releases.digits_task()
    n, dim = x.shape
    params0 = {"w": jnp.zeros(dim, jnp.float32), "b": jnp.zeros((), jnp.float32)}
    base = {"x": x, "y": y, "is_canary": np.zeros(n, bool)}

    # Dirac canary on the parameter with the least gradient signal in the data.
    grads = jax.vmap(jax.grad(audit_runs.logistic_loss), in_axes=(None, 0))(params0, base)
    flat = np.concatenate([np.asarray(grads["b"])[:, None], np.asarray(grads["w"])], axis=1)
    coordinate = int(np.argmin(np.mean(flat**2, axis=0)))  # position in ravel order (b, w)
    canary_grad = audit.dirac_canary_gradient(
        params0, index=coordinate, clip_norm=settings.clip_norm
    )
    loss = audit.with_gradient_canary(audit_runs.logistic_loss, canary_grad)

    # Input-space canary: an outlier with the label a clean model finds least likely.
    outlier = audit.outlier_input(x, scale=settings.canary_scale).astype(np.float32)
    clean = LogisticRegression(max_iter=1000).fit(x, y)
    flipped = float(clean.predict_proba(outlier[None])[0, 1] < 0.5)
    sign = 2.0 * flipped - 1.0

    def with_row(row_x, row_y, is_canary):
        return {
            "x": np.vstack([x, row_x[None]]),
            "y": np.append(y, row_y).astype(np.float32),
            "is_canary": np.append(base["is_canary"], is_canary),
        }

    canaries = {
        "gradient": (
            with_row(np.zeros(dim, np.float32), 0.0, True),
            lambda p: np.ravel(np.concatenate([p["b"][:, None], p["w"]], 1)[:, coordinate]),
        ),
        "input": (with_row(outlier, flipped, False), lambda p: sign * (p["w"] @ outlier)),
    }
    rows = []
    for eps in settings.epsilons:
        dp_plan = plan.plan_dp_sgd(
            plan.DpSgdConfig(
                epsilon=eps,
                delta=settings.delta,
                clip_norm=settings.clip_norm,
                batch_size=settings.batch_size,
                steps=settings.steps,
            ),
            num_units=n + 1,
        )
        row = {
            "claimed_epsilon": eps,
            "noise_multiplier": dp_plan.noise_multiplier,
            "sampling_rate": dp_plan.sampling_rate,
            "accounted_epsilon": dp_plan.spent().epsilon,
        }
        for label, sigma in (("", dp_plan.noise_multiplier), ("no_noise_", 0.0)):
            run = audit_runs.dpsgd_trials(
                loss,
                clip_norm=settings.clip_norm,
                learning_rate=settings.learning_rate,
                noise_multiplier=sigma,
                expected_batch_size=dp_plan.expected_batch_size,
            )
            for name, (data, score) in canaries.items():
                data = jax.tree.map(jnp.asarray, data)
                scores = {}
                for present in (True, False):
                    seeds = rng.integers(2**31 - 1, size=config.trials)
                    parts = []
                    for part in audit_runs.seed_chunks(seeds, config.chunk):
                        batches, masks = audit_runs.sample_trial_batches(
                            part,
                            rate=dp_plan.sampling_rate,
                            num_units=n + 1,
                            steps=settings.steps,
                            canary=n,
                            present=present,
                            known_batches_seed=_known_batches_seed(config),
                        )
                        history = run(data, params0, batches, masks, jnp.asarray(part, jnp.uint32))
                        params = jax.tree.map(lambda h: h[:, -1], history)
                        parts.append(score(jax.tree.map(np.asarray, params)))
                    scores[present] = np.concatenate(parts)
                row[f"{label}{name}"] = _bound(scores[True], scores[False], settings.delta, config)
        rows.append(row)
    return rows


# --------------------------------------------------------------------------------------------
# Report.
# --------------------------------------------------------------------------------------------

LAMBDA_COLUMNS = (
    ("task", "task", "{}"),
    ("claimed ε", "accounted_epsilon", "{:.3f}"),
    ("σ", "noise_multiplier", "{:.3f}"),
    ("q", "sampling_rate", "{:.3f}"),
    ("ε_LB natural", "natural", "{:.3f}"),
    ("ε_LB max-clip", "max_clip", "{:.3f}"),
    ("ε_LB no noise (natural)", "no_noise_natural", "{:.3f}"),
    ("ε_LB no noise (max-clip)", "no_noise_max_clip", "{:.3f}"),
    ("max-clip reach", "max_clip_reach", "{:.2f}"),
)
DPSGD_COLUMNS = (
    ("claimed ε", "accounted_epsilon", "{:.3f}"),
    ("σ", "noise_multiplier", "{:.3f}"),
    ("q", "sampling_rate", "{:.4f}"),
    ("ε_LB gradient", "gradient", "{:.3f}"),
    ("ε_LB input", "input", "{:.3f}"),
    ("ε_LB no noise (gradient)", "no_noise_gradient", "{:.3f}"),
    ("ε_LB no noise (input)", "no_noise_input", "{:.3f}"),
)


def markdown_table(rows: list[dict], columns) -> str:
    """A markdown table of `rows` with `(header, key, format)` columns."""
    lines = [
        "| " + " | ".join(h for h, _, _ in columns) + " |",
        "|" + "---|" * len(columns),
    ]
    for row in rows:
        lines.append("| " + " | ".join(f.format(row[k]) for _, k, f in columns) + " |")
    return "\n".join(lines)


def report(config: AuditConfig, lambda_rows, dpsgd_rows, seconds: float) -> str:
    """The markdown report of both audits."""
    mix, sgd = config.mixmin, config.dpsgd
    batches = (
        "other units' batches shared by all trials (only the canary's inclusion and the noise vary)"
        if config.known_batches
        else "independent Poisson batches per trial"
    )
    return "\n".join(
        [
            "# Canary audit",
            "",
            f"{config.trials} runs per world (with / without the canary) per canary and noise "
            f"setting; Clopper-Pearson at {config.confidence:.0%} confidence, threshold chosen "
            f"by `{config.method}`. Claimed ε is the accountant's ε (PLD) of the run; the "
            f"no-noise control runs the same mechanism with σ = 0. Batches: {batches}. "
            f"{seconds:.0f} s.",
            "",
            f"## DP-MixMin λ release (k = {mix.num_sources}, n = {mix.mixture_size} "
            f"(ρ = {mix.mixture_fraction}), T = {mix.steps}, b = {mix.batch_size}, "
            f"C = {mix.clip_norm}, η = {mix.learning_rate}, shift = {mix.shift}, "
            f"δ = {mix.delta})",
            "",
            markdown_table(lambda_rows, LAMBDA_COLUMNS),
            "",
            "max-clip reach: fraction of released λ at which the max-clip canary's gradient "
            "still has norm >= C.",
            "",
            f"## DP-SGD (logistic regression on digits, T = {sgd.steps}, b = {sgd.batch_size}, "
            f"C = {sgd.clip_norm}, lr = {sgd.learning_rate}, δ = {sgd.delta})",
            "",
            markdown_table(dpsgd_rows, DPSGD_COLUMNS),
            "",
        ]
    )


SUMMARY_COLUMNS = (
    ("release", "release", "{}"),
    ("claimed ε", "claimed_epsilon", "{:.3f}"),
    ("ε_LB many runs", "many_runs", "{:.3f}"),
    ("ε_LB one run (Steinke)", "one_run_steinke", "{:.3f}"),
    ("ε_LB one run (f-DP)", "one_run_fdp", "{:.3f}"),
    ("no-noise ε_LB many / one run", "no_noise", "{}"),
    ("tightness ε_LB/ε at ε = 1, 4", "tightness", "{}"),
)
PRIVATE_KEYS = ("many_runs", "one_run_steinke", "one_run_fdp")


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def summary_rows(lambda_rows, dpsgd_rows, releases: dict) -> list[dict]:
    """One row per release: claimed ε, ε_LB of each audit and of its no-noise control."""
    ratios: dict[str, list[float]] = {}
    for row in releases["tightness"]:
        ratios.setdefault(row["release"], []).append(row["ratio"])
    example, user, user_many = (
        releases["dpsgd_example"],
        releases["dpsgd_user"],
        releases["dpsgd_user_many"],
    )
    rows = [
        {
            "release": "DP-MixMin λ",
            "claimed_epsilon": max(r["accounted_epsilon"] for r in lambda_rows),
            "many_runs": max(max(r["natural"], r["max_clip"]) for r in lambda_rows),
            "no_noise_many_runs": min(r["no_noise_max_clip"] for r in lambda_rows),
            "tightness": ratios["DP-MixMin λ"],
        },
        {
            "release": "DP-SGD example level",
            "claimed_epsilon": max(r["accounted_epsilon"] for r in dpsgd_rows),
            "many_runs": max(max(r["gradient"], r["input"]) for r in dpsgd_rows),
            "no_noise_many_runs": min(r["no_noise_gradient"] for r in dpsgd_rows),
            **{k: v for k, v in example.items() if "one_run" in k},
            "tightness": ratios["DP-SGD"],
        },
        {
            **user_many,
            **{k: v for k, v in user.items() if "one_run" in k},
            "claimed_epsilon": max(user["claimed_epsilon"], user_many["claimed_epsilon"]),
        },
        {
            **releases["pipeline"],
            **{k: v for k, v in releases["pipeline_one_run"].items() if "one_run" in k},
            "claimed_epsilon": max(
                releases["pipeline"]["claimed_epsilon"],
                releases["pipeline_one_run"]["claimed_epsilon"],
            ),
        },
        *releases["pate"],
    ]
    for row in rows:
        controls = (row.get("no_noise_many_runs"), row.get("no_noise_one_run_steinke"))
        row["no_noise"] = " / ".join(_fmt(c) for c in controls)
        row["tightness"] = ", ".join(f"{r:.2f}" for r in row.get("tightness", [])) or "-"
    return rows


def summary_table(rows: list[dict]) -> str:
    """The markdown summary table (missing entries shown as -)."""
    lines = [
        "| " + " | ".join(h for h, _, _ in SUMMARY_COLUMNS) + " |",
        "|" + "---|" * len(SUMMARY_COLUMNS),
    ]
    for row in rows:
        cells = [
            "-" if row.get(key) is None else fmt.format(row[key]) for _, key, fmt in SUMMARY_COLUMNS
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary_plot(results: dict, path: pathlib.Path) -> None:
    """Left: ε_LB of every audit of every release beside its claimed ε; right: the white-box
    tightness ε_LB against claimed ε with the line ε_LB = claimed ε.

    Draws from `results` alone (the `main` dict or its `results.json` read back).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    rows, tightness_rows = results["summary"], results["releases"]["tightness"]
    methods = {
        "many_runs": ("o", "many runs"),
        "one_run_steinke": ("s", "one run (Steinke)"),
        "one_run_fdp": ("^", "one run (f-DP)"),
    }
    offsets = dict(zip(methods, (-0.25, 0.0, 0.25), strict=True))
    fig, (left, right) = plt.subplots(
        1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [max(3, len(rows)), 4]}
    )
    drawn = [1.0]
    for i, row in enumerate(rows):
        left.hlines(row["claimed_epsilon"], i - 0.4, i + 0.4, colors="k", linestyles="--", lw=1)
        for key, (marker, _) in methods.items():
            for prefix, face in (("", "C0"), ("no_noise_", "none")):
                value = row.get(prefix + key)
                if value is not None:
                    drawn.append(value)
                    left.scatter(
                        i + offsets[key],
                        value,
                        marker=marker,
                        s=40,
                        facecolors=face,
                        edgecolors="C0",
                    )
    left.set_xticks(range(len(rows)), [row["release"] for row in rows], rotation=25, ha="right")
    left.set_xlim(-0.6, len(rows) - 0.4)
    left.set_ylabel("ε lower bound (95% confidence)")
    left.set_title(
        "canary audits per release; within a release the audit methods are placed side by side",
        fontsize=9,
    )
    keys = [
        *(
            Line2D([], [], marker=m, ls="", color="C0", label=f"{name}, calibrated noise")
            for m, name in methods.values()
        ),
        Line2D([], [], marker="o", ls="", mfc="none", color="C0", label="hollow: no-noise control"),
        Line2D([], [], ls="--", color="k", label="claimed ε (accountant)"),
    ]
    left.set_ylim(top=1.4 * max(drawn))  # room for the legend above the points
    left.legend(handles=keys, fontsize=7, loc="upper left", ncol=2)

    mechanisms = list(dict.fromkeys(row["release"] for row in tightness_rows))
    styles = zip(("C1", "C2", "C3", "C4"), ("*", "D", "P", "X"), strict=True)
    for (color, marker), mechanism in zip(styles, mechanisms, strict=False):
        mine = [row for row in tightness_rows if row["release"] == mechanism]
        claimed = [row["claimed_epsilon"] for row in mine]
        right.scatter(
            claimed,
            [row["epsilon_lb"] for row in mine],
            marker=marker,
            s=100,
            color=color,
            label=f"{mechanism}: white-box tightness",
        )
        right.scatter(
            claimed,
            [row["no_noise_epsilon_lb"] for row in mine],
            marker=marker,
            s=100,
            facecolors="none",
            edgecolors=color,
            label=f"{mechanism}: no-noise control",
        )
    top = max(row["claimed_epsilon"] for row in tightness_rows) * 1.15
    right.plot([0, top], [0, top], "k--", lw=1, label="y = x: claimed ε = ε_LB")
    right.set_xlim(0, top)
    right.set_xlabel("claimed ε (accountant)")
    right.set_ylabel("ε lower bound (95% confidence)")
    right.set_title("white-box audit of the full transcript (worst-case canary)", fontsize=9)
    highest = max(max(row["epsilon_lb"], row["no_noise_epsilon_lb"]) for row in tightness_rows)
    right.set_ylim(top=1.45 * max(highest, top))
    right.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(config: AuditConfig, out_dir: str | pathlib.Path) -> dict:
    """Runs every audit; writes `results.md`, `results.json` and `results.png` to `out_dir`.

    Returns:
        `{"config", "mixmin", "dpsgd", "releases", "summary", "seconds", "violations",
        "noise_seeded", "provenance"}`, where a violation is a private ε_LB (any method,
        tightness included) above the claimed ε.
    """
    start = time.perf_counter()
    lambda_rows, dpsgd_rows = audit_lambda(config), audit_dpsgd(config)
    releases = {
        "dpsgd_example": audit_releases.dpsgd_one_run(config, user_level=False),
        "dpsgd_user": audit_releases.dpsgd_one_run(config, user_level=True),
        "dpsgd_user_many": audit_releases.dpsgd_user_level(config),
        "pipeline": audit_releases.pipeline(config),
        "pipeline_one_run": audit_releases.pipeline_one_run(config),
        "pate": audit_releases.pate(config),
        "tightness": audit_releases.tightness(config),
    }
    seconds = time.perf_counter() - start
    summary = summary_rows(lambda_rows, dpsgd_rows, releases)
    violations = sum(
        (row.get(key) or 0.0) > row["claimed_epsilon"] for row in summary for key in PRIVATE_KEYS
    ) + sum(row["epsilon_lb"] > row["claimed_epsilon"] for row in releases["tightness"])
    result = {
        "config": dataclasses.asdict(config),
        "mixmin": lambda_rows,
        "dpsgd": dpsgd_rows,
        "releases": releases,
        "summary": summary,
        "seconds": seconds,
        "violations": int(violations),
        # An audit measures the mechanisms on seeded noise (`config.seed`): it releases nothing.
        "noise_seeded": True,
        "provenance": provenance(),
    }
    text = "\n".join(
        [
            "# Canary audits of every release",
            "",
            f"95% lower bounds on ε; claimed ε is the accountant's ε for what ran (δ = "
            f"{config.releases.delta}). Tightness: white-box audit of the full transcript "
            f"(worst-case dirac canary), ε_LB / claimed ε. f-DP one-run bounds are ε at δ of "
            f"the largest rejected μ-GDP (Gaussian mechanisms only). {seconds:.0f} s.",
            "",
            summary_table(summary),
            "",
            markdown_table(
                releases["tightness"],
                (
                    ("mechanism", "release", "{}"),
                    ("claimed ε", "claimed_epsilon", "{:.3f}"),
                    ("σ", "sigma", "{:.3f}"),
                    ("ε_LB", "epsilon_lb", "{:.3f}"),
                    ("ε_LB / ε", "ratio", "{:.2f}"),
                    ("no-noise ε_LB", "no_noise_epsilon_lb", "{:.2f}"),
                ),
            ),
            "",
            report(config, lambda_rows, dpsgd_rows, seconds),
        ]
    )
    return finish(out_dir, result, text, plots={"results.png": summary_plot})


def _options(parser) -> None:
    parser.add_argument(
        "--known-batches",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="share the other units' batches across trials (default: the preset's choice)",
    )


def _config(args) -> AuditConfig:
    config = get_config(args.preset)
    if args.known_batches is None:
        return config
    return dataclasses.replace(config, known_batches=args.known_batches)


def _run(config: AuditConfig, args) -> dict:
    outcome = main(config, args.out)
    print(f"violations: {outcome['violations']}")
    return outcome


cli = Command(
    name="audit",
    description=__doc__.splitlines()[0],
    writes="results.md, results.json, results.png",
    examples=("--preset cpu", "--preset cpu --out DIR"),
    presets=PRESETS,
    options=_options,
    seeds="one",
    reproducible=False,
    config=_config,
    run=_run,
)


if __name__ == "__main__":
    with experiment_main("audit"):
        cli()
