"""Hot PATE experiments: diversity transfer (coordinated vs independent) and private generation.

(a) Tunable diversity with known ground truth: every teacher spreads most of its mass over a
    secret set of k tokens (with per-teacher jitter) and puts some mass on a private token of its
    own. Coverage and transferred support vs T for both samplers, for each k and n.
(b) Natural task: in-context teachers over a GPT-2 briefly trained on public synthetic Markov
    text; each teacher's prompt holds its own disjoint part of the sensitive records. At every
    step both samplers draw r histograms from the same teacher distributions; the prefix advances
    by sampling from the non-private average teacher distribution (nothing is released).
(c) Private generation from the same teachers with DPWS, DPARGMAX (Laplace) and confident-GNMax,
    a public fallback model (the same GPT-2 without private context), reporting ε, yield and the
    fallback fraction.

Command and expected results: see `experiments/configs/hot_pate.py`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import optax
from flax import nnx

from dpmix_jax.models.gpt2 import GPT2, GPT2Config
from dpmix_jax.pate import generation, metrics, samplers
from dpmix_jax.pate.accounting import PateLedger
from dpmix_jax.pate.teachers import InContextTeachers, build_prompts, partition_records
from experiments.configs.hot_pate import HotPateConfig, get_config

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

SEPARATOR = 0  # ends every record: the "blank line" of the synthetic language


def _log(message: str) -> None:
    print(f"[hot_pate {time.strftime('%H:%M:%S')}] {message}", flush=True)


def _sample(sampler: str, key, logits, r, *, temperature=1.0, top_k=None):
    if sampler == "coordinated":
        return samplers.coordinated_histograms(
            key,
            logits,
            r,
            temperature=temperature,
            top_k=top_k,
            batch_size=8,
        )
    return samplers.independent_histograms(key, logits, r, temperature=temperature)


def _at(values, thresholds, fraction_of_n: float, n: int):
    """The value at the threshold closest to fraction·n."""
    return values[int(np.argmin(np.abs(np.asarray(thresholds) - fraction_of_n * n)))]


def _threshold_at_coverage(histograms, n: int, level: float = 0.2) -> float:
    """The largest T (on a fine grid) at which coverage is still >= `level` (0 if none)."""
    grid = np.unique(np.round(np.geomspace(1, n, 64)))
    cov = np.asarray(metrics.coverage(histograms, jnp.asarray(grid, jnp.float32)))
    passing = grid[cov >= level]
    return float(passing.max()) if passing.size else 0.0


# --------------------------------------------------------------------------------------------
# (a) Tunable diversity.
# --------------------------------------------------------------------------------------------


def diversity_logits(key, *, n, vocab, k, private_mass, heterogeneity, background_mass):
    """Teacher logits: a secret set of k tokens shared by all, a private token per teacher."""
    key_set, key_private, key_jitter = jax.random.split(key, 3)
    order = jax.random.permutation(key_set, vocab)
    secret, others = order[:k], order[k:]
    private = others[jax.random.randint(key_private, (n,), 0, others.shape[0])]
    shared_mass = 1.0 - private_mass - background_mass
    logits = jnp.full((n, vocab), jnp.log(background_mass / vocab), jnp.float32)
    jitter = heterogeneity * jax.random.normal(key_jitter, (n, k))
    logits = logits.at[:, secret].set(jnp.log(shared_mass / k) + jitter)
    if private_mass > 0:
        logits = logits.at[jnp.arange(n), private].set(jnp.log(private_mass))
    return logits


def run_diversity(config: HotPateConfig, key) -> dict:
    cfg = config.diversity
    results = []
    for n in cfg.num_teachers:
        grid = metrics.threshold_grid(n)
        for k in cfg.set_sizes:
            key, key_logits, key_hist = jax.random.split(key, 3)
            logits = diversity_logits(
                key_logits,
                n=n,
                vocab=cfg.vocab_size,
                k=k,
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
# (b) Natural task: a GPT-2 on public synthetic text, in-context teachers.
# --------------------------------------------------------------------------------------------


def markov_language(seed: int, vocab: int, branching: int = 6):
    """A random sparse Markov chain over tokens 1..vocab-1 (Zipf weights over `branching`)."""
    rng = np.random.default_rng(seed)
    transitions = np.zeros((vocab, vocab))
    weights = 1.0 / np.arange(1, branching + 1)
    for t in range(vocab):
        transitions[t, rng.choice(np.arange(1, vocab), branching, replace=False)] = weights
    transitions /= transitions.sum(axis=1, keepdims=True)
    return transitions


def sample_records(rng, transitions, count: int, min_len: int = 4, max_len: int = 9):
    vocab = transitions.shape[0]
    records = []
    for _ in range(count):
        token = int(rng.integers(1, vocab))
        record = [token]
        for _ in range(int(rng.integers(min_len, max_len + 1)) - 1):
            token = int(rng.choice(vocab, p=transitions[token]))
            record.append(token)
        records.append(record + [SEPARATOR])
    return records


def train_public_model(config: HotPateConfig, transitions, key) -> GPT2:
    """Briefly trains a GPT-2 on public text from the synthetic language (next-token loss)."""
    cfg = config.natural
    preset = GPT2Config.tiny if cfg.model == "tiny" else GPT2Config.small
    needed = cfg.records_per_teacher * 10 + config.generation.max_new_tokens + cfg.num_steps + 16
    model_config = preset(vocab_size=cfg.vocab_size, n_positions=max(128, needed))
    model = GPT2(model_config, rngs=nnx.Rngs(int(jax.random.randint(key, (), 0, 2**30))))
    graphdef, state = nnx.split(model)
    optimizer = optax.adam(cfg.learning_rate)
    opt_state = optimizer.init(state)
    rng = np.random.default_rng(config.seed + 1)

    def loss_fn(state, batch):
        logits = nnx.merge(graphdef, state)(batch[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

    @jax.jit
    def train_step(state, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(state, batch)
        updates, opt_state = optimizer.update(grads, opt_state, state)
        return optax.apply_updates(state, updates), opt_state, loss

    for step in range(cfg.train_steps):
        stream = [t for r in sample_records(rng, transitions, cfg.batch_size * 8) for t in r]
        need = cfg.batch_size * (cfg.seq_len + 1)
        batch = np.asarray(stream[:need], np.int32).reshape(cfg.batch_size, cfg.seq_len + 1)
        state, opt_state, loss = train_step(state, opt_state, jnp.asarray(batch))
        if step % max(cfg.train_steps // 5, 1) == 0 or step == cfg.train_steps - 1:
            _log(f"(b) public pre-training step {step}: loss {float(loss):.3f}")
    return nnx.merge(graphdef, state)


def make_public_model(model: GPT2):
    """The public fallback: the same GPT-2 given only a separator (no private context)."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def last_logits(state, ids):
        return nnx.merge(graphdef, state)(ids)[0, -1]

    return lambda prefix: last_logits(state, jnp.asarray([[SEPARATOR, *prefix]], jnp.int32))


