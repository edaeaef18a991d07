"""k-scaling study: excess MixMin loss of DP-MixMin (ε = 1) against the number of sources k.

Trained proxies (default; the paper's Appendix A.6 at CPU scale): k public label functions over
one input set, one multi-head proxy trained on public images (one head per label function), ten
sensitive tasks labelled by sparse mixtures of the label functions (`TrainedProxyConfig`). The
proxy is trained once per seed with the largest k heads (cached under `DIR/proxies/`); smaller k
use its first k heads. Synthetic proxies (`--proxies synthetic`,
`mixing.synthetic.mixture_problem`): k sigmoid proxies on Gaussian inputs with labels from an
exact mixture of a few of them.

For every k, seed and task, DP-MixMin (mirror descent, Frank-Wolfe with the Gaussian oracle and
Frank-Wolfe with the exponential-mechanism oracle; T_k and η_k from `mixing.scaling.schedule`, C_k
from public data) is compared with non-private MixMin on the same split, and rerun without noise
(σ = 0, or ε_0 = ∞ for the exponential oracle) to split the excess into optimisation + clipping
bias and noise; the log-log slope of the mean excess over k >= `slope_min_k` is fitted (theory for
DP-SCO: 0.5; the paper measures 0.49). Writes `k_scaling.json`, `k_scaling.md` and
`k_scaling.png`.

    python -m experiments.k_scaling --preset cpu --out DIR
    python -m experiments.k_scaling --preset paper --smoke --out DIR
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import pathlib
import time
from collections.abc import Iterator

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from dpmix_jax import mixing  # noqa: E402
from dpmix_jax.data import builtin  # noqa: E402
from dpmix_jax.data.sources import ArraySource, Source, SubsetSource, random_split  # noqa: E402
from dpmix_jax.mixing import exponential_oracle  # noqa: E402
from dpmix_jax.mixing.scaling import gradient_norms, loglog_slope, public_clip_norm  # noqa: E402
from dpmix_jax.mixing.synthetic import mixture_problem  # noqa: E402
from dpmix_jax.pipeline.compare import provenance  # noqa: E402
from dpmix_jax.privacy import SEEDED_NOTE, accounting, randomness  # noqa: E402
from dpmix_jax.train import IndexedData, evaluate, proxies  # noqa: E402
from experiments.common_args import experiment_main  # noqa: E402
from experiments.configs import k_scaling as configs  # noqa: E402
from experiments.harness import Command, UsageError, finish  # noqa: E402
from experiments.plot_labels import counted, display_name  # noqa: E402

PAPER_SLOPE = 0.49
NUM_DIGITS = 10


# --------------------------------------------------------------------------------------------
# Problems: synthetic proxies, or trained proxies over public label functions.
# --------------------------------------------------------------------------------------------


def digit_label_functions(count: int, *, seed: int) -> np.ndarray:
    """`(10, count)` 0/1 membership: column i is a distinct non-empty proper subset S_i of the
    10 digits (label function "the digit is in S_i"), in a seeded random order, so the first k
    columns of a larger draw are the draw for k."""
    if not 1 <= count <= configs.NUM_DIGIT_SUBSETS:
        raise ValueError(f"count must be in [1, {configs.NUM_DIGIT_SUBSETS}], got {count}.")
    codes = np.random.default_rng(seed).permutation(np.arange(1, 2**NUM_DIGITS - 1))[:count]
    return ((codes[None, :] >> np.arange(NUM_DIGITS)[:, None]) & 1).astype(np.float32)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProxyData:
    """Where the trained-proxy setting's examples come from (each `{"image", "label"}`, the
    label an integer class whose label functions are the rows of `membership`).

    Attributes:
        public: the proxy's public training examples.
        holdout: public examples kept out of proxy training (for C_k).
        sensitive: the sensitive mixture split (n examples).
        membership: `(num_classes, K)` 0/1, label function i of class c.
    """

    public: Source
    holdout: Source
    sensitive: Source
    membership: np.ndarray


def digit_proxy_data(config: configs.KScalingConfig, seed: int) -> ProxyData:
    """MNIST-5k split at random into the sensitive split (n), the public holdout and the
    proxy's public training pool (the rest); K digit-subset label functions."""
    trained = config.trained
    images, digits = builtin.mnist_5k_digits(image_size=trained.image_size)
    total = len(images)
    num_public = total - config.num_examples - trained.public_holdout
    if num_public < 1:
        raise ValueError(
            f"num_examples ({config.num_examples}) + public_holdout ({trained.public_holdout})"
            f" must leave public training images out of MNIST-5k's {total}."
        )
    public, holdout, sensitive = random_split(
        total,
        (num_public / total, trained.public_holdout / total, config.num_examples / total),
        seed=seed,
    )
    source = ArraySource({"image": images, "label": digits})
    return ProxyData(
        public=SubsetSource(source, public),
        holdout=SubsetSource(source, holdout),
        sensitive=SubsetSource(source, sensitive),
        membership=digit_label_functions(trained.num_label_functions, seed=seed),
    )


