"""BandMF correlated noise against DP-SGD's independent noise, at equal ε.

Five measurements, each for independent noise and BandMF with several band counts b (cyclic
Poisson sampling over b partitions, accounted as DP-SGD with ceil(T / b) steps at the
partition's rate, σ calibrated to the same target ε):

- fine-tuning: the image demo's private fine-tuning on the digits default (`presets.digit_task`,
  `image_demo_config`) from a random initialisation ("random_init", all of the train split) for
  several epochs; test macro AUC, mean ± std over seeds;
- long fine-tuning: the same with a small expected batch and many epochs, so that the
  partition's rate stays small with b bands (the regime BandMF is meant for);
- text fine-tuning: the text demo's user-level private fine-tuning (`text_presets.text_task`,
  `text_demo_config`) of the model pretrained on the uniform mixture of the public domains (the
  pretrained model is stored once per seed and shared by every mechanism), on all train users;
  test perplexity (lower is better), mean ± std over seeds;
- DP-MixMin: mirror descent on the synthetic exact-mixture problem of `mixing.synthetic`;
  excess MixMin loss over non-private MixMin and cosine of λ to it, mean ± std over seeds;
- the noise step: time of one jitted noise transformation update on a parameter vector.

    python -m experiments.correlated_noise --out DIR [--reproducible]

Settings and measured results: `experiments/configs/correlated_noise.py`.
"""

from __future__ import annotations

import dataclasses
import pathlib
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from dpmix_jax import mixing
from dpmix_jax.mixing.synthetic import mixture_problem
from dpmix_jax.pipeline import presets, stage_store, text_presets
from dpmix_jax.pipeline.compare import provenance
from dpmix_jax.pipeline.image import ImagePipeline
from dpmix_jax.pipeline.text import TextPipeline
from dpmix_jax.privacy import (
    SEEDED_NOTE,
    correlated_noise,
    gaussian_noise,
    randomness,
)
from dpmix_jax.train import fit
from experiments.common_args import experiment_main
from experiments.configs.correlated_noise import CorrelatedNoiseConfig, get_config
from experiments.harness import Command, finish


def _settings(bands: tuple[int, ...]) -> list[tuple[str, dict]]:
    """(label, noise settings) of every compared mechanism: DP-SGD, then BandMF per b."""
    settings = [("DP-SGD", {"noise": "independent", "bands": None})]
    return settings + [(f"BandMF b={b}", {"noise": "bandmf", "bands": b}) for b in bands]


def _learning_rate(learning_rate: float | None) -> dict:
    """The fine-tuning override of the learning rate (none for None: the preset's)."""
    return {} if learning_rate is None else {"learning_rate": learning_rate}


def _mean_std(values: list[float]) -> list[float]:
    return [statistics.fmean(values), statistics.pstdev(values)]


def finetune_rows(
    config: CorrelatedNoiseConfig,
    root: pathlib.Path,
    reproducible: bool,
    *,
    bands: tuple[int, ...],
    epsilons: tuple[float, ...],
    steps: int,
    **finetune_overrides,
) -> list:
    """Test AUC of private fine-tuning from a random initialisation, per mechanism and ε, with
    the demo's fine-tuning settings replaced by `steps` and `finetune_overrides`.

    Privacy: every run is the pipeline's accounted fine-tuning at the target ε; the partition's
    sampling rate q and σ are the ones the accountant used.
    """
    task = presets.digit_task()
    rows = []
    for label, settings in _settings(bands):
        demo = presets.image_demo_config()
        finetune = dataclasses.replace(demo.finetune, steps=steps, **finetune_overrides, **settings)
        folder = root / label.replace(" ", "_").replace("=", "")
        pipeline = ImagePipeline(
            task, dataclasses.replace(demo, finetune=finetune), folder, reproducible=reproducible
        )
        examples = len(pipeline.task.train)
        partition = examples / (settings["bands"] or 1)
        for epsilon in epsilons:
            runs = [pipeline.run("random_init", epsilon, seed) for seed in config.seeds]
            rows.append(
                {
                    "mechanism": label,
                    "optimizer": finetune.optimizer,
                    "learning_rate": finetune.learning_rate,
                    "epsilon": epsilon,
                    "test_auc": _mean_std([r.utility for r in runs]),
                    "max_spent_epsilon": max(r.spent.epsilon for r in runs),
                    "epochs": steps * finetune.batch_size / examples,
                    "sampling_rate": finetune.batch_size / partition,
                }
            )
            print(rows[-1], flush=True)
    return rows


