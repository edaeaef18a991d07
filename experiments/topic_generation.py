"""Private topic-conditioned generation on a pretrained model: every generator, with its
utility, its teacher-token share and its ε, against the public model alone and the teachers'
average.

For each BBC topic of the text default, the sentences of half of its held-out articles are the
sensitive documents (one sentence is one unit), split among n in-context teachers over the
public model (`synthesis.build_ensemble`, built once per topic and seed and shared by every
method and ε). Each teacher-ensemble method (`synthesis.METHODS`) writes `lines_per_topic`
lines per topic through `synthesis.synthesize_with`, calibrated so that its worst case costs at
most (ε, δ) by its own analysis; the topics' teachers hold disjoint sentences, so a run is
(max over topics ε, δ)-DP. DP fine-tuning (`synthesis.finetune_generator`) trains one DP-LoRA
generator on every topic's sentences, each after its topic's neutral label ("Topic 3: ", which
tells the public model nothing), at (ε, δ), and samples the same lines after each label
(`FinetunedGenerator.sample`, post-processing). References: the public model alone (ε = 0,
`pate.peers.reference.generate_public`) and sampling from the teachers' average distribution
(ε = ∞, `generate_nonprivate`). Every line starts from the public prompt.

Measured per run (`synthesis.quality`): downstream accuracy of a logistic-regression
classifier on the public model's mean token states (`quality.mean_token_features`), trained on
the synthetic lines (labelled by topic) and tested on real sentences of the other held-out
articles; topic fidelity (the share of synthetic lines the same classifier trained on those
real sentences assigns to their topic); the downstream accuracy of TF-IDF + logistic regression
instead, which at a few lines a topic stays near chance even on real sentences; MAUVE against
the real sentences (features: the public model's last-token states); the share of tokens the
teachers released (the rest are the public model's); seconds per token over the ε = ∞
reference's. Each finished run's lines are stored in `stages/` under a key of what determines
them, so an interrupted study resumes where it stopped without spending its budget again; the
measures are recomputed from the stored lines (evaluation only). Writes results.json,
results.md, topic_generation.png and samples.jsonl.

    python -m experiments.topic_generation --out runs/topic_generation --reproducible
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import time

import matplotlib

matplotlib.use("Agg")
import jax  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from dpmix_jax import synthesis  # noqa: E402
from dpmix_jax.data.builtin import held_out_domains  # noqa: E402
from dpmix_jax.pate.peers import reference  # noqa: E402
from dpmix_jax.pipeline.compare import provenance  # noqa: E402
from dpmix_jax.privacy import SEEDED_NOTE, randomness  # noqa: E402
from dpmix_jax.synthesis import public_models, quality  # noqa: E402
from experiments.common_args import experiment_main  # noqa: E402
from experiments.configs import topic_generation as configs  # noqa: E402
from experiments.harness import Command, finish, progress_log  # noqa: E402
from experiments.run_files import read_stage, run_slot, write_samples, write_stage  # noqa: E402

TITLE = "Private topic-conditioned generation on a pretrained model"
HOT_PATE = ("coordinated", "independent")
# Every generator at the default ε, then the references: a run's randomness follows its place
# here (`run_slot`), so a study of fewer runs draws the same lines for each.
FULL_PLAN = [(g, e) for g in configs.GENERATORS for e in configs.EPSILONS] + [
    (r, None) for r in configs.REFERENCES
]
LABELS = {
    **{name: method.label for name, method in synthesis.REGISTRY.items()},
    synthesis.DP_FINETUNE: "DP fine-tuning (DP-LoRA)",
    "public": "public model (ε = 0)",
    "nonprivate": "teachers' average (ε = ∞)",
    "real": "real sentences (the data, cut to a line's length)",
}
# The measures whose gap between the references each generator keeps a share of.
GAP_MEASURES = ("topic_fidelity", "accuracy")
MEASURES = (
    "accuracy",
    "topic_fidelity",
    "tfidf_accuracy",
    "mauve",
    "teacher_share",
    "distinct_2",
    "time_vs_forward",
)


# --------------------------------------------------------------------------------------------
# Data.
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TopicData:
    """One topic's sensitive sentences (the teachers') and real held-out test sentences."""

    documents: tuple[dict, ...]
    test: tuple[str, ...]


def topic_sentences(topic: str, *, part: int, min_chars: int, max_chars: int) -> list[str]:
    """The sentences of a BBC topic's held-out articles of one parity (`part` 0: the
    even-numbered, the sensitive half; 1: the odd-numbered, the test half), those shorter than
    `min_chars` dropped and the rest cut to `max_chars`.

    Privacy: sensitive-side data (see `topic_data`).
    """
    articles = held_out_domains(seed=0)[f"bbc_{topic}"][part::2]
    lines = public_models.split_sentences(articles, min_chars=min_chars)
    return [line[:max_chars] for line in lines]


def topic_data(config: configs.TopicGenerationConfig) -> dict[str, TopicData]:
    """Per topic: the sentences of the even-numbered held-out articles (the sensitive
    documents, one unit each) and up to `test_per_topic` of the odd-numbered ones (the test).

    Privacy: both halves are sensitive-side data; only the first is read by the generators,
    the test half only by the (non-private) measures.
    """
    data = {}
    lengths = dict(min_chars=config.min_chars, max_chars=config.max_chars)
    for topic in config.topics:
        documents = tuple({"text": s} for s in topic_sentences(topic, part=0, **lengths))
        if len(documents) < config.num_teachers:
            raise ValueError(
                f"topic {topic} has {len(documents)} sentences for {config.num_teachers} teachers"
            )
        test = tuple(topic_sentences(topic, part=1, **lengths)[: config.test_per_topic])
        data[topic] = TopicData(documents=documents, test=test)
    return data


def topic_label(index: int) -> str:
    """The neutral label DP fine-tuning's documents of topic `index` start with: it names no
    topic, so the public model reads nothing from it."""
    return f"Topic {index + 1}: "


# --------------------------------------------------------------------------------------------
# Runs.
# --------------------------------------------------------------------------------------------


def run_name(config, model_digest: str, generator: str, epsilon: float | None, seed: int) -> str:
    """The stage name of one run: a hash of everything that determines it (the model by the
    digest of its tokenizer and parameters)."""
    settings = {
        **{k: v for k, v in dataclasses.asdict(config).items() if k not in ("progress",)},
        "generators": None,
        "references": None,
        "epsilons": None,
        "seeds": None,
        "model": model_digest,
        "generator": generator,
        "epsilon": epsilon,
        "seed": seed,
    }
    text = json.dumps(settings, sort_keys=True, default=str)
    return f"{generator}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"


def teacher_run(config, model, ensembles, generator: str, epsilon: float, key) -> dict:
    """One teacher-ensemble method at one ε: `lines_per_topic` lines per topic.

    Privacy: each topic's call is (ε, δ)-DP on its own sentences by the method's analysis; the
    topics are disjoint, so the run is (max ε, δ)-DP (parallel composition).
    """
    lines, labels, spent, tokens, teacher_tokens, seconds, unanimous = [], [], [], 0, 0, 0.0, []
    for index, topic in enumerate(config.topics):
        start = time.perf_counter()
        result = synthesis.synthesize_with(
            ensembles[topic],
            model,
            epsilon=epsilon,
            delta=config.delta,
            num_samples=config.lines_per_topic,
            method=generator,
            prompt=config.prompt,
            key=jax.random.fold_in(key, index),
            public_candidates=config.public_candidates if generator in HOT_PATE else None,
            min_unanimous_release=0.0,  # recorded per run (unanimous_release_probability)
        )
        seconds += time.perf_counter() - start
        lines += [text.strip() for text in result.texts]
        labels += [topic] * len(result.texts)
        spent.append(result.epsilon)
        tokens += result.tokens_generated
        teacher_tokens += result.steps_with_output
        unanimous.append(result.mechanism.get("unanimous_release_probability"))
    return {
        "lines": lines,
        "labels": labels,
        "epsilon": max(spent),
        "tokens": tokens,
        "teacher_tokens": teacher_tokens,
        "seconds": seconds,
        "unanimous_release_probability": unanimous[0],
    }


def finetune_run(config, model, data, epsilon: float, key) -> dict:
    """DP fine-tuning at one ε: one generator trained on every topic's labelled sentences,
    then `lines_per_topic` lines after each topic's label.

    Privacy: DP-SGD at the sentence level, (ε, δ)-DP by the PLD accountant for the steps that
    ran; sampling is post-processing.
    """
    start = time.perf_counter()
    documents = [
        {"text": topic_label(index) + document["text"]}
        for index, topic in enumerate(config.topics)
        for document in data[topic].documents
    ]
    generator = synthesis.finetune_generator(
        documents,
        model,
        epsilon=epsilon,
        delta=config.delta,
        key=key,
        max_new_tokens=config.max_new_tokens,
        tuning=config.finetuning,
    )
    lines, labels, tokens = [], [], 0
    for index, topic in enumerate(config.topics):
        prefix = topic_label(index) + config.prompt
        result = generator.sample(
            config.lines_per_topic, prefix=prefix, key=jax.random.fold_in(key, index + 1)
        )
        lines += [text.removeprefix(topic_label(index)).strip() for text in result.texts]
        labels += [topic] * len(result.texts)
        tokens += result.tokens_generated
    return {
        "lines": lines,
        "labels": labels,
        "epsilon": generator.epsilon,
        "tokens": tokens,
        "teacher_tokens": None,
        "seconds": time.perf_counter() - start,
        "unanimous_release_probability": None,
    }


def reference_run(config, model, ensembles, which: str, key) -> dict:
    """The ε = 0 (`which="public"`) or ε = ∞ (`"nonprivate"`) reference on the same teachers.

    Privacy: "nonprivate" reads the teachers without noise (ε = ∞): a reference only.
    """
    lines, labels, tokens, teacher_tokens, seconds = [], [], 0, 0, 0.0
    for index, topic in enumerate(config.topics):
        ensemble = ensembles[topic]
        settings = dict(
            prompt=ensemble.prompt_ids,
            max_new_tokens=config.max_new_tokens,
            eos_id=model.tokenizer.eos_id,
            stop_sequences=ensemble.stop_sequences,
        )
        start = time.perf_counter()
        for line in range(config.lines_per_topic):
            line_key = jax.random.fold_in(jax.random.fold_in(key, index), line)
            if which == "public":
                result = reference.generate_public(ensemble.public_model, key=line_key, **settings)
            else:
                result = reference.generate_nonprivate(ensemble.teachers, key=line_key, **settings)
            kept = len(result.tokens) - (result.stop_reason == "eos")
            lines.append((config.prompt + model.tokenizer.decode(result.tokens[:kept])).strip())
            labels.append(topic)
            tokens += len(result.tokens)
            teacher_tokens += result.sources.count("private")
        seconds += time.perf_counter() - start
    return {
        "lines": lines,
        "labels": labels,
        "epsilon": 0.0 if which == "public" else float("inf"),
        "tokens": tokens,
        "teacher_tokens": teacher_tokens,
        "seconds": seconds,
        "unanimous_release_probability": None,
    }


def real_test_sentences(config, data: dict[str, TopicData]) -> list[str]:
    """The real test sentences, topic after topic."""
    return [s for topic in config.topics for s in data[topic].test]


def measure(config, run: dict, data: dict[str, TopicData], featurize, embed) -> dict:
    """The run's downstream accuracy and topic fidelity (a classifier on `embed`'s features),
    TF-IDF downstream accuracy, MAUVE (on `featurize`'s), distinct-2 and teacher share.

    Privacy: not private: the measures read the real test sentences (evaluation only).
    """
    test = real_test_sentences(config, data)
    test_labels = [topic for topic in config.topics for _ in data[topic].test]
    worded = [(t, label) for t, label in zip(run["lines"], run["labels"], strict=True)]
    worded = [(t, label) for t, label in worded if quality.words(t)]
    texts, labels = [t for t, _ in worded], [label for _, label in worded]
    seed = config.mauve_seed
    trained_on_synthetic = len(set(labels)) >= 2
    return {
        "accuracy": quality.downstream_accuracy(
            texts, labels, test, test_labels, seed=seed, featurize=embed
        ).accuracy
        if trained_on_synthetic
        else None,
        "topic_fidelity": quality.downstream_accuracy(
            test, test_labels, texts, labels, seed=seed, featurize=embed
        ).accuracy
        if texts
        else 0.0,
        "tfidf_accuracy": quality.downstream_accuracy(
            texts, labels, test, test_labels, seed=seed
        ).accuracy
        if trained_on_synthetic
        else None,
        "mauve": quality.mauve_score(texts, test, featurize=featurize, seed=seed).mauve
        if len(texts) >= quality.MIN_MAUVE_TEXTS
        else None,
        "distinct_2": quality.distinct_n(texts, 2) if texts else 0.0,
        "teacher_share": None
        if run["teacher_tokens"] is None
        else run["teacher_tokens"] / max(run["tokens"], 1),
        "worded_lines": len(texts),
    }


def real_run(config, model, data: dict[str, TopicData], key) -> dict:
    """The data itself: `lines_per_topic` of each topic's sensitive sentences drawn at random,
    each cut to its first `max_new_tokens` tokens. It is what the measures give lines of this
    number and length that are real, the ceiling a generator could reach.

    Privacy: not private (ε = ∞): the sensitive sentences themselves, a reference only.
    """
    lines, labels, tokens = [], [], 0
    for index, topic in enumerate(config.topics):
        documents = data[topic].documents
        drawn = jax.random.choice(
            jax.random.fold_in(key, index),
            len(documents),
            (min(config.lines_per_topic, len(documents)),),
            replace=False,
        )
        for document in drawn.tolist():
            ids = model.tokenizer.encode(documents[document]["text"])[: config.max_new_tokens]
            lines.append(model.tokenizer.decode(ids).strip())
            labels.append(topic)
            tokens += len(ids)
    return {
        "lines": lines,
        "labels": labels,
        "epsilon": float("inf"),
        "tokens": tokens,
        "teacher_tokens": None,
        "seconds": 0.0,
        "unanimous_release_probability": None,
    }


# --------------------------------------------------------------------------------------------
# The study.
# --------------------------------------------------------------------------------------------


def main(
    config: configs.TopicGenerationConfig,
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
    digest = model.digest()
    data = topic_data(config)
    test = real_test_sentences(config, data)
    max_tokens = min(64, int(model.model.config.n_positions))
    featurize = remembering(
        quality.last_token_features(model.model, model.tokenizer, max_tokens=max_tokens), test
    )
    embed = remembering(
        quality.mean_token_features(model.model, model.tokenizer, max_tokens=max_tokens), test
    )
    plan = [(g, e) for g in config.generators for e in config.epsilons]
    plan += [(r, None) for r in config.references]
    rows, samples = [], []
    for seed in config.seeds:
        key = randomness.prng_key(seed if reproducible else randomness.secret_seed())
        ensembles: dict[str, synthesis.Ensemble] = {}

        def shared_ensembles(seed_key=key, ensembles=ensembles):
            for index, topic in enumerate(config.topics):
                if topic not in ensembles:
                    ensembles[topic] = synthesis.build_ensemble(
                        data[topic].documents,
                        model,
                        num_teachers=config.num_teachers,
                        prompt=config.prompt,
                        max_new_tokens=config.max_new_tokens,
                        key=jax.random.fold_in(jax.random.fold_in(seed_key, 0), index),
                        context_width=config.context_width,
                    )
            return ensembles

        for generator, epsilon in plan:
            stage = (
                None
                if stages is None
                else stages / f"{run_name(config, digest, generator, epsilon, seed)}.json"
            )
            if stage is not None and stage.exists():
                run = read_stage(stage)
            else:
                run_key = jax.random.fold_in(key, 1 + run_slot((generator, epsilon), FULL_PLAN))
                if generator == synthesis.DP_FINETUNE:
                    run = finetune_run(config, model, data, epsilon, run_key)
                elif generator == "real":
                    run = real_run(config, model, data, run_key)
                elif epsilon is None:
                    run = reference_run(config, model, shared_ensembles(), generator, run_key)
                else:
                    run = teacher_run(
                        config, model, shared_ensembles(), generator, epsilon, run_key
                    )
                if stage is not None:
                    write_stage(stage, run)
            run |= measure(config, run, data, featurize, embed)
            rows.append(
                {
                    "generator": generator,
                    "target_epsilon": epsilon,
                    "seed": seed,
                    **{k: v for k, v in run.items() if k not in ("lines", "labels")},
                }
            )
            samples += [
                {"generator": generator, "target_epsilon": epsilon, "seed": seed, "topic": t,
                 "text": s}
                for s, t in zip(run["lines"], run["labels"], strict=True)
                if generator != "real"  # the sensitive sentences themselves: never published
            ]  # fmt: skip
            log(
                f"seed {seed} {LABELS[generator]}"
                + ("" if epsilon is None else f" ε = {epsilon:g}")
                + f": accuracy {run['accuracy']:.2f}, fidelity {run['topic_fidelity']:.2f},"
                f" ε spent {run['epsilon']:.3g}, {run['seconds']:.0f} s"
            )
    add_forward_ratios(rows)
    results = {
        "config": dataclasses.asdict(config),
        "model": model.source,
        "test_sentences": {t: len(data[t].test) for t in config.topics},
        "noise_seeded": reproducible,
        "rows": rows,
        "summary": summarise(rows),
        "seconds": time.time() - start,
        "provenance": provenance(),
    }
    if out is not None:
        write_samples(out, samples)
    return finish(out, results, markdown(results), plots={"topic_generation.png": plot})


def remembering(featurize, texts):
    """`featurize`, computing the features of `texts` once: every run's MAUVE and classifiers
    featurize the same real test sentences, about a minute of SmolLM2 each time. The
    remembered array is read-only, so a caller that wrote into it would fail instead of
    changing every later run's score."""
    texts = tuple(texts)
    remembered = []

    def featurize_remembering(batch):
        if tuple(batch) != texts:
            return featurize(batch)
        if not remembered:
            features = np.array(featurize(texts))
            features.setflags(write=False)
            remembered.append(features)
        return remembered[0]

    return featurize_remembering


def add_forward_ratios(rows: list[dict]) -> None:
    """Adds to every row `time_vs_forward`: its seconds per token over those of the same
    seed's ε = ∞ reference, which only runs the teachers' forward passes and samples (None for
    DP fine-tuning, whose time is mostly its training, and for the real sentences)."""
    floor = {
        r["seed"]: r["seconds"] / max(r["tokens"], 1)
        for r in rows
        if r["generator"] == "nonprivate"
    }
    for row in rows:
        row["time_vs_forward"] = (
            row["seconds"] / max(row["tokens"], 1) / floor[row["seed"]]
            if row["seed"] in floor and row["generator"] not in (synthesis.DP_FINETUNE, "real")
            else None
        )


def summarise(rows: list[dict]) -> list[dict]:
    """Mean and standard deviation over seeds of every measure, per (generator, ε), and the
    share of the gap between the ε = 0 and ε = ∞ references' means it keeps, for topic
    fidelity and downstream accuracy (`gap_kept`)."""
    groups: dict[tuple[str, float | None], list[dict]] = {}
    for row in rows:
        groups.setdefault((row["generator"], row["target_epsilon"]), []).append(row)
    summary = []
    for (generator, epsilon), runs in groups.items():
        entry = {
            "generator": generator,
            "target_epsilon": epsilon,
            "seeds": len(runs),
            "epsilon_spent": max(r["epsilon"] for r in runs),
        }
        for name in MEASURES:
            values = [r[name] for r in runs if r.get(name) is not None]
            entry[name] = (
                {"mean": float(np.mean(values)), "std": float(np.std(values))} if values else None
            )
        summary.append(entry)
    for name in GAP_MEASURES:
        reference = {
            e["generator"]: e[name]["mean"]
            for e in summary
            if e["target_epsilon"] is None and e[name] is not None
        }
        for entry in summary:
            gap = None
            if (
                {"public", "nonprivate"} <= set(reference)
                and reference["nonprivate"] != reference["public"]
                and entry[name] is not None
            ):
                gap = (entry[name]["mean"] - reference["public"]) / (
                    reference["nonprivate"] - reference["public"]
                )
            entry.setdefault("gap_kept", {})[name] = gap
    return summary


def _cell(entry: dict, name: str, digits: int = 2) -> str:
    value = entry[name]
    if value is None:
        return "–"
    if entry["seeds"] == 1:
        return f"{value['mean']:.{digits}f}"
    return f"{value['mean']:.{digits}f} ± {value['std']:.{digits}f}"


def markdown(results: dict) -> str:
    """The results as a titled markdown page: one row per generator and ε, then the setting."""
    config = results["config"]
    lines = [
        f"# {TITLE}",
        "",
        "| generator | ε target | ε spent | topic fidelity | gap kept | downstream accuracy |"
        " gap kept | TF-IDF accuracy | MAUVE | teacher tokens | distinct-2 |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    order = {g: i for i, g in enumerate((*config["generators"], *config["references"]))}
    summary = sorted(
        results["summary"], key=lambda e: (order[e["generator"]], e["target_epsilon"] or 0.0)
    )
    for entry in summary:
        epsilon = entry["target_epsilon"]
        gap = {
            name: "–" if value is None else f"{value:.2f}"
            for name, value in entry["gap_kept"].items()
        }
        lines.append(
            f"| {LABELS[entry['generator']]} | {'-' if epsilon is None else f'{epsilon:g}'} |"
            f" {entry['epsilon_spent']:.3g} | {_cell(entry, 'topic_fidelity')} |"
            f" {gap['topic_fidelity']} | {_cell(entry, 'accuracy')} | {gap['accuracy']} |"
            f" {_cell(entry, 'tfidf_accuracy')} | {_cell(entry, 'mauve', 3)} |"
            f" {_cell(entry, 'teacher_share')} | {_cell(entry, 'distinct_2')} |"
        )
    tests = sum(results["test_sentences"].values())
    lines += [
        "",
        f"Setting: public model {config['model']}; {len(config['topics'])} BBC topics; per topic"
        f" {config['num_teachers']} in-context teachers ({config['context_width']}-token"
        " contexts) share the sentences of half of the topic's held-out articles (one sentence"
        f" is one unit); every generator writes {config['lines_per_topic']} lines of at most"
        f" {config['max_new_tokens']} tokens per topic, each starting with"
        f" {config['prompt']!r}, at the target (ε, δ = {config['delta']:g}) by its own"
        " analysis (ε spent: the largest over seeds). DP fine-tuning: one rank-"
        f"{config['finetuning']['lora']['rank']} DP-LoRA generator trained"
        f" {config['finetuning']['steps']} DP-SGD steps (expected batch"
        f" {config['finetuning']['batch_size']}) on every topic's labelled sentences. Downstream"
        " accuracy: logistic regression on the public model's mean token states, trained on"
        f" the synthetic lines, tested on {tests} real sentences of the other held-out articles"
        f" (chance {1 / len(config['topics']):.2f}); topic fidelity: the share of synthetic"
        " lines the same classifier trained on the real sentences assigns to their topic"
        f" (chance {1 / len(config['topics']):.2f}); TF-IDF accuracy: the downstream accuracy"
        " of TF-IDF + logistic regression instead; gap kept: (the measure - ε = 0's) / (ε = ∞'s -"
        " ε = 0's), from the means, for the measure on its left; teacher tokens: the"
        " share of tokens the teachers released (the rest are the public model's); real"
        " sentences: as many of the teachers' own sentences, cut to a line's length (a ceiling"
        " for lines of this number and length, not private). Mean ± std"
        " over"
        f" {len(config['seeds'])} seed{'s' if len(config['seeds']) > 1 else ''}.",
        SEEDED_NOTE if results.get("noise_seeded") else "Partitions, samplers and noise secret.",
    ]
    return "\n".join(lines)


def plot(results: dict, path: pathlib.Path) -> None:
    """Downstream accuracy and topic fidelity against ε, one line per generator, the
    references drawn across. Draws from `results` alone (`results.json` read back will do)."""
    config = results["config"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 5.5))
    for ax, name, label in (
        (axes[0], "accuracy", "downstream accuracy (real test sentences)"),
        (axes[1], "topic_fidelity", "topic fidelity (classifier trained on real)"),
    ):
        for index, generator in enumerate(config["generators"]):
            entries = sorted(
                (e for e in results["summary"] if e["generator"] == generator),
                key=lambda e: e["target_epsilon"],
            )
            ax.errorbar(
                [e["target_epsilon"] for e in entries],
                [e[name]["mean"] for e in entries],
                yerr=[e[name]["std"] for e in entries],
                marker="o",
                capsize=3,
                color=f"C{index}",
                label=LABELS[generator],
            )
        for which, style in (("public", ":"), ("nonprivate", "--"), ("real", "-.")):
            entry = next((e for e in results["summary"] if e["generator"] == which), None)
            if entry is not None:
                ax.axhline(entry[name]["mean"], color="k", linestyle=style, label=LABELS[which])
        ax.axhline(1 / len(config["topics"]), color="0.6", linewidth=0.8, label="chance")
        ax.set(xscale="log", xlabel="ε (δ fixed)", ylabel=label)
        ax.set_xticks(config["epsilons"], [f"{e:g}" for e in config["epsilons"]])
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=4, fontsize=8)
    fig.suptitle(
        f"{config['model']}: topic-conditioned lines, {config['num_teachers']} teachers per"
        f" topic; error bars: std over {len(config['seeds'])} seeds",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0.14, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


cli = Command(
    name="topic_generation",
    description=__doc__.splitlines()[0],
    writes="results.json, results.md, samples.jsonl, topic_generation.png, stages/",
    examples=(
        "--out runs/topic_generation --reproducible",
        "--preset tiny --out runs/tiny",
    ),
    presets=configs.PRESETS,
    quiet=True,
    config=lambda args: configs.get_config(args.preset),
    run=lambda config, args: main(config, args.out, reproducible=args.reproducible),
)


if __name__ == "__main__":
    with experiment_main("topic_generation"):
        cli()