TFDS_SPLITS = (("imagenet2012", "train"), ("imagenet2012", "validation"), ("cifar100", "train"))


def _require_tfds(data_dir: str | None) -> None:
    """Opens every tfds split the ImageNet → CIFAR-100 setting reads, as `tfds_proxy_data`
    opens them, so that a missing one stops the run in one line before any work."""
    from dpmix_jax.data import tfds_sources

    for name, split in TFDS_SPLITS:
        try:
            tfds_sources.open_data_source(name, split, data_dir=data_dir)
        except ValueError as err:
            raise ValueError(
                f"{err} (ImageNet-2012 needs its manual download: add --manual_dir DIR) or "
                "run --preset cpu"
            ) from err


def tfds_proxy_data(config: configs.KScalingConfig, seed: int) -> ProxyData:
    """ImageNet-2012 train (public; K classes one-vs-rest as label functions, seeded order),
    `public_holdout` images of its validation split (public, for C_k), and `num_examples`
    images of CIFAR-100 train (the sensitive split)."""
    from dpmix_jax.data import tfds_sources

    trained = config.trained
    size, data_dir = trained.image_size, trained.tfds_data_dir
    public = tfds_sources.imagenet_source("train", data_dir=data_dir, image_size=size)
    validation = tfds_sources.imagenet_source("validation", data_dir=data_dir, image_size=size)
    cifar = tfds_sources.TfdsImageSource(
        tfds_sources.open_data_source("cifar100", "train", data_dir=data_dir), image_size=size
    )
    for source, wanted, what in (
        (validation, trained.public_holdout, "public_holdout"),
        (cifar, config.num_examples, "num_examples"),
    ):
        if len(source) < wanted:
            raise ValueError(f"{what} = {wanted} exceeds the {len(source)} examples available.")
    rng = np.random.default_rng(seed)
    num_classes = 1000
    classes = rng.permutation(num_classes)[: trained.num_label_functions]
    membership = np.zeros((num_classes, len(classes)), np.float32)
    membership[classes, np.arange(len(classes))] = 1.0
    return ProxyData(
        public=public,
        holdout=SubsetSource(
            validation, np.sort(rng.permutation(len(validation))[: trained.public_holdout])
        ),
        sensitive=SubsetSource(cifar, np.sort(rng.permutation(len(cifar))[: config.num_examples])),
        membership=membership,
    )


def _batches(source: Source, membership: np.ndarray | None):
    """`gather(indices)` over `source` as model batches: inputs and class ids, plus the label
    functions' values when `membership` is given."""

    def gather(indices: np.ndarray) -> dict[str, np.ndarray]:
        example = source.gather(np.asarray(indices))
        batch = {"inputs": example["image"], "class_ids": example["label"].astype(np.int32)}
        if membership is not None:
            batch["labels"] = membership[example["label"]] * (np.asarray(indices) >= 0)[:, None]
        return batch

    return gather


