"""Private text generators head to head: Hot PATE, independent PATE, InvisibleInk, Amin et al.
2024 and PMixED on the same teachers, public model, documents and (ε, δ).

For each BBC topic of the text default, the sentences of half of the topic's held-out articles
are split among n in-context teachers over the public GPT-2 (`synthesis.build_ensemble`;
one sentence is one unit). Every method writes `lines_per_topic` lines per topic through
`synthesis.synthesize`, calibrated so that its worst case costs at most the target
(ε, δ) by its own analysis; the ε reported is the one for what ran. The topics hold disjoint
sentences, so a run's output is (max over topics ε, δ)-DP by parallel composition.

Measured per run (`synthesis.quality`): a TF-IDF + logistic-regression classifier trained on the
synthetic lines, labelled by topic, tested on real sentences of the other held-out articles;
MAUVE of the synthetic lines against those real sentences (features: the public model's
last-token states); the share of generated words in the public corpus's vocabulary; distinct-2;
tokens per second and teacher forward passes per token. References: the public model alone
(ε = 0, `pate.peers.reference.generate_public`) and sampling from the teachers' average
distribution (ε = ∞, `generate_nonprivate`). Writes results.json, results.md, text_peers.png
and samples.jsonl.

    python -m experiments.text_peers --out DIR --reproducible
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time

import matplotlib

matplotlib.use("Agg")
import jax  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from dpmix_jax import synthesis  # noqa: E402
from dpmix_jax.data.builtin import held_out_domains, load_text_mixture_task  # noqa: E402
from dpmix_jax.pate.peers import reference  # noqa: E402
from dpmix_jax.pipeline.compare import provenance  # noqa: E402
from dpmix_jax.privacy import SEEDED_NOTE, randomness  # noqa: E402
from dpmix_jax.synthesis import public_models, quality  # noqa: E402
from experiments.common_args import experiment_main  # noqa: E402
from experiments.configs import text_peers as configs  # noqa: E402
from experiments.harness import Command, finish, progress_log  # noqa: E402
from experiments.run_files import write_samples  # noqa: E402

TITLE = "Private text generators head to head: topic-conditioned lines on the BBC domains"
# Each private method's name in `synthesis.METHODS`.
SYNTHESIZE_METHOD = {**configs.HOT_PATE_METHODS, **{name: name for name in synthesis.PEER_METHODS}}
LABELS = {
    **{name: synthesis.REGISTRY[method].label for name, method in SYNTHESIZE_METHOD.items()},
    "public": "public model (ε = 0)",
    "nonprivate": "teachers' average (ε = ∞)",
}
# The public corpus separates paragraphs by blank lines: after one, the model starts a new line.
SEPARATOR = "\n\n"


# --------------------------------------------------------------------------------------------
# Data.
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TopicData:
    """One topic's sensitive sentences (the teachers') and real held-out test sentences."""

    documents: tuple[dict, ...]
    test: tuple[str, ...]


def topic_data(config: configs.TextPeersConfig) -> dict[str, TopicData]:
    """Per topic: sentences of the even-numbered held-out articles (the teachers' documents,
    one unit each) and up to `test_per_topic` sentences of the odd-numbered ones (the test set).

    Privacy: both halves are sensitive-side data; only the teachers' half is read by the
    private generators, the test half only by the (non-private) evaluation.
    """
    held_out = held_out_domains(seed=config.model.seed)
    data = {}
    for topic in config.topics:
        articles = held_out[f"bbc_{topic}"]

        def sentences(part, topic=topic):
            lines = public_models.split_sentences(part, min_chars=config.min_chars)
            return [line[: config.max_chars] for line in lines]

        teachers = sentences(articles[0::2])
        test = sentences(articles[1::2])[: config.test_per_topic]
        if len(teachers) < config.num_teachers:
            raise ValueError(
                f"topic {topic} has {len(teachers)} sentences for {config.num_teachers} teachers"
            )
        docs = tuple({"text": s, "source": f"bbc_{topic}"} for s in teachers)
        data[topic] = TopicData(documents=docs, test=tuple(test))
    return data


def public_vocabulary(config: configs.TextPeersConfig) -> frozenset[str]:
    """The words of the public model's training corpus (the public domains)."""
    task = load_text_mixture_task(
        seed=config.model.seed,
        num_users=config.model.num_users,
        max_public_per_domain=config.model.max_public_per_domain,
    )
    return quality.corpus_vocabulary([d for docs in task.public_domains.values() for d in docs])


