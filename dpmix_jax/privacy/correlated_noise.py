"""Correlated noise by banded matrix factorization (BandMF, DP-FTRL) as an optax transformation.

DP-SGD adds independent noise Z to every step's clipped gradient sum. BandMF releases C·G + Z
for a lower-triangular banded Toeplitz *strategy* C with b bands (coefficients c_0 .. c_{b-1})
and decodes it with C⁻¹, so the optimizer sees the gradients plus the correlated noise
W = C⁻¹Z, drawn step by step:

    w_t = (z_t - Σ_{j=1}^{b-1} c_j · w_{t-j}) / c_0,    z_t ~ N(0, stddev² I).

Later steps' noise partly cancels earlier steps' noise in the running sum the parameters
accumulate, so for the same privacy the parameters carry less noise. The default strategy is the
banded square root of the prefix-sum matrix (`sqrt_prefix_sum`), normalised to a maximum column
norm of 1, so the noise multiplier σ has its DP-SGD meaning. Privacy needs every unit to take
part at most once every b steps (cyclic Poisson sampling: `privacy.cyclic_sampling`, whose
partition key the state keeps, `partition_key_bytes`); the run of
T steps is then accounted as DP-SGD with ceil(T / b) steps at the partition's rate
(`amplified_bandmf_event`). One band (b = 1, c_0 = 1) is DP-SGD, bit for bit.

Memory: the transformation's state keeps the last b - 1 noise vectors, i.e. b - 1 float32 (or
wider, `clipping.sum_dtype`) copies of the trainable parameters.

Example:
    >>> import jax, jax.numpy as jnp
    >>> strategy = sqrt_prefix_sum(bands=3)
    >>> round(strategy.max_column_norm(), 6)
    1.0
    >>> noise = add_correlated_noise(1.0, strategy, key=jax.random.key(0))
    >>> state = noise.init(jnp.zeros(4))
    >>> updates, state = noise.update(jnp.zeros(4), state)
    >>> updates.shape, len(state.history)
    ((4,), 2)
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, NamedTuple

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import optax

from dpmix_jax.privacy import gaussian_noise
from dpmix_jax.privacy.accounting import dpsgd_event
from dpmix_jax.privacy.clipping import sum_dtype
from dpmix_jax.privacy.randomness import fresh_secret_key
from dpmix_jax.privacy.validation import check_steps

PyTree = Any


def check_bands(bands: int, name: str = "bands") -> int:
    """`bands` as an int, or a ValueError naming `name` unless it is an integer >= 1."""
    if isinstance(bands, bool) or not isinstance(bands, numbers.Integral) or bands < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {bands!r}.")
    return int(bands)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BandedToeplitzStrategy:
    """A lower-triangular banded Toeplitz matrix C: C[i, j] = c_{i-j} for 0 <= i - j < b, else 0.

    Attributes:
        coefficients: (c_0, ..., c_{b-1}), finite, with c_0 > 0 (C is then invertible).
    """

    coefficients: tuple[float, ...]

    def __post_init__(self) -> None:
        values = tuple(float(c) for c in self.coefficients)
        if not values or not all(math.isfinite(c) for c in values) or not values[0] > 0:
            raise ValueError(
                "coefficients must be a non-empty sequence of finite numbers with "
                f"coefficients[0] > 0, got {self.coefficients!r}."
            )
        object.__setattr__(self, "coefficients", values)

    @property
    def bands(self) -> int:
        """b, the number of non-zero diagonals."""
        return len(self.coefficients)

    def strategy_matrix(self, steps: int) -> np.ndarray:
        """C as a dense `(steps, steps)` float64 matrix."""
        steps = check_steps(steps)
        matrix = np.zeros((steps, steps))
        for offset, coefficient in enumerate(self.coefficients[:steps]):
            matrix += coefficient * np.eye(steps, k=-offset)
        return matrix

    def column_norms(self, steps: int) -> np.ndarray:
        """The L2 norm of each of C's `steps` columns (the last b - 1 columns are truncated)."""
        steps = check_steps(steps)
        squares = np.cumsum(np.square(self.coefficients))
        rows_below = np.minimum(self.bands, steps - np.arange(steps))
        return np.sqrt(squares[rows_below - 1])

    def max_column_norm(self) -> float:
        """The largest column norm, that of a full column: sqrt(Σ_j c_j²)."""
        return float(np.sqrt(np.sum(np.square(self.coefficients))))

    def normalized(self) -> BandedToeplitzStrategy:
        """The same strategy scaled to a maximum column norm of 1."""
        scale = self.max_column_norm()
        return BandedToeplitzStrategy(coefficients=tuple(c / scale for c in self.coefficients))

    def sensitivity(self, steps: int) -> float:
        """The L2 sensitivity of C·G over `steps` steps for a unit of gradient norm <= 1 that
        takes part at most once every b steps (b-min-separated participation).

        Columns b or more apart have disjoint supports, so a participation pattern S has
        sensitivity sqrt(Σ_{i ∈ S} ‖C[:, i]‖²). Column norms never increase with i, and the k-th
        participation is at step >= (k - 1)·b, so the pattern {0, b, 2b, ...} is the worst.
        """
        norms = self.column_norms(steps)
        return float(np.sqrt(np.sum(np.square(norms[:: self.bands]))))