def proxy_outputs(
    config: configs.KScalingConfig, seed: int, cache_dir: pathlib.Path | None
) -> dict[str, np.ndarray]:
    """The K-head proxy's logits and class ids on the public holdout and the sensitive split.

    Trains the proxy once per seed (public data only) unless `cache_dir` holds the outputs of
    the same settings.

    Privacy: the sensitive logits and class ids are sensitive; they are read only to build the
    `nll` matrices of the accounted DP-MixMin runs (and their non-private references).
    """
    trained = config.trained
    settings = json.dumps(
        {
            "seed": seed,
            "num_examples": config.num_examples,
            "trained": dataclasses.asdict(trained),
        },
        sort_keys=True,
        default=str,
    )
    path = None if cache_dir is None else cache_dir / f"proxy_seed{seed}.npz"
    if path is not None and path.exists():
        with np.load(path, allow_pickle=False) as cached:
            if str(cached["settings"]) == settings:
                return {name: cached[name] for name in cached.files if name != "settings"}
    data = (digit_proxy_data if trained.data == "digits" else tfds_proxy_data)(config, seed)
    image_shape = data.public[0]["image"].shape
    model = trained.model.build(image_shape, data.membership.shape[1], seed=seed)
    fit = proxies.train_image_proxy(
        model,
        IndexedData(gather=_batches(data.public, data.membership), num_examples=len(data.public)),
        trained.train,
        rng=np.random.default_rng(seed),
    )
    outputs = {}
    for split in ("holdout", "sensitive"):
        source = getattr(data, split)
        logits, ids = evaluate.model_outputs(
            fit.model,
            evaluate.outputs_and_labels("inputs", "class_ids"),
            _batches(source, None),
            len(source),
            batch_size=trained.eval_batch_size,
        )
        outputs[f"{split}_logits"] = logits.astype(np.float32)
        outputs[f"{split}_ids"] = ids.astype(np.int64)
    outputs["membership"] = data.membership
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("wb") as f:
            np.savez(f, settings=np.array(settings), **outputs)
    return outputs


def task_labels(
    config: configs.KScalingConfig, class_ids: np.ndarray, membership: np.ndarray, seed: int
) -> tuple[np.ndarray, np.ndarray | None]:
    """The sensitive tasks' binary labels `(n, num_tasks)` and their λ* `(num_tasks, K)`.

    Digits: task t is y ~ Bernoulli(Σ_i λ*_ti y_i(x)), λ*_t sparse
    (`builtin.sparse_mixtures`), drawn with the data seed. ImageNet → CIFAR-100: task t is
    "CIFAR-100 class t" (λ* unknown: None).

    Privacy: the labels are the sensitive data of the study.
    """
    trained = config.trained
    if trained.data == "imagenet_cifar100":
        return (class_ids[:, None] == np.arange(trained.num_tasks)).astype(np.int64), None
    rng = np.random.default_rng([seed, 1])
    weights = builtin.sparse_mixtures(
        rng, trained.num_tasks, membership.shape[1], trained.num_active_sources
    )
    probs = membership[class_ids] @ weights.T
    return (rng.random(probs.shape) < probs).astype(np.int64), weights


@dataclasses.dataclass(frozen=True)
class Instance:
    """One DP-MixMin problem: a task's proxy outputs on the sensitive split, and its λ* when
    the problem has one over these k sources."""

    task: int
    preds: np.ndarray
    true_weights: np.ndarray | None


def _clip_norm(config: configs.KScalingConfig, public_preds: list[np.ndarray]) -> float:
    return public_clip_norm(public_preds, quantile=config.clip_quantile, scale=config.clip_scale)