def build_teachers(config: HotPateConfig, model: GPT2, transitions) -> InContextTeachers:
    cfg = config.natural
    rng = np.random.default_rng(config.seed + 2)
    records = sample_records(rng, transitions, cfg.num_records)  # the "sensitive" data
    parts = partition_records(cfg.num_records, cfg.num_teachers, seed=config.seed)
    prompts = build_prompts(
        [r[:-1] for r in records],
        parts,
        separator=[SEPARATOR],
        records_per_teacher=cfg.records_per_teacher,
    )
    return InContextTeachers(model, prompts, batch_size=min(64, cfg.num_teachers), pad_id=0)


def run_natural(config: HotPateConfig, teachers, key) -> dict:
    cfg = config.natural
    n = teachers.num_teachers
    grid = metrics.threshold_grid(n)
    prefix: list[int] = []
    steps = []
    for step in range(cfg.num_steps):
        logits = teachers(prefix)
        key, key_hist, key_next = jax.random.split(key, 3)
        row = {"prefix": list(prefix)}
        for sampler in ("coordinated", "independent"):
            hist = _sample(
                sampler, key_hist, logits, cfg.num_histograms, temperature=cfg.temperature
            )
            row[sampler] = metrics.summarize(hist, grid)
        steps.append(row)
        hot, cold = row["coordinated"], row["independent"]
        quarter = {
            s: (_at(m["coverage"], grid, 0.25, n), _at(m["support"], grid, 0.25, n))
            for s, m in (("hot", hot), ("cold", cold))
        }
        _log(
            f"(b) step {step}: coverage/support at T=n/4: hot {quarter['hot'][0]:.2f}/"
            f"{quarter['hot'][1]}, cold {quarter['cold'][0]:.2f}/{quarter['cold'][1]}"
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
    return {"thresholds": grid.tolist(), "steps": steps, "mean": mean}


# --------------------------------------------------------------------------------------------
# (c) Private generation.
# --------------------------------------------------------------------------------------------


def run_generation(config: HotPateConfig, teachers, public_model, key) -> dict:
    cfg = config.generation
    n = teachers.num_teachers
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
        ),
    }
    rows = []
    for name, settings in privacy.items():
        for sampler in ("coordinated", "independent"):
            run = generation.GenerationConfig(
                sampler=sampler,
                temperature=config.natural.temperature,
                max_new_tokens=cfg.max_new_tokens,
                stop_sequences=((SEPARATOR,),),
                report_delta=cfg.report_delta,
                **settings,
            )
            ledger = PateLedger()
            results = []
            for _ in range(cfg.num_sequences):
                key, sub = jax.random.split(key)
                results.append(
                    generation.generate(
                        sub, teachers, [], run, public_model=public_model, ledger=ledger
                    )
                )
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
                "tokens": [r.tokens for r in results],
            }
            if name == "confident_gnmax":
                reports = [r.gnmax for r in results]
                row["per_sequence_epsilon"] = {
                    "data_dependent": [g.epsilon_data_dependent for g in reports],
                    "data_independent": [g.epsilon_data_independent for g in reports],
                }
            rows.append(row)
            _log(
                f"(c) {name} {sampler}: ε = {row['epsilon']:.2f} (δ = {row['delta']:.1e}), "
                f"yield {row['yield']:.2f}, fallback {row['fallback_fraction']:.2f}"
            )
    return {"rows": rows}


