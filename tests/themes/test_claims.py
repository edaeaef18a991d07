"""The claims this project makes from the DP-MixMin and Hot PATE papers, each checked here.

Result claims are checked on the stored results under `docs/results/` (the files every table in
README.md and docs/ is rebuilt from), and, where a run fits in the suite, on a small fresh run: a
rerun that stops showing a claim, or a commit that no longer reproduces its stored numbers, fails.
"""

import collections
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpmix_jax.pate import diversity, metrics, samplers

RESULTS = pathlib.Path(__file__).parents[2] / "docs" / "results"


def stored(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text())


def mean_by_method_and_epsilon(results: dict, field=lambda run: run["utility"]) -> dict:
    values = collections.defaultdict(list)
    for run in results["runs"]:
        values[(run["method"], run["epsilon"])].append(field(run))
    return {key: float(np.mean(v)) for key, v in values.items()}


# ------------------------------------------------------------------------------------------
# DP-MixMin: the demo comparisons (image: test AUC; text, user level: test perplexity)
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("demo", ["demo-image", "demo-text"])
def test_dp_mixmin_beats_uniform_beats_random_init_at_every_epsilon(demo):
    results = stored(demo)
    sign = 1 if results["higher_is_better"] else -1
    means = mean_by_method_and_epsilon(results)
    epsilons = sorted({eps for _, eps in means})
    assert len(epsilons) >= 3
    for eps in epsilons:
        dp_mixmin, uniform = means[("dp_mixmin", eps)], means[("uniform", eps)]
        random_init = means[("random_init", eps)]
        assert sign * (dp_mixmin - uniform) > 0, (eps, dp_mixmin, uniform)
        assert sign * (uniform - random_init) > 0, (eps, uniform, random_init)


@pytest.mark.parametrize("demo", ["demo-image", "demo-text"])
def test_dp_mixmin_weights_are_closer_to_the_true_mixture_than_uniform_weights(demo):
    results = stored(demo)
    runs = [r for r in results["runs"] if r["method"] in ("dp_mixmin", "uniform")]
    cosine = mean_by_method_and_epsilon(
        {"runs": runs}, lambda run: run["weight_quality"]["cosine_true"]
    )
    for eps in {eps for _, eps in cosine}:
        assert cosine[("dp_mixmin", eps)] > cosine[("uniform", eps)], eps


@pytest.mark.parametrize("demo", ["demo-image", "demo-text"])
def test_every_stored_private_run_spent_at_most_its_budget(demo):
    for run in stored(demo)["runs"]:
        if run["private"]:
            assert run["spent_epsilon"] <= run["epsilon"] * (1 + 1e-9), run
            assert run["spent_delta"] <= run["delta"], run


@pytest.mark.slow
def test_the_stored_image_demo_is_reproduced_bit_for_bit(tmp_path):
    """A small grid of the stored image demo, rerun from an empty folder at this commit with the
    stored run's settings, gives the stored numbers (its noise was seeded): the mixture weights
    to float32 rounding and the accountant's ε to its last bits, which differ across CPU
    instruction sets (FFT-based PLD sums, XLA's vector code), and the utility exactly wherever
    the weights came out bit for bit (a weight one rounding apart draws other pretraining
    examples)."""
    from dpmix_jax.pipeline.image import ImagePipeline
    from dpmix_jax.pipeline.presets import digit_task, image_demo_config

    results = stored("demo-image")
    assert results["noise_seeded"]
    expected = {(r["method"], r["epsilon"], r["seed"]): r for r in results["runs"]}
    pipeline = ImagePipeline(digit_task(), image_demo_config(), tmp_path, reproducible=True)
    for method in ("random_init", "dp_mixmin"):
        run = pipeline.run(method, 1.0, seed=0)
        want = expected[(method, 1.0, 0)]
        assert run.spent.epsilon == pytest.approx(want["spent_epsilon"], rel=1e-9), method
        if want["weights"] is not None:
            np.testing.assert_allclose(run.weights, want["weights"], rtol=0, atol=1e-6)
        if want["weights"] is None or np.array_equal(run.weights, want["weights"]):
            assert run.utility == want["utility"], method


def test_a_larger_mixture_split_helps_dp_mixmin_as_in_the_papers_rho_sweep():
    """Table 1's ρ row: DP-MixMin's perplexity and its spread over seeds fall as ρ grows (paper:
    17.97 ± 2.72, 17.52 ± 1.55, 16.78 ± 0.55 at ρ = 0.1, 0.2, 0.3); here it beats Uniform from
    ρ = 0.2 on (at ρ = 0.1, about 12 users, one seed of three mixes worse than Uniform)."""
    results = stored("enron_rho")
    rhos = [f"{rho:g}" for rho in results["mix_fractions"]]
    means, spreads = [], []
    for rho in rhos:
        runs = results["per_rho"][rho]["runs"]
        mixmin = [r["utility"] for r in runs if r["method"] == "dp_mixmin"]
        uniform = [r["utility"] for r in runs if r["method"] == "uniform"]
        means.append(np.mean(mixmin))
        spreads.append(np.std(mixmin, ddof=1))
        if float(rho) >= 0.2:
            assert np.mean(mixmin) < np.mean(uniform)
    assert means == sorted(means, reverse=True)
    assert spreads == sorted(spreads, reverse=True)


def ablation_utility(results: dict) -> dict:
    """{setting: {seed: test AUC}} of the stored ablations."""
    by_setting = collections.defaultdict(dict)
    for run in results["runs"]:
        by_setting[run["setting"]][run["seed"]] = run["utility"]
    return by_setting