# --------------------------------------------------------------------------------------------
# Runs.
# --------------------------------------------------------------------------------------------


def _run_key(seed: int, *, reproducible: bool) -> jax.Array:
    return randomness.prng_key(seed if reproducible else randomness.secret_seed())


def _teachers(config: configs.TextPeersConfig) -> dict:
    """The teachers' kind and, for fine-tuned teachers, their tuning."""
    if config.teachers == "fine_tuned":
        return {"teachers": "fine_tuned", "tuning": config.tuning}
    return {"teachers": config.teachers}


def private_run(
    config: configs.TextPeersConfig,
    model: public_models.PublicTextModel,
    data: dict[str, TopicData],
    method: str,
    epsilon: float,
    seed: int,
    *,
    reproducible: bool,
) -> dict:
    """One method at one ε and seed: `lines_per_topic` lines per topic and what they cost.

    Privacy: each topic's call is (ε, δ)-DP on its own sentences by the method's analysis; the
    topics are disjoint, so the run is (max ε, δ)-DP (parallel composition).
    """
    key = _run_key(seed, reproducible=reproducible)
    lines, labels, spent, tokens, passes, seconds = [], [], [], 0, 0, 0.0
    for index, topic in enumerate(config.topics):
        start = time.perf_counter()
        result = synthesis.synthesize(
            data[topic].documents,
            model,
            epsilon=epsilon,
            delta=config.delta,
            num_samples=config.lines_per_topic,
            num_teachers=config.num_teachers,
            method=SYNTHESIZE_METHOD[method],
            key=jax.random.fold_in(key, index),
            max_new_tokens=config.max_new_tokens,
            temperature=config.temperature,
            separator=SEPARATOR,
            min_unanimous_release=0.0,  # the head-to-head keeps the small-n setting it records
            **_teachers(config),
        )
        seconds += time.perf_counter() - start
        lines += [text.strip() for text in result.texts]
        labels += [topic] * len(result.texts)
        spent.append(result.epsilon)
        tokens += result.tokens_generated
        passes += result.teacher_forward_passes
    return {
        "lines": lines,
        "labels": labels,
        "epsilon": max(spent),
        "tokens": tokens,
        "seconds": seconds,
        "teacher_forward_passes": passes,
    }


def reference_run(
    config: configs.TextPeersConfig,
    model: public_models.PublicTextModel,
    data: dict[str, TopicData],
    which: str,
    seed: int,
    *,
    reproducible: bool,
) -> dict:
    """The ε = 0 (`which="public"`) or ε = ∞ (`"nonprivate"`) reference on the same teachers.

    Privacy: "nonprivate" reads the teachers without noise (ε = ∞): a reference only.
    """
    key = _run_key(seed, reproducible=reproducible)
    lines, labels, tokens, passes, seconds = [], [], 0, 0, 0.0
    for index, topic in enumerate(config.topics):
        topic_key = jax.random.fold_in(key, index)
        start = time.perf_counter()
        ensemble = synthesis.build_ensemble(
            data[topic].documents,
            model,
            num_teachers=config.num_teachers,
            max_new_tokens=config.max_new_tokens,
            key=jax.random.fold_in(topic_key, 0),
            separator=SEPARATOR,
            **(_teachers(config) if which == "nonprivate" else {}),  # ε = 0 reads no teacher
        )
        settings = dict(
            prompt=ensemble.prompt_ids,
            max_new_tokens=config.max_new_tokens,
            temperature=config.temperature,
            eos_id=model.tokenizer.eos_id,
            stop_sequences=ensemble.stop_sequences,
        )
        for line in range(config.lines_per_topic):
            line_key = jax.random.fold_in(topic_key, line + 1)
            if which == "public":
                result = reference.generate_public(ensemble.public_model, key=line_key, **settings)
            else:
                result = reference.generate_nonprivate(ensemble.teachers, key=line_key, **settings)
            lines.append(model.tokenizer.decode(result.tokens).strip())
            labels.append(topic)
            tokens += len(result.tokens)
            passes += result.teacher_forward_passes
        seconds += time.perf_counter() - start
    return {
        "lines": lines,
        "labels": labels,
        "epsilon": 0.0 if which == "public" else float("inf"),
        "tokens": tokens,
        "seconds": seconds,
        "teacher_forward_passes": passes,
    }


