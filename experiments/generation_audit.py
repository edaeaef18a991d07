"""A canary audit of every private text generator: an empirical ε lower bound from one run,
against each generator's claimed ε and against a control with no noise.

m canary documents share a public prefix ("My secret code is") and each ends in two rare words
of its own. Canary i is included with probability 1/2; teacher i reads it first (if included),
then a few real sentences of its own (one teacher per unit,
`synthesis.ensemble.build_unit_ensemble`), so the canary's presence changes one teacher's
context and nothing else: a change every teacher method's analysis covers (for DP
fine-tuning, a change within one user: twice its add-or-remove ε, a larger δ). Every generator
writes `num_texts` texts from the prefix (the teacher methods through
`synthesis.synthesize_with` at the claimed ε; DP fine-tuning trains on every teacher's
documents, each teacher's a user, then samples after the prefix).
Canary i's score is how often its two words occur in the texts; the auditor guesses the
highest-scored canaries in and the lowest out, and `privacy.audit.one_run_epsilon_lower_bound`
(Steinke, Nasr, Jagielski 2023) bounds ε from the correct guesses. A sound generator's bound
stays below its claim; a generator with no privacy (ε = ∞) is the control: its bound
shows what the audit can detect at this number of canaries. The control is the teacher ensemble
published with no aggregation at all: each text wholly one teacher's, drawn at random; the
teachers' average with no noise is run beside it. Writes results.json and results.md.

    python -m experiments.generation_audit --out runs/generation_audit --reproducible
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

from dpmix_jax import synthesis
from dpmix_jax.data.builtin import BBC_TOPICS, held_out_domains
from dpmix_jax.pate.peers import decoding, reference
from dpmix_jax.pipeline.compare import provenance
from dpmix_jax.privacy import SEEDED_NOTE, audit, randomness
from dpmix_jax.synthesis import public_models, quality
from dpmix_jax.synthesis.ensemble import build_unit_ensemble
from dpmix_jax.synthesis.registry import OWN_SETTINGS
from experiments.common_args import experiment_main
from experiments.configs import generation_audit as configs
from experiments.harness import Command, finish, progress_log
from experiments.run_files import read_stage, run_slot, write_samples, write_stage

CONTROL = "single_teacher"
AVERAGE = "nonprivate"
REFERENCES = (CONTROL, AVERAGE)
# Every generator at the default ε, then the references: a run's randomness follows its place
# here (`run_slot`), so an audit of fewer runs draws the same texts for each.
FULL_PLAN = [(g, e) for g in configs.GENERATORS for e in configs.EPSILONS] + [
    (r, None) for r in REFERENCES
]
HOT_PATE = ("coordinated", "independent")
LABELS = {
    **{name: method.label for name, method in synthesis.REGISTRY.items()},
    synthesis.DP_FINETUNE: "DP fine-tuning (DP-LoRA)",
    CONTROL: "one teacher per text, no aggregation (control, ε = ∞)",
    AVERAGE: "teachers' average, no noise (ε = ∞)",
}


@dataclasses.dataclass(frozen=True)
class Canaries:
    """The audit's canaries: each one's two rare words, and which were included."""

    words: tuple[tuple[str, str], ...]
    included: tuple[bool, ...]


def draw_canaries(config: configs.GenerationAuditConfig) -> Canaries:
    """m pairs of rare English words (7 to 10 letters, no word in two canaries) and each
    canary's inclusion, a fair coin, all drawn from `config.seed`."""
    rng = np.random.default_rng(config.seed)
    pool = sorted(w for w in quality.english_vocabulary() if w.isalpha() and 7 <= len(w) <= 10)
    chosen = rng.choice(len(pool), size=2 * config.num_canaries, replace=False)
    words = tuple(
        (pool[chosen[2 * i]], pool[chosen[2 * i + 1]]) for i in range(config.num_canaries)
    )
    included = tuple(bool(x) for x in rng.random(config.num_canaries) < 0.5)
    return Canaries(words=words, included=included)


def canary_text(config: configs.GenerationAuditConfig, words: tuple[str, str]) -> str:
    return f"{config.canary_prefix} {words[0]} {words[1]}."


def teacher_documents(config: configs.GenerationAuditConfig, canaries: Canaries) -> list[dict]:
    """Every teacher's documents as one user's: its canary first (if included), then
    `fillers_per_teacher` real sentences of the BBC topics no other teacher reads.

    Privacy: the canaries are the audit's own; the fillers stand in for sensitive data.
    """
    held_out = held_out_domains(seed=0)
    fillers = [
        s[:160]
        for topic in BBC_TOPICS
        for s in public_models.split_sentences(held_out[f"bbc_{topic}"], min_chars=40)
    ]
    documents = []
    for i, (words, included) in enumerate(zip(canaries.words, canaries.included, strict=True)):
        if included:
            documents.append({"text": canary_text(config, words), "user": i})
        start = i * config.fillers_per_teacher
        for sentence in fillers[start : start + config.fillers_per_teacher]:
            documents.append({"text": sentence, "user": i})
    return documents