def test_every_proxy_budget_beats_uniform_and_the_longest_dips():
    # The paper (Table 3, NIH Atelectasis): DP-MixMin above Uniform at every proxy budget, a flat
    # profile over 1 to 6 proxy epochs. Ours (docs/ablations.md): every DP-MixMin setting above
    # Uniform (0.7836); 75 to 300 proxy steps at most 0.012 apart; 450 steps (0.8789) below the
    # shorter budgets, in the mean over seeds.
    results = stored("ablations")
    auc = {name: np.mean(list(v.values())) for name, v in ablation_utility(results).items()}
    uniform = auc.pop("Uniform")
    assert min(auc.values()) > uniform
    proxy = [s["setting"] for s in results["settings"] if s["study"] == "proxy"]
    steps = [s["proxy_steps"] for s in results["settings"] if s["study"] == "proxy"]
    assert steps == [75, 150, 300, 450]
    shorter = [auc[name] for name in proxy[:-1]]
    assert max(shorter) - min(shorter) <= 0.012
    assert auc[proxy[-1]] < min(shorter)


def test_sequential_composition_is_below_parallel_as_in_table_6():
    # The paper (Table 6): sequential composition below parallel (0.740 ± 0.010 against 0.747 ±
    # 0.005). Ours (docs/ablations.md): 0.8747 ± 0.0199 against 0.8968 ± 0.0038, the mixture stage
    # at ε = 0.1 and fine-tuning at 0.9; the accountant's ε of the two stages composed is below
    # the 1 their noise was calibrated to by summing. Below on every seed here.
    results = stored("ablations")
    by_setting = ablation_utility(results)
    parallel, sequential = by_setting["parallel"], by_setting["sequential 0.1/0.9"]
    assert sorted(sequential) == sorted(parallel) == results["seeds"]
    assert all(sequential[seed] < parallel[seed] for seed in results["seeds"])
    for run in results["runs"]:
        if run["setting"] == "sequential 0.1/0.9":
            stages = run["stage_epsilons"]
            assert stages["mixture"] == pytest.approx(0.1, rel=1e-3)
            assert stages["finetune"] == pytest.approx(0.9, rel=1e-3)
            assert run["spent_epsilon"] < sum(stages.values()) <= 1 + 1e-9


def test_dp_mixmins_gap_to_nonprivate_mixmin_is_the_noise_in_lambda():
    # The paper (Table 6): parallel DP-MixMin and non-private MixMin within a standard deviation
    # (0.747 ± 0.005, 0.746 ± 0.006). Ours (docs/ablations.md, the DP-MixMin gap study): the data
    # fine-tuned on explain none of our gap (at most 0.0015 between the whole split and D_ft on
    # one λ), the noise in λ all of it: it narrows as D_mix grows, closes at mixture ε = 4, and
    # over 8 seeds the composition table's comparison is about one standard deviation apart.
    results = stored("mixmin_gap")
    summary = {(row["condition"], row["arm"]): row for row in results["summary"]}
    conditions = list(dict.fromkeys(row["condition"] for row in results["summary"]))
    for condition in conditions:
        assert abs(summary[condition, "nonprivate_all"]["gap_to_nonprivate_ft"]) <= 0.0015

    def gap(condition, arm="dp_mixmin"):
        row = summary[condition, arm]
        return row["gap_to_nonprivate_ft"], row["gap_to_nonprivate_ft_se"]

    rho = [c for c in conditions if c.endswith(", 60 fine-tuning steps")]
    assert rho == [f"ρ = {r}, 60 fine-tuning steps" for r in ("0.1", "0.3", "0.5", "0.7")]
    assert gap(rho[0])[0] > gap(rho[1])[0] > gap(rho[3])[0] > 0
    for condition in rho[:3]:
        mean, error = gap(condition)
        assert mean > 2 * error, condition
    base = rho[1]
    for arm in ("dp_mixmin_mix4", "dp_mixmin_mix16"):
        mean, error = gap(base, arm)
        assert abs(mean) < 2 * error and abs(mean) < gap(base)[0] / 4, arm
        assert summary[base, arm]["cosine_true"] > summary[base, "dp_mixmin"]["cosine_true"]
    assert len(results["seeds"]) == 8
    dp, nonprivate = summary[base, "dp_mixmin"], summary[base, "nonprivate_all"]
    assert (nonprivate["utility_mean"] - dp["utility_mean"]) / dp["utility_std"] < 1.1
    for run in results["runs"]:
        budget = run["mixture_epsilon"] or results["epsilon"]
        assert run["spent_epsilon"] <= max(budget, results["epsilon"]) * (1 + 1e-9), run


def test_dp_mixmin_against_uniform_at_rho_0_1_is_the_noise_in_lambda():
    # The paper (Table 1's ρ row): DP-MixMin at ρ = 0.1 beats Uniform (17.97 ± 2.72 against
    # 19.88 ± 1.10). Ours (docs/experiments.md, the low-ρ study): with about 12 users in D_mix the
    # noise in λ's logits at ε = 1 is three times ρ = 0.3's, and a third of the λs fall below
    # Uniform's cosine to λ*; over 10 seeds DP-MixMin beats Uniform on most seeds, but a seed whose
    # λ lands on a domain λ* does not use takes its mean to Uniform's. A batch scaled to ρ = 0.3's
    # rate does not remove the noise; a mixture ε of 4 does, and then DP-MixMin beats Uniform on
    # every seed, as at ρ = 0.3.
    results = stored("low_rho")
    lambdas = {row["condition"]: row for row in results["lambda_summary"]}
    base, scaled = lambdas["ρ = 0.1, ε = 1, b = 4"], lambdas["ρ = 0.1, ε = 1, b = 1.33"]
    larger, reference = lambdas["ρ = 0.1, ε = 4, b = 4"], lambdas["ρ = 0.3, ε = 1, b = 4"]
    assert base["users"] < 15 < 30 < reference["users"]
    assert base["logit_noise"] > 3 * reference["logit_noise"]
    assert base["below_uniform_last"] > 0.25 > 0.05 > reference["below_uniform_last"]
    assert scaled["logit_noise"] > 0.9 * base["logit_noise"]
    assert scaled["below_uniform_last"] > 0.25
    assert larger["logit_noise"] < 1.1 * reference["logit_noise"]
    assert larger["below_uniform_last"] < 0.1
    assert len(results["seeds"]) >= 10
    arms = {row["arm"]: row for row in results["summary"]}
    uniform, dp = arms["uniform"], arms["dp_mixmin"]
    assert dp["utility_median"] < uniform["utility_median"]
    assert 0 < dp["worse_than_uniform"] <= 0.3
    assert abs(dp["minus_uniform"]) < dp["minus_uniform_se"]
    assert dp["utility_std"] > 3 * uniform["utility_std"]
    worst = max((r for r in results["runs"] if r["arm"] == "dp_mixmin"), key=lambda r: r["utility"])
    assert worst["cosine_true"] < results["uniform_cosine"] / 2
    for arm in ("dp_mixmin_mix4", "dp_mixmin_rho0.3"):
        assert arms[arm]["worse_than_uniform"] == 0, arm
        assert -arms[arm]["minus_uniform"] > 4 * arms[arm]["minus_uniform_se"], arm
    for run in results["runs"]:
        budget = run["mixture_epsilon"] or results["epsilon"]
        assert run["spent_epsilon"] <= max(budget, results["epsilon"]) * (1 + 1e-9), run