def synthetic_instances(
    config: configs.KScalingConfig, seed: int
) -> Iterator[tuple[int, float, list[Instance]]]:
    """(k, C_k, [one instance]) per k: a fresh synthetic problem; C_k from a public one."""
    problem = dict(
        num_features=config.num_features, support=config.support, proxy_scale=config.proxy_scale
    )
    for k in config.ks:
        public, _ = mixture_problem(
            num_examples=config.public_examples, num_sources=k, seed=config.public_seed, **problem
        )
        preds, true_weights = mixture_problem(
            num_examples=config.num_examples, num_sources=k, seed=seed, **problem
        )
        yield k, _clip_norm(config, [public]), [Instance(0, preds, true_weights)]


def trained_instances(
    config: configs.KScalingConfig, seed: int, cache_dir: pathlib.Path | None
) -> Iterator[tuple[int, float, list[Instance]]]:
    """(k, C_k, one instance per task) per k, from the first k heads of the seed's proxy.

    C_k comes from the proxy's outputs on the public holdout with stand-in tasks of the same
    family (sparse mixtures of the label functions, drawn with `public_seed`).
    """
    trained = config.trained
    outputs = proxy_outputs(config, seed, cache_dir)
    membership = outputs["membership"]
    labels, true_weights = task_labels(config, outputs["sensitive_ids"], membership, seed)
    stand_in_weights = builtin.sparse_mixtures(
        np.random.default_rng([config.public_seed, seed]),
        trained.stand_in_tasks,
        membership.shape[1],
        trained.num_active_sources,
    )
    stand_in_probs = membership[outputs["holdout_ids"]] @ stand_in_weights.T
    stand_in_labels = (
        np.random.default_rng([config.public_seed, seed, 1]).random(stand_in_probs.shape)
        < stand_in_probs
    )
    for k in config.ks:
        public = [
            proxies.nll_matrix(outputs["holdout_logits"][:, :k], stand_in_labels[:, t])
            for t in range(trained.stand_in_tasks)
        ]
        instances = []
        for t in range(trained.num_tasks):
            weights = None if true_weights is None else true_weights[t]
            if weights is not None and weights[k:].any():
                weights = None  # λ* uses label functions outside these k
            preds = proxies.nll_matrix(outputs["sensitive_logits"][:, :k], labels[:, t])
            instances.append(Instance(t, preds.astype(np.float32), weights))
        yield k, _clip_norm(config, public), instances


# --------------------------------------------------------------------------------------------
# The study.
# --------------------------------------------------------------------------------------------


def noise_levels(config: configs.KScalingConfig) -> dict[str, dict[int, float]]:
    """Per solver of `config`, T_k -> its noise at (ε, δ): σ for mirror descent and the Gaussian
    Frank-Wolfe oracle (DP-SGD's calibration at q = b / n), ε_0 per selection for the
    exponential oracle (`exponential_oracle.calibrate_step_epsilon`). Each depends on T_k only:
    the rate and the target are the same for every run."""
    q = min(1.0, config.batch_size / config.num_examples)
    levels = {}
    for solver in config.solvers:
        steps = sorted({config.schedule(k, solver, 1.0)[0] for k in config.ks})
        if solver == configs.EXPONENTIAL_FRANK_WOLFE:
            calibrate = exponential_oracle.calibrate_step_epsilon
        else:
            calibrate = functools.partial(accounting.calibrate_noise_multiplier, sampling_rate=q)
        levels[solver] = {
            t: calibrate(target_epsilon=config.epsilon, delta=config.delta, steps=t) for t in steps
        }
    return levels