# --------------------------------------------------------------------------------------------
# Reporting.
# --------------------------------------------------------------------------------------------


def plot_diversity(result: dict, out: pathlib.Path) -> None:
    for n in sorted({r["num_teachers"] for r in result["rows"]}):
        rows = [r for r in result["rows"] if r["num_teachers"] == n]
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
        fig.savefig(out / f"diversity_n{n}.png", dpi=110)
        plt.close(fig)


def plot_natural(result: dict, out: pathlib.Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for sampler, style in (("coordinated", "-"), ("independent", "--")):
        m = result["mean"][sampler]
        axes[0].plot(result["thresholds"], m["coverage"], style, label=sampler)
        axes[1].plot(result["thresholds"], m["support"], style, label=sampler)
    for ax, name in zip(
        axes, ("coverage (mean over steps)", "support (mean over steps)"), strict=True
    ):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("threshold T")
        ax.set_ylabel(name)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "natural.png", dpi=110)
    plt.close(fig)


def markdown(result: dict) -> str:
    lines = ["# Hot PATE", "", "## (a) Tunable diversity", ""]
    lines.append("T@20%: largest T with coverage >= 0.2; gain = ratio hot/cold.\n")
    lines.append(
        "| n | k | cov@n/4 hot | cov@n/4 cold | cov@n/2 hot | cov@n/2 cold | "
        "support@n/2 hot | support@n/2 cold | T@20% hot | T@20% cold | gain |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for row in result["diversity"]["rows"]:
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
    nat = result["natural"]
    lines += [
        "",
        "## (b) Natural task (mean over decoding steps)",
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
    for s in ("coordinated", "independent"):
        mpt = nat["mean"][s]["max_passing_threshold"]
        lines.append(
            f"\nMax passing threshold ({s}): "
            + ", ".join(f"{k} tries {v:.1f}" for k, v in mpt.items())
        )
    lines += [
        "",
        "## (c) Private generation",
        "",
        "| aggregator | sampler | ε | δ | queries | yield | public fallback |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in result["generation"]["rows"]:
        lines.append(
            f"| {row['aggregator']} | {row['sampler']} | {row['epsilon']:.2f} | "
            f"{row['delta']:.1e} | {row['queries']} | {row['yield']:.2f} | "
            f"{row['fallback_fraction']:.2f} |"
        )
    for row in result["generation"]["rows"]:
        if "per_sequence_epsilon" in row:
            eps = row["per_sequence_epsilon"]
            lines.append(
                f"\nconfident-GNMax ({row['sampler']}), ε per sequence: data-dependent "
                + ", ".join(f"{e:.2f}" for e in eps["data_dependent"])
                + "; data-independent "
                + ", ".join(f"{e:.2f}" for e in eps["data_independent"])
                + " (the data-dependent value is not itself private)"
            )
    return "\n".join(lines) + "\n"


def main(config: HotPateConfig, out_dir: str | pathlib.Path) -> dict:
    """Runs (a), (b) and (c); writes JSON, markdown and plots to `out_dir`; returns the results."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    key_div, key_model, key_nat, key_gen = jax.random.split(jax.random.key(config.seed), 4)
    start = time.perf_counter()
    result = {"config": dataclasses.asdict(config)}
    result["diversity"] = run_diversity(config, key_div)
    transitions = markov_language(config.seed, config.natural.vocab_size)
    model = train_public_model(config, transitions, key_model)
    teachers = build_teachers(config, model, transitions)
    result["natural"] = run_natural(config, teachers, key_nat)
    result["generation"] = run_generation(config, teachers, make_public_model(model), key_gen)
    result["seconds"] = time.perf_counter() - start
    (out / "hot_pate.json").write_text(json.dumps(result, indent=1))
    (out / "hot_pate.md").write_text(markdown(result))
    plot_diversity(result["diversity"], out)
    plot_natural(result["natural"], out)
    _log(f"done in {result['seconds']:.0f} s; wrote {out}")
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="cpu", choices=("cpu", "paper"))
    parser.add_argument("--out", default="runs/hot_pate")
    args = parser.parse_args()
    main(get_config(args.preset), args.out)