def test_nih_presets_on_cpu_keep_the_papers_order_at_every_epsilon():
    """Tables 7 and 8's order on the NIH experiments' code (digits stand-in): DP-MixMin above
    Uniform above Random Search above Random Init at every ε, below the non-private MixMin
    bound at ε <= 2 (paper, CheXpert at ε = 1: 0.707, 0.670, 0.667, 0.636; bound 0.712)."""
    from experiments.configs import nih

    assert nih.get_config("chexpert", "cpu") == nih.get_config("mimic", "cpu")  # one run is both
    results = stored("nih_cpu")
    auc = {(row["method"], row["epsilon"]): row["macro_auc"] for row in results["macro"].values()}
    epsilons = sorted({eps for _, eps in auc})
    assert epsilons == [1.0, 2.0, 5.0] and results["tasks"] and results["seeds"] == 2
    for eps in epsilons:
        order = [auc[(m, eps)] for m in ("dp_mixmin", "uniform", "random_search", "random_init")]
        assert order == sorted(order, reverse=True), eps
        if eps <= 2:
            assert auc[("dp_mixmin", eps)] < auc[("nonprivate_mixmin", eps)]


def test_openwebmath_preset_on_cpu_beats_uniform_at_every_epsilon():
    """Table 2's claim on the OpenWebMath experiment's code (embedded text, example level):
    DP-MixMin's perplexity below Uniform's at every ε (paper at ε = 1: 12.22 against 14.05)
    and above the non-private MixMin bound, with λ close to non-private MixMin's."""
    results = stored("openwebmath")
    (rho,) = results["per_rho"]
    runs = results["per_rho"][rho]
    perplexity = mean_by_method_and_epsilon(runs)
    cosine = mean_by_method_and_epsilon(runs, lambda run: run["weight_quality"]["cosine_reference"])
    for eps in (1.0, 2.0, 5.0):
        bound, mixmin = perplexity[("nonprivate_mixmin", eps)], perplexity[("dp_mixmin", eps)]
        assert bound < mixmin < 0.95 * perplexity[("uniform", eps)]
        assert cosine[("dp_mixmin", eps)] > 0.9


def test_per_task_gains_are_largest_for_dp_mixmin_as_in_the_paper():
    # The paper (Figure 3): DP-MixMin's mean relative gain over Random Init is about twice
    # Uniform's and Random Search's. Ours must rank DP-MixMin first, at a ratio within a band
    # around the paper's 1.8-2.4 (our weaker Random Init makes every gain larger).
    results = stored("per_task")
    gain = results["macro"]["gain"]
    assert gain["dp_mixmin"] > max(gain["uniform"], gain["random_search"]) > 0
    assert 1.2 <= results["macro"]["gain_ratio"]["uniform"] <= 3.5
    assert results["macro"]["vs_uniform"]["absolute"] > 0
    auc = [{m: t["methods"][m]["auc"]["mean"] for m in t["methods"]} for t in results["tasks"]]
    wins = sum(task["dp_mixmin"] > task["uniform"] for task in auc)
    assert wins >= 0.75 * len(auc)
    # The rare-label task: DP-MixMin's λ is closer to non-private MixMin's than uniform weights.
    cosine = results["rare_task"]["cosine_to_nonprivate"]
    assert cosine["dp_mixmin"]["mean"] > cosine["uniform"]["mean"]


def test_dp_mixmin_beats_uniform_in_both_prevalence_groups_as_in_table_10():
    # The paper (Table 10, CheXpert -> NIH, ε = 1): DP-MixMin above Uniform in both halves of the
    # tasks by prevalence, +0.040 (+5.6%) on the more prevalent and +0.034 (+6.0%) on the rarer.
    # Ours (docs/experiments.md, per-task gains): +0.092 (+13.8%) and +0.081 (+17.8%); as in the
    # paper, the gain is larger in absolute terms on group A and in relative terms on group B.
    results = stored("per_task")
    prevalence = collections.defaultdict(list)
    for task in results["tasks"]:
        prevalence[task["group"]].append(task["prevalence"])
    assert min(prevalence["A"]) > max(prevalence["B"])
    ours, paper = results["groups"], results["paper"]["groups_vs_uniform"]
    for group in ("A", "B"):
        assert ours[group]["vs_uniform"]["absolute"] > 0 and paper[group]["absolute"] > 0
        assert ours[group]["gain_ratio"]["uniform"] > 1
    a, b = ours["A"]["vs_uniform"], ours["B"]["vs_uniform"]
    assert a["absolute"] > b["absolute"] and paper["A"]["absolute"] > paper["B"]["absolute"]
    assert b["relative"] > a["relative"] and paper["B"]["relative"] > paper["A"]["relative"]


