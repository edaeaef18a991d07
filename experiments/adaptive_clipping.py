"""Adaptive clipping against fixed clip norms in the image demo's private fine-tuning.

On the digits default (`pipeline.presets.digit_task`, `image_demo_config`), DP fine-tuning on D_ft
of the model publicly pretrained on the uniform mixture of the sources (the demo's "uniform"
method) at one ε, for three seeds, with: the preset's tuned C, 10·C and C/10 held fixed, and
adaptive clipping (target quantile 0.5, η = 0.2, σ_b = max(b/20, σ)) started from each of those
three. Every run uses the same σ (calibrated to ε for the preset's q and T); the
ledger's ε is reported. Table: test macro AUC (mean ± std over seeds) and the clip norm at the
end of the run. Writes `adaptive_clipping.json` and `adaptive_clipping.md` under `--out`.

    python -m experiments.adaptive_clipping --out runs/adaptive_clipping

Settings and measured results: `experiments/configs/adaptive_clipping.py`.
"""

from __future__ import annotations

import dataclasses
import pathlib
import time

import numpy as np

from dpmix_jax.pipeline import ImagePipeline, presets
from dpmix_jax.pipeline.compare import provenance
from dpmix_jax.privacy import SEEDED_NOTE, randomness
from dpmix_jax.privacy.adaptive_clipping import AdaptiveClipping, current_clip_norm
from dpmix_jax.privacy.randomness import fresh_secret_key
from dpmix_jax.train import fit
from experiments.common_args import experiment_main
from experiments.configs.adaptive_clipping import AdaptiveClippingStudyConfig, get_config
from experiments.harness import Command, finish


def variants(config: AdaptiveClippingStudyConfig, base_clip: float) -> list[tuple[str, dict]]:
    """(label, TrainConfig overrides) of every compared setting, fixed C first."""
    adaptive = AdaptiveClipping(
        target_quantile=config.target_quantile, learning_rate=config.learning_rate
    )
    fixed = [
        (f"fixed C = {s * base_clip:g}", {"clip_norm": s * base_clip}) for s in config.clip_scales
    ]
    moving = [
        (
            f"adaptive from C = {s * base_clip:g}",
            {"clip_norm": s * base_clip, "adaptive_clipping": adaptive},
        )
        for s in config.clip_scales
    ]
    return fixed + moving


