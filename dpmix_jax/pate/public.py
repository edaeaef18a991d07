"""Public language models for private generation: load, store, train, and decode from them.

A `PublicTextModel` is a Flax GPT-2 with its tokenizer. It comes from

* a transformers GPT-2 checkpoint folder (`config.json` with `model_type` "gpt2", the weights as
  `model.safetensors` or `pytorch_model.bin`, and the folder's tokenizer: `tokenizer.json`, or
  `vocab.json` + `merges.txt`), converted by `GPT2.from_pretrained`;
* a folder written by `save_public_model` (`dpmix_model.json`, `params.npz`, `tokenizer.json`);
* `text_default_model`: a byte-level BPE and a small GPT-2 trained on the public domains of the
  embedded text default, stored in a stage folder and read back by later calls.

Nothing downloads. The helpers below are the public side of Hot PATE decoding: the fallback
model (`make_public_model`), the stop tokens of a line (`newline_tokens`), the decoded text with
fallback tokens marked (`marked_text`), and the sentences a corpus is cut into
(`split_sentences`).

Privacy:
    Everything here reads public data only (public documents, public checkpoints).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import pathlib
import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tokenizers import Tokenizer

from dpmix_jax.data.tokenizer import EOS_TOKEN, TextTokenizer, load_bpe_tokenizer

if TYPE_CHECKING:
    from dpmix_jax.models.gpt2 import GPT2, GPT2Config

__all__ = [
    "PublicTextModel",
    "TextDefaultModel",
    "heldout_perplexity",
    "load_public_model",
    "make_public_model",
    "marked_text",
    "newline_tokens",
    "save_public_model",
    "split_public",
    "split_sentences",
    "text_default_model",
    "train_public_gpt2",
]

_STORED_CONFIG = "dpmix_model.json"
_SENTENCE_BREAK = re.compile(r"(?<=[.!?])\s+|\n+")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PublicTextModel:
    """A public GPT-2 and its tokenizer.

    Attributes:
        model: the Flax GPT-2 (`dpmix_jax.models.gpt2.GPT2`).
        tokenizer: its byte-level BPE tokenizer (ids below the model's vocabulary size).
        source: where it came from (a folder, or the text default's settings), for reports.
    """

    model: GPT2
    tokenizer: TextTokenizer
    source: str

    def __post_init__(self):
        vocab = int(self.model.config.vocab_size)
        if self.tokenizer.vocab_size > vocab:
            raise ValueError(
                f"the tokenizer has {self.tokenizer.vocab_size} tokens but the model only "
                f"{vocab} (of {self.source}); use the model's own tokenizer."
            )

    @property
    def context_length(self) -> int:
        """The model's positions (its longest input)."""
        return int(self.model.config.n_positions)


def _tokenizer_eos(folder: pathlib.Path) -> str:
    """The end-of-text token named by the folder's tokenizer settings (default <|endoftext|>)."""
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        path = folder / name
        if path.is_file():
            token = json.loads(path.read_text()).get("eos_token")
            if isinstance(token, dict):
                token = token.get("content")
            if isinstance(token, str) and token:
                return token
    return EOS_TOKEN


def _folder_tokenizer(folder: pathlib.Path) -> TextTokenizer:
    eos = _tokenizer_eos(folder)
    try:
        if (folder / "tokenizer.json").is_file():
            return TextTokenizer(Tokenizer.from_file(str(folder / "tokenizer.json")), eos)
        if (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file():
            return load_bpe_tokenizer(folder, eos_token=eos)
    except Exception as err:  # `tokenizers` raises its own exception type for a corrupt file
        raise ValueError(f"model folder {folder}: cannot read its tokenizer ({err})") from None
    raise ValueError(
        f"model folder {folder} has no tokenizer: tokenizer.json, or vocab.json and merges.txt, "
        "is missing"
    )


def load_public_model(folder: str | os.PathLike) -> PublicTextModel:
    """The GPT-2 and tokenizer stored in `folder` (a transformers checkpoint or ours).

    Raises:
        ValueError: one line naming what is missing or wrong: not a folder, no `config.json`
            nor `dpmix_model.json`, a `model_type` other than gpt2, no weights, no tokenizer.
    """
    from dpmix_jax.models.gpt2 import GPT2, GPT2Config

    path = pathlib.Path(folder)
    if not path.is_dir():
        raise ValueError(f"model folder {path} does not exist or is not a folder")
    if (path / _STORED_CONFIG).is_file():
        try:
            config = GPT2Config(**json.loads((path / _STORED_CONFIG).read_text()))
        except (json.JSONDecodeError, TypeError) as err:
            raise ValueError(f"{path / _STORED_CONFIG} is not a GPT-2 config ({err})") from None
        if not (path / "params.npz").is_file():
            raise ValueError(f"model folder {path} has {_STORED_CONFIG} but no params.npz")
        model = GPT2(config, rngs=nnx.Rngs(0))
        graphdef, state = nnx.split(model)
        leaves, treedef = jax.tree.flatten(state)
        with np.load(path / "params.npz") as stored:
            loaded = [stored[f"leaf{i}"] for i in range(len(stored.files))]
        if [a.shape for a in loaded] != [leaf.shape for leaf in leaves]:
            raise ValueError(f"{path / 'params.npz'} does not match {path / _STORED_CONFIG}")
        state = jax.tree.unflatten(treedef, [jnp.asarray(a) for a in loaded])
        return PublicTextModel(
            model=nnx.merge(graphdef, state), tokenizer=_folder_tokenizer(path), source=str(path)
        )
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(
            f"model folder {path} is not a GPT-2: config.json (a transformers checkpoint) or "
            f"{_STORED_CONFIG} (stored by dpmix) is missing"
        )
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{config_file} is not valid JSON ({err})") from None
    if not isinstance(config, dict) or config.get("model_type") != "gpt2":
        found = config.get("model_type") if isinstance(config, dict) else None
        raise ValueError(
            f"{config_file}: model_type is {found!r}; need a GPT-2 checkpoint (model_type gpt2)"
        )
    missing = [k for k in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head")
               if k not in config]  # fmt: skip
    if missing:
        raise ValueError(f"{config_file} lacks the GPT-2 fields {', '.join(missing)}")
    tokenizer = _folder_tokenizer(path)
    try:
        model = GPT2.from_pretrained(path)
    except ValueError as err:
        raise ValueError(f"model folder {path}: {err}") from None
    return PublicTextModel(model=model, tokenizer=tokenizer, source=str(path))


def save_public_model(public: PublicTextModel, folder: str | os.PathLike) -> pathlib.Path:
    """Writes `public` to `folder` (created) in the format `load_public_model` reads back."""
    path = pathlib.Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    config = public.model.config
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    fields = {k: (str(np.dtype(v)) if k in ("dtype", "param_dtype") else v)
              for k, v in fields.items()}  # fmt: skip
    public.tokenizer.save(path / "tokenizer.json")
    leaves = jax.tree.leaves(nnx.state(public.model))
    np.savez(path / "params.npz", **{f"leaf{i}": np.asarray(x) for i, x in enumerate(leaves)})
    if public.tokenizer.eos_token != EOS_TOKEN:
        (path / "special_tokens_map.json").write_text(
            json.dumps({"eos_token": public.tokenizer.eos_token})
        )
    (path / _STORED_CONFIG).write_text(json.dumps(fields, indent=1))
    return path


# --------------------------------------------------------------------------------------------
# Decoding helpers.
# --------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnums=0)
def _logits_at(graphdef, state, ids: jax.Array, position: jax.Array) -> jax.Array:
    return nnx.merge(graphdef, state)(ids)[0, position]


def make_public_model(model: GPT2, context: Sequence[int]) -> Callable[[Sequence[int]], jax.Array]:
    """The public fallback: the same GPT-2 given only the public `context` (no private records).

    Every call runs one row of the model's full `n_positions`, right-padded (the model is causal,
    so the padding never reaches the logits read), and all such models share one compiled
    function per model structure: decoding compiles once, not once per prefix length.
    """
    graphdef, state = nnx.split(model)
    context = [int(t) for t in context]
    width = int(model.config.n_positions)

    def last_logits(prefix: Sequence[int]) -> jax.Array:
        ids = [*context, *(int(t) for t in prefix)]
        if not 0 < len(ids) <= width:
            raise ValueError(
                f"the public context and prefix hold {len(ids)} tokens; the model reads 1 to "
                f"{width}"
            )
        row = np.zeros((1, width), np.int32)
        row[0, : len(ids)] = ids
        return _logits_at(graphdef, state, jnp.asarray(row), jnp.asarray(len(ids) - 1))

    return last_logits


def newline_tokens(tokenizer: TextTokenizer) -> tuple[int, ...]:
    """Ids of every vocabulary token whose text contains a newline."""
    return tuple(t for t in range(tokenizer.vocab_size) if "\n" in tokenizer.decode([t]))


def marked_text(tokenizer: TextTokenizer, tokens: Sequence[int], sources: Sequence[str]) -> str:
    """The decoded text with every run of public-fallback tokens in square brackets."""
    pieces, run, run_source = [], [], None
    for token, source in zip([*tokens, None], [*sources, None], strict=True):
        if source != run_source and run:
            text = tokenizer.decode(run)
            pieces.append(f"[{text}]" if run_source == "public" else text)
            run = []
        run_source = source
        if token is not None:
            run.append(int(token))
    return "".join(pieces)


def split_sentences(texts: Sequence[str], *, min_chars: int) -> list[str]:
    """Every sentence or line of `texts` with at least `min_chars` characters, stripped, in order.

    Privacy:
        The result is as sensitive as `texts`.
    """
    sentences = (s.strip() for text in texts for s in _SENTENCE_BREAK.split(text))
    return [s for s in sentences if len(s) >= min_chars]


# --------------------------------------------------------------------------------------------
# Training a public GPT-2 on public documents.
# --------------------------------------------------------------------------------------------


def split_public(
    documents: Sequence[Sequence[str]], every: int
) -> tuple[list[list[str]], list[list[str]]]:
    """Per domain: the training documents and the held-out ones (every `every`-th document)."""
    train = [[d for i, d in enumerate(docs) if i % every != every - 1] for docs in documents]
    heldout = [[d for i, d in enumerate(docs) if i % every == every - 1] for docs in documents]
    return train, heldout


def heldout_perplexity(
    model: GPT2, tokenizer: TextTokenizer, documents: Sequence[str], seq_len: int
) -> float:
    """Per-token perplexity of `model` on `documents` (each led by EOS, concatenated, cut into
    non-overlapping rows of `seq_len` tokens; every next token of a row is scored)."""
    stream = np.concatenate(
        [
            np.asarray([tokenizer.eos_id, *ids], np.int32)
            for ids in tokenizer.encode_batch(list(documents))
        ]
    )
    rows = stream[: len(stream) // seq_len * seq_len].reshape(-1, seq_len)
    if not len(rows):
        raise ValueError(f"held-out documents hold fewer than seq_len = {seq_len} tokens.")
    graphdef, state = nnx.split(model)

    @jax.jit
    def nll_sum(state, ids):
        logits = nnx.merge(graphdef, state)(ids)[:, :-1]
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        return -jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1).sum()

    total = sum(
        float(nll_sum(state, jnp.asarray(rows[s : s + 32]))) for s in range(0, len(rows), 32)
    )
    return float(np.exp(total / (rows.shape[0] * (seq_len - 1))))


def train_public_gpt2(
    model_config: GPT2Config,
    tokenizer: TextTokenizer,
    documents: Sequence[Sequence[str]],
    *,
    train_steps: int,
    batch_size: int,
    learning_rate: float,
    seed: int,
    on_log: Callable[[int, float], None] | None = None,
) -> tuple[GPT2, list[tuple[int, float]]]:
    """Trains a GPT-2 of `model_config` on public documents (one source per domain, uniform).

    Documents are packed into rows of `n_positions` tokens (`pretrain.PackedMixture`) and trained
    with the engine's public steps on the next-token loss; `on_log(step, loss)` sees every logged
    loss (5 in all). Returns the model and its logged (step, loss) pairs.

    Privacy:
        Public documents only: the steps are not private.
    """
    from dpmix_jax.models.gpt2 import GPT2
    from dpmix_jax.train import MetricLogger, TrainConfig, Trainer, fit, losses
    from dpmix_jax.train.pretrain import PackedMixture

    model = GPT2(model_config, rngs=nnx.Rngs(seed))
    sources = [
        [np.asarray(ids, np.int32) for ids in tokenizer.encode_batch(list(domain))]
        for domain in documents
    ]
    packed = PackedMixture(
        sources,
        np.full(len(sources), 1.0 / len(sources)),
        seq_len=model_config.n_positions,
        batch_size=batch_size,
        eos_id=tokenizer.eos_id,
    )
    train_config = TrainConfig(
        steps=train_steps,
        batch_size=batch_size,
        learning_rate=learning_rate,
        log_every=max(train_steps // 5, 1),
        progress=False,
    )
    trainer = Trainer(train_config, model, losses.next_token_nll(mask_key=None))
    logger = MetricLogger()

    def report(done: int, until: int) -> None:
        latest = logger.history[-1] if logger.history else None
        if on_log is not None and latest is not None and latest["step"] == done:
            on_log(done, latest["train_loss"])

    result = fit(
        trainer, packed.batch, rng=np.random.default_rng(seed), logger=logger, on_step=report
    )
    return result.model, [(r["step"], r["train_loss"]) for r in logger.history]


@dataclasses.dataclass(frozen=True, kw_only=True)
class TextDefaultModel:
    """Settings of the public model trained on the embedded text default's public domains.

    Attributes:
        vocab_size: byte-level BPE vocabulary (trained on the public documents).
        width, depth, heads: the GPT-2's n_embd, n_layer, n_head.
        seq_len: its positions (the packed training rows).
        train_steps, batch_size, learning_rate: public pre-training.
        max_public_per_domain, num_users: arguments of `load_text_mixture_task`.
        seed: seed of the text default, the initialisation and the batches.
    """

    vocab_size: int = 512
    width: int = 64
    depth: int = 2
    heads: int = 4
    seq_len: int = 128
    train_steps: int = 300
    batch_size: int = 32
    learning_rate: float = 3e-3
    max_public_per_domain: int = 300
    num_users: int = 20
    seed: int = 0

    def __post_init__(self):
        if self.vocab_size < 257:
            raise ValueError(f"vocab_size must be >= 257 (byte-level BPE), got {self.vocab_size}.")
        for name in ("width", "depth", "heads", "seq_len", "train_steps", "batch_size",
                     "learning_rate", "max_public_per_domain", "num_users"):  # fmt: skip
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}.")

    def key(self) -> str:
        """A short fingerprint of the settings (the stage folder's name)."""
        text = json.dumps(dataclasses.asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def text_default_model(
    stages: str | os.PathLike | None,
    settings: TextDefaultModel = TextDefaultModel(),  # noqa: B008 (frozen, immutable)
    *,
    log: Callable[[str], None] | None = None,
) -> PublicTextModel:
    """The public model of the embedded text default: read back from
    `stages/public_model-<settings key>/` when stored there, else trained (and stored there).

    Privacy:
        Trained on the text default's public domains only; the stored files hold nothing
        sensitive.
    """
    from dpmix_jax.data.builtin import load_text_mixture_task
    from dpmix_jax.data.tokenizer import train_bpe_tokenizer
    from dpmix_jax.models.gpt2 import GPT2Config

    folder = None
    if stages is not None:
        folder = pathlib.Path(stages) / f"public_model-{settings.key()}"
        if (folder / _STORED_CONFIG).is_file():
            stored = load_public_model(folder)
            return dataclasses.replace(stored, source=f"text default model ({folder})")
    task = load_text_mixture_task(
        seed=settings.seed,
        num_users=settings.num_users,
        max_public_per_domain=settings.max_public_per_domain,
    )
    public = [task.public_domains[name] for name in task.domain_names]
    tokenizer = train_bpe_tokenizer(
        (d for docs in public for d in docs), vocab_size=settings.vocab_size
    )
    config = GPT2Config.tiny(
        vocab_size=tokenizer.vocab_size,
        n_positions=settings.seq_len,
        n_embd=settings.width,
        n_layer=settings.depth,
        n_head=settings.heads,
    )

    def on_log(step: int, loss: float) -> None:
        if log is not None:
            log(f"public model step {step}/{settings.train_steps}: loss {loss:.3f}")

    model, _ = train_public_gpt2(
        config,
        tokenizer,
        public,
        train_steps=settings.train_steps,
        batch_size=settings.batch_size,
        learning_rate=settings.learning_rate,
        seed=settings.seed,
        on_log=on_log,
    )
    source = "text default model" + (f" ({folder})" if folder is not None else "")
    trained = PublicTextModel(model=model, tokenizer=tokenizer, source=source)
    if folder is not None:
        tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
        save_public_model(trained, tmp)
        tmp.replace(folder)
    return trained