def test_small_epsilon_weights_degrade_gracefully_as_in_the_paper():
    # The paper (Tables 11, 14, 15): at ε = 1 DP-MixMin's λ is far closer to non-private
    # MixMin's λ than uniform weights; at ε = 0.2 it degrades, and where D_mix holds few units
    # (Enron, user level) it can fall below the uniform reference. Ours: above uniform in every
    # run at ε = 1 on both defaults, above it on average at ε = 0.2 on the image default (366
    # examples in D_mix), and lower at ε = 0.2 than at ε = 1 on both.
    defaults = stored("small_eps")["defaults"]
    for name, part in defaults.items():
        by_epsilon = {row["epsilon"]: row for row in part["summary"]}
        strong, weak = by_epsilon[1.0], by_epsilon[0.2]
        assert strong["cosine_mean"] > strong["uniform_mean"] and strong["below_uniform"] == 0
        assert weak["cosine_mean"] < strong["cosine_mean"], name
        for row in (strong, weak):
            assert row["max_spent_epsilon"] <= row["epsilon"] * (1 + 1e-9), name
    image = {row["epsilon"]: row for row in defaults["image"]["summary"]}[0.2]
    assert image["cosine_mean"] > image["uniform_mean"]


def test_gsd_cannot_tell_shared_input_sources_apart_and_dp_mixmin_beats_the_oracle_source():
    # The paper (appendix A.4): GSD scores sources by their inputs, so sources that share the
    # inputs and differ in labels look alike to it (far closer to each other than a source with
    # other inputs), and even the oracle choice of a single source stays below DP-MixMin.
    results = stored("gsd")
    spread = results["distance_spread"]["random_init"]
    assert spread["relative_spread"] < 0.1 and spread["max"] < 0.75 * spread["control"]
    assert results["methods"]["dp_mixmin"]["mean"] > results["oracle_single_source"]["mean"]
    assert results["methods"]["dp_mixmin"]["mean"] > results["gsd_selected"]["random_init"]["mean"]


def test_the_rho_guides_sufficient_n_reaches_alpha_on_the_measured_grid():
    # The paper (appendix A.2) sizes D_mix from the excess-loss bound: n units suffice for an
    # excess α. Ours (docs/experiments.md, ρ guide): at α = 0.01 the measured mean excess first
    # falls to α at a grid n below the guide's sufficient n (16,000 against 96,515 at ε = 0.1,
    # 4,000 against 30,254 at ε = 1) and stays there; the bound is privacy-limited below
    # n× = (C/B)²·log(1/δ)/ε²; the paper's language point (2.8M tokens for α = 0.001, k = 16) is
    # the guide's size within 1%. With the solver the bound describes (few noisy steps of large
    # batches) the measured mean excess is below the bound at every grid point.
    results = stored("rho_guide")
    config, clip_norm = results["config"], results["clip_norm"]
    for item in results["summary"]:
        epsilon, sizes = item["epsilon"], item["sizes"]
        means = zip(sizes, item["dp_mean"], strict=True)
        reached = [n for n, excess in means if excess <= config["alpha"]]
        assert reached == sizes[sizes.index(item["first_grid_n_reaching_alpha"]) :]
        assert reached[0] <= item["sufficient_n"]
        crossover = clip_norm**2 * np.log(1 / config["delta"]) / epsilon**2
        assert item["crossover_n"] == pytest.approx(crossover)
        regimes = ["privacy" if n < crossover else "statistics" for n in sizes]
        assert item["limited_by"] == regimes
        assert item["epsilon_spent_max"] <= epsilon * (1 + 1e-9)
        for n, measured, bound in zip(sizes, item["dp_mean"], item["bound"], strict=True):
            assert measured < bound, (epsilon, n, measured, bound)
    language = results["paper_points"][1]
    assert language["k"] == 16 and language["alpha"] == 1e-3
    assert language["sufficient_units_b1"] == pytest.approx(language["paper_units"], rel=0.01)


def tabular_by_point(results: dict) -> tuple[dict, dict]:
    """Mean test AUC by (shift, ε, method) and paired differences by (shift, ε)."""
    auc = {(r["shift"], r["epsilon"], r["method"]): r["auc"][0] for r in results["table"]}
    differences = {(d["shift"], d["epsilon"]): d for d in results["differences"]}
    return auc, differences


def test_tabular_pretraining_pays_and_the_mixture_does_not():
    # The DP-MixMin paper assumes the sources share the sensitive inputs' distribution.
    # docs/tabular.md, on a table with age-band sources: every method that pretrains beats Random
    # Init, DP-MixMin by +0.062 to +0.133; DP-MixMin does not beat Uniform (paired differences
    # between -0.023 and +0.005, Uniform ahead at ε = 0.5 at every shift); nor does non-private
    # MixMin's λ, below Uniform at all 9 points.
    auc, differences = tabular_by_point(stored("tabular"))
    assert len(differences) == 9
    for (shift, epsilon, method), value in auc.items():
        if method != "random_init":
            assert value > auc[(shift, epsilon, "random_init")], (shift, epsilon, method)
    for (shift, epsilon), row in differences.items():
        assert row["dp_mixmin - random_init"][0] > 0.06
        assert -0.025 < row["dp_mixmin - uniform"][0] < 0.005
        if epsilon == 0.5:
            assert row["dp_mixmin - uniform"][0] < 0, shift
        assert row["nonprivate_mixmin - uniform"][0] < 0, (shift, epsilon)