def private_run(
    config: configs.KScalingConfig,
    solver: str,
    preds: np.ndarray,
    *,
    steps: int,
    learning_rate: float | None,
    clip_norm: float,
    noise: float,
    seed: int,
) -> tuple[np.ndarray, float]:
    """The released λ and the accountant's ε of one DP-MixMin run of `solver`; `noise` is σ
    (0: none) or, for the exponential oracle, ε_0 (∞: none).

    Privacy: (ε, δ)-DP on `preds`' examples for the calibrated noise; no guarantee without it.
    """
    if solver == configs.EXPONENTIAL_FRANK_WOLFE:
        result = mixing.dp_exponential_frank_wolfe(
            preds,
            step_epsilon=noise,
            delta=config.delta,
            steps=steps,
            clip_norm=clip_norm,
            seed=seed,
        )
    else:
        result = mixing.dp_mixmin(
            preds,
            noise_multiplier=noise,
            delta=config.delta,
            steps=steps,
            batch_size=config.batch_size,
            clip_norm=clip_norm,
            learning_rate=learning_rate,
            seed=seed,
            solver=solver,
        )
    return result.weights, result.epsilon


def run_instance(
    config: configs.KScalingConfig,
    k: int,
    seed: int,
    clip_norm: float,
    instance: Instance,
    noise: dict[str, dict[int, float]],
    *,
    reproducible: bool,
) -> dict:
    """Runs every solver (with its calibrated noise and without noise) on one instance; returns
    its row. `noise` is `noise_levels(config)`.

    Privacy: the noisy runs are DP-MixMin at (ε, δ) on the instance's sensitive split; the
    reference, the noiseless twins and the diagnostics are not private (study measurements only).
    """
    preds = instance.preds
    reference = np.asarray(
        mixing.mixmin(
            preds, steps=config.reference_steps, learning_rate=config.reference_learning_rate
        )
    )
    uniform = np.full(k, 1.0 / k)
    # One stream per (k, seed, task), shared by the noisy run and its noiseless twin.
    noise_seed = seed * 1000 + instance.task if reproducible else randomness.secret_seed()
    row = {
        "k": k,
        "seed": seed,
        "task": instance.task,
        "clip_norm": clip_norm,
        "clipped_at_optimum": float(np.mean(gradient_norms(preds, reference) > clip_norm)),
        "uniform_excess": mixing.excess_loss(uniform, reference, preds),
    }
    if instance.true_weights is not None:
        row["true_weights_excess"] = mixing.excess_loss(instance.true_weights, reference, preds)
    for solver in config.solvers:
        steps, learning_rate = config.schedule(k, solver, clip_norm)
        row[f"{solver}_steps"] = steps
        row[f"{solver}_learning_rate"] = learning_rate
        no_noise = math.inf if solver == configs.EXPONENTIAL_FRANK_WOLFE else 0.0
        excess = {}
        for part, level in (("excess", noise[solver][steps]), ("bias", no_noise)):
            weights, epsilon = private_run(
                config,
                solver,
                preds,
                steps=steps,
                learning_rate=learning_rate,
                clip_norm=clip_norm,
                noise=level,
                seed=noise_seed,
            )
            excess[part] = mixing.excess_loss(weights, reference, preds)
            if part == "excess":
                row[f"{solver}_epsilon"] = epsilon
                row[f"{solver}_cosine"] = mixing.cosine_similarity(weights, reference)
        row[f"{solver}_excess"] = excess["excess"]
        row[f"{solver}_bias"] = excess["bias"]
        row[f"{solver}_noise"] = excess["excess"] - excess["bias"]
    return row


