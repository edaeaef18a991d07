"""A tabular DP-MixMin task from a table shipped inside a pip package (nothing downloaded).

The table is statsmodels' `fair` data set (`statsmodels.datasets.fair`, a CSV in the wheel):
6,366 married women from the 1974 Redbook magazine survey (Fair 1978), with the marriage
rating, age, years married, children, religiousness, education and the wife's and husband's
occupation codes; the binary task is whether she reported any extramarital affair (32% do). It
is the largest bundled table with a binary label and a demographic column that splits it into
sources sharing the label: age (six bands).

The task (`load_fair_task`):

- the rows are split once, by a public seed, into a public pool (fraction `public_fraction`) and
  a sensitive pool;
- the public sources are the public pool's age bands (`AGE_SOURCES`): k sources that share the
  label and differ in their covariate distribution (age, and with it years married and
  children);
- the sensitive data is a weighted draw without replacement from the sensitive pool: weight
  ∝ π*(band) / (the band's share of the sensitive pool) · exp(-shift · z(rate_marriage)), where
  π* (`target_mixture`) is the sensitive population's age mix (a mixture of the sources, what
  MixMin models) and `shift` tilts it, within every band, towards unhappy marriages: a covariate
  shift that no mixture of the sources reproduces (the assumption DP-MixMin relies on fails as
  `shift` grows);
- features: the six numeric columns standardised with the public pool's mean and standard
  deviation only, and one-hot codes of the two occupation columns over the codebook's fixed
  categories 1-6 (no category is learned from any data).

Privacy: the sensitive rows enter no preprocessing statistic (the test
`test_public_preprocessing_ignores_sensitive_rows` changes them and compares). The pool split,
the draw and the split into train / validation / test use public seeds; the draw, which reads
the sensitive pool's age-band counts, is how the study makes its sensitive population, before
any method sees the data, and no method reads those counts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from dpmix_jax.data.sources import ArraySource

NUMERIC_COLUMNS = ("rate_marriage", "age", "yrs_married", "children", "religious", "educ")
CATEGORICAL_COLUMNS = ("occupation", "occupation_husb")
OCCUPATION_CODES = (1, 2, 3, 4, 5, 6)  # the codebook's categories (student ... professional)
# Public sources: age bands of the public pool (ages are recorded as 17.5, 22, 27, 32, 37, 42).
AGE_SOURCES: tuple[tuple[str, tuple[float, ...]], ...] = (
    ("age <= 22", (17.5, 22.0)),
    ("age 27", (27.0,)),
    ("age 32", (32.0,)),
    ("age >= 37", (37.0, 42.0)),
)
TILT_COLUMN = "rate_marriage"


def load_fair_table():
    """The `fair` table as a pandas DataFrame (read from the statsmodels wheel, offline).

    Raises:
        SystemExit: statsmodels is not installed (one line saying how to install it).
    """
    try:
        from statsmodels.datasets import fair
    except ImportError as err:
        raise SystemExit(
            "the tabular task needs statsmodels (its bundled `fair` table): pip install statsmodels"
        ) from err
    return fair.load_pandas().data


@dataclasses.dataclass(frozen=True, kw_only=True)
class TabularTaskConfig:
    """Public settings of the tabular task (see the module docstring).

    Attributes:
        public_fraction: share of the table's rows in the public pool.
        target_mixture: π*, the sensitive population's mix of the age sources (sums to 1).
        shift: the covariate-shift knob (>= 0): the tilt towards low marriage ratings.
        num_sensitive: rows drawn from the sensitive pool.
        val_size, test_size: rows of the sensitive validation and test splits (the rest is the
            train split).
        seed: the public seed of the pool split, the draw and the splits.
    """

    public_fraction: float = 0.35
    target_mixture: tuple[float, ...] = (0.1, 0.15, 0.25, 0.5)
    shift: float = 0.0
    num_sensitive: int = 1500
    val_size: int = 150
    test_size: int = 400
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.public_fraction < 1:
            raise ValueError(f"public_fraction must be in (0, 1), got {self.public_fraction!r}.")
        mixture = np.asarray(self.target_mixture, dtype=float)
        if (
            mixture.shape != (len(AGE_SOURCES),)
            or (mixture < 0).any()
            or not np.isclose(mixture.sum(), 1.0)
        ):
            raise ValueError(
                f"target_mixture must be {len(AGE_SOURCES)} non-negative weights summing to 1, "
                f"got {self.target_mixture!r}."
            )
        if not (np.isfinite(self.shift) and self.shift >= 0):
            raise ValueError(f"shift must be a finite number >= 0, got {self.shift!r}.")
        for name in ("num_sensitive", "val_size", "test_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
        if self.val_size + self.test_size >= self.num_sensitive:
            raise ValueError(
                f"val_size + test_size ({self.val_size + self.test_size}) must leave train rows "
                f"of num_sensitive ({self.num_sensitive})."
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class TabularTask:
    """k public sources of (features, label) rows and a sensitive binary task.

    Attributes:
        name: for reports.
        sources: the k public sources, each {"features": (n_i, d), "labels": (n_i, 1)}.
        source_names: their names.
        train, val, test: sensitive splits of the same arrays; `group_ids` of every split and
            source hold the row's index in the original table (its stable identity).
        feature_names: the d columns.
        shift: the covariate-shift knob the task was drawn with.
        target_mixture: π*, the sensitive population's mix of the sources.
    """

    name: str
    sources: tuple[ArraySource, ...]
    source_names: tuple[str, ...]
    train: ArraySource
    val: ArraySource
    test: ArraySource
    feature_names: tuple[str, ...]
    shift: float
    target_mixture: tuple[float, ...]

    @property
    def k(self) -> int:
        return len(self.sources)

    @property
    def num_features(self) -> int:
        return len(self.feature_names)


@dataclasses.dataclass(frozen=True)
class Preprocessing:
    """Feature preprocessing fit on public rows: means and standard deviations of the numeric
    columns (the one-hot categories are fixed by the codebook)."""

    mean: np.ndarray
    std: np.ndarray

    @classmethod
    def fit(cls, public_numeric: np.ndarray) -> Preprocessing:
        """Statistics of the public rows' numeric columns (constant columns keep scale 1)."""
        std = public_numeric.std(axis=0)
        return cls(mean=public_numeric.mean(axis=0), std=np.where(std > 0, std, 1.0))

    def transform(self, numeric: np.ndarray, categorical: np.ndarray) -> np.ndarray:
        """float32 features: standardised numeric columns, then one-hot occupation codes."""
        scaled = (numeric - self.mean) / self.std
        return np.concatenate([scaled, one_hot(categorical)], axis=1).astype(np.float32)


