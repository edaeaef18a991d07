"""Hot PATE's share of tokens from the teachers against their number n, on SmolLM2-135M.

The text default's e-mail sentences (one document per sentence, the unit) go to n in-context
teachers by a keyed hash (`synthesis.build_ensemble`, built once per n and shared by every
generator); each generator (coordinated or independent histograms, confident-GNMax over the
public model's top candidates, at a target ε) writes the same few short texts through
`synthesis.synthesize_with`, calibrated so that its worst case costs at most (ε, δ). Measured per
run: the tokens the aggregator released from the teachers' votes against those the public
model filled in, the accountant's ε, and the plan's probability that a token all n teachers
agree on is released (a function of public settings: near 1/c a release carries hardly any of
the vote). Each finished run is stored in `stages/` under a key of what determines it, so an
interrupted study resumes where it stopped. Writes results.json, results.md, samples.jsonl and
teacher_share.png.

    python -m experiments.teacher_share --out runs/teacher_share --reproducible
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import time

import jax

from dpmix_jax import synthesis
from dpmix_jax.pipeline.compare import provenance
from dpmix_jax.privacy import randomness
from experiments.common_args import experiment_main
from experiments.configs import teacher_share as configs
from experiments.harness import Command, finish, progress_log
from experiments.run_files import read_stage, write_samples, write_stage


def run_key(
    config: configs.TeacherShareConfig, model_digest: str, num_teachers: int, generator, seed: int
) -> str:
    """The stage name of one run: a hash of everything that determines it (the model by the
    digest of its tokenizer and parameters, `PublicTextModel.digest`)."""
    settings = {
        "model": model_digest,
        "num_teachers": num_teachers,
        "generator": dataclasses.asdict(generator),
        "num_samples": config.num_samples,
        "max_new_tokens": config.max_new_tokens,
        "context_width": config.context_width,
        "delta": config.delta,
        "seed": seed,
    }
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    return f"n{num_teachers}-{generator.method}-{digest}"


def generate(config, model, ensemble, generator, key) -> dict:
    """One generator's texts on the shared ensemble, and where their tokens came from."""
    start = time.perf_counter()
    result = synthesis.synthesize_with(
        ensemble,
        model,
        epsilon=generator.epsilon,
        delta=config.delta,
        num_samples=config.num_samples,
        method=generator.method,
        key=key,
        public_candidates=generator.public_candidates,
        min_unanimous_release=0.0,  # the study measures the share below the floor too
    )
    return {
        "texts": [t.strip() for t in result.texts],
        "marked_texts": [t.strip() for t in result.marked_texts],
        "epsilon": result.epsilon,
        "tokens": result.tokens_generated,
        "teacher_tokens": result.steps_with_output,
        "unanimous_release_probability": result.mechanism.get("unanimous_release_probability"),
        "seconds": time.perf_counter() - start,
    }