def text_rows(config: CorrelatedNoiseConfig, root: pathlib.Path, reproducible: bool) -> list:
    """Test perplexity of the text demo's user-level private fine-tuning, per mechanism and ε.

    Every mechanism starts from the same model per seed, pretrained on public documents drawn
    uniformly over the domains (stored under `root`), and fine-tunes on all train users; the
    seeds' spread is mostly the pretrained models', so each row also has the paired difference
    to DP-SGD's perplexity at its ε and seed (mean ± std over seeds).

    Privacy: the accounted DP fine-tuning of the text pipeline (`TextPipeline.finetune_trainer`:
    Poisson-sampled users, up to G rows each, clipped per user); its noise and sampler are
    private streams of the run named by mechanism and ε (`private_seed`), and the reported ε is
    the ledger's for the steps that ran.
    """
    pipeline = TextPipeline(
        text_presets.text_task(), text_presets.text_demo_config(), root, reproducible=reproducible
    )
    demo = pipeline.config.finetune
    rows_all = np.arange(len(pipeline.task.train))
    users = len(np.unique(np.asarray(pipeline.task.train.user_ids)))
    uniform = np.full(pipeline.k, 1.0 / pipeline.k)
    models = {seed: pipeline.pretrained(uniform, seed) for seed in config.seeds}
    rows, independent = [], {}
    for label, settings in _settings(config.bands):
        for epsilon in config.epsilons:
            finetune = dataclasses.replace(
                demo, steps=config.text_steps, epsilon=epsilon, delta=config.delta, **settings
            )
            name = f"finetune_{label}_eps{stage_store.epsilon_name(epsilon)}"
            perplexities, spent = [], []
            for seed in config.seeds:
                key = pipeline.private_seed(seed, name, pipeline.config_key)
                trainer, data = pipeline.finetune_trainer(
                    models[seed], finetune, rows_all, randomness.prng_key(key)
                )
                sampler = pipeline.private_seed(seed, name, pipeline.config_key, "sampler")
                result = fit(trainer, data, rng=np.random.default_rng(sampler))
                perplexities.append(pipeline.utility(result.model, "test"))
                spent.append(result.ledger.budget(config.delta, demo.accountant).epsilon)
            baseline = independent.setdefault(epsilon, perplexities)  # DP-SGD runs first
            rows.append(
                {
                    "mechanism": label,
                    "epsilon": epsilon,
                    "test_perplexity": _mean_std(perplexities),
                    "minus_dp_sgd": _mean_std(
                        [p - q for p, q in zip(perplexities, baseline, strict=True)]
                    ),
                    "max_spent_epsilon": max(spent),
                    "epochs": config.text_steps * demo.batch_size / users,
                    "sampling_rate": demo.batch_size / (users / (settings["bands"] or 1)),
                }
            )
            print(rows[-1], flush=True)
    pretrained = [pipeline.utility(models[seed], "test") for seed in config.seeds]
    rows.append({"mechanism": "pretrained only", "test_perplexity": _mean_std(pretrained)})
    return rows