def main(
    config: configs.KScalingConfig, out: pathlib.Path | None = None, *, reproducible: bool = False
) -> dict:
    """Runs the study; returns (and, with `out`, writes) the results.

    Each DP run is repeated without noise (σ = 0 or ε_0 = ∞; same C, η, T, b, batches): that
    run's excess is the optimisation + clipping bias, and the rest of the DP run's excess is the
    noise part. The seeds make the data (and, for trained proxies, the public split and proxy);
    the DP runs' noise and sampling are secret unless `reproducible`.
    """
    if config.trained is not None and config.trained.data == "imagenet_cifar100":
        _require_tfds(config.trained.tfds_data_dir)  # fail before any work
    noise = noise_levels(config)
    print(
        f"ε = {config.epsilon}, δ = {config.delta}, b = {config.batch_size}; "
        + "; ".join(
            f"{solver} {'ε_0' if solver == configs.EXPONENTIAL_FRANK_WOLFE else 'σ'} by T: "
            + ", ".join(f"{t}: {level:.3g}" for t, level in levels.items())
            for solver, levels in noise.items()
        )
    )
    cache_dir = None if out is None else out / "proxies"
    rows = []
    start = time.time()
    for seed in config.seeds:
        problems = (
            synthetic_instances(config, seed)
            if config.trained is None
            else trained_instances(config, seed, cache_dir)
        )
        for k, clip_norm, instances in problems:
            for instance in instances:
                rows.append(
                    run_instance(
                        config,
                        k,
                        seed,
                        clip_norm,
                        instance,
                        noise,
                        reproducible=reproducible,
                    )
                )
            mine = rows[-len(instances) :]
            parts = ", ".join(
                f"{s} {np.mean([r[f'{s}_excess'] for r in mine]):.2e}"
                f" (bias {np.mean([r[f'{s}_bias'] for r in mine]):.1e})"
                for s in config.solvers
            )
            print(
                f"seed {seed} k = {k:4d}: C = {clip_norm:.1f}, {len(instances)} task(s), mean"
                f" excess {parts} [{time.time() - start:.0f}s]",
                flush=True,
            )

    summary = summarise(config, rows)
    results = {
        "config": dataclasses.asdict(config),
        "proxies": "synthetic" if config.trained is None else "trained",
        "noise": {
            solver: {str(t): v for t, v in levels.items()} for solver, levels in noise.items()
        },
        "noise_seeded": reproducible,
        "seconds": time.time() - start,
        "provenance": provenance(),
        "rows": rows,
        **summary,
    }
    return finish(
        out,
        results,
        markdown(config, results),
        name="k_scaling",
        plots={"k_scaling.png": plot},
    )


def summarise(config: configs.KScalingConfig, rows: list[dict]) -> dict:
    """Per k (over seeds and tasks): mean/std of the excess and its bias and noise parts, C, T,
    η, the clipped fraction; slopes.

    `slopes[name]` fits the mean total excess; `part_slopes[name]` fits the mean bias and the
    mean noise part separately (a mean <= 0 is floored at 1e-12 and makes that slope meaningless).
    """
    ks = np.array(config.ks)

    def stats(key: str) -> dict:
        per_k = [[r[key] for r in rows if r["k"] == k] for k in config.ks]
        return {
            "mean": [float(np.mean(v)) for v in per_k],
            "std": [float(np.std(v)) for v in per_k],
        }

    table = {name: stats(f"{name}_excess") for name in (*config.solvers, "uniform")}
    parts = {s: {p: stats(f"{s}_{p}") for p in ("bias", "noise")} for s in config.solvers}
    slopes = {
        s: loglog_slope(ks, np.array(table[s]["mean"]), config.slope_min_k) for s in config.solvers
    }
    part_slopes = {
        s: {
            p: loglog_slope(ks, np.array(parts[s][p]["mean"]), config.slope_min_k)
            for p in ("bias", "noise")
        }
        for s in config.solvers
    }
    steps = {
        s: [next(r[f"{s}_steps"] for r in rows if r["k"] == k) for k in config.ks]
        for s in config.solvers
    }
    return {
        "ks": list(config.ks),
        "clip_norms": stats("clip_norm"),
        "steps": steps,
        "clipped_at_optimum": stats("clipped_at_optimum"),
        "excess": table,
        "parts": parts,
        "slopes": slopes,
        "part_slopes": part_slopes,
        "max_epsilon": max(r[f"{s}_epsilon"] for r in rows for s in config.solvers),
    }