def main(
    config: configs.TeacherShareConfig,
    out: pathlib.Path | None = None,
    *,
    reproducible: bool = False,
) -> dict:
    """Runs the study; returns (and, with `out`, writes) the results. Finished runs are read
    back from `out/stages`. Without `reproducible` the partitions, samplers and noise are
    secret."""
    start = time.time()
    log = progress_log(config.progress, start)

    stages = None if out is None else pathlib.Path(out) / "stages"
    model = synthesis.load_public_model(config.model, stages=stages, log=log)
    model_digest = model.digest()
    documents = synthesis.text_default_documents()
    rows, samples = [], []
    for seed in config.seeds:
        key = randomness.prng_key(seed if reproducible else randomness.secret_seed())
        for num_teachers in config.teacher_counts:
            ensemble_key = jax.random.fold_in(jax.random.fold_in(key, num_teachers), 0)
            ensemble = None
            for index, generator in enumerate(config.generators):
                name = run_key(config, model_digest, num_teachers, generator, seed)
                stage = None if stages is None else stages / f"{name}.json"
                if stage is not None and stage.exists():
                    run = read_stage(stage)
                    log(f"n = {num_teachers} {generator.name}: read back from {stage.name}")
                else:
                    if ensemble is None:
                        log(f"n = {num_teachers}: building the teachers' contexts")
                        ensemble = synthesis.build_ensemble(
                            documents,
                            model,
                            num_teachers=num_teachers,
                            max_new_tokens=config.max_new_tokens,
                            key=ensemble_key,
                            context_width=config.context_width,
                        )
                    generator_key = jax.random.fold_in(
                        jax.random.fold_in(key, num_teachers), index + 1
                    )
                    run = generate(config, model, ensemble, generator, generator_key)
                    if stage is not None:
                        write_stage(stage, run)
                    log(
                        f"n = {num_teachers} {generator.name}: ε {run['epsilon']:.3g}, teacher "
                        f"tokens {run['teacher_tokens']}/{run['tokens']}, {run['seconds']:.0f} s"
                    )
                rows.append(
                    {
                        "num_teachers": num_teachers,
                        "generator": generator.name,
                        "method": generator.method,
                        "target_epsilon": generator.epsilon,
                        "public_candidates": generator.public_candidates,
                        "seed": seed,
                        "teacher_share": run["teacher_tokens"] / run["tokens"]
                        if run["tokens"]
                        else 0.0,
                        **{k: v for k, v in run.items() if k not in ("texts", "marked_texts")},
                    }
                )
                samples += [
                    {"num_teachers": num_teachers, "generator": generator.name, "seed": seed,
                     "text": text, "marked_text": marked}
                    for text, marked in zip(run["texts"], run["marked_texts"], strict=True)
                ]  # fmt: skip
    results = {
        "config": dataclasses.asdict(config),
        "model": model.source,
        "noise_seeded": reproducible,
        "rows": rows,
        "seconds": time.time() - start,
        "provenance": provenance(),
    }
    if out is not None:
        write_samples(out, samples)
    return finish(out, results, markdown(results), plots={"teacher_share.png": plot})


def markdown(results: dict) -> str:
    """One row per (n, generator): ε spent, teacher tokens, and the unanimous-release
    probability."""
    config = results["config"]
    lines = [
        f"Model: {config['model']}; the text default's e-mail sentences (one document each); "
        f"δ = {config['delta']:g}; {config['num_samples']} texts of at most "
        f"{config['max_new_tokens']} tokens per run; contexts of {config['context_width']} "
        "tokens.",
        "",
        "| n | generator | ε spent | teacher tokens | share | P(unanimous token released) |",
        "|---|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        carried = row["unanimous_release_probability"]
        lines.append(
            f"| {row['num_teachers']} | {row['generator']} | {row['epsilon']:.3f} | "
            f"{row['teacher_tokens']}/{row['tokens']} | {row['teacher_share']:.2f} | "
            f"{'–' if carried is None else f'{carried:.3f}'} |"
        )
    return "\n".join(lines)


def plot(results: dict, path: pathlib.Path) -> None:
    """The share of teacher tokens against n (solid) and the probability that a unanimous token
    is released (dashed), one colour per generator."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6.4, 4.0))
    names = list(dict.fromkeys(row["generator"] for row in results["rows"]))
    for index, name in enumerate(names):
        rows = sorted(
            (r for r in results["rows"] if r["generator"] == name), key=lambda r: r["num_teachers"]
        )
        counts = [r["num_teachers"] for r in rows]
        colour = f"C{index}"
        axis.plot(counts, [r["teacher_share"] for r in rows], "o-", color=colour, label=name)
        carried = [r["unanimous_release_probability"] for r in rows]
        if all(value is not None for value in carried):
            axis.plot(counts, carried, "--", color=colour, alpha=0.6)
    axis.set_xscale("log", base=2)
    axis.set_ylim(-0.02, 1.02)
    axis.set_xlabel("teachers n")
    axis.set_ylabel("share of tokens from the teachers")
    axis.set_title("solid: teacher tokens; dashed: P(unanimous token released)", fontsize=9)
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


cli = Command(
    name="teacher_share",
    description=__doc__.splitlines()[0],
    writes="results.json, results.md, samples.jsonl, teacher_share.png, stages/",
    examples=("--out runs/teacher_share --reproducible", "--preset tiny --out runs/tiny"),
    presets=configs.PRESETS,
    config=lambda args: configs.get_config(args.preset),
    run=lambda config, args: main(config, args.out, reproducible=args.reproducible),
)


if __name__ == "__main__":
    with experiment_main("teacher_share"):
        cli()