def test_tabular_covariate_shift_costs_a_little_and_reweighting_does_not_pay():
    # docs/tabular.md: Uniform's AUC falls over shifts 0, 1, 2 at each ε; DP-MixMin's gap to
    # Uniform widens with the shift only at ε = 0.5 (-0.008, -0.009, -0.023); the density-ratio
    # variant is below DP-MixMin at 7 of the 9 points, by the most at the largest shift, and
    # its effective number of public rows falls with the shift.
    results = stored("tabular")
    auc, differences = tabular_by_point(results)
    shifts = sorted({shift for shift, _ in differences})
    effective = collections.defaultdict(list)
    for run in results["runs"]:
        if run["method"] == "dp_mixmin_ratio":
            point = (run["shift"], run["epsilon"])
            effective[point].append(run["extra"]["effective_public_rows"])
    for epsilon in sorted({epsilon for _, epsilon in differences}):
        uniform = [auc[(shift, epsilon, "uniform")] for shift in shifts]
        assert uniform == sorted(uniform, reverse=True), epsilon
        gap, ratio = (
            [differences[(shift, epsilon)][name][0] for shift in shifts]
            for name in ("dp_mixmin - uniform", "dp_mixmin_ratio - dp_mixmin")
        )
        assert (gap[0] > gap[1] > gap[2]) == (epsilon == 0.5), epsilon
        assert min(ratio) == ratio[-1] < 0, epsilon
        rows = [np.mean(effective[(shift, epsilon)]) for shift in shifts]
        assert rows == sorted(rows, reverse=True), epsilon
    below = [d["dp_mixmin_ratio - dp_mixmin"][0] < 0 for d in differences.values()]
    assert sum(below) == 7


def test_the_k_scaling_slope_is_near_the_papers():
    # The paper (Appendix A.6): DP-MixMin's excess loss grows with the number of sources k with a
    # log-log slope of 0.49 (theory 0.5). Ours, mirror descent on trained proxies over k >= 32,
    # must stay within 0.15 of it; every run spent at most its ε.
    results = stored("k_scaling")
    assert abs(results["slopes"]["mirror_descent"] - 0.49) <= 0.15
    assert results["max_epsilon"] <= results["config"]["epsilon"] * (1 + 1e-9)


def test_the_exponential_oracle_loses_to_the_gaussian_one_by_its_noise():
    # docs/experiments.md: from k = 8 on, Frank-Wolfe's exponential-mechanism oracle has a larger
    # excess than its Gaussian oracle, while without noise (its bias) it is the best of the three
    # solvers from k = 32 on; mirror descent has the smallest excess at k = 1000.
    results = stored("k_scaling")
    ks, excess, parts = results["ks"], results["excess"], results["parts"]
    exponential, gaussian = excess["frank_wolfe_exponential"], excess["frank_wolfe"]
    for index, k in enumerate(ks):
        if k >= 8:
            assert exponential["mean"][index] > gaussian["mean"][index], k
        if k >= 32:
            biases = {name: parts[name]["bias"]["mean"][index] for name in parts}
            assert min(biases, key=biases.get) == "frank_wolfe_exponential", k
    last = {name: excess[name]["mean"][-1] for name in excess}
    assert min(last, key=last.get) == "mirror_descent"


AUDIT_PRIVATE_BOUNDS = (
    "many_runs",
    "one_run_steinke",
    "one_run_fdp",
    "natural",
    "max_clip",
    "gradient",
    "input",
    "mix",
    "ft",
    "epsilon_lb",
)


def _audit_records(results: dict):
    yield from results["mixmin"]
    yield from results["dpsgd"]
    for value in results["releases"].values():
        yield from value if isinstance(value, list) else [value]


def test_every_audit_bound_is_below_its_claim_and_every_control_above():
    results = stored("audit")
    assert results["violations"] == 0
    checked = controls = 0
    for record in _audit_records(results):
        claim = record["claimed_epsilon"]
        for key, value in record.items():
            if key in AUDIT_PRIVATE_BOUNDS and value is not None:
                assert value <= claim, (record.get("release"), key, value, claim)
                checked += 1
            elif key.startswith("no_noise_") and isinstance(value, float):
                assert value > claim, (record.get("release"), key, value, claim)
                controls += 1
    assert checked >= 20 and controls >= 20


def test_the_white_box_audit_certifies_at_least_half_of_the_claimed_epsilon():
    tightness = stored("audit")["releases"]["tightness"]
    assert {row["release"] for row in tightness} == {"DP-SGD", "DP-MixMin λ"}
    for row in tightness:
        assert 0.5 <= row["epsilon_lb"] / row["claimed_epsilon"] <= 1.0, row


# ------------------------------------------------------------------------------------------
# Hot PATE: diversity transfer of coordinated sampling (fresh runs)
# ------------------------------------------------------------------------------------------

TEACHERS = 32


def output_estimate(probs, sampler, aggregator, draws=20_000, seed=0):
    return diversity.output_distribution(
        jax.random.key(seed), probs, sampler=sampler, aggregator=aggregator, num_draws=draws
    )


@pytest.mark.parametrize(("tau", "gamma"), [(4, 4.0), (16, 1.0)])
def test_coordinated_tws_never_falls_below_the_theorem_beta(tau, gamma):
    # The main theorem: coordinated histograms + TWS_{τ/2,γ} are (τ, 0.17, γ)-diversity
    # preserving. On every adversarial ensemble the lower confidence bound (4 standard errors) of
    # the attained β must be >= 0.17, and the relevance bound P_j <= γ·avg_j must hold.
    for ensemble in diversity.adversarial_ensembles(TEACHERS, tau):
        est = output_estimate(
            ensemble.probs, "coordinated", diversity.tws_aggregator(tau / 2, gamma)
        )
        got = diversity.attained(ensemble.probs, est, tau)
        assert got.beta is not None, ensemble.name
        assert got.beta_lower >= diversity.THEOREM_BETA_TWS, (ensemble.name, got)
        assert got.gamma_lower <= gamma, (ensemble.name, got)


def test_independent_sampling_falls_far_below_the_theorem_beta():
    # Power: the same measurement on cold PATE finds the failures the theorem rules out for
    # coordinated sampling (low-probability tokens shared by many teachers, wide uniforms).
    tau = 16
    by_name = {e.name: e for e in diversity.adversarial_ensembles(TEACHERS, tau)}
    for name in ("minority_low_q", "wide_uniform"):
        probs = by_name[name].probs
        est = output_estimate(probs, "independent", diversity.tws_aggregator(tau / 2, 1.0))
        assert diversity.attained(probs, est, tau).beta_lower is not None
        assert diversity.attained(probs, est, tau, z=-4.0).beta_lower < 0.05, name