def measure(
    config: configs.TextPeersConfig,
    run: dict,
    data: dict[str, TopicData],
    vocabulary: frozenset[str],
    featurize,
) -> dict:
    """The run's utility and readability (see the module docstring), and its topic fidelity:
    the share of its lines that a classifier trained on the real test sentences assigns to the
    topic they were generated for (it reads the topic signal even in lines too few or too
    garbled to train a classifier on).

    Privacy: not private: the measures read the real test sentences (evaluation only).
    """
    test = [s for topic in config.topics for s in data[topic].test]
    test_labels = [topic for topic in config.topics for _ in data[topic].test]
    texts = [line if quality.words(line) else "" for line in run["lines"]]
    worded = [t for t in texts if t]
    labels = [label for t, label in zip(texts, run["labels"], strict=True) if t]
    downstream = quality.downstream_accuracy(
        worded, labels, test, test_labels, seed=config.mauve_seed
    )
    fidelity = quality.downstream_accuracy(
        test, test_labels, worded, labels, seed=config.mauve_seed
    )
    mauve = quality.mauve_score(worded, test, featurize=featurize, seed=config.mauve_seed)
    return {
        "accuracy": downstream.accuracy,
        "macro_f1": downstream.macro_f1,
        "topic_fidelity": fidelity.accuracy,
        "mauve": mauve.mauve,
        "vocabulary_share": quality.vocabulary_share(worded, vocabulary),
        "distinct_2": quality.distinct_n(worded, 2),
        "empty_lines": len(texts) - len(worded),
        "tokens_per_second": run["tokens"] / max(run["seconds"], 1e-9),
        "teacher_passes_per_token": run["teacher_forward_passes"] / max(run["tokens"], 1),
    }


# --------------------------------------------------------------------------------------------
# The study.
# --------------------------------------------------------------------------------------------

MEASURES = (
    "accuracy",
    "topic_fidelity",
    "mauve",
    "vocabulary_share",
    "distinct_2",
    "tokens_per_second",
    "time_vs_forward",
    "teacher_passes_per_token",
)


def add_forward_ratios(rows: list[dict]) -> None:
    """Adds to every row `time_vs_forward`: its seconds per token over those of the same seed's
    ε = ∞ reference, which only runs the teachers' forward passes and samples (the floor)."""
    floor = {
        r["seed"]: r["seconds"] / max(r["tokens"], 1) for r in rows if r["method"] == "nonprivate"
    }
    for row in rows:
        row["time_vs_forward"] = row["seconds"] / max(row["tokens"], 1) / floor[row["seed"]]


def summarise(rows: list[dict]) -> list[dict]:
    """Mean and standard deviation over seeds of every measure, per (method, ε)."""
    groups: dict[tuple[str, float], list[dict]] = {}
    for row in rows:
        groups.setdefault((row["method"], row["target_epsilon"]), []).append(row)
    summary = []
    for (method, epsilon), runs in groups.items():
        entry = {
            "method": method,
            "target_epsilon": epsilon,
            "seeds": len(runs),
            "epsilon_spent": max(r["epsilon"] for r in runs),
        }
        for name in MEASURES:
            values = np.array([r[name] for r in runs], np.float64)
            entry[name] = {"mean": float(values.mean()), "std": float(values.std())}
        summary.append(entry)
    return summary