def sqrt_prefix_sum(bands: int) -> BandedToeplitzStrategy:
    """The square root of the prefix-sum matrix truncated to `bands` bands, normalised.

    The prefix-sum matrix A (ones on and below the diagonal) is Toeplitz with generating function
    1 / (1 - x); its square root has coefficients r_j = binom(2j, j) / 4^j, the Taylor
    coefficients of (1 - x)^(-1/2). Truncating them to b bands and scaling to a maximum column
    norm of 1 gives the strategy with which σ is the DP-SGD noise multiplier.
    """
    bands = check_bands(bands)
    coefficients = [1.0]
    for j in range(1, bands):
        coefficients.append(coefficients[-1] * (2 * j - 1) / (2 * j))
    return BandedToeplitzStrategy(coefficients=tuple(coefficients)).normalized()


def amplified_bandmf_event(
    *, noise_multiplier: float, sampling_rate: float, steps: int, bands: int
) -> dp_accounting.DpEvent:
    """The event of `steps` BandMF steps with `bands` bands under cyclic Poisson sampling.

    With a strategy normalised to a maximum column norm of 1 and each unit in one of b
    partitions (active once every b steps, each of its units included with probability q), the
    run is DP-SGD with ceil(T / b) steps at rate q and noise multiplier σ (Choquette-Choo et al.,
    "Amplified banded matrix factorization", 2023).
    """
    bands = check_bands(bands)
    steps = check_steps(steps)
    return dpsgd_event(
        noise_multiplier=noise_multiplier, sampling_rate=sampling_rate, steps=-(-steps // bands)
    )


def correlate(
    draw: PyTree, history: tuple[PyTree, ...], strategy: BandedToeplitzStrategy
) -> tuple[PyTree, tuple[PyTree, ...]]:
    """One step of W = C⁻¹Z: w_t = (z_t - Σ_{j=1}^{b-1} c_j w_{t-j}) / c_0, and the new history.

    Args:
        draw: z_t, a pytree of Gaussian draws.
        history: (w_{t-1}, ..., w_{t-b+1}), newest first, zeros before the first step.
        strategy: C.

    Returns:
        (w_t, (w_t, ..., w_{t-b+2})). With one band and c_0 = 1, w_t is `draw` itself.

    Privacy: post-processing of the Gaussian draws; the noise is as secret as they are.
    """
    lead, *rest = strategy.coefficients
    if len(history) != len(rest):
        raise ValueError(f"history holds {len(history)} vectors, the strategy needs {len(rest)}.")
    noise = draw
    for coefficient, past in zip(rest, history, strict=True):
        noise = jax.tree.map(lambda w, p, c=coefficient: w - c * p, noise, past)
    if lead != 1.0:
        noise = jax.tree.map(lambda w: w / lead, noise)
    return noise, ((noise, *history[:-1]) if rest else ())


class CorrelatedNoiseState(NamedTuple):
    """The secret key of the next draw, the last b - 1 noise vectors (newest first), and the
    secret key of the run's cyclic partition (`partition_key_bytes`), kept here so that a
    resumed run keeps its partition."""

    key: jax.Array
    history: tuple[PyTree, ...]
    partition_key: jax.Array


# Folded into the noise key to derive the partition key (a stream apart from the noise draws).
_PARTITION_STREAM = 0xBA4D


def partition_key_bytes(state: CorrelatedNoiseState) -> bytes:
    """The 32-byte key of the run's cyclic partition (`cyclic_sampling.cyclic_parts`).

    Privacy: secret like the noise key; never log it.
    """
    return np.asarray(jax.device_get(state.partition_key), np.uint32).tobytes()


def add_correlated_noise(
    stddev: float, strategy: BandedToeplitzStrategy, key: jax.Array | None = None
) -> optax.GradientTransformation:
    """Adds the correlated noise w_t = (z_t - Σ_{j>=1} c_j w_{t-j}) / c_0 of `strategy` (C⁻¹Z).

    z_t is drawn exactly as `gaussian_noise.add_gaussian_noise` draws its noise (the same key
    splitting and `gaussian_noise_tree`), so one band with c_0 = 1 adds exactly the same noise.
    Updates are promoted to float32 (or wider, `sum_dtype`) and the noise is added there.

    Args:
        stddev: the standard deviation of z_t (>= 0), σ·Δ for a sum of sensitivity Δ.
        strategy: the banded strategy C (normalise it, `BandedToeplitzStrategy.normalized`,
            for σ to mean what it means for DP-SGD).
        key: None (default): every `init` draws a new secret key from the operating system. A
            given key replays a seeded noise stream on every `init` (see `add_gaussian_noise`).

    Privacy: with C normalised, Δ the clipped sum's sensitivity and units taking part at most
    once every b steps, T steps are `amplified_bandmf_event(σ, q, T, b)`. The state (key and
    past noise) is secret: never log it; a checkpoint holding it is sensitive. It holds b - 1
    float32 copies of the parameters.
    """
    stddev = float(stddev)
    if not stddev >= 0:
        raise ValueError(f"stddev must be >= 0, got {stddev!r}.")
    if not isinstance(strategy, BandedToeplitzStrategy):
        raise ValueError(f"strategy must be a BandedToeplitzStrategy, got {strategy!r}.")
    rest = strategy.coefficients[1:]

    def init_fn(params: PyTree) -> CorrelatedNoiseState:
        history = tuple(  # distinct buffers: a jitted step may donate the state
            jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), sum_dtype(p.dtype)), params)
            for _ in rest
        )
        run_key = fresh_secret_key() if key is None else key
        partition_key = jax.random.bits(
            jax.random.fold_in(run_key, _PARTITION_STREAM), (8,), jnp.uint32
        )
        return CorrelatedNoiseState(run_key, history, partition_key)

    def update_fn(updates: PyTree, state: CorrelatedNoiseState, params: PyTree = None):
        del params
        next_key, noise_key = jax.random.split(state.key)
        draw = gaussian_noise.gaussian_noise_tree(noise_key, updates, stddev)
        noise, history = correlate(draw, state.history, strategy)
        wide = jax.tree.map(lambda u, n: u.astype(n.dtype), updates, noise)
        new_state = CorrelatedNoiseState(next_key, history, state.partition_key)
        return optax.tree.add(wide, noise), new_state

    return optax.GradientTransformation(init_fn, update_fn)
