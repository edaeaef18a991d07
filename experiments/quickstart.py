"""DP-SGD in a few lines: softmax regression on scikit-learn's digits, with the privacy core only.

Command:
    python -m experiments.quickstart            # about 10 s on 2 CPU cores

Expected: the training loss falls from ln(10) ≈ 2.30 to about 0.2, test accuracy is about 0.93,
and the printed (ε, δ) is the ledger's for the steps run (ε <= 2 at δ = 1e-5).
"""

from __future__ import annotations

from dpmix_jax.cli import arguments
from experiments.common_args import add_reproducible_flag, experiment_main, experiment_parser


def example_loss(params, example):
    import jax

    logits = example["x"] @ params["w"] + params["b"]
    return -jax.nn.log_softmax(logits)[example["y"]]


def main(argv: list[str] | None = None) -> list[dict[str, float]]:
    """Trains once per ε and seed of the command line; returns each run's accuracy and spent ε."""
    parser = experiment_parser(
        "quickstart",
        __doc__.splitlines()[0],
        examples=("", "--epsilons 1 --steps 100", "--epsilons 0.5 2 --seeds 0 1"),
    )
    parser.add_argument(
        "--epsilons",
        type=float,
        nargs="+",
        default=[2.0],
        metavar="EPS",
        help="target ε of each run (δ = 1e-5)",
    )
    parser.add_argument("--steps", type=int, default=300, metavar="T", help="DP-SGD steps")
    parser.add_argument(
        "--seeds",
        type=arguments.parse_seed,
        nargs="+",
        default=[0],
        metavar="SEED",
        help="one run per seed: the train/test split",
    )
    add_reproducible_flag(parser, seeds="--seeds")
    args = parser.parse_args(argv)
    return [
        run_once(epsilon=epsilon, seed=seed, steps=args.steps, reproducible=args.reproducible)
        for epsilon in args.epsilons
        for seed in args.seeds
    ]


def run_once(*, epsilon: float, seed: int, steps: int, reproducible: bool) -> dict[str, float]:
    """DP-SGD on the digits at target ε; prints the loss, accuracy and spent budget.

    Privacy: the training split is the sensitive data; its noise and Poisson sampling come from
    secret randomness unless `reproducible` (then from `seed`), and the printed ε is the
    ledger's for the steps run.
    """
    # Imported here, so that `--help` answers without loading JAX.
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from sklearn.datasets import load_digits

    from dpmix_jax.privacy import (
        SEEDED_NOTE,
        DpSgdConfig,
        PrivacyLedger,
        clipped_grad_sum,
        make_dp_sgd_step,
        plan_dp_sgd,
        private_optimizer,
        randomness,
    )

    noise_seed = seed if reproducible else randomness.secret_seed()

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(x))
    train, test = order[:1400], order[1400:]

    config = DpSgdConfig(epsilon=epsilon, delta=1e-5, clip_norm=1.0, batch_size=128, steps=steps)
    plan = plan_dp_sgd(config, num_units=len(train))
    grad_sum = clipped_grad_sum(example_loss, clip_norm=config.clip_norm)
    optimizer = private_optimizer(
        optax.adam(0.05),
        noise_multiplier=plan.noise_multiplier,
        sensitivity=grad_sum.sensitivity(),
        expected_batch_size=plan.expected_batch_size,
        key=randomness.prng_key(noise_seed),
    )
    step = jax.jit(make_dp_sgd_step(grad_sum, optimizer))
    params = {"w": jnp.zeros((64, 10)), "b": jnp.zeros(10)}
    opt_state = optimizer.init(params)
    sampler, rng, ledger = plan.sampler(), np.random.default_rng(noise_seed), PrivacyLedger()
    mean_loss = jax.jit(
        lambda p, xs, ys: jnp.mean(jax.vmap(example_loss, in_axes=(None, 0))(p, {"x": xs, "y": ys}))
    )

    print(
        f"target ε = {epsilon:g}, seed {seed}: σ = {plan.noise_multiplier:.3f}, "
        f"q = {plan.sampling_rate:.4f}, T = {config.steps}"
    )
    print(f"{'step':>5} {'train loss':>10}")
    for t in range(1, config.steps + 1):
        batch = sampler.sample(rng, len(train))
        rows = train[np.where(batch.mask, batch.indices, 0)]
        params, opt_state, _ = step(params, opt_state, {"x": x[rows], "y": y[rows]}, batch.mask)
        ledger.record(plan.step_event())
        if t % 50 == 0 or t == 1:
            print(f"{t:>5} {float(mean_loss(params, x[train], y[train])):>10.4f}")
    accuracy = float(np.mean(np.argmax(x[test] @ params["w"] + params["b"], axis=1) == y[test]))
    budget = ledger.budget(config.delta)
    print(f"test accuracy {accuracy:.3f}; spent {budget} over {ledger.count} steps")
    print(SEEDED_NOTE if reproducible else "noise and sampling secret (operating system)")
    return {"accuracy": accuracy, "epsilon": budget.epsilon}


if __name__ == "__main__":
    with experiment_main("quickstart"):
        main()