def main(
    config: configs.TextPeersConfig,
    out: pathlib.Path | None = None,
    *,
    reproducible: bool = False,
) -> dict:
    """Runs the head-to-head; returns (and, with `out`, writes) the results.

    The public model is read back from `out/stages` when stored there (trained otherwise).
    Without `reproducible`, partitions, samplers and noise are secret.
    """
    start = time.time()
    log = progress_log(config.progress, start)

    stages = None if out is None else out / "stages"
    model = public_models.text_default_model(stages, config.model, log=log)
    data = topic_data(config)
    vocabulary = public_vocabulary(config)
    featurize = _featurizer(model)
    rows, samples = [], []
    plan = [(m, e) for m in config.methods for e in config.epsilons]
    plan += [(r, None) for r in config.references]
    for seed in config.seeds:
        for method, epsilon in plan:
            if epsilon is None:
                run = reference_run(config, model, data, method, seed, reproducible=reproducible)
            else:
                run = private_run(
                    config, model, data, method, epsilon, seed, reproducible=reproducible
                )
            row = _row(
                method, epsilon, seed, run, measure(config, run, data, vocabulary, featurize)
            )
            rows.append(row)
            samples += [
                {"method": method, "target_epsilon": epsilon, "seed": seed, "topic": t, "text": s}
                for s, t in zip(run["lines"], run["labels"], strict=True)
            ]
            log(
                f"seed {seed} {LABELS[method]}"
                + ("" if epsilon is None else f" ε = {epsilon:g}")
                + f": accuracy {row['accuracy']:.2f}, fidelity {row['topic_fidelity']:.2f},"
                f" MAUVE {row['mauve']:.3f}, ε spent {row['epsilon']:.3g}"
            )
    add_forward_ratios(rows)
    results = {
        "config": dataclasses.asdict(config),
        "model": {
            "source": model.source,
            "heldout_perplexity": public_models.heldout_perplexity(
                model.model,
                model.tokenizer,
                [s for topic in config.topics for s in data[topic].test],
                model.context_length,
            ),
            "parameters": int(
                sum(np.size(x) for x in jax.tree.leaves(nnx.state(model.model, nnx.Param)))
            ),
        },
        "test_sentences": {t: len(data[t].test) for t in config.topics},
        "teacher_sentences": {t: len(data[t].documents) for t in config.topics},
        "noise_seeded": reproducible,
        "rows": rows,
        "summary": summarise(rows),
        "seconds": time.time() - start,
        "provenance": provenance(),
    }
    if out is not None:
        write_samples(out, samples)
    return finish(out, results, markdown(config, results), plots={"text_peers.png": plot})


def _featurizer(model: public_models.PublicTextModel):
    """MAUVE's features from the public model, each set of texts featurized once."""
    last_token_features = quality.last_token_features(
        model.model, model.tokenizer, max_tokens=model.context_length
    )
    known: dict[tuple[str, ...], np.ndarray] = {}

    def featurize(texts):
        if tuple(texts) not in known:
            known[tuple(texts)] = last_token_features(texts)
        return known[tuple(texts)]

    return featurize


def _row(method: str, epsilon: float | None, seed: int, run: dict, measures: dict) -> dict:
    return {
        "method": method,
        "target_epsilon": epsilon,
        "seed": seed,
        "epsilon": run["epsilon"],
        "tokens": run["tokens"],
        "seconds": run["seconds"],
        **measures,
    }


def _with_defaults(stored: dict, defaults: dict) -> dict:
    """The `stored` settings, nested ones included, with every setting added after the run was
    stored at its default (the run ran with it)."""
    merged = {**defaults, **stored}
    return {
        name: _with_defaults(value, defaults[name])
        if isinstance(value, dict) and isinstance(defaults.get(name), dict)
        else value
        for name, value in merged.items()
    }