@pytest.mark.parametrize("plausible_tokens", [2, 3, 4, 8])
def test_coordinated_coverage_is_above_independent_at_half_n(plausible_tokens):
    # Diverse teachers: k equally plausible shared tokens plus small per-teacher variations. At
    # the threshold n/2 coordinated sampling keeps transferring every plausible token (coverage
    # above 0.8); independent sampling splits the votes, so its coverage falls to about 0.6 at
    # k = 2 and to nothing from k = 3 on.
    n, vocab = 64, 200
    key_private, key = jax.random.split(jax.random.key(0))
    shared = jnp.full((vocab,), -jnp.inf).at[:plausible_tokens].set(0.0)
    logits = shared + 0.3 * jax.random.normal(key_private, (n, vocab))
    threshold = jnp.array([n / 2])
    hot = samplers.coordinated_histograms(key, logits, 300)
    cold = samplers.independent_histograms(key, logits, 300)
    hot_coverage = float(metrics.coverage(hot, threshold)[0])
    cold_coverage = float(metrics.coverage(cold, threshold)[0])
    assert hot_coverage > 0.8 and hot_coverage > cold_coverage + 0.25
    assert int(metrics.transferred_support(hot, threshold)[0]) == plausible_tokens
    if plausible_tokens >= 3:
        assert cold_coverage < 0.05
        assert int(metrics.transferred_support(cold, threshold)[0]) <= 1


def test_coordinated_sampling_transfers_the_natural_tasks_diversity():
    # The paper (Hot PATE): coordinated sampling transfers the teachers' diversity, so many tokens
    # pass a high threshold; independent sampling splits the votes. Ours (docs/experiments.md,
    # Hot PATE (b), n = 512 in-context teachers over e-mail sentences, mean over 8 steps): at
    # T = n/2 = 256 coverage 0.836 against 0.076 and 126.4 tokens transferred against 0.1; the
    # largest passing T in one try is 439 against 106.
    natural = stored("hot_pate")["natural"]
    hot, cold = natural["mean"]["coordinated"], natural["mean"]["independent"]
    assert natural["thresholds"][-1] == natural["num_teachers"] / 2
    assert all(h > c for h, c in zip(hot["coverage"], cold["coverage"], strict=True))
    assert hot["coverage"][-1] > 0.8 and cold["coverage"][-1] < 0.1
    assert hot["support"][-1] > 100 and cold["support"][-1] < 1
    assert hot["max_passing_threshold"]["1"] > 4 * cold["max_passing_threshold"]["1"]


def test_queries_within_a_budget_grow_about_quadratically_with_the_teachers():
    # The paper (Hot PATE): under DP composition the queries one budget answers grow about
    # quadratically with the number of teachers. Ours (docs/experiments.md, Hot PATE scaling,
    # n = 16 to 2048, ε = 10): coordinated sampling keeps its threshold near n, so the Gaussian
    # release's calls grow as n^2.00 and DPWS's reach a local slope of 1.97-2.00 at the largest
    # n; at k = 20 independent sampling's threshold is near n/k and it answers 305 times fewer
    # DPWS calls at n = 2048.
    results = stored("hot_pate_scaling")
    largest = max(results["config"]["teacher_counts"])
    fits = {(f["k"], f["sampler"]): f for f in results["queries"]["fits"]}
    rows = {(r["k"], r["n"], r["sampler"]): r for r in results["queries"]["rows"]}
    for k in results["config"]["set_sizes"]:
        hot = fits[k, "coordinated"]
        assert abs(hot["gaussian"]["slope"] - 2) < 0.1 and hot["dpws"]["slope_top"] > 1.9
    hot, cold = rows[20, largest, "coordinated"], rows[20, largest, "independent"]
    assert hot["dpws"]["calls"] > 100 * cold["dpws"]["calls"]
    assert fits[20, "independent"]["dpws"]["slope"] < fits[20, "coordinated"]["dpws"]["slope"]


@pytest.mark.parametrize("name", ["enron_rho", "openwebmath"])
def test_stored_rho_pages_are_their_json_through_the_current_writer(name):
    """The ρ table and the per-ρ tables of a stored text run are `experiments.enron`'s writer
    applied to its JSON (one spread convention, the population std, in both)."""
    from dpmix_jax.pipeline import compare
    from experiments import enron

    results = stored(name)
    tables = [
        compare.markdown_table(results["per_rho"][f"{r:g}"]) for r in results["mix_fractions"]
    ]
    page = enron.rho_markdown(results) + "\n\n" + "\n".join(tables)
    assert page == (RESULTS / f"{name}.md").read_text()


def test_fine_tuned_teachers_write_closer_to_real_text_than_in_context_ones():
    """Fine-tuned teachers' average (ε = ∞) is closer to the real sentences (MAUVE) than the
    in-context teachers' on every seed; through Hot PATE at ε = 10 the two stay within noise."""
    fine_tuned, in_context = stored("text_peers_fine_tuned"), stored("text_peers")
    assert fine_tuned["config"]["teachers"] == "fine_tuned"
    assert fine_tuned["config"]["seeds"] == in_context["config"]["seeds"]

    def mauve(results, method, epsilon=None):
        rows = results["rows"]
        return [r["mauve"] for r in rows if (r["method"], r["target_epsilon"]) == (method, epsilon)]

    assert min(mauve(fine_tuned, "nonprivate")) > max(mauve(in_context, "nonprivate"))
    tuned, read = mauve(fine_tuned, "hot_pate", 10.0), mauve(in_context, "hot_pate", 10.0)
    assert abs(np.mean(tuned) - np.mean(read)) < np.std(tuned) + np.std(read)