def _setting(config: configs.KScalingConfig) -> str:
    if config.trained is None:
        return (
            f"synthetic proxies, n = {config.num_examples}, {len(config.seeds)} seeds; C_k from a"
            " public stand-in problem"
        )
    trained = config.trained
    sources = (
        "digit-subset label functions over MNIST-5k"
        if trained.data == "digits"
        else "ImageNet-2012 classes, tasks: CIFAR-100 classes"
    )
    return (
        f"trained {trained.num_label_functions}-head proxy ({sources}), k = its first k heads,"
        f" {trained.num_tasks} tasks × {len(config.seeds)} seeds, n = {config.num_examples};"
        " C_k from the proxy's outputs on a public holdout"
    )


def markdown(config: configs.KScalingConfig, summary: dict) -> str:
    """The summary as markdown tables (total excess; bias/noise parts) plus the fitted slopes."""
    names = [*config.solvers, "uniform"]
    steps_head = " | ".join(f"T {s}" for s in config.solvers)
    lines = [
        f"| k | C_k | {steps_head} | clipped at optimum | "
        + " | ".join(f"{n} excess" for n in names)
        + " |"
    ]
    lines.append("|---" * (len(names) + len(config.solvers) + 3) + "|")
    for i, k in enumerate(summary["ks"]):
        cells = [
            f"{summary['excess'][n]['mean'][i]:.2e} ± {summary['excess'][n]['std'][i]:.1e}"
            for n in names
        ]
        steps = " | ".join(str(summary["steps"][s][i]) for s in config.solvers)
        lines.append(
            f"| {k} | {summary['clip_norms']['mean'][i]:.1f} | {steps} | "
            f"{summary['clipped_at_optimum']['mean'][i]:.1%} | " + " | ".join(cells) + " |"
        )
    heads = [f"{s} {p}" for s in config.solvers for p in ("bias (no noise)", "noise")]
    lines += ["", "| k | " + " | ".join(heads) + " |", "|---" * (len(heads) + 1) + "|"]
    for i, k in enumerate(summary["ks"]):
        cells = [
            f"{summary['parts'][s][p]['mean'][i]:.2e} ± {summary['parts'][s][p]['std'][i]:.1e}"
            for s in config.solvers
            for p in ("bias", "noise")
        ]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    slopes = "; ".join(
        f"{s}: {summary['slopes'][s]:.2f} (bias {summary['part_slopes'][s]['bias']:.2f},"
        f" noise {summary['part_slopes'][s]['noise']:.2f})"
        for s in config.solvers
    )
    lines.append(
        f"\nlog-log slope of the mean excess over k >= {config.slope_min_k}: {slopes};"
        f" the paper (Appendix A.6, mirror descent): {PAPER_SLOPE} (theory 0.5)"
    )
    lines.append(f"Setting: {_setting(config)}.")
    lines.append(
        f"ε = {config.epsilon} (largest accountant ε of a run: {summary['max_epsilon']:.3f}),"
        f" δ = {config.delta}, b = {config.batch_size}; C_k = {config.clip_scale} ×"
        f" q{config.clip_quantile:g} of public gradient norms at uniform λ (quarter-octave grid);"
        f" mirror descent T_k = min({config.max_steps}, ⌈(nε)²/(ln k ln(1/δ))⌉),"
        f" η_k = {config.step_size} √(2 ln k / T_k)/C_k; Frank-Wolfe (either oracle)"
        f" T_k = min({config.max_steps}, ⌈(nε/(ln k √ln(1/δ)))^(2/3)⌉); bias = excess of the"
        " same run without noise (σ = 0, or ε_0 = ∞), noise = the rest."
    )
    if configs.EXPONENTIAL_FRANK_WOLFE in config.solvers:
        lines.append(
            f"{configs.EXPONENTIAL_FRANK_WOLFE}: the exponential mechanism picks each step's"
            " vertex from the clipped gradient sum over all n examples (no sampling); ε_0 per"
            " selection is calibrated so that the T_k selections, ε_0²/8-zCDP each, compose to"
            " ε (RDP accountant; the other solvers: PLD)."
        )
    lines.append(SEEDED_NOTE if summary.get("noise_seeded") else "DP noise and sampling secret.")
    return "\n".join(lines)