def feature_names() -> tuple[str, ...]:
    """Names of the feature columns, in `Preprocessing.transform`'s order."""
    hot = [f"{column}={code}" for column in CATEGORICAL_COLUMNS for code in OCCUPATION_CODES]
    return (*NUMERIC_COLUMNS, *hot)


def one_hot(categorical: np.ndarray) -> np.ndarray:
    """One-hot codes of each categorical column over `OCCUPATION_CODES`.

    Raises:
        ValueError: a code outside the codebook (naming the column and the first such row).
    """
    codes = np.asarray(OCCUPATION_CODES, dtype=float)
    blocks = []
    for column, values in zip(CATEGORICAL_COLUMNS, np.asarray(categorical).T, strict=True):
        hot = values[:, None] == codes[None, :]
        if not hot.any(axis=1).all():
            row = int(np.flatnonzero(~hot.any(axis=1))[0])
            raise ValueError(
                f"column {column!r} row {row} has code {values[row]:g}, not one of "
                f"{OCCUPATION_CODES}."
            )
        blocks.append(hot.astype(np.float32))
    return np.concatenate(blocks, axis=1)


def age_band(age: np.ndarray) -> np.ndarray:
    """The index in `AGE_SOURCES` of each age.

    Raises:
        ValueError: an age in no band (naming the first such row).
    """
    age = np.asarray(age, dtype=float)
    band = np.full(age.shape, -1)
    for index, (_, ages) in enumerate(AGE_SOURCES):
        band[np.isin(age, ages)] = index
    if (band < 0).any():
        row = int(np.flatnonzero(band < 0)[0])
        raise ValueError(f"column 'age' row {row} has age {age[row]:g}, in no source band.")
    return band