def rescore(config: configs.TextPeersConfig, out: pathlib.Path) -> dict:
    """Recomputes every measure of the finished run in `out` from its samples.jsonl and the
    generation records of its results.json (ε spent, tokens, seconds, teacher passes) without
    generating again, and rewrites its results (the generating run's provenance is kept as
    `generation_provenance`).

    Raises:
        ValueError: `out` holds no finished run, or one made with other settings.
    """
    if not (out / "results.json").is_file() or not (out / "samples.jsonl").is_file():
        raise ValueError(f"{out} holds no finished run (results.json and samples.jsonl)")
    stored = json.loads((out / "results.json").read_text())
    mine = json.loads(json.dumps(dataclasses.asdict(config), default=str))
    defaults = json.loads(json.dumps(dataclasses.asdict(configs.TextPeersConfig()), default=str))
    if {k: v for k, v in _with_defaults(stored["config"], defaults).items() if k != "progress"} != {
        k: v for k, v in mine.items() if k != "progress"
    }:
        raise ValueError(f"the run in {out} was made with other settings than these")
    samples = [json.loads(line) for line in (out / "samples.jsonl").open()]
    model = public_models.text_default_model(out / "stages", config.model)
    data = topic_data(config)
    vocabulary = public_vocabulary(config)
    featurize = _featurizer(model)
    rows = []
    for old in stored["rows"]:
        cell = (old["method"], old["target_epsilon"], old["seed"])
        lines = [s for s in samples if (s["method"], s["target_epsilon"], s["seed"]) == cell]
        run = {
            "lines": [s["text"] for s in lines],
            "labels": [s["topic"] for s in lines],
            "epsilon": old["epsilon"],
            "tokens": old["tokens"],
            "seconds": old["seconds"],
            "teacher_forward_passes": round(old["teacher_passes_per_token"] * old["tokens"]),
        }
        rows.append(_row(*cell, run, measure(config, run, data, vocabulary, featurize)))
    add_forward_ratios(rows)
    results = {
        **stored,
        "rows": rows,
        "summary": summarise(rows),
        "generation_provenance": stored.get("generation_provenance", stored["provenance"]),
        "provenance": provenance(),
    }
    write_samples(out, samples)
    return finish(out, results, markdown(config, results), plots={"text_peers.png": plot})


def _cell(entry: dict, name: str, digits: int = 2) -> str:
    value = entry[name]
    if entry["seeds"] == 1:
        return f"{value['mean']:.{digits}f}"
    return f"{value['mean']:.{digits}f} ± {value['std']:.{digits}f}"


def _epsilon_label(entry: dict) -> str:
    epsilon = entry["target_epsilon"]
    return "-" if epsilon is None else f"{epsilon:g}"


def _teacher_kind(teachers: str) -> str:
    return "fine-tuned teachers" if teachers == "fine_tuned" else "in-context teachers"


def _teacher_label(config: configs.TextPeersConfig) -> str:
    if config.teachers == "fine_tuned":
        tuning = config.tuning
        return (
            f"{_teacher_kind(config.teachers)} (each a rank-{tuning.lora.rank} LoRA adapter on the"
            f" last {tuning.last_blocks} block(s), {tuning.steps} full-batch Adam steps on its own"
            " sentences)"
        )
    return _teacher_kind(config.teachers)


def _texts_per_epsilon(config: configs.TextPeersConfig, entry: dict) -> str:
    """Lines written per topic over the ε they spent (the references spend 0 or ∞: "-")."""
    if entry["target_epsilon"] is None:
        return "-"
    return f"{config.lines_per_topic / entry['epsilon_spent']:.1f}"