def plot(results: dict, path: pathlib.Path) -> None:
    """Excess loss against k per solver (mean ± std over seeds × tasks), with its fitted slope
    and a line of the paper's slope through the first point of the fit.

    Draws from `results` alone (`k_scaling.json` read back will do).
    """
    config = results["config"]
    ks = np.array(results["ks"])
    min_k = config["slope_min_k"]
    first = int(np.argmax(ks >= min_k))
    runs = counted(sum(row["k"] == ks[0] for row in results["rows"]), "run")
    solvers = config["solvers"]
    fig, axes = plt.subplots(1, len(solvers), figsize=(5.5 * len(solvers), 4.5))
    for ax, solver in zip(np.atleast_1d(axes), solvers, strict=True):
        part_slopes = results["part_slopes"][solver]
        curves = {
            f"total (fitted slope {results['slopes'][solver]:.2f})": results["excess"][solver],
            f"bias, no noise (fitted slope {part_slopes['bias']:.2f})": results["parts"][solver][
                "bias"
            ],
            f"noise part (fitted slope {part_slopes['noise']:.2f})": results["parts"][solver][
                "noise"
            ],
            "uniform weights": results["excess"]["uniform"],
        }
        for label, stats in curves.items():
            mean = np.array(stats["mean"])
            keep = mean > 0  # a noise part <= 0 cannot be drawn on a log axis
            ax.errorbar(
                ks[keep], mean[keep], yerr=np.array(stats["std"])[keep], marker="o", label=label
            )
        anchor = results["excess"][solver]["mean"][first]
        fitted = ks[first:]
        ax.plot(
            fitted,
            anchor * (fitted / ks[first]) ** PAPER_SLOPE,
            "k:",
            label=f"slope {PAPER_SLOPE} (the paper's, mirror descent) through the total at"
            f" k = {ks[first]}",
        )
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="number of sources k",
            ylabel=f"excess loss (mean ± std over {runs})",
        )
        ax.minorticks_off()
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.set_title(
            f"{display_name(solver)}, {results['proxies']} proxies, ε = {config['epsilon']:g};"
            f"\nerror bars: ± std over {runs} (seeds × tasks); slopes fitted over"
            f" k ≥ {min_k}",
            fontsize=9,
        )
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _options(parser) -> None:
    parser.add_argument(
        "--proxies",
        default="trained",
        choices=configs.PROXIES,
        help="trained: a multi-head proxy over public label functions; synthetic: sigmoid"
        " proxies with an exact-mixture label model",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="with --preset paper: its data, ResNet-50 proxy, image size, heads and all solvers,"
        " but k in {2, 4, 8}, one seed, two tasks, n = 8 and one proxy step of batch 2 (a test"
        " that the paper path runs; its excess losses mean nothing)",
    )


def _config(args) -> configs.KScalingConfig:
    if args.smoke and args.preset != "paper":
        raise UsageError("--smoke applies to --preset paper")
    if args.smoke and args.proxies != "trained":
        raise UsageError("--smoke applies to the trained proxies, not --proxies synthetic")
    return configs.get_config(args.preset, args.proxies, smoke_test=args.smoke)


cli = Command(
    name="k_scaling",
    description=__doc__.splitlines()[0],
    writes="k_scaling.json, k_scaling.md, k_scaling.png (and the proxy cache)",
    examples=(
        "--preset cpu",
        "--preset cpu --proxies synthetic",
        "--preset paper",
        "--preset paper --smoke",
    ),
    presets=configs.PRESETS,
    options=_options,
    config=_config,
    run=lambda config, args: main(config, args.out, reproducible=args.reproducible),
)


if __name__ == "__main__":
    with experiment_main("k_scaling"):
        cli()