def scores(texts: list[str], canaries: Canaries) -> np.ndarray:
    """Per canary: how many of its two words occur, summed over the texts."""
    counted = [set(quality.words(text.lower())) for text in texts]
    return np.asarray(
        [sum((a in words) + (b in words) for words in counted) for a, b in canaries.words],
        np.float64,
    )


def run_name(config, digest: str, generator: str, epsilon: float | None) -> str:
    """The stage name of one run: a hash of everything that determines it."""
    settings = {
        **{k: v for k, v in dataclasses.asdict(config).items() if k != "progress"},
        "generators": None,
        "epsilons": None,
        "model": digest,
        "generator": generator,
        "epsilon": epsilon,
    }
    text = json.dumps(settings, sort_keys=True, default=str)
    return f"{generator}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"


def generate(config, model, documents, ensemble, generator: str, epsilon, key) -> dict:
    """One generator's texts from the canaries' prefix, and what they cost.

    Privacy: the control reads the teachers without noise (ε = ∞): a reference only.
    """
    start = time.perf_counter()
    if generator in REFERENCES:
        texts = [
            config.canary_prefix + text
            for text in reference_texts(config, model, ensemble(), generator, key)
        ]
        spent, teacher_share = float("inf"), 1.0
    elif generator == synthesis.DP_FINETUNE:
        trained = synthesis.finetune_generator(
            documents,
            model,
            epsilon=epsilon,
            delta=config.delta,
            key=key,
            max_new_tokens=config.max_new_tokens,
            tuning=config.finetuning,
        )
        result = trained.sample(
            config.num_texts, prefix=config.canary_prefix, key=jax.random.fold_in(key, 1)
        )
        texts, spent, teacher_share = list(result.texts), result.epsilon, None
    else:
        # InvisibleInk's own setting gives every text a disjoint batch of teachers: at most
        # one text per teacher.
        num_texts = config.num_texts
        if generator in OWN_SETTINGS:
            num_texts = min(num_texts, config.num_canaries)
        result = synthesis.synthesize_with(
            ensemble(),
            model,
            epsilon=epsilon,
            delta=config.delta,
            num_samples=num_texts,
            method=generator,
            prompt=config.canary_prefix,
            key=key,
            public_candidates=config.public_candidates if generator in HOT_PATE else None,
            min_unanimous_release=0.0,  # measured, not refused: the audit reads every method
        )
        texts, spent = list(result.texts), result.epsilon
        teacher_share = result.steps_with_output / max(result.tokens_generated, 1)
    return {
        "texts": texts,
        "epsilon": spent,
        "teacher_share": teacher_share,
        "seconds": time.perf_counter() - start,
    }


def reference_texts(config, model, ensemble, generator: str, key) -> list[str]:
    """The ε = ∞ texts: each from the teachers' average distribution (`AVERAGE`), or each
    wholly from one teacher drawn at random (`CONTROL`: what is published without any
    aggregation), as many as the generators write.

    Privacy: not private (ε = ∞): references only.
    """
    settings = dict(
        prompt=ensemble.prompt_ids,
        max_new_tokens=config.max_new_tokens,
        eos_id=model.tokenizer.eos_id,
        stop_sequences=ensemble.stop_sequences,
    )
    texts = []
    for index in range(config.num_texts):
        text_key, teacher_key = jax.random.split(jax.random.fold_in(key, index))
        if generator == AVERAGE:
            result = reference.generate_nonprivate(ensemble.teachers, key=text_key, **settings)
            tokens = result.tokens[: len(result.tokens) - (result.stop_reason == "eos")]
        else:
            teacher = int(jax.random.randint(teacher_key, (), 0, ensemble.teachers.num_teachers))

            def next_token(step_key, prefix, teacher=teacher):
                logits = jnp.asarray(ensemble.teachers(prefix))[teacher]
                return int(jax.random.categorical(step_key, logits.astype(jnp.float32)))

            decoded = decoding.decode(next_token, key=text_key, **settings)
            tokens = decoded.tokens[: len(decoded.tokens) - (decoded.stop_reason == "eos")]
        texts.append(model.tokenizer.decode(tokens))
    return texts


def bound(config, run: dict, canaries: Canaries) -> dict:
    """The one-run ε lower bound from the run's texts, and the guesses behind it.

    Privacy: not private: the auditor knows which canaries were included (evaluation only).
    """
    canary_scores = scores(run["texts"], canaries)
    lower = audit.one_run_epsilon_lower_bound(
        canary_scores,
        np.asarray(canaries.included),
        delta=config.delta,
        confidence=config.confidence,
    )
    included = np.asarray(canaries.included)
    return {
        "epsilon_lower_bound": lower.epsilon,
        "guesses": lower.details["guesses"],
        "correct": lower.details["correct"],
        "included_seen": int(np.sum((canary_scores > 0) & included)),
        "excluded_seen": int(np.sum((canary_scores > 0) & ~included)),
    }