def test_the_public_candidates_make_private_text_read_but_carry_little_vote():
    # docs/generate.md: with 16 candidates Hot PATE's words are as English as the public model's
    # (within 0.1 of it, far above the whole vocabulary's at ε = 10, on both sets), MAUVE on the
    # notes is higher with the candidates; at ε = 1 a unanimous vote is rarely released.
    results = stored("readable_text")

    def row(document_set, generator):
        return next(
            r for r in results["rows"]
            if r["document_set"] == document_set and r["generator"] == generator
        )  # fmt: skip

    for document_set in ("text_default", "notes"):
        public = row(document_set, "public")["english_share"]
        whole = row(document_set, "coordinated (ε = 10)")
        for epsilon in (1, 10):
            restricted = row(document_set, f"coordinated (ε = {epsilon}, top 16)")
            assert restricted["english_share"] > public - 0.1
            assert restricted["english_share"] > whole["english_share"] + 0.2
            assert restricted["epsilon"] <= epsilon
        assert (
            row(document_set, "coordinated (ε = 1, top 16)")["unanimous_release_probability"] < 0.1
        )
        assert (
            row(document_set, "nonprivate")["teacher_tokens"]
            == row(document_set, "nonprivate")["tokens"]
        )
    notes_mauve = row("notes", "coordinated (ε = 10, top 16)")["mauve"]
    assert notes_mauve > 10 * row("notes", "coordinated (ε = 10)")["mauve"]


def test_a_release_carries_the_vote_only_with_enough_teachers():
    # docs/generate.md, How many teachers a release needs: on SmolLM2 at ε = 1 the probability
    # that a unanimous token is released rises with n (0.083 at 16, 0.990 at 256), below 0.5
    # up to 32 teachers and above 0.85 from 128; coordinated sampling releases more tokens than
    # independent at ε = 10 for every n; every run stays within its target.
    results = stored("teacher_share")
    rows = {(r["num_teachers"], r["generator"]): r for r in results["rows"]}
    counts = sorted(results["config"]["teacher_counts"])
    assert counts[0] <= 16 and counts[-1] >= 512
    at_one = "coordinated (ε = 1, top 16)"
    carried = [rows[n, at_one]["unanimous_release_probability"] for n in counts]
    assert all(a < b or a == b == 1.0 for a, b in zip(carried, carried[1:], strict=False))
    assert all(v < 0.5 for n, v in zip(counts, carried, strict=True) if n <= 32)
    assert all(v > 0.85 for n, v in zip(counts, carried, strict=True) if n >= 128)
    for n in counts:
        hot = rows[n, "coordinated (ε = 10, top 16)"]["teacher_share"]
        assert hot > rows[n, "independent (ε = 10, top 16)"]["teacher_share"]
    for row in results["rows"]:
        assert 0 < row["epsilon"] <= row["target_epsilon"] + 1e-9
        assert row["teacher_tokens"] <= row["tokens"] <= 2 * 12


def test_dp_fine_tuning_writes_english_once_paid_but_does_not_reach_the_documents_at_this_scale():
    # docs/generate.md, DP fine-tuning as a generator: 30 DP-LoRA steps keep SmolLM2's English
    # (within 0.1 of the public model's share on both sets), the reader sees the target ε, and on
    # the notes MAUVE stays at or below the public model's (the text does not move toward the
    # documents) while the teachers' average at ε = ∞ is above both.
    results = stored("readable_text")
    rows = {(r["document_set"], r["generator"]): r for r in results["rows"]}
    for document_set in ("text_default", "notes"):
        public = rows[document_set, "public"]
        for epsilon in (1, 10):
            tuned = rows[document_set, f"dp_finetune (ε = {epsilon})"]
            assert tuned["english_share"] > public["english_share"] - 0.1
            assert tuned["epsilon"] == epsilon and tuned["teacher_tokens"] is None
            assert tuned["tokens"] > 0
    public_mauve = rows["notes", "public"]["mauve"]
    for epsilon in (1, 10):
        assert rows["notes", f"dp_finetune (ε = {epsilon})"]["mauve"] <= public_mauve
    assert rows["notes", "nonprivate"]["mauve"] > public_mauve


def test_the_topic_studys_references_separate_and_no_private_generator_comes_near_infinity():
    # docs/generate.md, Which generator: over 3 seeds the lines sampled from the teachers' average
    # (ε = ∞) beat the public model's (ε = 0) in downstream accuracy and topic fidelity by far more
    # than two standard errors of the difference, the public model's accuracy is near chance and
    # the real sentences at least reach ε = ∞; TF-IDF on the same lines separates nothing; no
    # private generator's mean comes within two standard errors of ε = ∞ on either measure; every
    # run spent at most its target ε; the published samples hold every generated line and none
    # of the real (sensitive) sentences.
    results = stored("topic_generation")
    seeds = results["config"]["seeds"]
    assert len(seeds) == 3
    summary = {(e["generator"], e["target_epsilon"]): e for e in results["summary"]}
    lines = results["config"]["lines_per_topic"] * len(results["config"]["topics"])
    tests = results["config"]["test_per_topic"] * len(results["config"]["topics"])
    chance = 1 / len(results["config"]["topics"])
    private = [key for key in summary if key[1] is not None]
    assert len(private) == 7 * 3
    for measure, size in (("accuracy", tests), ("topic_fidelity", lines)):
        mean = {key: e[measure]["mean"] for key, e in summary.items()}
        # Of a difference of two means over the seeds, at the largest binomial variance.
        standard_error = np.sqrt(2 * 0.25 / size / len(seeds))
        infinite, zero = mean["nonprivate", None], mean["public", None]
        assert infinite - zero > 5 * standard_error, measure
        assert abs(zero - chance) < 0.05, measure
        assert mean["real", None] >= infinite - standard_error, measure
        assert all(mean[key] < infinite - 2 * standard_error for key in private), measure
    tfidf = {key: e["tfidf_accuracy"]["mean"] for key, e in summary.items()}
    assert abs(tfidf["nonprivate", None] - tfidf["public", None]) < 0.1
    assert tfidf["real", None] < 0.35
    for row in results["rows"]:
        if row["target_epsilon"] is not None:
            assert 0 < row["epsilon"] <= row["target_epsilon"] * (1 + 1e-9), row["generator"]
    samples = [json.loads(line) for line in (RESULTS / "topic_generation_samples.jsonl").open()]
    assert {s["generator"] for s in samples} == {g for g, _ in summary} - {"real"}
    assert len(samples) == (len(summary) - 1) * lines * len(seeds)


