"""Seconds per generated token of every teacher method against the teachers' forward passes.

One BBC topic's sensitive sentences (those `experiments.topic_generation` gives its teachers) go
to n in-context teachers, built once (`synthesis.build_ensemble`). Every method of
`synthesis.METHODS` is calibrated once for one text (`synthesis.calibrate_on`; Hot PATE over
the public model's candidates with its release floor off, which does not change a step's
work). Then each round writes one text of at most `max_new_tokens` tokens with every method
and with the teachers' average (the ε = ∞ reference: the teachers' forward passes and a sample,
nothing else), in a fresh order each round, after one untimed round that compiles. A method's
cost in a round is its seconds per token over the reference's in the same round; the table
gives the median over rounds and the range. Keys are fixed and no text is kept: a timing
benchmark. Writes results.json and results.md.

    python -m experiments.bench_generation --out runs/bench_generation
"""

from __future__ import annotations

import dataclasses
import pathlib
import time

import jax
import numpy as np

from dpmix_jax import synthesis
from dpmix_jax.pate.peers import reference
from dpmix_jax.pipeline.compare import provenance
from experiments import topic_generation
from experiments.common_args import experiment_main
from experiments.configs import bench_generation as configs
from experiments.harness import Command, finish, progress_log

REFERENCE = "nonprivate"
HOT_PATE = ("coordinated", "independent")


def topic_documents(config: configs.BenchGenerationConfig) -> list[dict]:
    """The topic's sensitive sentences, one document each: those `experiments.topic_generation`
    gives its teachers.

    Privacy: sensitive-side data, read by the teachers only; no text is kept.
    """
    sentences = topic_generation.topic_sentences(
        config.topic, part=0, min_chars=config.min_chars, max_chars=config.max_chars
    )
    return [{"text": sentence} for sentence in sentences]


def main(config: configs.BenchGenerationConfig, out: pathlib.Path | None = None) -> dict:
    """Runs the benchmark; returns (and, with `out`, writes) the results."""
    start = time.time()
    log = progress_log(config.progress, start)
    model = synthesis.load_public_model(config.model, log=log)
    ensemble = synthesis.build_ensemble(
        topic_documents(config),
        model,
        num_teachers=config.num_teachers,
        prompt=config.prompt,
        max_new_tokens=config.max_new_tokens,
        key=jax.random.key(config.seed),
        context_width=config.context_width,
    )
    plans = {
        method: synthesis.calibrate_on(
            ensemble,
            model,
            epsilon=config.epsilon,
            delta=config.delta,
            num_samples=1,
            method=method,
            public_candidates=config.public_candidates if method in HOT_PATE else None,
            min_unanimous_release=0.0,
        )
        for method in config.methods
    }

    def write_one(name: str, key: jax.Array) -> tuple[float, int]:
        """Seconds and tokens of one text by `name` (a method or the reference)."""
        begin = time.perf_counter()
        if name == REFERENCE:
            result = reference.generate_nonprivate(
                ensemble.teachers,
                prompt=ensemble.prompt_ids,
                max_new_tokens=ensemble.max_new_tokens,
                key=key,
                eos_id=model.tokenizer.eos_id,
                stop_sequences=ensemble.stop_sequences,
            )
            tokens = len(result.tokens)
        else:
            chosen, plan = plans[name]
            samples = chosen.generate(
                plan, ensemble.teachers, ensemble.public_model, prompt=ensemble.prompt_ids, key=key
            )
            tokens = sum(len(sample.tokens) for sample in samples)
        return time.perf_counter() - begin, tokens

    names = [*config.methods, REFERENCE]
    order = np.random.default_rng(config.seed)
    timed: dict[str, list[tuple[float, int]]] = {name: [] for name in names}
    for round_index in range(config.rounds + 1):
        for name in order.permutation(names).tolist():
            key = jax.random.fold_in(jax.random.key(config.seed), 1 + names.index(name))
            seconds, tokens = write_one(name, jax.random.fold_in(key, round_index))
            if round_index > 0:  # the first round compiles
                timed[name].append((seconds, tokens))
        log(f"round {round_index} of {config.rounds} (round 0 compiles, untimed)")
    results = {
        "config": dataclasses.asdict(config),
        "model": model.source,
        "rows": ratios(timed),
        "seconds": time.time() - start,
        "provenance": provenance(),
    }
    return finish(out, results, markdown(results))


def ratios(timed: dict[str, list[tuple[float, int]]]) -> list[dict]:
    """Per method: the median seconds per token, and its ratio to the reference's in the same
    round (median, min and max over rounds). A round whose text has no token counts as 1 token
    (it still ran a step)."""
    per_token = {
        name: np.array([seconds / max(tokens, 1) for seconds, tokens in runs])
        for name, runs in timed.items()
    }
    rows = []
    for name, values in per_token.items():
        ratio = values / per_token[REFERENCE]
        rows.append(
            {
                "method": name,
                "seconds_per_token": float(np.median(values)),
                "time_vs_forward": float(np.median(ratio)),
                "time_vs_forward_min": float(ratio.min()),
                "time_vs_forward_max": float(ratio.max()),
                "tokens": int(sum(tokens for _, tokens in timed[name])),
            }
        )
    return rows


def markdown(results: dict) -> str:
    """One row per method: seconds per token and its ratio to the teachers' forward passes."""
    config = results["config"]
    labels = {name: method.label for name, method in synthesis.REGISTRY.items()}
    labels[REFERENCE] = "teachers' average (ε = ∞, the forward passes)"
    lines = [
        "| method | ms per token | × the teachers' forward passes (median) | range over rounds |",
        "|---|---|---|---|",
    ]
    for row in results["rows"]:
        lines.append(
            f"| {labels[row['method']]} | {1000 * row['seconds_per_token']:.0f} |"
            f" {row['time_vs_forward']:.2f} | {row['time_vs_forward_min']:.2f} -"
            f" {row['time_vs_forward_max']:.2f} |"
        )
    lines += [
        "",
        f"Setting: public model {config['model']}; {config['num_teachers']} in-context teachers"
        f" ({config['context_width']}-token contexts) on the BBC {config['topic']} sentences;"
        f" one text of at most {config['max_new_tokens']} tokens per method and round after"
        f" {config['prompt']!r}, {config['rounds']} timed rounds in a fresh order each after one"
        f" that compiles; every method calibrated once for ε = {config['epsilon']:g},"
        f" δ = {config['delta']:g} (Hot PATE over {config['public_candidates']} public"
        " candidates). Ratio: a method's seconds per token over the reference's in the same"
        " round.",
    ]
    return "\n".join(lines)


cli = Command(
    name="bench_generation",
    description=__doc__.splitlines()[0],
    writes="results.json, results.md",
    examples=("--out runs/bench_generation", "--preset tiny --out runs/tiny"),
    presets=configs.PRESETS,
    seeds=None,
    quiet=True,
    reproducible=False,
    config=lambda args: configs.get_config(args.preset),
    run=lambda config, args: main(config, args.out),
)


if __name__ == "__main__":
    with experiment_main("bench_generation"):
        cli()
