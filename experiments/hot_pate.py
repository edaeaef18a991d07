"""Hot PATE experiments: diversity transfer (coordinated vs independent) and private generation.

(a) Tunable diversity with known ground truth: every teacher spreads most of its mass over a
    secret set of k tokens (with per-teacher jitter) and puts some mass on a private token of its
    own. Coverage and transferred support vs T for both samplers, for each k and n.
(b) Natural task on the text default: a byte-level BPE and a small GPT-2 trained here on the
    public domains only (BBC topics, Python code, Python docs; public steps of the training
    engine); the sensitive records are the sentences of the sensitive e-mail corpus, each given
    to one of n teachers by a keyed hash of the record (`privacy.assign_parts`, secret key
    unless --reproducible); teacher i's prompt is its own records,
    one per line, then a shared public instruction. At every step both samplers draw r
    histograms from the same teacher distributions; the prefix advances by sampling from the
    non-private average teacher distribution (nothing is released).
(c) Private generation from the same teachers with DPWS, DPARGMAX (Laplace) and confident-GNMax,
    a public fallback model (the same GPT-2 given only the public instruction), reporting ε,
    yield and the fallback fraction. A line ends at any token holding a newline.

Privacy unit of (b)/(c): one record (one sentence of one e-mail) moves one teacher's vote.
The randomness of every part (partition key, samplers, aggregator noise) is secret, drawn from the
operating system, unless `--reproducible` seeds it with the config's seed; the results then say
`privacy.SEEDED_NOTE`.

Command and expected results: see `experiments/configs/hot_pate.py`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import pathlib
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
from flax import nnx

from dpmix_jax.data.builtin import load_text_mixture_task
from dpmix_jax.data.tokenizer import TextTokenizer
from dpmix_jax.models.gpt2 import GPT2, GPT2Config
from dpmix_jax.pate import diversity, generation, metrics, samplers, smooth_sensitivity
from dpmix_jax.pate.accounting import PateLedger
from dpmix_jax.pate.teachers import InContextTeachers, build_prompts, partition_records
from dpmix_jax.privacy import SEEDED_NOTE, randomness
from dpmix_jax.synthesis.public_models import (
    TextDefaultModel,
    make_public_model,
    marked_text,
    newline_tokens,
    split_sentences,
    text_default_model,
)
from experiments.common_args import experiment_main
from experiments.configs.hot_pate import PRESETS, HotPateConfig, get_config
from experiments.harness import Command, UsageError, finish

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _log(message: str) -> None:
    print(f"[hot_pate {time.strftime('%H:%M:%S')}] {message}", flush=True)


def _sample(sampler: str, key, logits, r, *, temperature=1.0, top_k=None):
    if sampler == "coordinated":
        return samplers.coordinated_histograms(key, logits, r, temperature=temperature, top_k=top_k)
    return samplers.independent_histograms(key, logits, r, temperature=temperature)


def _at(values, thresholds, fraction_of_n: float, n: int):
    """The value at the threshold closest to fraction·n."""
    return values[int(np.argmin(np.abs(np.asarray(thresholds) - fraction_of_n * n)))]


def _threshold_at_coverage(histograms, n: int, level: float = 0.2) -> float:
    """The largest T (on a fine grid) at which coverage is still >= `level` (0 if none)."""
    return metrics.threshold_at_coverage(
        histograms, level, np.unique(np.round(np.geomspace(1, n, 64)))
    )


# --------------------------------------------------------------------------------------------
# (a) Tunable diversity.
# --------------------------------------------------------------------------------------------


def run_diversity(config: HotPateConfig, key) -> dict:
    cfg = config.diversity
    results = []
    for n in cfg.num_teachers:
        grid = metrics.threshold_grid(n)
        for k in cfg.set_sizes:
            key, key_logits, key_hist = jax.random.split(key, 3)
            logits, _ = diversity.secret_set_logits(
                key_logits,
                num_teachers=n,
                vocab_size=cfg.vocab_size,
                set_size=k,
                private_mass=cfg.private_mass,
                heterogeneity=cfg.heterogeneity,
                background_mass=cfg.background_mass,
            )
            row = {"num_teachers": n, "k": k}
            for sampler in ("coordinated", "independent"):
                start = time.perf_counter()
                hist = _sample(sampler, key_hist, logits, cfg.num_histograms, top_k=cfg.top_k)
                hist.block_until_ready()
                row[sampler] = metrics.summarize(hist, grid)
                row[sampler]["threshold_at_20pct"] = _threshold_at_coverage(hist, n)
                row[sampler]["histograms_per_s"] = cfg.num_histograms / (
                    time.perf_counter() - start
                )
            results.append(row)
            hot, cold = row["coordinated"], row["independent"]
            _log(
                f"(a) n={n} k={k}: coverage@n/2 hot {hot['coverage'][-1]:.2f} cold "
                f"{cold['coverage'][-1]:.2f}; T@20% hot {hot['threshold_at_20pct']:.0f} cold "
                f"{cold['threshold_at_20pct']:.0f}"
            )
    return {"rows": results}


# --------------------------------------------------------------------------------------------
# (d) The diversity-preservation guarantee, measured.
# --------------------------------------------------------------------------------------------


def _guarantee_row(probs, tau, aggregate, key, draws, **labels) -> dict:
    row = dict(labels, tau=float(tau))
    for sampler in ("coordinated", "independent"):
        est = diversity.output_distribution(
            key, probs, sampler=sampler, aggregator=aggregate, num_draws=draws
        )
        got = diversity.attained(probs, est, tau)
        row[sampler] = {
            "beta": got.beta,
            "beta_lower": got.beta_lower,
            "gamma": got.gamma,
            "gamma_lower": got.gamma_lower,
            "gamma_upper": got.gamma_upper,
        }
    return row


def run_guarantees(config: HotPateConfig, key) -> dict:
    """Smallest β and largest γ attained by sampler + TWS_{τ/2,γ} and + DPWS on the adversarial
    ensembles of `pate.diversity`, against the theorem (β = 0.17 for coordinated TWS).

    Privacy:
        Synthetic teachers only; nothing sensitive is read.
    """
    cfg = config.guarantees
    rows = []
    for tau in cfg.taus:
        for gamma in cfg.gammas:
            for ensemble in diversity.adversarial_ensembles(cfg.num_teachers, tau):
                key, sub = jax.random.split(key)
                rows.append(
                    _guarantee_row(
                        ensemble.probs,
                        tau,
                        diversity.tws_aggregator(tau / 2, gamma),
                        sub,
                        cfg.num_draws,
                        aggregator="tws",
                        gamma=gamma,
                        ensemble=ensemble.name,
                    )  # fmt: skip
                )
    tau = diversity.dpws_tau(cfg.dpws_epsilon, cfg.dpws_delta)
    aggregate = diversity.dpws_aggregator(cfg.dpws_epsilon, cfg.dpws_delta, 1.0)
    for ensemble in diversity.adversarial_ensembles(cfg.dpws_teachers, tau):
        key, sub = jax.random.split(key)
        rows.append(
            _guarantee_row(
                ensemble.probs,
                tau,
                aggregate,
                sub,
                cfg.dpws_draws,
                aggregator="dpws",
                gamma=1.0,
                ensemble=ensemble.name,
            )  # fmt: skip
        )

    def summary(aggregator, gamma, sampler):
        picked = [r for r in rows if r["aggregator"] == aggregator and r["gamma"] == gamma]
        worst = min(picked, key=lambda r: r[sampler]["beta"])
        return {
            "beta": worst[sampler]["beta"],
            "beta_lower": worst[sampler]["beta_lower"],
            "beta_ensemble": worst["ensemble"],
            "beta_tau": worst["tau"],
            "gamma": max(r[sampler]["gamma"] for r in picked),
            "gamma_lower": max(r[sampler]["gamma_lower"] for r in picked),
            "gamma_upper": max(r[sampler]["gamma_upper"] for r in picked),
        }

    settings = [("tws", g) for g in cfg.gammas] + [("dpws", 1.0)]
    table = [
        {"aggregator": a, "gamma": g, "dpws_tau": tau if a == "dpws" else None,
         **{s: summary(a, g, s) for s in ("coordinated", "independent")}}
        for a, g in settings
    ]  # fmt: skip
    for row in table:
        hot, cold = row["coordinated"], row["independent"]
        _log(
            f"(d) {row['aggregator']} γ={row['gamma']:g}: min β hot {hot['beta']:.3f} "
            f"({hot['beta_ensemble']}) cold {cold['beta']:.3f}; max γ hot {hot['gamma']:.3f} "
            f"cold {cold['gamma']:.3f}"
        )
    return {"rows": rows, "table": table}


# --------------------------------------------------------------------------------------------
# (b) Natural task: a GPT-2 trained on the public text domains, in-context teachers.
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class NaturalTask:
    """The natural task's pieces: public tokenizer and model, the teachers, the public prompt.

    Attributes:
        tokenizer: byte-level BPE trained on the public domains only.
        model: the GPT-2 trained on the public domains only.
        teachers: n in-context teachers, each over its own disjoint part of the records.
        instruction: token ids of the shared public instruction (the end of every prompt).
        stop_tokens: ids of every token whose text holds a newline (a record ends there).
        num_records: sensitive records available to the partition.
        train_loss: (step, public training loss) pairs.
        parts: each teacher's record positions (`partition_records`).
        heldout_perplexity: the model's per-token perplexity on held-out public documents.
        public_train_seconds: wall time of the run that trained the tokenizer and model.
    """

    tokenizer: TextTokenizer
    model: GPT2
    teachers: InContextTeachers
    instruction: list[int]
    stop_tokens: tuple[int, ...]
    num_records: int
    train_loss: list[tuple[int, float]]
    parts: list[np.ndarray]
    heldout_perplexity: float
    public_train_seconds: float


def sensitive_records(
    texts: Sequence[str], tokenizer: TextTokenizer, *, min_chars: int, max_tokens: int
) -> list[list[int]]:
    """The records: every sentence or line of the documents with >= `min_chars` characters,
    tokenized and cut to `max_tokens` tokens, in document order.

    Privacy:
        The result is sensitive; one record is one sentence of one document. Which sentences
        exist depends on the data, but the partition among teachers depends only on their count.
    """
    kept = split_sentences(texts, min_chars=min_chars)
    return [ids[:max_tokens] for ids in tokenizer.encode_batch(kept)]


def _public_settings(config: HotPateConfig) -> TextDefaultModel:
    """Everything the public tokenizer and model depend on (their stage folder's key): the
    natural task's GPT-2 preset with its width and depth overrides, trained on the public domains
    with every `heldout_every`-th document held out."""
    cfg = config.natural
    preset = GPT2Config.tiny if cfg.model == "tiny" else GPT2Config.small
    overrides = {"n_embd": cfg.width, "n_layer": cfg.depth}
    gpt2 = preset(
        vocab_size=cfg.vocab_size,
        n_positions=cfg.seq_len,
        **{k: v for k, v in overrides.items() if v is not None},
    )
    return TextDefaultModel(
        vocab_size=cfg.vocab_size,
        width=gpt2.n_embd,
        depth=gpt2.n_layer,
        heads=gpt2.n_head,
        seq_len=cfg.seq_len,
        train_steps=cfg.train_steps,
        batch_size=cfg.batch_size,
        learning_rate=cfg.learning_rate,
        max_public_per_domain=cfg.max_public_per_domain,
        num_users=cfg.num_users,
        seed=config.seed,
        heldout_every=cfg.heldout_every,
    )


@dataclasses.dataclass(frozen=True)
class PublicModel:
    """The public tokenizer and GPT-2 with their training record.

    Attributes:
        tokenizer: byte-level BPE trained on all public documents.
        model: GPT-2 trained on the public training documents.
        train_loss: (step, training loss) pairs.
        heldout_perplexity: per-token perplexity on the held-out public documents.
        train_seconds: wall time of tokenizer + model training (the run that trained them).
        cached: True when read back from the stage folder rather than trained by this run.
    """

    tokenizer: TextTokenizer
    model: GPT2
    train_loss: list[tuple[int, float]]
    heldout_perplexity: float
    train_seconds: float
    cached: bool


def public_model(config: HotPateConfig, stages: pathlib.Path | None) -> PublicModel:
    """The public tokenizer and GPT-2 (`synthesis.public_models.text_default_model`): read back
    from `stages/public_model-<settings key>/` when a run with the same settings stored them
    there, else trained (and stored when `stages`).

    Privacy:
        Reads public documents only (the text default's public domains); the stored files hold
        nothing sensitive.
    """

    def log(message: str) -> None:
        _log(f"(b) {message}")

    trained = text_default_model(stages, _public_settings(config), log=log)
    training = trained.training
    if training.cached:
        _log(
            f"(b) public model read back ({trained.source}; held-out perplexity "
            f"{training.heldout_perplexity:.1f})"
        )
    else:
        _log(
            f"(b) public model trained in {training.train_seconds:.0f} s; held-out perplexity "
            f"{training.heldout_perplexity:.1f}"
        )
    return PublicModel(
        tokenizer=trained.tokenizer,
        model=trained.model,
        train_loss=list(training.train_loss),
        heldout_perplexity=training.heldout_perplexity,
        train_seconds=training.train_seconds,
        cached=training.cached,
    )


def build_natural_task(
    config: HotPateConfig, *, reproducible: bool = False, stages: pathlib.Path | None = None
) -> NaturalTask:
    """Tokenizer and GPT-2 on the public domains; teachers over the sensitive e-mail sentences.

    Privacy:
        The tokenizer and the model read public documents only. Each record's teacher is a keyed
        hash of the record's tokens (`partition_records`; the key is `config.seed` with
        `reproducible`, else a secret), so one record enters exactly one teacher's prompt and
        adding or removing a record moves no other; the instruction is public.
    """
    cfg = config.natural
    task = load_text_mixture_task(
        seed=config.seed, num_users=cfg.num_users, max_public_per_domain=cfg.max_public_per_domain
    )
    trained = public_model(config, stages)
    tokenizer, model = trained.tokenizer, trained.model
    records = sensitive_records(
        task.sensitive.texts,
        tokenizer,
        min_chars=cfg.min_record_chars,
        max_tokens=cfg.max_record_tokens,
    )
    record_ids = [np.asarray(record, np.int64).tobytes() for record in records]
    key = config.seed if reproducible else None
    parts = partition_records(record_ids, cfg.num_teachers, key=key)
    instruction = tokenizer.encode(cfg.instruction)
    newline = tokenizer.encode("\n")
    prompts = [
        prompt + instruction
        for prompt in build_prompts(
            records, parts, separator=newline, records_per_teacher=cfg.records_per_teacher
        )
    ]
    # Public width: every record is cut to max_record_tokens (`sensitive_records`).
    width = cfg.records_per_teacher * (cfg.max_record_tokens + len(newline)) + len(instruction)
    teachers = InContextTeachers(
        model,
        prompts,
        width=width,
        batch_size=min(128, cfg.num_teachers),
        pad_id=tokenizer.eos_id,
    )
    short = sum(len(part) < cfg.records_per_teacher for part in parts)
    _log(
        f"(b) {len(records)} sensitive records, {cfg.num_teachers} teachers x "
        f"{cfg.records_per_teacher} ({short} with fewer); longest prompt "
        f"{max(map(len, prompts))} of the public width {width} tokens"
    )
    return NaturalTask(
        tokenizer=tokenizer,
        model=model,
        teachers=teachers,
        instruction=instruction,
        stop_tokens=newline_tokens(tokenizer),
        num_records=len(records),
        train_loss=trained.train_loss,
        parts=parts,
        heldout_perplexity=trained.heldout_perplexity,
        public_train_seconds=trained.train_seconds,
    )


def run_natural(config: HotPateConfig, task: NaturalTask, key) -> dict:
    """Coverage and support vs T for both samplers on the same prefixes, step by step.

    Privacy:
        Reads the teachers (sensitive) and releases nothing private: the histograms are
        measured, and the prefix advances by sampling the non-private average teacher
        distribution, which is only a way to reach natural prefixes for the measurement.
    """
    cfg = config.natural
    teachers = task.teachers
    n = teachers.num_teachers
    grid = metrics.threshold_grid(n)
    prefix: list[int] = []
    steps = []
    for step in range(cfg.num_steps):
        logits = teachers(prefix)
        key, key_hist, key_next = jax.random.split(key, 3)
        row = {"prefix": list(prefix), "prefix_text": task.tokenizer.decode(prefix)}
        for sampler in ("coordinated", "independent"):
            start = time.perf_counter()
            hist = _sample(
                sampler,
                key_hist,
                logits,
                cfg.num_histograms,
                temperature=cfg.temperature,
                top_k=cfg.top_k,
            )
            hist.block_until_ready()
            row[sampler] = metrics.summarize(hist, grid)
            row[sampler]["seconds"] = time.perf_counter() - start
        steps.append(row)
        hot, cold = row["coordinated"], row["independent"]
        _log(
            f"(b) step {step} {row['prefix_text']!r}: coverage/support at T=n/2: hot "
            f"{hot['coverage'][-1]:.2f}/{hot['support'][-1]}, cold {cold['coverage'][-1]:.2f}/"
            f"{cold['support'][-1]}; {hot['seconds']:.1f}/{cold['seconds']:.1f} s"
        )
        average = jnp.mean(jax.nn.softmax(logits / cfg.temperature, axis=-1), axis=0)
        prefix.append(int(jax.random.categorical(key_next, jnp.log(average))))
    mean = {
        s: {
            name: np.mean([st[s][name] for st in steps], axis=0).tolist()
            for name in ("coverage", "support", "targmax_yield", "tws_yield")
        }
        for s in ("coordinated", "independent")
    }
    for s in mean:
        mean[s]["max_passing_threshold"] = {
            k: float(np.mean([st[s]["max_passing_threshold"][k][0] for st in steps]))
            for k in steps[0][s]["max_passing_threshold"]
        }
        mean[s]["worst_max_passing_threshold"] = {
            k: float(np.min([st[s]["max_passing_threshold"][k][0] for st in steps]))
            for k in steps[0][s]["max_passing_threshold"]
        }
    return {
        "num_teachers": n,
        "num_records": task.num_records,
        "train_loss": task.train_loss,
        "heldout_perplexity": task.heldout_perplexity,
        "public_train_seconds": task.public_train_seconds,
        "model_size": {
            "n_embd": task.model.config.n_embd,
            "n_layer": task.model.config.n_layer,
            "parameters": sum(x.size for x in jax.tree.leaves(nnx.state(task.model, nnx.Param))),
        },
        "thresholds": grid.tolist(),
        "steps": steps,
        "mean": mean,
        "final_text": task.tokenizer.decode(prefix),
    }


# --------------------------------------------------------------------------------------------
# (c) Private generation.
# --------------------------------------------------------------------------------------------


def run_generation(config: HotPateConfig, task: NaturalTask, key) -> dict:
    """Private decoding with each DP aggregator and sampler; public-model fallback on FAIL.

    Privacy:
        Teachers are read only through the DP aggregators of `generation.generate`; every call
        is charged in the run's ledger. The fallback model sees only the public instruction.
    """
    cfg = config.generation
    teachers = task.teachers
    n = teachers.num_teachers
    public_model = make_public_model(task.model, [task.tokenizer.eos_id, *task.instruction])
    release = release_parameters(config, n, teachers.vocab_size)
    privacy = {
        "dpws": dict(aggregator="dpws", epsilon=cfg.epsilon, delta=cfg.delta, gamma=cfg.gamma),
        "dpargmax_laplace": dict(
            aggregator="dpargmax_laplace", epsilon=cfg.epsilon, threshold=cfg.argmax_threshold * n
        ),
        "confident_gnmax": dict(
            aggregator="confident_gnmax",
            threshold=cfg.gnmax_threshold * n,
            sigma1=cfg.gnmax_sigma1 * n,
            sigma2=cfg.gnmax_sigma2 * n,
            release_order=release["order"],
            release_noise_multiplier=release["noise_multiplier"],
            release_beta=release["beta"],
        ),
    }
    rows = []
    for name, settings in privacy.items():
        for sampler in ("coordinated", "independent"):
            run = generation.GenerationConfig(
                sampler=sampler,
                temperature=config.natural.temperature,
                top_k=config.natural.top_k if sampler == "coordinated" else None,
                max_new_tokens=cfg.max_new_tokens,
                stop_sequences=tuple((t,) for t in task.stop_tokens),
                report_delta=cfg.report_delta,
                **settings,
            )
            ledger = PateLedger()
            results = []
            start = time.perf_counter()
            for _ in range(cfg.num_sequences):
                key, sub = jax.random.split(key)
                results.append(
                    generation.generate(
                        teachers, [], run, public_model=public_model, ledger=ledger, key=sub
                    )
                )
            seconds = time.perf_counter() - start
            last = results[-1]
            sources = [s for r in results for s in r.sources]
            queries = sum(r.num_queries for r in results)
            failed = sum(r.num_failed for r in results)
            row = {
                "aggregator": name,
                "sampler": sampler,
                "epsilon": last.epsilon,
                "delta": last.delta,
                "queries": queries,
                "yield": 1 - failed / max(queries, 1),
                "fallback_fraction": sources.count("public") / max(len(sources), 1),
                "seconds": seconds,
                "tokens_per_s": len(sources) / seconds,
                "tokens": [r.tokens for r in results],
                "sources": [r.sources for r in results],
                "texts": [
                    config.natural.instruction + task.tokenizer.decode(r.tokens) for r in results
                ],
                "marked_texts": [
                    config.natural.instruction + marked_text(task.tokenizer, r.tokens, r.sources)
                    for r in results
                ],
            }
            if name == "confident_gnmax":
                reports = [r.gnmax for r in results]
                row["per_sequence_epsilon"] = {
                    "data_dependent": [g.epsilon_data_dependent for g in reports],
                    "data_independent": [g.epsilon_data_independent for g in reports],
                    "released": [r.released.epsilon for r in results],
                    "release_rdp": [r.released.release_rdp for r in results],
                    "release_noise_std": [r.released.noise_std for r in results],
                }
            rows.append(row)
            _log(
                f"(c) {name} {sampler}: ε = {row['epsilon']:.2f} (δ = {row['delta']:.1e}), "
                f"yield {row['yield']:.2f}, fallback {row['fallback_fraction']:.2f}, "
                f"{row['tokens_per_s']:.2f} tokens/s; {row['texts'][0]!r}"
            )
    tokens = sum(len(s) for row in rows for s in row["sources"])
    seconds = sum(row["seconds"] for row in rows)
    return {
        "rows": rows,
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "release": release,
        "report_delta": cfg.report_delta,
    }


def release_parameters(config: HotPateConfig, n: int, vocab_size: int) -> dict:
    """(λ, β, σ_s) of confident-GNMax's smooth-sensitivity release: the config's, or chosen from
    public inputs (`smooth_sensitivity.choose_release`) when it leaves them to None.

    Privacy:
        Reads no sensitive data: the choice costs nothing.
    """
    cfg = config.generation
    if cfg.release_order is not None:
        return {
            "order": cfg.release_order,
            "beta": 0.49 / cfg.release_order,
            "noise_multiplier": cfg.release_noise_multiplier,
            "chosen": False,
        }
    choice = smooth_sensitivity.choose_release(
        num_queries=cfg.max_new_tokens,
        num_teachers=n,
        num_classes=vocab_size,
        threshold=cfg.gnmax_threshold * n,
        sigma1=cfg.gnmax_sigma1 * n,
        sigma2=cfg.gnmax_sigma2 * n,
        delta=cfg.report_delta,
        agreement=cfg.release_agreement,
    )
    _log(
        f"(c) release chosen from public inputs: λ = {choice.order:g}, β = {choice.beta:.4f}, "
        f"σ_s = {choice.noise_multiplier:.2f} (predicted ε {choice.predicted_epsilon:.2f})"
    )
    return {
        "order": choice.order,
        "beta": choice.beta,
        "noise_multiplier": choice.noise_multiplier,
        "chosen": True,
        "predicted_epsilon": choice.predicted_epsilon,
    }


# --------------------------------------------------------------------------------------------
# Reporting.
# --------------------------------------------------------------------------------------------


def plot_diversity(result: dict, path: pathlib.Path, *, num_teachers: int) -> None:
    """(a) at n = `num_teachers`: coverage and transferred support against T, one line per k
    and sampler. Draws from `result` alone (`hot_pate.json` read back will do)."""
    n = num_teachers
    rows = [r for r in result["diversity"]["rows"] if r["num_teachers"] == n]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for i, row in enumerate(rows):
        color = f"C{i}"
        for sampler, style in (("coordinated", "-"), ("independent", "--")):
            m = row[sampler]
            axes[0].plot(
                m["thresholds"],
                m["coverage"],
                style,
                color=color,
                label=f"k={row['k']} {sampler[:4]}",
            )
            axes[1].plot(m["thresholds"], m["support"], style, color=color)
    for ax, name in zip(axes, ("coverage", "transferred support"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("threshold T")
        ax.set_ylabel(name)
    axes[0].legend(fontsize=7, ncol=2)
    fig.suptitle(f"Tunable diversity, n = {n} (solid: coordinated, dashed: independent)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_natural(result: dict, path: pathlib.Path) -> None:
    """(b): coverage and support against T, mean over the decoding steps, per sampler. Draws
    from `result` alone."""
    natural = result["natural"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for sampler, style in (("coordinated", "-"), ("independent", "--")):
        m = natural["mean"][sampler]
        axes[0].plot(natural["thresholds"], m["coverage"], style, label=sampler)
        axes[1].plot(natural["thresholds"], m["support"], style, label=sampler)
    for ax, name in zip(
        axes, ("coverage (mean over steps)", "support (mean over steps)"), strict=True
    ):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("threshold T")
        ax.set_ylabel(name)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plots(result: dict) -> dict[str, Callable[[dict, pathlib.Path], None]]:
    """The run's plots, file name -> `plot(result, path)`: `diversity_n<N>.png` for every n of
    (a), `natural.png` for (b); none for the parts that did not run."""
    files: dict[str, Callable[[dict, pathlib.Path], None]] = {}
    if "diversity" in result:
        for n in sorted({r["num_teachers"] for r in result["diversity"]["rows"]}):
            files[f"diversity_n{n}.png"] = functools.partial(plot_diversity, num_teachers=n)
    if "natural" in result:
        files["natural.png"] = plot_natural
    return files


def markdown(result: dict) -> str:
    lines = ["# Hot PATE"]
    if "diversity" in result:
        lines += _diversity_markdown(result["diversity"])
    if "natural" in result:
        lines += _natural_markdown(result["natural"], result["config"])
    if "generation" in result:
        lines += _generation_markdown(result["generation"])
    if "guarantees" in result:
        lines += _guarantee_markdown(result["guarantees"])
    seconds = ", ".join(f"{k} {v:.0f} s" for k, v in result["seconds"].items())
    if result["noise_seeded"]:
        lines += ["", f"{SEEDED_NOTE} (seed {result['config']['seed']})."]
    else:
        lines += ["", "Private randomness secret (from the operating system)."]
    lines += ["", f"Parts run: {', '.join(result['parts'])}. Run time: {seconds}."]
    return "\n".join(lines) + "\n"


def _diversity_markdown(diversity: dict) -> list[str]:
    lines = ["", "## (a) Tunable diversity", ""]
    lines.append("T@20%: largest T with coverage >= 0.2; gain = ratio hot/cold.\n")
    lines.append(
        "| n | k | cov@n/4 hot | cov@n/4 cold | cov@n/2 hot | cov@n/2 cold | "
        "support@n/2 hot | support@n/2 cold | T@20% hot | T@20% cold | gain |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for row in diversity["rows"]:
        hot, cold = row["coordinated"], row["independent"]
        n = row["num_teachers"]
        gain = hot["threshold_at_20pct"] / max(cold["threshold_at_20pct"], 1.0)
        q_hot = _at(hot["coverage"], hot["thresholds"], 0.25, n)
        q_cold = _at(cold["coverage"], cold["thresholds"], 0.25, n)
        lines.append(
            f"| {n} | {row['k']} | {q_hot:.2f} | "
            f"{q_cold:.2f} | {hot['coverage'][-1]:.2f} | {cold['coverage'][-1]:.2f}"
            f" | {hot['support'][-1]} | {cold['support'][-1]} | {hot['threshold_at_20pct']:.0f} |"
            f" {cold['threshold_at_20pct']:.0f} | {gain:.1f}x |"
        )
    return lines


def _natural_markdown(nat: dict, config: dict) -> list[str]:
    model, size = config["natural"], nat["model_size"]
    losses_text = ", ".join(f"{loss:.2f} at step {step}" for step, loss in nat["train_loss"])
    lines = [
        "",
        f"## (b) Natural task (n = {nat['num_teachers']} teachers over {nat['num_records']} "
        f"records, r = {model['num_histograms']}; mean over {len(nat['steps'])} decoding steps)",
        "",
        f"Public GPT-2 (width {size['n_embd']}, {size['n_layer']} layers, "
        f"{size['parameters']:,} parameters, BPE V = {model['vocab_size']}; "
        f"{model['train_steps']} public steps of "
        f"{model['batch_size']} x {model['seq_len']} tokens; training loss {losses_text} nats): "
        f"held-out public perplexity {nat['heldout_perplexity']:.1f} per token "
        f"(trained in {nat['public_train_seconds']:.0f} s by the run that stored it).",
        "",
        f"Decoded prefix (non-private average, not released): {nat['final_text']!r}",
        "",
        "| T | coverage hot | coverage cold | support hot | support cold |",
        "|---|---|---|---|---|",
    ]
    for i in sorted({*range(0, len(nat["thresholds"]), 4), len(nat["thresholds"]) - 1}):
        h, c = nat["mean"]["coordinated"], nat["mean"]["independent"]
        lines.append(
            f"| {nat['thresholds'][i]:.1f} | {h['coverage'][i]:.3f} | "
            f"{c['coverage'][i]:.3f} | {h['support'][i]:.1f} | {c['support'][i]:.1f} |"
        )
    lines += ["", "| max passing T (mean / worst step) | 1 try | 5 tries | 10 tries |"]
    lines.append("|---|---|---|---|")
    for s in ("coordinated", "independent"):
        mean = nat["mean"][s]["max_passing_threshold"]
        worst = nat["mean"][s]["worst_max_passing_threshold"]
        lines.append(
            f"| {s} | " + " | ".join(f"{mean[k]:.0f} / {worst[k]:.0f}" for k in mean) + " |"
        )
    return lines


def _generation_markdown(gen: dict) -> list[str]:
    release = gen["release"]
    conversion = math.log(1 / gen["report_delta"]) / (release["order"] - 1)
    lines = [
        "",
        "## (c) Private generation",
        "",
        f"{gen['tokens']} tokens in {gen['seconds']:.0f} s ({gen['tokens_per_s']:.2f} tokens/s, "
        "the teachers' forward passes and the aggregators in the loop).",
        "",
        "| aggregator | sampler | ε | δ | queries | yield | public fallback | tokens/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in gen["rows"]:
        lines.append(
            f"| {row['aggregator']} | {row['sampler']} | {row['epsilon']:.2f} | "
            f"{row['delta']:.1e} | {row['queries']} | {row['yield']:.2f} | "
            f"{row['fallback_fraction']:.2f} | {row['tokens_per_s']:.2f} |"
        )
    lines += ["", "Samples (ε of the whole row's run; tokens from the public fallback in [ ]):", ""]
    for row in gen["rows"]:
        for text in row["marked_texts"]:
            lines.append(
                f"- {row['aggregator']}, {row['sampler']}, ε = {row['epsilon']:.2f}: {text!r}"
            )
    for row in gen["rows"]:
        if "per_sequence_epsilon" in row:
            eps = row["per_sequence_epsilon"]
            lines.append(
                f"\nconfident-GNMax ({row['sampler']}), ε per sequence: data-dependent "
                + ", ".join(f"{e:.2f}" for e in eps["data_dependent"])
                + " (not itself private); released privately by smooth sensitivity "
                + ", ".join(f"{e:.2f}" for e in eps["released"])
                + f" (λ = {release['order']:g}, σ_s = {release['noise_multiplier']:.2f}, "
                + ("chosen from public inputs" if release["chosen"] else "fixed")
                + "; the release's own RDP "
                + ", ".join(f"{e:.2f}" for e in eps["release_rdp"])
                + ", noise std "
                + ", ".join(f"{e:.3f}" for e in eps["release_noise_std"])
                + f", RDP-to-DP term {conversion:.2f})"
                + "; data-independent "
                + ", ".join(f"{e:.2f}" for e in eps["data_independent"])
            )
    return lines


def _guarantee_markdown(guarantees: dict) -> list[str]:
    lines = [
        "",
        "## (d) Diversity preservation (τ, β, γ), measured",
        "",
        "Smallest β and largest γ attained over the adversarial ensembles and τ values "
        "(`pate.diversity`), with 4-standard-error bounds; theorem: coordinated + TWS_{τ/2,γ} "
        "is (τ, 0.17, γ), DPWS is (4ε⁻¹ln(1/δ), Θ(1), 1).",
        "",
        "| aggregator | γ | min β hot [lower] (ensemble, τ) | min β cold | max γ hot [upper] "
        "| max γ cold | theorem β, γ |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in guarantees["table"]:
        hot, cold = row["coordinated"], row["independent"]
        theorem = "0.17, " + f"{row['gamma']:g}" if row["aggregator"] == "tws" else "Θ(1), 1"
        name = "TWS_{τ/2,γ}" if row["aggregator"] == "tws" else f"DPWS (τ = {row['dpws_tau']:.1f})"
        lines.append(
            f"| {name} | {row['gamma']:g} | {hot['beta']:.3f} [{hot['beta_lower']:.3f}] "
            f"({hot['beta_ensemble']}, {hot['beta_tau']:.0f}) | {cold['beta']:.3f} "
            f"({cold['beta_ensemble']}) | {hot['gamma']:.3f} [{hot['gamma_upper']:.3f}] | "
            f"{cold['gamma']:.3f} | {theorem} |"
        )
    return lines


PARTS = ("diversity", "guarantees", "natural", "generation")


def run_experiments(
    config: HotPateConfig,
    task: NaturalTask | None = None,
    *,
    reproducible: bool = False,
    parts: Sequence[str] = PARTS,
    stages: pathlib.Path | None = None,
) -> dict:
    """Runs the chosen `parts` of (a)-(d) (building the natural task unless given, with the
    public model stored in / read back from `stages`) with per-part timings.

    Privacy: the samplers' and aggregators' keys derive from `config.seed` with `reproducible`
    (the result then has `noise_seeded` True), else from a secret that is never stored.
    """
    unknown = sorted(set(parts) - set(PARTS))
    if unknown or not parts:
        raise ValueError(f"parts must be a non-empty subset of {PARTS}, got {list(parts)}.")
    root = config.seed if reproducible else randomness.secret_seed()
    key_div, key_nat, key_gen = jax.random.split(randomness.prng_key(root), 3)
    seconds: dict[str, float] = {}
    result = {
        "config": dataclasses.asdict(config),
        "noise_seeded": reproducible,
        "parts": [p for p in PARTS if p in parts],
        "seconds": seconds,
    }
    start = time.perf_counter()

    def lap(name: str) -> None:
        seconds[name] = time.perf_counter() - start - sum(seconds.values())

    if "diversity" in parts:
        result["diversity"] = run_diversity(config, key_div)
        lap("diversity")
    if "guarantees" in parts:
        result["guarantees"] = run_guarantees(config, jax.random.fold_in(key_div, 1))
        lap("guarantees")
    if task is None and {"natural", "generation"} & set(parts):
        task = build_natural_task(config, reproducible=reproducible, stages=stages)
        lap("natural_setup")
    if "natural" in parts:
        result["natural"] = run_natural(config, task, key_nat)
        lap("natural")
    if "generation" in parts:
        result["generation"] = run_generation(config, task, key_gen)
        lap("generation")
    seconds["total"] = time.perf_counter() - start
    return result


def main(
    config: HotPateConfig,
    out_dir: str | pathlib.Path,
    *,
    reproducible: bool = False,
    parts: Sequence[str] = PARTS,
) -> dict:
    """Runs the chosen parts; writes hot_pate.json, hot_pate.md and the plots (`plots`) to
    `out_dir`, prints the tables and returns the results.

    The public tokenizer and GPT-2 are stored under `out_dir/stages/` (keyed by their settings)
    and read back by later runs with the same settings.
    """
    out = pathlib.Path(out_dir)
    result = run_experiments(config, reproducible=reproducible, parts=parts, stages=out / "stages")
    finish(out, result, markdown(result), name="hot_pate", plots=plots(result))
    _log(f"done in {result['seconds']['total']:.0f} s; wrote {out_dir}")
    return result


def _options(parser) -> None:
    parser.add_argument(
        "--parts",
        default=",".join(PARTS),
        metavar="LIST",
        help=f"comma-separated parts to run, of {','.join(PARTS)} (default: all)",
    )


def _parts(text: str) -> tuple[str, ...]:
    """The parts `--parts` lists, in its order."""
    chosen = tuple(p.strip() for p in text.split(",") if p.strip())
    if not chosen or set(chosen) - set(PARTS):
        raise UsageError(f"--parts must list some of {','.join(PARTS)}, got {text!r}")
    return chosen


def _config(args) -> HotPateConfig:
    _parts(args.parts)  # a bad list stops the run before any work
    return get_config(args.preset)


cli = Command(
    name="hot_pate",
    description=__doc__.splitlines()[0],
    writes="hot_pate.json, hot_pate.md, diversity_n<N>.png, natural.png and stages/ (the public"
    " model)",
    examples=("--preset cpu", "--preset cpu --parts natural,generation", "--preset tiny"),
    presets=PRESETS,
    options=_options,
    seeds="one",
    config=_config,
    run=lambda config, args: main(
        config, args.out, reproducible=args.reproducible, parts=_parts(args.parts)
    ),
)


if __name__ == "__main__":
    with experiment_main("hot_pate"):
        cli()