def mixmin_rows(config: CorrelatedNoiseConfig, reproducible: bool) -> list:
    """Excess loss and cosine of DP-MixMin's λ to non-private MixMin, per mechanism and ε."""
    problems = []
    for seed in config.seeds:
        preds, _ = mixture_problem(
            num_examples=config.mixmin_examples, num_sources=config.mixmin_sources, seed=seed
        )
        reference = np.asarray(mixing.mixmin(preds, steps=2000, learning_rate=2.0))
        noise_seed = seed if reproducible else randomness.secret_seed()
        problems.append((preds, reference, noise_seed))
    rows = []
    for label, settings in _settings(config.bands):
        for epsilon in config.epsilons:
            excess, cosine, spent, sigma = [], [], [], None
            for preds, reference, noise_seed in problems:
                result = mixing.dp_mixmin(
                    preds,
                    epsilon=epsilon,
                    delta=config.delta,
                    steps=config.mixmin_steps,
                    batch_size=config.mixmin_batch_size,
                    clip_norm=config.mixmin_clip_norm,
                    learning_rate=config.mixmin_learning_rate,
                    seed=noise_seed,
                    **settings,
                )
                excess.append(mixing.excess_loss(result.weights, reference, preds))
                cosine.append(mixing.cosine_similarity(result.weights, reference))
                spent.append(result.epsilon)
                sigma = result.noise_multiplier
            rows.append(
                {
                    "mechanism": label,
                    "epsilon": epsilon,
                    "noise_multiplier": sigma,
                    "excess_loss": _mean_std(excess),
                    "cosine": _mean_std(cosine),
                    "max_spent_epsilon": max(spent),
                }
            )
            print(rows[-1], flush=True)
    return rows


def noise_step_rows(config: CorrelatedNoiseConfig) -> list:
    """Median wall time of one jitted noise update on a float32 vector of `bench_size`."""
    params = jnp.zeros(config.bench_size, jnp.float32)
    key = jax.random.key(0)  # timing only: this noise protects nothing
    transformations = [("DP-SGD", gaussian_noise.add_gaussian_noise(1.0, key))]
    transformations += [
        (
            f"BandMF b={b}",
            correlated_noise.add_correlated_noise(1.0, correlated_noise.sqrt_prefix_sum(b), key),
        )
        for b in config.bands
    ]
    rows = []
    for label, transformation in transformations:
        update = jax.jit(transformation.update)
        state = transformation.init(params)
        updates, state = update(params, state)  # compile
        jax.block_until_ready(updates)
        times = []
        for _ in range(config.bench_repeats):
            start = time.perf_counter()
            updates, state = update(params, state)
            jax.block_until_ready(updates)
            times.append(time.perf_counter() - start)
        rows.append(
            {
                "mechanism": label,
                "parameters": config.bench_size,
                "median_ms": 1e3 * statistics.median(times),
                "state_copies": len(getattr(state, "history", ())),
            }
        )
        print(rows[-1], flush=True)
    return rows


