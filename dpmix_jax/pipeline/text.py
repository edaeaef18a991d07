"""DP-MixMin end to end for text domains (the Enron and OpenWebMath settings).

k public domains (Common Pile sources; in the embedded default five BBC topics, Python code and
Python docs) each hold their own documents; the sensitive corpus is documents with authors (Enron
sent mail: user-level DP, a user's whole mail is one unit) or without (OpenWebMath: example-level
DP, one document is one unit; such tasks give every document its own user id). Stages, each
stored so that a rerun skips it:

0. a byte-level BPE tokenizer trained on the public documents only (or GPT-2's own, or the
   pretrained model's own), shared by every seed: it never sees sensitive text;
1. split the sensitive train split into disjoint D_mix (fraction ρ of the users, or of the
   documents at example level) and D_ft;
2. train one GPT-2 proxy per public domain on that domain's documents;
3. cache the `sequence` proxy outputs on D_mix: L[j, i] = log p_i(document j), with T_j its
   scored tokens (each document scored from an end-of-text context, cut to the proxy's length);
4. learn λ with `mixing.dp_mixmin(kind="sequence")` at (ε, δ) on D_mix (user level: users
   Poisson-sampled, up to G of their documents each, averaged, clipped);
5. pretrain the downstream LM on public documents drawn by λ (`train.pretrain.PackedMixture`):
   a GPT-2 from scratch, or a pretrained public model such as SmolLM2-135M trained further;
6. DP-fine-tune it on D_ft: user level, each user's documents packed into rows of their own and a
   Poisson-sampled user contributing up to G rows; example level, one row per document;
7. evaluate perplexity on the test users' documents (packed per user), lower is better.
The end-to-end budget is the parallel composition of stages 4 and 6 (disjoint users), or with
`composition="sequential"` both stages run on the whole train split with ε split between them and
the end-to-end ε is the accountant's for both stages' events composed. Baselines run through
the same stages (see `results.METHOD_NOTES`).

API (the task and its adapters live in `text_data` and are re-exported here):
    DomainTextTask, from_builtin, from_user_documents, from_enron, from_document_files,
    documents_as_units, require_paths                   (see `pipeline.text_data`)
    LanguageModelSpec(*, config, weights=None)          a GPT-2        (see `pipeline.text_models`)
    PretrainedModelSpec(*, name, seq_len)               "smollm2", a .gguf file, a model folder
    TextPipelineConfig(*, level, mix_fraction, ..., proxy, mixture, pretrain, finetune)
    TextPipeline(task, config, root, *, on_stage=None, reproducible=False)
        .run(method, epsilon, seed) -> RunResult       (and the stages: split, tokenizer,
        proxies, proxy_outputs, mixture, nonprivate_weights, pretrained, finetune, utility)
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import pathlib
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dpmix_jax.data.text import document_tokens, pack_sequences
from dpmix_jax.data.tokenizer import TextTokenizer, gpt2_tokenizer, train_bpe_tokenizer
from dpmix_jax.models import lora
from dpmix_jax.pipeline.budget import Composition, check_allow_large_delta, stage_epsilons
from dpmix_jax.pipeline.mixture_config import MixtureConfig
from dpmix_jax.pipeline.mixture_pipeline import MixturePipeline
from dpmix_jax.pipeline.splits import derived_seed
from dpmix_jax.pipeline.stage_store import StageStore, weights_key
from dpmix_jax.pipeline.text_data import (
    DomainTextTask,
    documents_as_units,
    from_builtin,
    from_document_files,
    from_enron,
    from_user_documents,
    require_paths,
)
from dpmix_jax.pipeline.text_models import (
    LanguageModelSpec,
    PretrainedModelSpec,
    last_blocks_mask,
)
from dpmix_jax.privacy import validation
from dpmix_jax.train import Checkpointer, IndexedData, TrainConfig, Trainer, evaluate, fit, losses
from dpmix_jax.train.engine import TrainState, split_model
from dpmix_jax.train.pretrain import PackedMixture
from dpmix_jax.train.proxies import sequence_proxy_outputs

Level = Literal["user", "example"]
TokenizerKind = Literal["bpe", "gpt2", "model"]
ModelSpec = LanguageModelSpec | PretrainedModelSpec
Split = Literal["train", "val", "test"]
Role = Literal["proxy", "model"]

__all__ = [
    "DomainTextTask",
    "LanguageModelSpec",
    "PretrainedModelSpec",
    "Level",
    "TextPipeline",
    "TextPipelineConfig",
    "documents_as_units",
    "from_builtin",
    "from_document_files",
    "from_enron",
    "from_user_documents",
    "require_paths",
]


# ------------------------------------------------------------------------------------------
# Settings
# ------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class TextPipelineConfig:
    """Public settings of the text pipeline.

    Attributes:
        delta: δ of each private stage; below 1/n for the n units of each private stage
            (checked before any work) unless `allow_large_delta`.
        allow_large_delta: accept δ >= 1/n; every result of the run records it.
        level: "user" (a user's documents are one unit) or "example" (a document is one unit).
        mix_fraction: ρ, the fraction of the train users (documents) given to the mixture stage.
        composition: "parallel" (disjoint D_mix, D_ft: max) or "sequential" (no split; sum).
        sequential_mixture_share: with sequential composition, the mixture stage's share of ε.
        tokenizer: "bpe" (a byte-level BPE trained on the public documents), "gpt2", or
            "model": the tokenizer of `model`, a `PretrainedModelSpec` (required with one).
        vocab_size: the BPE vocabulary size ("bpe" only).
        proxy_model: the per-domain proxy LM (a GPT-2 trained from scratch on the pipeline's
            tokenizer).
        model: the downstream LM: a GPT-2 (`LanguageModelSpec`) or a pretrained public model
            (`PretrainedModelSpec`, e.g. SmolLM2-135M), pretrained further on the λ-mixture and
            fine-tuned privately.
        proxy: public training of each proxy (rows of `proxy_model.seq_len` tokens).
        shared_proxies: train the k proxies once (seed 0, under `root/proxies`) and use them for
            every seed, instead of a proxy set per seed. They see public data only, so sharing
            costs no privacy; seeds then vary everything but the proxies.
        mixture: the DP-MixMin stage (`max_examples_per_user` is G at user level).
        pretrain: public pretraining on the λ-mixture of documents.
        finetune: private fine-tuning (`level` and G as above); its `epsilon` and `delta` are
            replaced by each run's.
        finetune_last_blocks: train only the last this-many blocks and the (tied) head during
            fine-tuning (the paper: 2); None trains every parameter.
        finetune_lora: fine-tune LoRA adapters (`models.lora`) added to the pretrained model
            instead: only the adapters train (the pretrained weights stay frozen); needs
            `finetune_last_blocks=None`.
        random_search_candidates: m, the Random Search baseline's number of Dirichlet(1) draws.
        eval_batch_size: rows per evaluation batch.
    """

    delta: float = 1e-5
    allow_large_delta: bool = False
    level: Level = "user"
    mix_fraction: float = 0.3
    composition: Composition = "parallel"
    sequential_mixture_share: float = 0.1
    tokenizer: TokenizerKind = "bpe"
    vocab_size: int = 512
    proxy_model: LanguageModelSpec
    model: ModelSpec
    proxy: TrainConfig
    shared_proxies: bool = False
    mixture: MixtureConfig
    pretrain: TrainConfig
    finetune: TrainConfig
    finetune_last_blocks: int | None = None
    finetune_lora: lora.LoraConfig | None = None
    random_search_candidates: int = 4
    eval_batch_size: int = 32

    def __post_init__(self) -> None:
        validation.check_delta(self.delta)
        check_allow_large_delta(self.allow_large_delta)
        if self.level not in ("user", "example"):
            raise ValueError(f"level must be 'user' or 'example', got {self.level!r}.")
        if not 0 < self.mix_fraction < 1:
            raise ValueError(f"mix_fraction must be in (0, 1), got {self.mix_fraction!r}.")
        stage_epsilons(1.0, self.composition, self.sequential_mixture_share)
        if self.tokenizer not in ("bpe", "gpt2", "model"):
            raise ValueError(f"tokenizer must be 'bpe', 'gpt2' or 'model', got {self.tokenizer!r}.")
        if not isinstance(self.proxy_model, LanguageModelSpec):
            raise ValueError("proxy_model must be a LanguageModelSpec (a GPT-2 trained here).")
        if not isinstance(self.model, LanguageModelSpec | PretrainedModelSpec):
            raise ValueError("model must be a LanguageModelSpec or a PretrainedModelSpec.")
        if (self.tokenizer == "model") != isinstance(self.model, PretrainedModelSpec):
            raise ValueError(
                "tokenizer='model' goes with a PretrainedModelSpec model, and a pretrained "
                f"model needs its own tokenizer; got tokenizer={self.tokenizer!r} and a "
                f"{type(self.model).__name__}."
            )
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
        last = self.finetune_last_blocks
        if last is not None and not (isinstance(last, int) and not isinstance(last, bool)):
            raise ValueError(f"finetune_last_blocks must be None or an integer, got {last!r}.")
        # A pretrained model's depth is known once it loads (`finetune_trainer` checks it then).
        gpt2_depth = self.model.num_blocks if isinstance(self.model, LanguageModelSpec) else None
        if last is not None and gpt2_depth is not None and not 0 <= last <= gpt2_depth:
            raise ValueError(
                f"finetune_last_blocks must be None or an integer in [0, {gpt2_depth}], got "
                f"{last!r}."
            )
        if self.finetune_lora is not None and (
            not isinstance(self.finetune_lora, lora.LoraConfig)
            or self.finetune_last_blocks is not None
        ):
            raise ValueError(
                "finetune_lora must be a LoraConfig, with finetune_last_blocks=None (the "
                "adapters alone train)."
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
    every kept token is scored (`losses.sequence_log_prob` skips position 0).

    Privacy: a fixed per-document map (no privacy cost); on sensitive documents its rows are read
    only by accounted stages or evaluation.
    """
    layout = document_tokens(token_lists, max_len=seq_len - 1, eos_id=eos_id)
    column = np.ones((len(token_lists), 1), dtype=bool)
    tokens = np.concatenate([np.full_like(column, eos_id, dtype=np.int32), layout.targets], 1)
    return tokens, np.concatenate([column, layout.mask], axis=1), layout.token_counts


# ------------------------------------------------------------------------------------------
# The pipeline
# ------------------------------------------------------------------------------------------


class TextPipeline(MixturePipeline):
    """DP-MixMin and its baselines on one `DomainTextTask`, with stages stored under `root`.

    Args:
        task: the data.
        config: public settings.
        root: directory of the stage store (the tokenizer at the top, one sub-directory per
            seed).
        on_stage: called with a stage name whenever a stage is computed (not when it is loaded);
            for progress reports and tests.
        reproducible: seed the private randomness from each run's seed (see
            `MixturePipeline`); default secret.
    """

    def __init__(
        self,
        task: DomainTextTask,
        config: TextPipelineConfig,
        root: str | pathlib.Path,
        *,
        on_stage: Callable[[str], None] | None = None,
        reproducible: bool = False,
    ):
        super().__init__(task, config, root, on_stage=on_stage, reproducible=reproducible)
        self._trainers: dict[str, Trainer] = {}
        self._encoded: dict[tuple[Split, Role], list[list[int]]] = {}
        self._public_encoded: dict[Role, list[list[np.ndarray]]] = {}

    higher_is_better = False

    @property
    def k(self) -> int:
        return self.task.k

    # ------------------------------------------------------------------ tokens
    @functools.cached_property
    def tokenizer(self) -> TextTokenizer:
        """The downstream model's tokenizer: GPT-2's, the pretrained model's own, or a BPE
        trained on the public documents only (`_public_bpe`)."""
        if self.config.tokenizer == "gpt2":
            return gpt2_tokenizer()
        if self.config.tokenizer == "model":
            return self.config.model.tokenizer
        return self._public_bpe()

    @functools.cached_property
    def proxy_tokenizer(self) -> TextTokenizer:
        """The proxies' tokenizer: the pipeline's, except beside a pretrained model, whose
        vocabulary (49,152 tokens for SmolLM2) would dwarf a small proxy: then a BPE of
        `vocab_size` trained on the public documents. The proxies' log-probabilities of a
        document do not depend on the downstream model's tokenizer."""
        return self._public_bpe() if self.config.tokenizer == "model" else self.tokenizer

    def _public_bpe(self) -> TextTokenizer:
        """A BPE of `vocab_size` trained on the public documents only (stored at
        `tokenizer.json` in the settings folder, shared by every seed)."""
        path = self.settings_folder() / "tokenizer.json"
        if not path.exists():
            self._on_stage("tokenizer")
            public = (doc for docs in self.task.public_domains.values() for doc in docs)
            trained = train_bpe_tokenizer(public, vocab_size=self.config.vocab_size)
            trained.save(path.with_suffix(".tmp")).replace(path)
            path.chmod(0o600)
        return TextTokenizer.from_file(path)

    def _tokenizer(self, role: Role) -> TextTokenizer:
        return self.proxy_tokenizer if role == "proxy" else self.tokenizer

    def _public_tokens(self, role: Role) -> list[list[np.ndarray]]:
        """Token ids of every public domain's documents, by the `role`'s tokenizer."""
        if role not in self._public_encoded:
            tokenizer = self._tokenizer(role)
            self._public_encoded[role] = [
                [np.asarray(t, np.int32) for t in tokenizer.encode_batch(list(docs))]
                for docs in self.task.public_domains.values()
            ]
        return self._public_encoded[role]

    def _tokens(self, split: Split, role: Role = "model") -> list[list[int]]:
        """Token ids of a sensitive split's documents by the `role`'s tokenizer (empty
        documents get one end-of-text).

        Privacy: a per-document map with a tokenizer fitted on public text only.
        """
        if (split, role) not in self._encoded:
            tokenizer = self._tokenizer(role)
            encoded = tokenizer.encode_batch(list(getattr(self.task, split).texts))
            self._encoded[split, role] = [ids or [tokenizer.eos_id] for ids in encoded]
        return self._encoded[split, role]

    def _packed_rows(self, split: Split, rows: np.ndarray, seq_len: int):
        """The documents at `rows` packed per unit (user, or document at example level) into
        rows of `seq_len`: `(tokens, mask, unit id per row)`.

        Privacy: no row mixes two units, so a unit's rows are exactly its contribution.
        """
        documents = getattr(self.task, split)
        tokens = self._tokens(split)
        packed = pack_sequences(
            [tokens[i] for i in rows],
            seq_len=seq_len,
            eos_id=self.tokenizer.eos_id,
            group_ids=np.asarray(documents.user_ids)[rows],
        )
        return packed.tokens, packed.mask, packed.group_ids

    def data_digest(self) -> str:
        """SHA-256 (hex) of every public domain's documents and every sensitive split's
        documents with their authors.

        Privacy: a digest of sensitive documents, kept owner-only (see `MixturePipeline`).
        """
        digest = hashlib.sha256()

        def add(texts: Sequence[str]) -> None:
            digest.update(f"{len(texts)}/".encode())
            for text in texts:
                digest.update(hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest())

        for domain, documents in self.task.public_domains.items():
            add([domain])
            add(list(documents))
        for split in ("train", "val", "test"):
            documents = getattr(self.task, split)
            add([split])
            add(documents.texts)
            add([documents.users[u] for u in documents.user_ids])
        return digest.hexdigest()

    # ------------------------------------------------------------------ stages
    def settings(self) -> dict[str, Any]:
        """`MixturePipeline.settings` and the digest of the downstream model's starting weights,
        so that stages are never read back for a checkpoint whose content changed."""
        return {**super().settings(), "model_weights": self.config.model.identity()}

    def split_unit_ids(self) -> list[str]:
        """Each document's user name at user level (D_mix and D_ft are then user-disjoint), its
        text at example level: identifiers that depend on the unit alone."""
        train = self.task.train
        if self.config.level == "user":
            return [train.users[u] for u in train.user_ids]
        return list(train.texts)

    def _public_trainer(self, name: str, config: TrainConfig, spec: ModelSpec) -> Trainer:
        """One public `Trainer` per role, compiled once and reused for every model it trains."""
        if name not in self._trainers:
            role = "proxy" if name == "proxy" else "model"
            model = spec.build(self._tokenizer(role).vocab_size, seed=0, load=False)
            loss = losses.next_token_nll(mask_key="mask" if name == "proxy" else None)
            self._trainers[name] = Trainer(config, model, loss)
        return self._trainers[name]

    def _fit_public(
        self, stage: str, directory: pathlib.Path, seed: int, trainer: Trainer, model, data
    ) -> nnx.Module:
        """Trains `model` with the shared `trainer`, checkpointed in `directory`."""
        checkpointer = Checkpointer(directory)
        if checkpointer.latest_step() != trainer.config.steps:
            self._on_stage(stage)
        _, params, _, _ = split_model(model)
        params = jax.tree.map(jnp.copy, params)  # fit consumes its state; `model` keeps its own
        start = TrainState(jnp.zeros((), jnp.int32), params, trainer.optimizer.init(params))
        rng = np.random.default_rng(derived_seed(seed, directory.name))
        result = fit(
            trainer, data, rng=rng, state=start, checkpointer=checkpointer, on_step=self._on_step
        )
        checkpointer.close()
        return result.model

    def proxies(self, seed: int) -> list[nnx.Module]:
        """One proxy LM per public domain, trained on that domain's documents only (the seed's
        own set, or with `shared_proxies` the set of seed 0 under `proxies/` in the settings
        folder)."""
        if self.config.shared_proxies:
            seed, store = 0, StageStore(self.settings_folder() / "proxies")
        else:
            store = self._store(seed)
        spec = self.config.proxy_model
        trainer = self._public_trainer("proxy", self.config.proxy, spec)
        tokenizer = self.proxy_tokenizer
        models = []
        for index, (domain, tokens) in enumerate(
            zip(self.task.source_names, self._public_tokens("proxy"), strict=True)
        ):
            packed = pack_sequences(tokens, seq_len=spec.seq_len, eos_id=tokenizer.eos_id)
            data = IndexedData(
                gather=_row_gather(packed.tokens, packed.mask), num_examples=len(packed.tokens)
            )
            model = spec.build(tokenizer.vocab_size, seed=derived_seed(seed, "proxy", domain))
            models.append(
                self._fit_public("proxy", store.path(f"proxy_{index}"), seed, trainer, model, data)
            )
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
            all_tokens = self._tokens("train", "proxy")
            tokens, mask, _ = _scored_documents(
                [all_tokens[i] for i in mix],
                seq_len=self.config.proxy_model.seq_len,
                eos_id=self.proxy_tokenizer.eos_id,
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
        """User id of each D_mix document at user level (the unit `dp_mixmin` samples), else None.

        Privacy: user ids only decide the grouping, which is what user-level DP protects.
        """
        mix, _ = self.split(seed)
        return np.asarray(self.task.train.user_ids)[mix] if self.config.level == "user" else None

    def mixture_inputs(self, seed: int) -> dict[str, Any]:
        """The `sequence` proxy outputs on D_mix (with token counts, and user ids at user level),
        as `dp_mixmin` / `mixmin` arguments."""
        log_probs, counts = self.proxy_outputs(seed)
        return {
            "preds": log_probs,
            "kind": "sequence",
            "lengths": counts,
            "user_ids": self._mixture_users(seed),
        }

    def pretrained(self, weights: np.ndarray | None, seed: int) -> nnx.Module:
        """The downstream LM pretrained on public documents drawn by λ (document i of a domain
        with probability λ_domain / size), or a fresh random initialisation for `weights=None`.
        A pretrained public model (`PretrainedModelSpec`) starts from its own weights and is
        trained further on the mixture; its Random Init is its architecture at random."""
        spec = self.config.model
        vocab = self.tokenizer.vocab_size
        if weights is None:
            return spec.build(vocab, seed=derived_seed(seed, "model"), load=False)
        model = spec.build(vocab, seed=derived_seed(seed, "model"))
        data = PackedMixture(
            self._public_tokens("model"),
            weights,
            seq_len=spec.seq_len,
            batch_size=self.config.pretrain.batch_size,
            eos_id=self.tokenizer.eos_id,
        )
        trainer = self._public_trainer("pretrain", self.config.pretrain, spec)
        name = f"pretrain_{weights_key(weights)}"
        directory = self._store(seed).path(name)
        return self._fit_public(name, directory, seed, trainer, model, data.batch)

    def _finetune_data(self, rows: np.ndarray) -> tuple[IndexedData, int]:
        """Train documents at `rows` as fine-tuning data, and the number of privacy units.

        User level: each user's documents packed into rows of their own (`user_ids` per row).
        Example level: one row per document (its first tokens), so a unit is one row.

        Privacy: the rows are read only by the accounted DP-SGD of `finetune`.
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

    def finetune_trainer(
        self, init: nnx.Module, config: TrainConfig, rows: np.ndarray, noise_key: jax.Array
    ) -> tuple[Trainer, IndexedData]:
        """DP-SGD on the next-token loss of the train documents at `rows` (`_finetune_data`),
        training the last `finetune_last_blocks` blocks, LoRA adapters added to a copy of `init`
        (`finetune_lora`; their A matrices drawn from seed 0), or everything.

        Privacy: at user level Poisson-sampled users, up to G rows each, averaged and clipped;
        `num_units` counts the users (or documents) among `rows`.
        """
        data, num_units = self._finetune_data(rows)
        last = self.config.finetune_last_blocks
        mask = None if last is None else last_blocks_mask(init, last)
        if self.config.finetune_lora is not None:
            init = lora.add_lora(nnx.clone(init), self.config.finetune_lora, rngs=nnx.Rngs(0))
            mask = lora.trainable_mask(init)
        trainer = Trainer(
            config,
            init,
            losses.next_token_nll(mask_key="mask"),
            trainable_mask=mask,
            num_units=num_units,
            noise_key=noise_key,
        )
        return trainer, data

    def utility(self, model: nnx.Module, split: Split) -> float:
        """Perplexity of the LM on a sensitive split's documents, packed per unit (test or
        validation users).

        Privacy: evaluation on held-out users; not accounted, so releasing it (or choosing by it,
        as random search does on validation users) is not covered by the run's ε.
        """
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
