"""DP-MixMin end to end for text domains (the Enron and OpenWebMath settings).

k public domains (Common Pile sources; in the embedded default five BBC topics, Python code and
Python docs) each hold their own documents; the sensitive corpus is documents with authors (Enron
sent mail: user-level DP, a user's whole mail is one unit) or without (OpenWebMath: example-level
DP, one document is one unit; such tasks give every document its own user id). Stages, each
stored so that a rerun skips it:

0. a byte-level BPE tokenizer trained on the public documents only (or GPT-2's own), shared by
   every seed: it never sees sensitive text;
1. split the sensitive train split into disjoint D_mix (fraction ρ of the users, or of the
   documents at example level) and D_ft;
2. train one GPT-2 proxy per public domain on that domain's documents;
3. cache the `sequence` proxy outputs on D_mix: L[j, i] = log p_i(document j), with T_j its
   scored tokens (each document scored from an end-of-text context, cut to the proxy's length);
4. learn λ with `mixing.dp_mixmin(kind="sequence")` at (ε, δ) on D_mix (user level: users
   Poisson-sampled, up to G of their documents each, averaged, clipped);
5. pretrain the downstream GPT-2 on public documents drawn by λ (`train.pretrain.PackedMixture`);
6. DP-fine-tune it on D_ft: user level, each user's documents packed into rows of their own and a
   Poisson-sampled user contributing up to G rows; example level, one row per document;
7. evaluate perplexity on the test users' documents (packed per user), lower is better.
The end-to-end budget is the parallel composition of stages 4 and 6 (disjoint users), or with
`composition="sequential"` both stages run on the whole train split with ε split between them and
the budgets add. Baselines run through the same stages (see `common.METHOD_NOTES`).

Fine-tuning runs that share shapes and σ compile the same XLA programs; `compilation_cache=True`
points JAX's persistent compilation cache (a process-wide setting) at `root/xla_cache` when no
cache is configured, so that they compile once.

API:
    DomainTextTask(*, name, public_domains, train, val, test, true_weights=None)
    from_builtin(task, *, split_fractions=(0.6, 0.2, 0.2), seed=0) -> DomainTextTask
    from_user_documents(documents, public_domains, *, name, split_fractions, seed, ...)
    from_enron(enron_root, public_root, *, domains=None, max_public_documents=None, ...)
    from_document_files(path, public_root, *, max_documents=50_000, ...)   (OpenWebMath)
    documents_as_units(texts) -> UserDocuments          every document its own unit
    LanguageModelSpec(*, config, weights=None)          .build(vocab_size, *, seed, load=True)
    TextPipelineConfig(*, level, mix_fraction, ..., proxy, mixture, pretrain, finetune)
    TextPipeline(task, config, root, *, on_stage=None, compilation_cache=True)
        .run(method, epsilon, seed) -> RunResult       (and the stages: split, tokenizer,
        proxies, proxy_outputs, mixture, nonprivate_weights, pretrained, finetune, perplexity)
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import pathlib
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dpmix_jax.data import builtin
from dpmix_jax.data.text import (
    UserDocuments,
    document_tokens,
    iter_documents,
    load_domains,
    load_enron,
    pack_sequences,
)
from dpmix_jax.data.tokenizer import TextTokenizer, gpt2_tokenizer, train_bpe_tokenizer
from dpmix_jax.mixing import dp_mixmin, mixmin
from dpmix_jax.models.gpt2 import GPT2, GPT2Config, trainable_mask
from dpmix_jax.pipeline import common
from dpmix_jax.pipeline.image import _result_from_json
from dpmix_jax.privacy import accounting
from dpmix_jax.train import Checkpointer, IndexedData, TrainConfig, Trainer, evaluate, fit, losses
from dpmix_jax.train.engine import TrainState, split_model
from dpmix_jax.train.pretrain import PackedMixture
from dpmix_jax.train.proxies import sequence_proxy_outputs

Level = Literal["user", "example"]
TokenizerKind = Literal["bpe", "gpt2"]
Split = Literal["train", "val", "test"]


# ------------------------------------------------------------------------------------------
# The task and its adapters
# ------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class DomainTextTask:
    """k public text domains and a sensitive corpus split by user into train, val and test.

    Attributes:
        name: for reports.
        public_domains: domain name -> public documents (k >= 2 domains, none empty).
        train, val, test: sensitive documents with their users; no user is in two splits.
        true_weights: the population mixture over the domains that generated the sensitive
            documents, when known (the embedded default), for scoring λ.
    """

    name: str
    public_domains: Mapping[str, Sequence[str]]
    train: UserDocuments
    val: UserDocuments
    test: UserDocuments
    true_weights: np.ndarray | None = None

    def __post_init__(self) -> None:
        if len(self.public_domains) < 2:
            raise ValueError(f"need at least 2 public domains, got {len(self.public_domains)}.")
        empty = [name for name, docs in self.public_domains.items() if not docs]
        if empty:
            raise ValueError(f"public domains {empty} have no documents.")
        for split in ("train", "val", "test"):
            if len(getattr(self, split)) == 0:
                raise ValueError(f"the sensitive {split} split has no documents.")
        names = {s: _present_users(getattr(self, s)) for s in ("train", "val", "test")}
        for a, b in (("train", "val"), ("train", "test"), ("val", "test")):
            if shared := names[a] & names[b]:
                raise ValueError(
                    f"{len(shared)} users are in both the {a} and {b} splits (e.g. "
                    f"{sorted(shared)[0]!r}); the splits must be user-disjoint."
                )
        if self.true_weights is not None and np.shape(self.true_weights) != (self.k,):
            raise ValueError(
                f"true_weights must have shape ({self.k},), got {np.shape(self.true_weights)}."
            )

    @property
    def domain_names(self) -> tuple[str, ...]:
        return tuple(self.public_domains)

    @property
    def k(self) -> int:
        return len(self.public_domains)


def _present_users(documents: UserDocuments) -> set[str]:
    return {documents.users[u] for u in np.unique(documents.user_ids)}


def documents_as_units(texts: Sequence[str]) -> UserDocuments:
    """Documents without authors, each its own unit (example-level tasks such as OpenWebMath)."""
    return UserDocuments(
        texts=tuple(texts),
        user_ids=np.arange(len(texts), dtype=np.int64),
        users=tuple(f"doc{i}" for i in range(len(texts))),
    )


def from_user_documents(
    documents: UserDocuments,
    public_domains: Mapping[str, Sequence[str]],
    *,
    name: str,
    split_fractions: tuple[float, float, float] = (0.6, 0.2, 0.2),
    seed: int = 0,
    true_weights: np.ndarray | None = None,
) -> DomainTextTask:
    """A task from a sensitive corpus: its users are split into train, val and test by `seed`.

    Privacy: the split is a seeded permutation of users (data-independent), so the test users'
    documents never reach a training stage.
    """
    if len(split_fractions) != 3:
        raise ValueError(f"split_fractions must be (train, val, test), got {split_fractions!r}.")
    train, val, test = documents.split_by_user(split_fractions, seed=seed)
    return DomainTextTask(
        name=name,
        public_domains={k: tuple(v) for k, v in public_domains.items()},
        train=train,
        val=val,
        test=test,
        true_weights=None if true_weights is None else np.asarray(true_weights, np.float64),
    )


def from_builtin(
    task: builtin.TextMixtureTask,
    *,
    split_fractions: tuple[float, float, float] = (0.6, 0.2, 0.2),
    seed: int = 0,
) -> DomainTextTask:
    """The embedded text default (`data.builtin.load_text_mixture_task`) as a pipeline task;
    `true_weights` is its population mixture."""
    return from_user_documents(
        task.sensitive,
        task.public_domains,
        name=f"e-mail users over {len(task.domain_names)} text domains (embedded)",
        split_fractions=split_fractions,
        seed=seed,
        true_weights=task.population_weights,
    )


def from_enron(
    enron_root: str | os.PathLike,
    public_root: str | os.PathLike,
    *,
    domains: Sequence[str] | None = None,
    max_public_documents: int | None = None,
    split_fractions: tuple[float, float, float] = (0.6, 0.2, 0.2),
    seed: int = 0,
) -> DomainTextTask:
    """Enron sent mail (user level) against public domain folders (Common Pile layout).

    Args:
        enron_root: the CMU `maildir` (or its parent); see `data.text.load_enron`.
        public_root: one sub-folder of `.jsonl[.gz]`/`.parquet` files per domain.
        domains: which domain folders (default: all).
        max_public_documents: cap per domain.
        split_fractions, seed: the user split into train, val and test.
    """
    _require_paths({"Enron maildir": enron_root, "public domain folder": public_root})
    return from_user_documents(
        load_enron(enron_root),
        load_domains(public_root, domains=domains, max_documents_per_domain=max_public_documents),
        name="Enron sent mail",
        split_fractions=split_fractions,
        seed=seed,
    )


def from_document_files(
    path: str | os.PathLike,
    public_root: str | os.PathLike,
    *,
    name: str = "OpenWebMath",
    max_documents: int | None = 50_000,
    domains: Sequence[str] | None = None,
    max_public_documents: int | None = None,
    split_fractions: tuple[float, float, float] = (0.8, 0.1, 0.1),
    seed: int = 0,
) -> DomainTextTask:
    """Sensitive documents without authors (OpenWebMath `.parquet`/`.jsonl` files), each its own
    unit (example level), against public domain folders."""
    _require_paths({f"{name} documents": path, "public domain folder": public_root})
    texts = list(iter_documents(path, max_documents=max_documents))
    return from_user_documents(
        documents_as_units(texts),
        load_domains(public_root, domains=domains, max_documents_per_domain=max_public_documents),
        name=name,
        split_fractions=split_fractions,
        seed=seed,
    )


def _require_paths(paths: Mapping[str, str | os.PathLike | None]) -> None:
    """ValueError naming every missing path (None entries are not required)."""
    missing = [
        f"{what}: {path}"
        for what, path in paths.items()
        if path is not None and not os.path.exists(path)
    ]
    if missing:
        raise ValueError("missing input paths (nothing is downloaded): " + "; ".join(missing))


# ------------------------------------------------------------------------------------------
# Settings
# ------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class LanguageModelSpec:
    """A GPT-2 architecture, optionally started from a local checkpoint.

    Attributes:
        config: the architecture; its `vocab_size` is replaced by the tokenizer's and
            `n_positions` is the training sequence length.
        weights: a local transformers GPT-2 folder or weights file to start from (None: random
            initialisation). Its vocabulary must be the tokenizer's (GPT-2's for GPT-2 weights).
    """

    config: GPT2Config
    weights: str | None = None

    @property
    def seq_len(self) -> int:
        return self.config.n_positions

    def build(self, vocab_size: int, *, seed: int, load: bool = True) -> GPT2:
        """The model for a `vocab_size` tokenizer: the checkpoint's weights when `weights` is set
        and `load` is True, else a random initialisation from `seed`."""
        config = dataclasses.replace(self.config, vocab_size=vocab_size)
        if self.weights is None or not load:
            return GPT2(config, rngs=nnx.Rngs(seed))
        _require_paths({"GPT-2 weights": self.weights})
        return GPT2.from_pretrained(self.weights, config=config)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TextPipelineConfig:
    """Public settings of the text pipeline.

    Attributes:
        delta: δ of each private stage.
        level: "user" (a user's documents are one unit) or "example" (a document is one unit).
        mix_fraction: ρ, the fraction of the train users (documents) given to the mixture stage.
        composition: "parallel" (disjoint D_mix, D_ft: max) or "sequential" (no split; sum).
        sequential_mixture_share: with sequential composition, the mixture stage's share of ε.
        tokenizer: "bpe" (a byte-level BPE trained on the public documents) or "gpt2".
        vocab_size: the BPE vocabulary size ("bpe" only).
        proxy_model: the per-domain proxy LM.
        model: the downstream LM.
        proxy: public training of each proxy (rows of `proxy_model.seq_len` tokens).
        mixture: the DP-MixMin stage (`max_examples_per_user` is G at user level).
        pretrain: public pretraining on the λ-mixture of documents.
        finetune: private fine-tuning (`level` and G as above); its `epsilon` and `delta` are
            replaced by each run's.
        finetune_last_blocks: train only the last this-many blocks and the (tied) head during
            fine-tuning (the paper: 2); None trains every parameter.
        random_search_candidates: m, the Random Search baseline's number of Dirichlet(1) draws.
        eval_batch_size: rows per evaluation batch.
    """

    delta: float = 1e-5
    level: Level = "user"
    mix_fraction: float = 0.3
    composition: common.Composition = "parallel"
    sequential_mixture_share: float = 0.1
    tokenizer: TokenizerKind = "bpe"
    vocab_size: int = 512
    proxy_model: LanguageModelSpec
    model: LanguageModelSpec
    proxy: TrainConfig
    mixture: common.MixtureConfig
    pretrain: TrainConfig
    finetune: TrainConfig
    finetune_last_blocks: int | None = None
    random_search_candidates: int = 4
    eval_batch_size: int = 32

    def __post_init__(self) -> None:
        accounting.check_delta(self.delta)
        if self.level not in ("user", "example"):
            raise ValueError(f"level must be 'user' or 'example', got {self.level!r}.")
        if not 0 < self.mix_fraction < 1:
            raise ValueError(f"mix_fraction must be in (0, 1), got {self.mix_fraction!r}.")
        common.stage_epsilons(1.0, self.composition, self.sequential_mixture_share)
        if self.tokenizer not in ("bpe", "gpt2"):
            raise ValueError(f"tokenizer must be 'bpe' or 'gpt2', got {self.tokenizer!r}.")
        if self.tokenizer == "bpe" and not (
            isinstance(self.vocab_size, int) and self.vocab_size >= 257
        ):
            raise ValueError(f"a BPE vocab_size must be an integer >= 257, got {self.vocab_size!r}")
        if self.proxy.private or self.pretrain.private:
            raise ValueError("proxy and pretrain stages train on public data: private=False.")
        if not self.finetune.private:
            raise ValueError("the finetune stage must be private (private=True).")
        if self.finetune.level != self.level:
            raise ValueError(
                f"finetune.level is {self.finetune.level!r} but the pipeline level is "
                f"{self.level!r}; they must agree."
            )
        user_level = self.level == "user"
        if (self.mixture.max_examples_per_user is not None) != user_level:
            raise ValueError(
                "mixture.max_examples_per_user (G) is required at user level and unused at "
                f"example level; level is {self.level!r}."
            )
        if self.finetune_last_blocks is not None and not (
            isinstance(self.finetune_last_blocks, int)
            and 0 <= self.finetune_last_blocks <= self.model.config.n_layer
        ):
            raise ValueError(
                f"finetune_last_blocks must be None or an integer in [0, "
                f"{self.model.config.n_layer}], got {self.finetune_last_blocks!r}."
            )
        if not isinstance(self.random_search_candidates, int) or self.random_search_candidates < 1:
            raise ValueError("random_search_candidates must be an integer >= 1.")
        if not isinstance(self.eval_batch_size, int) or self.eval_batch_size < 1:
            raise ValueError(f"eval_batch_size must be an integer >= 1, got {self.eval_batch_size}")


# ------------------------------------------------------------------------------------------
# Token layouts
# ------------------------------------------------------------------------------------------


def _row_gather(tokens: np.ndarray, mask: np.ndarray) -> Callable[[np.ndarray], dict]:
    """`gather(indices)` over fixed rows; -1 indices give all-padding rows."""

    def gather(indices: np.ndarray) -> dict[str, np.ndarray]:
        indices = np.asarray(indices)
        keep = indices >= 0
        picked = np.maximum(indices, 0)
        return {
            "tokens": np.where(keep[:, None], tokens[picked], 0).astype(np.int32),
            "mask": mask[picked] & keep[:, None],
        }

    return gather


def _scored_documents(token_lists: Sequence[Sequence[int]], *, seq_len: int, eos_id: int):
    """One document per row of `seq_len`: end-of-text, then its first seq_len - 1 tokens, so
    every kept token is scored (`losses.sequence_log_prob` skips position 0)."""
    layout = document_tokens(token_lists, max_len=seq_len - 1, eos_id=eos_id)
    column = np.ones((len(token_lists), 1), dtype=bool)
    tokens = np.concatenate([np.full_like(column, eos_id, dtype=np.int32), layout.targets], 1)
    return tokens, np.concatenate([column, layout.mask], axis=1), layout.token_counts


def _derived_seed(seed: int, *names: object) -> int:
    """A 32-bit seed for one named use of the run seed (a different stream per name)."""
    text = "/".join(str(n) for n in (seed, *names))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "little")


# ------------------------------------------------------------------------------------------
# The pipeline
# ------------------------------------------------------------------------------------------


class TextPipeline:
    """DP-MixMin and its baselines on one `DomainTextTask`, with stages stored under `root`.

    Args:
        task: the data.
        config: public settings.
        root: directory of the stage store (the tokenizer at the top, one sub-directory per
            seed).
        on_stage: called with a stage name whenever a stage is computed (not when it is loaded);
            for progress reports and tests.
        compilation_cache: point JAX's persistent compilation cache at `root/xla_cache` when no
            cache directory is configured (process-wide; fine-tuning runs with equal shapes and σ
            then compile once).
    """

    def __init__(
        self,
        task: DomainTextTask,
        config: TextPipelineConfig,
        root: str | pathlib.Path,
        *,
        on_stage: Callable[[str], None] | None = None,
        compilation_cache: bool = True,
    ):
        self.task = task
        self.config = config
        self.root = pathlib.Path(root)
        self._on_stage = on_stage or (lambda name: None)
        self._trainers: dict[str, Trainer] = {}
        self._encoded: dict[str, list[list[int]]] = {}
        if compilation_cache and jax.config.jax_compilation_cache_dir is None:
            jax.config.update("jax_compilation_cache_dir", str(self.root.absolute() / "xla_cache"))

    # ------------------------------------------------------------------ tokens
    @functools.cached_property
    def tokenizer(self) -> TextTokenizer:
        """GPT-2's tokenizer, or a BPE trained on the public documents only (stored at
        `root/tokenizer.json`, shared by every seed)."""
        if self.config.tokenizer == "gpt2":
            return gpt2_tokenizer()
        path = self.root / "tokenizer.json"
        if not path.exists():
            self._on_stage("tokenizer")
            self.root.mkdir(parents=True, exist_ok=True)
            public = (doc for docs in self.task.public_domains.values() for doc in docs)
            trained = train_bpe_tokenizer(public, vocab_size=self.config.vocab_size)
            trained.save(path.with_suffix(".tmp")).replace(path)
        return TextTokenizer.from_file(path)

    @functools.cached_property
    def _public_tokens(self) -> list[list[np.ndarray]]:
        return [
            [np.asarray(t, np.int32) for t in self.tokenizer.encode_batch(list(docs))]
            for docs in self.task.public_domains.values()
        ]

    def _tokens(self, split: Split) -> list[list[int]]:
        """Token ids of a sensitive split's documents (empty documents get one end-of-text)."""
        if split not in self._encoded:
            encoded = self.tokenizer.encode_batch(list(getattr(self.task, split).texts))
            self._encoded[split] = [ids or [self.tokenizer.eos_id] for ids in encoded]
        return self._encoded[split]

    def _packed_rows(self, split: Split, rows: np.ndarray, seq_len: int):
        """The documents at `rows` packed per unit (user, or document at example level) into
        rows of `seq_len`: `(tokens, mask, unit id per row)`; no row mixes two units."""
        documents = getattr(self.task, split)
        tokens = self._tokens(split)
        packed = pack_sequences(
            [tokens[i] for i in rows],
            seq_len=seq_len,
            eos_id=self.tokenizer.eos_id,
            group_ids=np.asarray(documents.user_ids)[rows],
        )
        return packed.tokens, packed.mask, packed.group_ids

    # ------------------------------------------------------------------ stages
    def _store(self, seed: int) -> common.StageStore:
        return common.StageStore(self.root / f"seed{seed}")

    def split(self, seed: int) -> tuple[np.ndarray, np.ndarray]:
        """Disjoint (D_mix, D_ft) positions of the sensitive train split, user-disjoint at user
        level; with sequential composition both are the whole split."""
        if self.config.composition == "sequential":
            everything = np.arange(len(self.task.train))
            return everything, everything
        user_level = self.config.level == "user"

        def compute():
            self._on_stage("split")
            mix, ft = common.split_mixture(
                len(self.task.train),
                self.config.mix_fraction,
                seed=seed,
                group_ids=self.task.train.user_ids if user_level else None,
            )
            return {"mix": mix, "ft": ft}

        stored = self._store(seed).json("split", compute)
        return np.asarray(stored["mix"], np.int64), np.asarray(stored["ft"], np.int64)

    def _public_trainer(self, name: str, config: TrainConfig, spec: LanguageModelSpec) -> Trainer:
        """One public `Trainer` per role, compiled once and reused for every model it trains."""
        if name not in self._trainers:
            model = spec.build(self.tokenizer.vocab_size, seed=0, load=False)
            loss = losses.next_token_nll(mask_key="mask" if name == "proxy" else None)
            self._trainers[name] = Trainer(config, model, loss)
        return self._trainers[name]

    def _fit_public(self, stage: str, name: str, seed: int, trainer: Trainer, model, data) -> GPT2:
        """Trains `model` with the shared `trainer`, checkpointed under `seed{seed}/name`."""
        checkpointer = Checkpointer(self._store(seed).path(name))
        if checkpointer.latest_step() != trainer.config.steps:
            self._on_stage(stage)
        _, params, _, _ = split_model(model)
        start = TrainState(jnp.zeros((), jnp.int32), params, trainer.optimizer.init(params))
        rng = np.random.default_rng(_derived_seed(seed, name))
        result = fit(trainer, data, rng=rng, state=start, checkpointer=checkpointer)
        checkpointer.close()
        return result.model

    def proxies(self, seed: int) -> list[GPT2]:
        """One proxy LM per public domain, trained on that domain's documents only."""
        spec = self.config.proxy_model
        trainer = self._public_trainer("proxy", self.config.proxy, spec)
        eos = self.tokenizer.eos_id
        models = []
        for index, (name, tokens) in enumerate(
            zip(self.task.domain_names, self._public_tokens, strict=True)
        ):
            packed = pack_sequences(tokens, seq_len=spec.seq_len, eos_id=eos)
            data = IndexedData(
                gather=_row_gather(packed.tokens, packed.mask), num_examples=len(packed.tokens)
            )
            model = spec.build(self.tokenizer.vocab_size, seed=_derived_seed(seed, "proxy", name))
            models.append(self._fit_public("proxy", f"proxy_{index}", seed, trainer, model, data))
        return models

    def proxy_outputs(self, seed: int) -> tuple[np.ndarray, np.ndarray]:
        """`(L, T)` on D_mix: L[j, i] the total log-probability of document j under proxy i,
        T[j] its scored tokens (documents cut to the proxy's length).

        Privacy: computed from the sensitive documents of D_mix; consumed only by the accounted
        mixture stage (and by the non-private MixMin baseline, which is labelled as such).
        """

        def compute():
            models = self.proxies(seed)
            mix, _ = self.split(seed)
            self._on_stage("proxy_outputs")
            all_tokens = self._tokens("train")
            tokens, mask, _ = _scored_documents(
                [all_tokens[i] for i in mix],
                seq_len=self.config.proxy_model.seq_len,
                eos_id=self.tokenizer.eos_id,
            )
            log_probs, counts = sequence_proxy_outputs(
                models,
                _row_gather(tokens, mask),
                len(mix),
                batch_size=self.config.eval_batch_size,
            )
            return {"log_probs": log_probs, "token_counts": counts}

        name = f"proxy_outputs_{self.config.composition}"
        stored = self._store(seed).json(name, compute)
        return np.asarray(stored["log_probs"]), np.asarray(stored["token_counts"])

    def _mixture_users(self, seed: int) -> np.ndarray | None:
        mix, _ = self.split(seed)
        return np.asarray(self.task.train.user_ids)[mix] if self.config.level == "user" else None

    def mixture(self, epsilon: float, seed: int) -> tuple[np.ndarray, accounting.PrivacyBudget]:
        """λ by DP-MixMin (`sequence` kind) on D_mix at (ε, δ), and its accountant's budget.

        Privacy: reads D_mix only through `dp_mixmin`: Poisson-sampled users (user level, up to
        G documents each, averaged then clipped) or documents, Gaussian noise, accounted.
        """
        mix_config = self.config.mixture

        def compute():
            log_probs, counts = self.proxy_outputs(seed)
            self._on_stage("mixture")
            result = dp_mixmin(
                log_probs,
                kind="sequence",
                lengths=counts,
                user_ids=self._mixture_users(seed),
                max_examples_per_user=mix_config.max_examples_per_user,
                epsilon=epsilon,
                delta=self.config.delta,
                steps=mix_config.steps,
                batch_size=mix_config.batch_size,
                clip_norm=mix_config.clip_norm,
                learning_rate=mix_config.learning_rate,
                seed=_derived_seed(seed, "mixture", f"{epsilon:g}"),
                solver=mix_config.solver,
                shift=mix_config.shift,
                accountant=mix_config.accountant,
            )
            return {
                "weights": result.weights,
                "spent": common.budget_to_json(
                    accounting.PrivacyBudget(result.epsilon, result.delta)
                ),
                "noise_multiplier": result.noise_multiplier,
                "sampling_rate": result.sampling_rate,
                "num_units": result.num_units,
                "ledger": result.ledger.state_dict(),
            }

        name = f"mixture_{self.config.composition}_eps{epsilon:g}"
        stored = self._store(seed).json(name, compute)
        return np.asarray(stored["weights"]), common.budget_from_json(stored["spent"])

    def nonprivate_weights(self, seed: int) -> np.ndarray:
        """λ by exact MixMin on D_mix. NOT private: the upper-bound baseline only."""

        def compute():
            log_probs, counts = self.proxy_outputs(seed)
            self._on_stage("nonprivate_mixture")
            weights = mixmin(
                log_probs,
                kind="sequence",
                lengths=counts,
                steps=self.config.mixture.nonprivate_steps,
            )
            return {"weights": np.asarray(weights)}

        name = f"mixture_nonprivate_{self.config.composition}"
        return np.asarray(self._store(seed).json(name, compute)["weights"])

    def pretrained(self, weights: np.ndarray | None, seed: int) -> GPT2:
        """The downstream LM pretrained on public documents drawn by λ (document i of a domain
        with probability λ_domain / size), or a fresh random initialisation for `weights=None`."""
        spec = self.config.model
        vocab = self.tokenizer.vocab_size
        if weights is None:
            return spec.build(vocab, seed=_derived_seed(seed, "model"), load=False)
        model = spec.build(vocab, seed=_derived_seed(seed, "model"))
        data = PackedMixture(
            self._public_tokens,
            weights,
            seq_len=spec.seq_len,
            batch_size=self.config.pretrain.batch_size,
            eos_id=self.tokenizer.eos_id,
        )
        trainer = self._public_trainer("pretrain", self.config.pretrain, spec)
        name = f"pretrain_{common.weights_key(weights)}"
        return self._fit_public(name, name, seed, trainer, model, data.batch)

    def _finetune_data(self, rows: np.ndarray) -> tuple[IndexedData, int]:
        """Train documents at `rows` as fine-tuning data, and the number of privacy units.

        User level: each user's documents packed into rows of their own (`user_ids` per row).
        Example level: one row per document (its first tokens), so a unit is one row.
        """
        seq_len, eos = self.config.model.seq_len, self.tokenizer.eos_id
        if self.config.level == "user":
            tokens, mask, users = self._packed_rows("train", rows, seq_len)
            data = IndexedData(
                gather=_row_gather(tokens, mask), num_examples=len(tokens), user_ids=users
            )
            return data, len(np.unique(users))
        all_tokens = self._tokens("train")
        tokens, mask, _ = _scored_documents(
            [all_tokens[i] for i in rows], seq_len=seq_len, eos_id=eos
        )
        return IndexedData(gather=_row_gather(tokens, mask), num_examples=len(rows)), len(rows)

    def finetune(
        self, init: GPT2, init_name: str, part: str, epsilon: float, seed: int
    ) -> tuple[GPT2, accounting.PrivacyBudget]:
        """DP fine-tuning from `init` on D_ft (`part="ft"`) or the whole train split (`"all"`).

        Privacy: DP-SGD at (ε, δ) on the chosen part, at the configured level (user level:
        Poisson-sampled users, up to G rows each, averaged, clipped); the returned budget is the
        ledger's for the steps executed (restored, not re-spent, on resume). The noise key is
        distinct for every (init, part, ε) and derived from the secret run seed.
        """
        _, ft = self.split(seed)
        rows = ft if part == "ft" else np.arange(len(self.task.train))
        part = f"{part}_{self.config.composition}" if part == "ft" else part
        config = dataclasses.replace(self.config.finetune, epsilon=epsilon, delta=self.config.delta)
        name = f"finetune_{init_name}_{part}_eps{epsilon:g}"
        checkpointer = Checkpointer(self._store(seed).path(name))
        if checkpointer.latest_step() != config.steps:
            self._on_stage("finetune")
        data, num_units = self._finetune_data(rows)
        last = self.config.finetune_last_blocks
        trainer = Trainer(
            config,
            init,
            losses.next_token_nll(mask_key="mask"),
            trainable_mask=None if last is None else trainable_mask(init, last_n_blocks=last),
            num_units=num_units,
            noise_key=jax.random.key(_derived_seed(seed, name)),
        )
        rng = np.random.default_rng(_derived_seed(seed, name, "sampler"))
        result = fit(trainer, data, rng=rng, checkpointer=checkpointer)
        checkpointer.close()
        return result.model, result.ledger.budget(self.config.delta, config.accountant)

    def perplexity(self, model: GPT2, split: Split) -> float:
        """Perplexity of the LM on a sensitive split's documents, packed per unit (test or
        validation users). Evaluation only, not released."""
        documents = getattr(self.task, split)
        tokens, mask, _ = self._packed_rows(
            split, np.arange(len(documents)), self.config.model.seq_len
        )
        return evaluate.perplexity(
            model,
            _row_gather(tokens, mask),
            len(tokens),
            batch_size=self.config.eval_batch_size,
        )

    # ------------------------------------------------------------------ methods
    def run(self, method: common.Method, epsilon: float, seed: int) -> common.RunResult:
        """One method at target ε (end to end) and one seed; stored, so a rerun is free."""
        accounting.check_epsilon(epsilon)
        if method not in common.METHODS:
            raise ValueError(f"method must be one of {common.METHODS}, got {method!r}.")
        name = f"run_{method}_{self.config.composition}_eps{epsilon:g}"
        stored = self._store(seed).json(name, lambda: self._run(method, epsilon, seed).to_json())
        return _result_from_json(stored, self.config.delta)

    def _run(self, method: str, epsilon: float, seed: int) -> common.RunResult:
        delta, composition = self.config.delta, self.config.composition
        if method == "random_search":
            return self._random_search(epsilon, seed)
        if method == "dp_mixmin":
            mix_epsilon, ft_epsilon = common.stage_epsilons(
                epsilon, composition, self.config.sequential_mixture_share
            )
            weights, mix_budget = self.mixture(mix_epsilon, seed)
            part = "ft"
        else:
            mix_budget, ft_epsilon = None, epsilon
            part = "all"
            weights = {
                "uniform": np.full(self.task.k, 1.0 / self.task.k),
                "random_init": None,
                "nonprivate_mixmin": (
                    self.nonprivate_weights(seed) if method == "nonprivate_mixmin" else None
                ),
            }[method]
        init = self.pretrained(weights, seed)
        model, ft_budget = self.finetune(init, common.weights_key(weights), part, ft_epsilon, seed)
        stages = {"finetune": ft_budget}
        if mix_budget is not None:
            stages["mixture"] = mix_budget
        return common.RunResult(
            method=method,
            epsilon=epsilon,
            delta=delta,
            seed=seed,
            utility=self.perplexity(model, "test"),
            weights=None if weights is None else [float(w) for w in weights],
            spent=common.end_to_end_budget(stages, composition),
            stages=stages,
            composition=composition,
            private=method != "nonprivate_mixmin",
        )

    def _random_search(self, epsilon: float, seed: int) -> common.RunResult:
        candidates = common.dirichlet_candidates(
            self.task.k, self.config.random_search_candidates, seed=seed
        )
        scored = []
        for weights in candidates:
            init = self.pretrained(weights, seed)
            model, budget = self.finetune(init, common.weights_key(weights), "ft", epsilon, seed)
            scored.append((self.perplexity(model, "val"), weights, model, budget))
        val_ppl, weights, model, _ = min(scored, key=lambda item: item[0])
        # All m candidates were fine-tuned on the same D_ft: what ran is their sequential
        # composition, and the selection on validation data is not accounted at all.
        spent = accounting.compose_sequential(*(s[3] for s in scored))
        return common.RunResult(
            method="random_search",
            epsilon=epsilon,
            delta=self.config.delta,
            seed=seed,
            utility=self.perplexity(model, "test"),
            weights=[float(w) for w in weights],
            spent=spent,
            stages={"finetune": spent},
            composition=self.config.composition,
            private=False,
            extra={
                "validation_perplexities": [s[0] for s in scored],
                "selected_validation_perplexity": val_ppl,
            },
        )