def markdown(config: configs.TextPeersConfig, results: dict) -> str:
    """The results as a titled markdown page: the head-to-head table and the setting."""
    lines = [
        f"# {TITLE}",
        "",
        "| method | ε target | ε spent | texts per ε | downstream accuracy | topic fidelity |"
        " MAUVE | words in public vocabulary | distinct-2 | tokens/s | time / teachers' forward |"
        " teacher passes per token |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    order = {m: i for i, m in enumerate((*config.methods, *config.references))}
    summary = sorted(
        results["summary"],
        key=lambda e: (order[e["method"]], e["target_epsilon"] or 0.0),
    )
    for entry in summary:
        lines.append(
            f"| {LABELS[entry['method']]} | {_epsilon_label(entry)} |"
            f" {entry['epsilon_spent']:.3g} | {_texts_per_epsilon(config, entry)} |"
            f" {_cell(entry, 'accuracy')} |"
            f" {_cell(entry, 'topic_fidelity')} |"
            f" {_cell(entry, 'mauve', 3)} | {_cell(entry, 'vocabulary_share')} |"
            f" {_cell(entry, 'distinct_2')} | {entry['tokens_per_second']['mean']:.0f} |"
            f" {entry['time_vs_forward']['mean']:.2f} |"
            f" {entry['teacher_passes_per_token']['mean']:.0f} |"
        )
    tests = sum(results["test_sentences"].values())
    lines += [
        "",
        f"Setting: {len(config.topics)} BBC topics; per topic {config.num_teachers}"
        f" {_teacher_label(config)} over the public GPT-2"
        f" ({results['model']['parameters']:,} parameters, per-token perplexity"
        f" {results['model']['heldout_perplexity']:.1f} on the test"
        " sentences) share the sentences of half of the topic's held-out"
        f" articles (one sentence is one unit); every method writes {config.lines_per_topic}"
        f" lines of at most {config.max_new_tokens} tokens per topic at the target (ε, δ ="
        f" {config.delta:g}) by its own analysis (ε spent: the largest over seeds of the run's"
        " ε, the topics' disjoint data composing in parallel; texts per ε: the lines written per"
        " topic over that ε, at the run's calibration). Downstream accuracy: TF-IDF +"
        f" logistic regression trained on the synthetic lines, tested on {tests} real"
        " sentences of the other held-out articles (chance"
        f" {1 / len(config.topics):.2f}); topic fidelity: the share of synthetic lines that the"
        " same classifier trained on the real sentences assigns to their topic (chance"
        f" {1 / len(config.topics):.2f}); MAUVE against the same real sentences, features from"
        " the public model; words in public vocabulary: the share of generated words that"
        " occur in the public corpus. Time / teachers' forward: seconds per token"
        " over those of the ε = ∞ reference, which only runs the teachers and samples (its"
        f" floor). Mean ± std over {len(config.seeds)} seeds.",
        SEEDED_NOTE if results.get("noise_seeded") else "Partitions, samplers and noise secret.",
    ]
    return "\n".join(lines)


def plot(results: dict, path: pathlib.Path) -> None:
    """Utility against ε, one line per method, the ε = 0 and ε = ∞ references drawn across.

    Draws from `results` alone (`results.json` read back will do).
    """
    config = results["config"]
    epsilons = config["epsilons"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, name, label in (
        (axes[0], "accuracy", "downstream accuracy (real test sentences)"),
        (axes[1], "topic_fidelity", "topic fidelity (classifier trained on real)"),
        (axes[2], "mauve", "MAUVE against real sentences"),
    ):
        for index, method in enumerate(config["methods"]):
            entries = sorted(
                (e for e in results["summary"] if e["method"] == method),
                key=lambda e: e["target_epsilon"],
            )
            ax.errorbar(
                [e["target_epsilon"] for e in entries],
                [e[name]["mean"] for e in entries],
                yerr=[e[name]["std"] for e in entries],
                marker="o",
                capsize=3,
                color=f"C{index}",
                label=LABELS[method],
            )
        for which, style in (("public", ":"), ("nonprivate", "--")):
            entry = next((e for e in results["summary"] if e["method"] == which), None)
            if entry is not None:
                ax.axhline(entry[name]["mean"], color="k", linestyle=style, label=LABELS[which])
        ax.set(xscale="log", xlabel="ε (each topic's run; δ fixed)", ylabel=label)
        ax.set_xticks(epsilons, [f"{e:g}" for e in epsilons])
    for ax in axes[:2]:
        ax.axhline(1 / len(config["topics"]), color="0.6", linewidth=0.8, label="chance")
    axes[0].legend(fontsize=7)
    # Runs stored before the fine-tuned teachers had only in-context ones.
    teachers = _teacher_kind(config.get("teachers", "in_context"))
    fig.suptitle(
        f"Topic-conditioned lines, {config['num_teachers']} {teachers} per topic; error bars: std"
        f" over {len(config['seeds'])} seeds",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _options(parser) -> None:
    parser.add_argument(
        "--rescore",
        action="store_true",
        help="recompute the measures of the finished run in --out from its samples.jsonl, "
        "without generating again",
    )


cli = Command(
    name="text_peers",
    description=__doc__.splitlines()[0],
    writes="results.json, results.md, samples.jsonl, text_peers.png, stages/",
    examples=(
        "--out runs/text_peers --reproducible",
        "--out runs/text_peers --rescore",
        "--preset fine_tuned --out runs/text_peers_fine_tuned --reproducible",
        "--preset tiny --out runs/tiny",
    ),
    presets=configs.PRESETS,
    options=_options,
    quiet=True,
    config=lambda args: configs.get_config(args.preset),
    run=lambda config, args: (
        rescore(config, args.out)
        if args.rescore
        else main(config, args.out, reproducible=args.reproducible)
    ),
)


if __name__ == "__main__":
    with experiment_main("text_peers"):
        cli()