def main(
    config: configs.GenerationAuditConfig,
    out: pathlib.Path | None = None,
    *,
    reproducible: bool = False,
) -> dict:
    """Runs the audit; returns (and, with `out`, writes) the results. Finished runs are read
    back from `out/stages`. Without `reproducible` the generators' randomness is secret (the
    canaries and their inclusion always come from `config.seed`: the auditor knows them)."""
    start = time.time()
    log = progress_log(config.progress, start)

    stages = None if out is None else pathlib.Path(out) / "stages"
    model = synthesis.load_public_model(config.model, stages=stages, log=log)
    digest = model.digest()
    canaries = draw_canaries(config)
    documents = teacher_documents(config, canaries)
    built: list[synthesis.Ensemble] = []

    def ensemble() -> synthesis.Ensemble:
        if not built:
            built.append(
                build_unit_ensemble(
                    documents,
                    model,
                    num_teachers=None,
                    prompt=config.canary_prefix,
                    max_new_tokens=config.max_new_tokens,
                    batch_size=64,
                    stop_at_newline=True,
                    separator="\n",
                    on_step=None,
                    context_width=config.context_width,
                )
            )
        return built[0]

    key = randomness.prng_key(config.seed if reproducible else randomness.secret_seed())
    plan = [(g, e) for g in config.generators for e in config.epsilons]
    plan += [(reference_name, None) for reference_name in REFERENCES]
    rows, samples = [], []
    for generator, epsilon in plan:
        stage = None
        if stages is not None:
            stage = stages / f"{run_name(config, digest, generator, epsilon)}.json"
        if stage is not None and stage.exists():
            run = read_stage(stage)
        else:
            run = generate(
                config, model, documents, ensemble, generator, epsilon,
                jax.random.fold_in(key, run_slot((generator, epsilon), FULL_PLAN)),
            )  # fmt: skip
            run |= bound(config, run, canaries)
            if stage is not None:
                write_stage(stage, run)
        rows.append(
            {
                "generator": generator,
                "target_epsilon": epsilon,
                **{k: v for k, v in run.items() if k != "texts"},
            }
        )
        samples += [
            {"generator": generator, "target_epsilon": epsilon, "text": t} for t in run["texts"]
        ]
        log(
            f"{LABELS[generator]}"
            + ("" if epsilon is None else f" ε = {epsilon:g}")
            + f": ε lower bound {run['epsilon_lower_bound']:.2f} ({run['correct']} of"
            f" {run['guesses']} guesses right), {run['seconds']:.0f} s"
        )
    results = {
        "config": dataclasses.asdict(config),
        "model": model.source,
        "canaries_included": int(sum(canaries.included)),
        "noise_seeded": reproducible,
        "rows": rows,
        "seconds": time.time() - start,
        "provenance": provenance(),
    }
    if out is not None:
        write_samples(out, samples)
    return finish(out, results, markdown(results))


def markdown(results: dict) -> str:
    """One row per audited run: claimed ε, the audit's lower bound and its guesses."""
    config = results["config"]
    lines = [
        "| generator | ε claimed | ε lower bound | correct guesses | included canaries seen |"
        " excluded canaries seen | teacher tokens |",
        "|---|---|---|---|---|---|---|",
    ]
    included = results["canaries_included"]
    excluded = config["num_canaries"] - included
    for row in results["rows"]:
        share = "–" if row["teacher_share"] is None else f"{row['teacher_share']:.2f}"
        claimed = "∞" if row["target_epsilon"] is None else f"{row['epsilon']:.3g}"
        lines.append(
            f"| {LABELS[row['generator']]} | {claimed} | {row['epsilon_lower_bound']:.2f} |"
            f" {row['correct']}/{row['guesses']} | {row['included_seen']}/{included} |"
            f" {row['excluded_seen']}/{excluded} | {share} |"
        )
    lines += [
        "",
        f"Setting: public model {config['model']}; {config['num_canaries']} canaries"
        f" ({config['canary_prefix']!r} and two rare words), each first in its own teacher's"
        f" context, included with probability 1/2 ({included} were); {config['num_texts']}"
        f" texts of at most {config['max_new_tokens']} tokens per run; ε lower bound: the"
        " one-run audit of Steinke, Nasr and Jagielski (2023) at δ ="
        f" {config['delta']:g}, confidence {config['confidence']:g}, over the canaries ranked"
        " by how often their words occur in the texts.",
        SEEDED_NOTE if results.get("noise_seeded") else "The generators' randomness secret.",
    ]
    return "\n".join(lines)


cli = Command(
    name="generation_audit",
    description=__doc__.splitlines()[0],
    writes="results.json, results.md, samples.jsonl, stages/",
    examples=("--out runs/generation_audit --reproducible", "--preset tiny --out runs/tiny"),
    presets=configs.PRESETS,
    seeds="one",
    quiet=True,
    config=lambda args: configs.get_config(args.preset),
    run=lambda config, args: main(config, args.out, reproducible=args.reproducible),
)


if __name__ == "__main__":
    with experiment_main("generation_audit"):
        cli()