def sensitive_draw_weights(
    band: np.ndarray, tilt: np.ndarray, target_mixture: Sequence[float], shift: float
) -> np.ndarray:
    """Draw weights of the sensitive pool's rows: π*(band) / (the band's share of the pool)
    · exp(-shift · tilt), normalised to sum to 1.

    Args:
        band: each row's source band.
        tilt: each row's standardised tilt covariate (marriage rating, public statistics).
        target_mixture: π*.
        shift: the covariate-shift knob.
    """
    counts = np.bincount(band, minlength=len(target_mixture)).astype(float)
    share = counts / counts.sum()
    target = np.asarray(target_mixture, dtype=float)
    weights = target[band] / share[band] * np.exp(-shift * (tilt - tilt.max()))
    return weights / weights.sum()


def load_fair_task(config: TabularTaskConfig | None = None, *, table=None) -> TabularTask:
    """The tabular task of `config` (see the module docstring).

    Args:
        config: public settings (default `TabularTaskConfig()`).
        table: the `fair` DataFrame (default `load_fair_table()`; tests pass edited copies).

    Privacy: preprocessing statistics come from the public pool alone; the sensitive draw uses
    only public seeds and the design weights `sensitive_draw_weights`.
    """
    config = config or TabularTaskConfig()
    table = load_fair_table() if table is None else table
    missing = [c for c in (*NUMERIC_COLUMNS, *CATEGORICAL_COLUMNS, "affairs") if c not in table]
    if missing:
        raise ValueError(f"the fair table lacks the columns {missing}.")
    numeric = table[list(NUMERIC_COLUMNS)].to_numpy(dtype=float)
    categorical = table[list(CATEGORICAL_COLUMNS)].to_numpy(dtype=float)
    affairs = table["affairs"].to_numpy(dtype=float)
    if not (np.isfinite(numeric).all() and np.isfinite(affairs).all()):
        row = int(np.flatnonzero(~np.isfinite(np.c_[numeric, affairs]).all(axis=1))[0])
        raise ValueError(f"the fair table's row {row} has a missing or infinite value.")
    labels = (affairs > 0).astype(np.float32)[:, None]
    rng = np.random.default_rng(config.seed)
    count = len(table)
    public = rng.permutation(count) < round(config.public_fraction * count)
    preprocessing = Preprocessing.fit(numeric[public])
    features = preprocessing.transform(numeric, categorical)
    band = age_band(numeric[:, NUMERIC_COLUMNS.index("age")])

    def source(rows: np.ndarray) -> ArraySource:
        return ArraySource({"features": features[rows], "labels": labels[rows]}, group_ids=rows)

    sources = tuple(source(np.flatnonzero(public & (band == i))) for i in range(len(AGE_SOURCES)))
    pool = np.flatnonzero(~public)
    if config.num_sensitive > len(pool):
        raise ValueError(
            f"num_sensitive ({config.num_sensitive}) exceeds the sensitive pool's {len(pool)} rows."
        )
    tilt = features[pool, NUMERIC_COLUMNS.index(TILT_COLUMN)]
    weights = sensitive_draw_weights(band[pool], tilt, config.target_mixture, config.shift)
    # Weighted draw without replacement (Efraimidis-Spirakis keys), then a random order.
    keys = np.log(rng.uniform(size=len(pool))) / np.maximum(weights, 1e-300)
    drawn = pool[np.argsort(-keys)[: config.num_sensitive]]
    drawn = drawn[rng.permutation(len(drawn))]
    test = drawn[: config.test_size]
    val = drawn[config.test_size : config.test_size + config.val_size]
    train = drawn[config.test_size + config.val_size :]
    return TabularTask(
        name=f"fair (statsmodels), age sources, shift {config.shift:g}",
        sources=sources,
        source_names=tuple(name for name, _ in AGE_SOURCES),
        train=source(train),
        val=source(val),
        test=source(test),
        feature_names=feature_names(),
        shift=config.shift,
        target_mixture=tuple(config.target_mixture),
    )