def _auc_table(rows: list, title: str) -> list[str]:
    lines = [
        title,
        "",
        "| optimizer | η | mechanism | ε | q | test AUC | spent ε (max) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        auc = r["test_auc"]
        lines.append(
            f"| {r['optimizer']} | {r['learning_rate']:g} | {r['mechanism']} | {r['epsilon']:g} | "
            f"{r['sampling_rate']:.3f} | {auc[0]:.4f} ± {auc[1]:.4f} | "
            f"{r['max_spent_epsilon']:.3f} |"
        )
    return lines


def markdown(results: dict) -> str:
    """The tables of `results` (numbers as stored in the JSON, rounded for display)."""
    config = results["config"]
    seeds = len(config["seeds"])
    lines = _auc_table(
        results["finetune"],
        f"Private fine-tuning of the image demo (digits, random initialisation, "
        f"{config['finetune_steps']} steps, {results['finetune'][0]['epochs']:.1f} epochs), "
        f"test macro AUC, mean ± std over {seeds} seeds; q is the sampling rate of a step:",
    )
    lines += [""] + _auc_table(
        results["long_finetune"],
        f"Long private fine-tuning of the image demo (digits, random initialisation, expected "
        f"batch {config['long_batch_size']}, {config['long_steps']} steps, "
        f"{results['long_finetune'][0]['epochs']:.1f} epochs), test macro AUC, "
        f"mean ± std over {seeds} seeds:",
    )
    text = results["text"]
    lines += [
        "",
        f"User-level private fine-tuning of the text demo (embedded text default, the model "
        f"pretrained on the uniform mixture, all train users, {config['text_steps']} steps, "
        f"{text[0]['epochs']:.1f} epochs), test perplexity (lower is better), mean ± std over "
        f"{seeds} seeds:",
        "",
        "| mechanism | ε | q | test perplexity | minus DP-SGD's (paired) | spent ε (max) |",
        "|---|---|---|---|---|---|",
    ]
    for r in text:
        perplexity = f"{r['test_perplexity'][0]:.3f} ± {r['test_perplexity'][1]:.3f}"
        if "epsilon" not in r:
            lines.append(f"| {r['mechanism']} | – | – | {perplexity} | – | – |")
            continue
        paired = f"{r['minus_dp_sgd'][0]:+.3f} ± {r['minus_dp_sgd'][1]:.3f}"
        lines.append(
            f"| {r['mechanism']} | {r['epsilon']:g} | {r['sampling_rate']:.3f} | {perplexity} | "
            f"{paired} | {r['max_spent_epsilon']:.3f} |"
        )
    lines += [
        "",
        f"DP-MixMin (mirror descent; k = {config['mixmin_sources']}, n = "
        f"{config['mixmin_examples']}, T = {config['mixmin_steps']}, batch "
        f"{config['mixmin_batch_size']}, C = {config['mixmin_clip_norm']:g}, η = "
        f"{config['mixmin_learning_rate']:g}), against non-private MixMin, mean ± std:",
        "",
        "| mechanism | ε | σ | excess loss | cosine | spent ε (max) |",
        "|---|---|---|---|---|---|",
    ]
    for r in results["mixmin"]:
        excess, cosine = r["excess_loss"], r["cosine"]
        lines.append(
            f"| {r['mechanism']} | {r['epsilon']:g} | {r['noise_multiplier']:.3f} | "
            f"{excess[0]:.2e} ± {excess[1]:.1e} | {cosine[0]:.4f} ± {cosine[1]:.4f} | "
            f"{r['max_spent_epsilon']:.3f} |"
        )
    lines += [
        "",
        "One jitted noise update (median wall time):",
        "",
        "| mechanism | parameters | ms | float32 parameter copies in the state |",
        "|---|---|---|---|",
    ]
    for r in results["noise_step"]:
        lines.append(
            f"| {r['mechanism']} | {r['parameters']} | {r['median_ms']:.2f} | {r['state_copies']} |"
        )
    origin = results["provenance"]
    lines += [
        "",
        SEEDED_NOTE if results["noise_seeded"] else "Private randomness secret (operating system).",
        f"Command: `{origin['command']}`, {results['wall_s']:.0f} s on {origin['cpu_count']} "
        f"CPU cores ({origin['backend']}), {origin['date']}, commit {origin['commit']}.",
    ]
    return "\n".join(lines)


def main(config: CorrelatedNoiseConfig, out: pathlib.Path, *, reproducible: bool = False) -> dict:
    """Runs the study; writes `results.json` and `results.md` to `out` (stages under it)."""
    start = time.time()
    out.mkdir(parents=True, exist_ok=True)
    results = {
        "config": dataclasses.asdict(config),
        "provenance": provenance(),
        "noise_seeded": reproducible,
        "finetune": finetune_rows(
            config,
            out / "stages",
            reproducible,
            bands=config.bands,
            epsilons=config.epsilons,
            steps=config.finetune_steps,
        ),
        "long_finetune": [
            row
            for optimizer, learning_rate in config.long_optimizers
            for row in finetune_rows(
                config,
                out / "stages" / f"long_{optimizer}_{learning_rate}",
                reproducible,
                bands=config.long_bands,
                epsilons=config.long_epsilons,
                steps=config.long_steps,
                batch_size=config.long_batch_size,
                optimizer=optimizer,
                **_learning_rate(learning_rate),
            )
        ],
        "text": text_rows(config, out / "stages" / "text", reproducible),
        "mixmin": mixmin_rows(config, reproducible),
        "noise_step": noise_step_rows(config),
    }
    results["wall_s"] = time.time() - start
    return finish(out, results, markdown(results))


cli = Command(
    name="correlated_noise",
    description=__doc__.splitlines()[0],
    writes="results.json, results.md, stages/",
    examples=("--reproducible",),
    config=lambda args: get_config(),
    run=lambda config, args: main(config, args.out, reproducible=args.reproducible),
)


if __name__ == "__main__":
    with experiment_main("correlated_noise"):
        cli()