def test_with_64_teachers_hot_pates_release_carries_the_vote_and_its_lines_sit_above_public():
    # docs/generate.md, Which generator: at ε = 10 on seed 0, 64 teachers a topic release a
    # unanimous token with probability above a half where 16 did not; the lines then sit above
    # the public model's in both measures, far below the real sentences'; the run is within its
    # ε and its published samples are every generated line, none of the real ones.
    many, few = stored("topic_generation_teachers64"), stored("topic_generation")
    assert (many["config"]["num_teachers"], few["config"]["num_teachers"]) == (64, 16)

    def row(results, generator):
        rows = [r for r in results["rows"] if r["generator"] == generator and r["seed"] == 0]
        return next(r for r in rows if r["target_epsilon"] in (None, 10.0))

    assert row(many, "coordinated")["unanimous_release_probability"] > 0.5
    assert row(few, "coordinated")["unanimous_release_probability"] < 0.5
    assert 0 < row(many, "coordinated")["epsilon"] <= 10.0 * (1 + 1e-9)
    for measure in ("accuracy", "topic_fidelity"):
        coordinated = row(many, "coordinated")[measure]
        assert row(many, "public")[measure] < coordinated < row(many, "real")[measure] / 2
    samples = [
        json.loads(line) for line in (RESULTS / "topic_generation_teachers64_samples.jsonl").open()
    ]
    lines = many["config"]["lines_per_topic"] * len(many["config"]["topics"])
    assert sorted({s["generator"] for s in samples}) == ["coordinated", "public"]
    assert len(samples) == 2 * lines


def test_the_enron_stand_ins_order_is_lambdas_and_random_searchs_selection():
    # The paper (Table 1, Enron): Random Search above Uniform in perplexity and DP-MixMin's
    # reduction against Uniform widening as ε shrinks (13.9% at ε = 5, 15.6% at ε = 1). Ours
    # (docs/experiments.md, the Enron order study): DP fine-tuning barely moves any model, so the
    # gain is λ's (the same before fine-tuning) and does not widen as ε shrinks; a single random
    # candidate lands on either side of Uniform, and Random Search beats Uniform through its
    # unaccounted selection, at more ε than its nominal one.
    results = stored("enron_order")
    summary = results["summary"]
    per_epsilon = {row["epsilon"]: row for row in summary["per_epsilon"]}
    assert sorted(per_epsilon) == [1.0, 5.0] and len(results["seeds"]) >= 3
    for row in per_epsilon.values():
        gap = row["uniform_pretrained_test"][0] - row["dp_mixmin_pretrained_test"][0]
        for arm in ("uniform", "dp_mixmin"):
            assert abs(row[f"{arm}_finetune_change"][0]) < gap / 10, row
        assert abs(row["gain_percent"][0] - row["pretrained_gain_percent"][0]) < 0.5
        assert row["gain_percent"][0] < -10
    # Not the paper's widening: the gain at ε = 1 is no larger than at ε = 5.
    assert per_epsilon[1.0]["gain_percent"][0] >= per_epsilon[5.0]["gain_percent"][0]
    candidates = summary["candidates"]
    assert 0.25 < candidates["below_uniform"] / candidates["count"] < 0.75
    assert abs(candidates["minus_uniform"][0]) < candidates["minus_uniform"][1]
    assert candidates["cosine_true"] < summary["uniform_cosine_true"]
    assert results["zero_domains"] >= len(results["true_weights"]) / 2
    searches = {row["candidates"]: row for row in summary["random_search"]}
    best = searches[max(searches)]
    assert best["minus_uniform"][0] < 0 and best["below_uniform"] == len(results["seeds"])
    assert best["minus_uniform"][0] < searches[1]["minus_uniform"][0]
    assert searches[1]["spent_epsilon"] <= 1 + 1e-9 < best["spent_epsilon"]
    for run in results["runs"]:
        assert run["spent_epsilon"] <= run["epsilon"] * (1 + 1e-9), run


def test_random_search_gain_ratio_is_its_choice_among_candidates_and_a_spread_lambda():
    """docs/experiments.md, "DP-MixMin's gain against Random Search's": the per-task ratio (1.37x
    against the paper's about 2) is Random Search's choice among four candidates on validation
    data, not its budget; with one candidate, or a λ* on one source, the ratio is the paper's."""
    results = stored("random_search_gain")
    rows = {(row["active_sources"], row["arm"]): row for row in results["summary"]}

    def ratio(active, m, budget="charged"):
        return rows[active, f"random_search_m{m}_{budget}"]["ratio"]

    per_task = stored("per_task")["macro"]["gain_ratio"]["random_search"]
    assert ratio(3, 4) == pytest.approx(per_task, abs=0.02) and ratio(3, 4) < 1.5
    assert abs(ratio(3, 4, "calibrated") - ratio(3, 4)) < 0.05
    for active in (3, 1):
        for budget in ("charged", "calibrated"):
            assert ratio(active, 1, budget) > ratio(active, 2, budget) > ratio(active, 4, budget)
    assert ratio(3, 1) > 2
    one, four = rows[3, "random_search_m1_charged"], rows[3, "random_search_m4_charged"]
    assert one["dp_minus_gain"] - four["dp_minus_gain"] > 2 * four["dp_minus_gain_std"]
    for budget in ("charged", "calibrated"):
        assert ratio(1, 4, budget) >= 2.0
    assert rows[1, "dp_mixmin"]["gain"] > rows[3, "dp_mixmin"]["gain"] + 0.2
    assert len(results["seeds"]) >= 3
    for row in results["summary"]:
        charged = row["budget"] == "charged" and row["candidates"] > 1
        assert (row["spent_epsilon"] > 1.4) if charged else (row["spent_epsilon"] <= 1 + 1e-3)