def main(
    config: AdaptiveClippingStudyConfig,
    out: pathlib.Path | None = None,
    *,
    reproducible: bool = False,
    task=None,
) -> dict:
    """Runs every (setting, seed) fine-tuning; returns and writes the results.

    `task` defaults to `presets.digit_task()` (a smaller task makes a quick test).

    Privacy: each run is one DP-SGD release at (ε, δ) on D_ft with σ calibrated for the preset's
    q and T (adaptive clipping spends the same ε); comparing settings on the test split is a
    study of the method, not a private selection.
    """
    start = time.time()
    task = presets.digit_task() if task is None else task
    demo = presets.image_demo_config()
    if config.pretrain_steps is not None:
        demo = dataclasses.replace(
            demo, pretrain=dataclasses.replace(demo.pretrain, steps=config.pretrain_steps)
        )
    finetune = demo.finetune
    if config.steps is not None:
        finetune = dataclasses.replace(finetune, steps=config.steps)
    finetune = dataclasses.replace(finetune, epsilon=config.epsilon, delta=demo.delta)
    root = out if out is not None else pathlib.Path("runs/adaptive_clipping")
    pipeline = ImagePipeline(task, demo, root / "stages", reproducible=reproducible)
    runs = []
    for label, overrides in variants(config, finetune.clip_norm):
        train_config = dataclasses.replace(finetune, **overrides)
        for seed in config.seeds:
            _, rows = pipeline.split(seed)
            init = pipeline.pretrained(np.full(pipeline.k, 1.0 / pipeline.k), seed)
            name = f"adaptive_clipping_{label}"
            noise_key = (
                randomness.prng_key(pipeline.private_seed(seed, name))
                if reproducible
                else fresh_secret_key()
            )
            trainer, data = pipeline.finetune_trainer(init, train_config, rows, noise_key)
            sampler = np.random.default_rng(
                pipeline.private_seed(seed, name, "sampler") if reproducible else None
            )
            result = fit(trainer, data, rng=sampler)
            adaptive = train_config.adaptive_clipping is not None
            final_clip = (
                float(current_clip_norm(result.state.opt_state))
                if adaptive
                else train_config.clip_norm
            )
            runs.append(
                {
                    "setting": label,
                    "seed": seed,
                    "initial_clip_norm": train_config.clip_norm,
                    "adaptive": adaptive,
                    "final_clip_norm": final_clip,
                    "test_auc": pipeline.utility(result.model, "test"),
                    "spent_epsilon": result.ledger.epsilon(demo.delta, train_config.accountant),
                    "noise_multiplier": trainer.plan.noise_multiplier,
                }
            )
            print(
                f"{label} seed {seed}: AUC {runs[-1]['test_auc']:.4f}, C_T {final_clip:.3g}",
                flush=True,
            )
    summary = summarize(runs)
    results = {
        **provenance(),
        "config": dataclasses.asdict(config),
        "task": task.name,
        "finetune": {
            "steps": finetune.steps,
            "batch_size": finetune.batch_size,
            "learning_rate": finetune.learning_rate,
            "delta": demo.delta,
            "preset_clip_norm": finetune.clip_norm,
        },
        "noise_seeded": reproducible,
        "runs": runs,
        "summary": summary,
        "wall_s": time.time() - start,
    }
    results["table"] = markdown(results)
    return finish(out, results, results["table"], name="adaptive_clipping")


def summarize(runs: list[dict]) -> list[dict]:
    """Per setting (in run order): mean and std over seeds of the test AUC and the final C."""
    summary = []
    for label in dict.fromkeys(r["setting"] for r in runs):
        part = [r for r in runs if r["setting"] == label]
        auc = np.array([r["test_auc"] for r in part])
        clip = np.array([r["final_clip_norm"] for r in part])
        summary.append(
            {
                "setting": label,
                "seeds": len(part),
                "test_auc_mean": round(float(auc.mean()), 4),
                "test_auc_std": round(float(auc.std()), 4),
                "final_clip_norm_mean": round(float(clip.mean()), 4),
                "max_spent_epsilon": round(max(r["spent_epsilon"] for r in part), 4),
            }
        )
    return summary


def markdown(results: dict) -> str:
    """The summary as a markdown table, with the run's settings."""
    lines = [
        "| setting | test AUC (mean ± std) | final C (mean) | spent ε |",
        "|---|---|---|---|",
    ]
    for row in results["summary"]:
        lines.append(
            f"| {row['setting']} | {row['test_auc_mean']:.4f} ± {row['test_auc_std']:.4f} | "
            f"{row['final_clip_norm_mean']:.4g} | {row['max_spent_epsilon']:.4g} |"
        )
    ft = results["finetune"]
    lines.append(
        f"\n{results['task']}; DP fine-tuning on D_ft from uniform-λ pretraining, "
        f"T = {ft['steps']}, b = {ft['batch_size']}, lr = {ft['learning_rate']}, "
        f"δ = {ft['delta']:g}, seeds {list(results['config']['seeds'])}; "
        f"{SEEDED_NOTE if results['noise_seeded'] else 'DP noise and sampling secret.'}"
    )
    return "\n".join(lines)


cli = Command(
    name="adaptive_clipping",
    description=__doc__.splitlines()[0],
    writes="adaptive_clipping.json, adaptive_clipping.md, stages/",
    examples=("",),
    config=lambda args: get_config(),
    run=lambda config, args: main(config, args.out, reproducible=args.reproducible),
)


if __name__ == "__main__":
    with experiment_main("adaptive_clipping"):
        cli()
