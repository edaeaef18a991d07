"""Text that reads: private generation on SmolLM2-135M-Instruct against its ε = 0 and ε = ∞
references, on the text default's e-mail sentences and on the example notes.

For each document set the even-numbered documents go to n in-context teachers over the public
model (`synthesis.build_ensemble`, built once and shared by every generator), the odd-numbered
ones are the real held-out text. Each generator writes `num_samples` texts: the public model
alone (ε = 0, `pate.peers.reference.generate_public`), the teachers' average distribution with
no noise (ε = ∞, `generate_nonprivate`), the private methods through
`synthesis.synthesize_with`, each calibrated so that its worst case costs at most (ε, δ), and
DP fine-tuning (`synthesize(method="dp_finetune")`: DP-LoRA of the public model on the
teachers' documents, then sampling; no teachers, so its teacher-token count is empty).
Measured per run: the share of generated words in an English word list
(`quality.english_vocabulary`), MAUVE against the held-out text on the public model's
last-token states, distinct-2, the share of tokens that came from the teachers, and the ε the
accountant gives for what ran. Each finished run is stored in `stages/` under a key of what
determines it, so an interrupted study resumes where it stopped. Writes results.json,
results.md and samples.jsonl.

    python -m experiments.readable_text --out runs/readable_text --reproducible
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import time

import jax

from dpmix_jax import synthesis
from dpmix_jax.pate.peers import reference
from dpmix_jax.pipeline.compare import provenance
from dpmix_jax.privacy import randomness
from dpmix_jax.synthesis import quality
from experiments.common_args import experiment_main
from experiments.configs import readable_text as configs
from experiments.harness import Command, finish, progress_log
from experiments.run_files import read_stage, run_slot, write_samples, write_stage

NOTES = pathlib.Path(__file__).resolve().parents[1] / "docs" / "examples" / "generate"


def documents(name: str) -> tuple[list[dict], list[str]]:
    """The set's (teachers' documents, held-out texts): even and odd positions.

    Privacy: both halves are sensitive-side data; the held-out half is read only by the
    (non-private) measures.
    """
    if name == "text_default":
        records = list(synthesis.text_default_documents())
    else:
        records = synthesis.load_documents(NOTES)
    return list(records[0::2]), [r["text"] for r in records[1::2]]


def run_key(
    config: configs.ReadableTextConfig, model_digest: str, document_set, generator, seed: int
) -> str:
    """The stage name of one run: a hash of everything that determines it (the model by the
    digest of its tokenizer and parameters, `PublicTextModel.digest`)."""
    finetuning = None
    if generator.method == synthesis.DP_FINETUNE:
        finetuning = [config.finetune_steps, document_set.finetune_batch_size]
    # The documents' settings apart from DP fine-tuning's batch, which `finetuning` holds.
    documents_settings = dataclasses.asdict(document_set)
    del documents_settings["finetune_batch_size"]
    settings = {
        "model": model_digest,
        "document_set": documents_settings,
        "generator": dataclasses.asdict(generator),
        "num_samples": config.num_samples,
        "max_new_tokens": config.max_new_tokens,
        "delta": config.delta,
        "seed": seed,
        **({"finetuning": finetuning} if finetuning else {}),
    }
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    return f"{document_set.name}-{generator.method}-{digest}"


def generate(config, model, ensemble, generator, key, *, documents, document_set) -> dict:
    """One generator's texts on the shared ensemble (DP fine-tuning: on the teachers'
    `documents`), and what they cost.

    Privacy: "nonprivate" reads the teachers without noise (ε = ∞): a reference only.
    """
    start = time.perf_counter()
    private = dict(
        epsilon=generator.epsilon,
        delta=config.delta,
        num_samples=config.num_samples,
        method=generator.method,
        key=key,
    )
    if generator.method == synthesis.DP_FINETUNE:
        result = synthesis.synthesize(
            documents,
            model,
            **private,
            max_new_tokens=config.max_new_tokens,
            finetuning=synthesis.GeneratorTuning(
                steps=config.finetune_steps, batch_size=document_set.finetune_batch_size
            ),
        )
        texts, marked = list(result.texts), list(result.marked_texts)
        tokens, teacher_tokens = result.tokens_generated, None
        epsilon, mechanism = result.epsilon, result.mechanism
    elif generator.method in configs.REFERENCES:
        settings = dict(
            prompt=ensemble.prompt_ids,
            max_new_tokens=config.max_new_tokens,
            eos_id=model.tokenizer.eos_id,
            stop_sequences=ensemble.stop_sequences,
        )
        texts, teacher_tokens, tokens = [], 0, 0
        for index in range(config.num_samples):
            text_key = jax.random.fold_in(key, index)
            if generator.method == "public":
                result = reference.generate_public(ensemble.public_model, key=text_key, **settings)
            else:
                result = reference.generate_nonprivate(ensemble.teachers, key=text_key, **settings)
            kept = len(result.tokens) - (result.stop_reason == "eos")
            texts.append(model.tokenizer.decode(result.tokens[:kept]))
            tokens += len(result.tokens)
            teacher_tokens += result.sources.count("private")
        epsilon = 0.0 if generator.method == "public" else float("inf")
        marked, mechanism = texts, {}
    else:
        result = synthesis.synthesize_with(
            ensemble,
            model,
            **private,
            public_candidates=generator.public_candidates,
            min_unanimous_release=0.0,  # the study records how rarely a unanimous token wins
        )
        texts, marked = list(result.texts), list(result.marked_texts)
        tokens, teacher_tokens = result.tokens_generated, result.steps_with_output
        epsilon, mechanism = result.epsilon, result.mechanism
    return {
        "texts": [t.strip() for t in texts],
        "marked_texts": [t.strip() for t in marked],
        "epsilon": epsilon,
        "tokens": tokens,
        "teacher_tokens": teacher_tokens,
        "seconds": time.perf_counter() - start,
        "unanimous_release_probability": mechanism.get("unanimous_release_probability"),
    }


def measure(config, texts: list[str], heldout: list[str], featurize) -> dict:
    """English-word share, distinct-2 and MAUVE against the held-out texts (None with fewer
    than `quality.MIN_MAUVE_TEXTS` worded texts on a side).

    Privacy: not private: MAUVE reads the real held-out texts (evaluation only).
    """
    worded = [t for t in texts if quality.words(t)]
    mauve = None
    if min(len(worded), len(heldout)) >= quality.MIN_MAUVE_TEXTS:
        mauve = quality.mauve_score(
            heldout, worded, featurize=featurize, seed=config.mauve_seed
        ).mauve
    return {
        "english_share": quality.vocabulary_share(worded, quality.english_vocabulary())
        if worded
        else 0.0,
        "distinct_2": quality.distinct_n(worded, 2) if worded else 0.0,
        "mauve": mauve,
        "worded_texts": len(worded),
    }


def main(
    config: configs.ReadableTextConfig,
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
    featurize = quality.last_token_features(
        model.model, model.tokenizer, max_tokens=min(64, int(model.model.config.n_positions))
    )
    rows, samples = [], []
    for document_set in config.document_sets:
        teachers_documents, heldout = documents(document_set.name)
        heldout = heldout[: document_set.heldout]
        heldout_measures = measure(config, heldout, heldout, featurize)
        for seed in config.seeds:
            key = randomness.prng_key(seed if reproducible else randomness.secret_seed())
            ensemble = None
            for generator in config.generators:
                name = run_key(config, model_digest, document_set, generator, seed)
                stage = None if stages is None else stages / f"{name}.json"
                if stage is not None and stage.exists():
                    run = read_stage(stage)
                    log(f"{document_set.name} {generator.name}: read back from {stage.name}")
                else:
                    if ensemble is None and generator.method != synthesis.DP_FINETUNE:
                        log(f"{document_set.name}: {document_set.num_teachers} teachers")
                        ensemble = synthesis.build_ensemble(
                            teachers_documents,
                            model,
                            num_teachers=document_set.num_teachers,
                            max_new_tokens=config.max_new_tokens,
                            key=jax.random.fold_in(key, 0),
                            context_width=document_set.context_width,
                        )
                    generator_key = jax.random.fold_in(
                        key, 1 + run_slot(generator, configs.DEFAULT_GENERATORS)
                    )
                    run = generate(
                        config, model, ensemble, generator, generator_key,
                        documents=teachers_documents, document_set=document_set,
                    )  # fmt: skip
                    run |= measure(config, run["texts"], heldout, featurize)
                    if stage is not None:
                        write_stage(stage, run)
                    log(
                        f"{document_set.name} {generator.name}: ε {run['epsilon']:.3g}, "
                        f"English {run['english_share']:.2f}, teacher tokens "
                        f"{run['teacher_tokens'] or '-'}/{run['tokens']}, {run['seconds']:.0f} s"
                    )
                rows.append(
                    {
                        "document_set": document_set.name,
                        "generator": generator.name,
                        "method": generator.method,
                        "target_epsilon": generator.epsilon,
                        "public_candidates": generator.public_candidates,
                        "seed": seed,
                        **{k: v for k, v in run.items() if k not in ("texts", "marked_texts")},
                    }
                )
                samples += [
                    {"document_set": document_set.name, "generator": generator.name,
                     "seed": seed, "text": text, "marked_text": marked}
                    for text, marked in zip(run["texts"], run["marked_texts"], strict=True)
                ]  # fmt: skip
        rows.append(
            {
                "document_set": document_set.name,
                "generator": "held-out real text",
                "method": "heldout",
                "target_epsilon": None,
                "public_candidates": None,
                "seed": None,
                **heldout_measures,
            }
        )
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
    return finish(out, results, markdown(results))


def _number(value, digits: int = 2) -> str:
    if value is None:
        return "–"
    if value == float("inf"):
        return "∞"
    return f"{value:.{digits}f}"


def markdown(results: dict) -> str:
    """One table per document set: every generator's ε, English-word share, MAUVE, distinct-2
    and teacher-token share."""
    lines = [
        f"Model: {results['config']['model']}; δ = {results['config']['delta']:g} per private run; "
        f"{results['config']['num_samples']} texts of at most "
        f"{results['config']['max_new_tokens']} tokens per run.",
    ]
    for document_set in results["config"]["document_sets"]:
        name = document_set["name"]
        lines += [
            "",
            f"**{name}** ({document_set['num_teachers']} teachers):",
            "",
            "| generator | ε spent | English words | MAUVE | distinct-2 | teacher tokens |",
            "|---|---|---|---|---|---|",
        ]
        for row in results["rows"]:
            if row["document_set"] != name:
                continue
            share = (
                "–"
                if row.get("teacher_tokens") is None
                else f"{row['teacher_tokens']}/{row['tokens']}"
            )
            lines.append(
                f"| {row['generator']} | {_number(row.get('epsilon'), 3)} | "
                f"{_number(row['english_share'])} | {_number(row['mauve'], 3)} | "
                f"{_number(row['distinct_2'])} | {share} |"
            )
    return "\n".join(lines)


cli = Command(
    name="readable_text",
    description=__doc__.splitlines()[0],
    writes="results.json, results.md, samples.jsonl, stages/",
    examples=("--out runs/readable_text --reproducible", "--preset tiny --out runs/tiny"),
    presets=configs.PRESETS,
    config=lambda args: configs.get_config(args.preset),
    run=lambda config, args: main(config, args.out, reproducible=args.reproducible),
)


if __name__ == "__main__":
    with experiment_main("readable_text"):
        cli()
