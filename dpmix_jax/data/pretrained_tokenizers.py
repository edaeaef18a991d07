"""Tokenizers of pretrained Llama-family models, offline: from a transformers folder or a GGUF file.

A transformers folder ships the whole tokenizer as ``tokenizer.json``. A llama.cpp GGUF file has
none: it stores the vocabulary, the merges, each token's type and the special token ids as
metadata, plus the name of the pre-tokenizer (``tokenizer.ggml.pre``) that splits text before
the merges apply. `gguf_tokenizer` rebuilds a `tokenizers` byte-level BPE from those: control
tokens (``<|im_start|>``, ``<|end_of_text|>``, ...) are matched whole as special tokens, the split
is the model family's (GPT-2's regex; SmolLM's single digits then GPT-2's regex; Llama 3's or
Qwen2's regex) and a BOS token is prepended when the file asks for one.

Both return a `data.tokenizer.TextTokenizer` (``encode`` / ``encode_batch`` / ``decode`` /
``eos_id``), whose end-of-text token is the model's EOS token.

API:
    gguf_tokenizer(path)          byte-level BPE from a GGUF file's metadata
    folder_tokenizer(folder)      ``tokenizer.json`` of a transformers folder
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from dpmix_jax.data.tokenizer import TextTokenizer

# llama.cpp's token types (gguf.TokenType): 3 is CONTROL (special), 4 is USER_DEFINED (added).
_CONTROL, _USER_DEFINED = 3, 4
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


class _Split(NamedTuple):
    """How a pre-tokenizer family splits text, and whether BPE keeps in-vocabulary words whole.

    ``regex`` None means GPT-2's split (the one built into ``ByteLevel``).
    """

    regex: str | None = None
    single_digits: bool = False
    ignore_merges: bool = False


_LLAMA3 = _Split(regex=_LLAMA3_SPLIT, ignore_merges=True)
_QWEN2 = _Split(regex=_QWEN2_SPLIT)
_SMOLLM = _Split(single_digits=True)
# tokenizer.ggml.pre values, as llama.cpp's converter names them, grouped as llama.cpp splits.
PRE_TOKENIZERS = {
    "default": _Split(),
    "gpt-2": _Split(),
    "smollm": _SMOLLM,
    "starcoder": _SMOLLM,
    "refact": _SMOLLM,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "llama-bpe": _LLAMA3,
    "smaug-bpe": _LLAMA3,
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,
}


def _pre_tokenizer(split: _Split) -> pre_tokenizers.PreTokenizer:
    if split.regex is not None:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split.regex), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if split.single_digits:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return byte_level


def _gguf_tokenizer_fields(path: str) -> dict[str, Any]:
    """The ``tokenizer.*`` metadata of a GGUF file, keys without the prefix."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError, TypeError) as err:
        raise ValueError(f"{path} is not a readable GGUF file: {err}") from err
    return {
        key.removeprefix("tokenizer."): field.contents()
        for key, field in reader.fields.items()
        if key.startswith("tokenizer.ggml.")
    }


def gguf_tokenizer(path: str | os.PathLike) -> TextTokenizer:
    """The byte-level BPE tokenizer a GGUF file describes (``tokenizer.ggml.model`` "gpt2").

    Args:
      path: the ``.gguf`` file.

    Returns:
      A `TextTokenizer` whose end-of-text token is the file's EOS token.

    Raises:
      ValueError: naming the file, if it is unreadable, describes another tokenizer model (e.g.
        a sentencepiece "llama" vocabulary) or a pre-tokenizer not in `PRE_TOKENIZERS`, or lacks
        the vocabulary, merges or EOS id.
    """
    path = os.fspath(path)
    fields = _gguf_tokenizer_fields(path)
    kind = fields.get("ggml.model")
    if kind != "gpt2":
        raise ValueError(f"{path}: tokenizer model {kind!r} is not supported; need 'gpt2'")
    pre = fields.get("ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(
            f"{path}: pre-tokenizer {pre!r} is not supported; supported: "
            f"{', '.join(PRE_TOKENIZERS)}"
        )
    for key in ("ggml.tokens", "ggml.merges", "ggml.eos_token_id"):
        if key not in fields:
            raise ValueError(f"{path} lacks the GGUF metadata key 'tokenizer.{key}'")
    tokens = fields["ggml.tokens"]
    vocab = {token: index for index, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError(f"{path}: the vocabulary repeats tokens")
    split = PRE_TOKENIZERS[pre]
    backend = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=[tuple(merge.split(" ", 1)) for merge in fields["ggml.merges"]],
            ignore_merges=split.ignore_merges,
        )
    )
    backend.pre_tokenizer = _pre_tokenizer(split)
    backend.decoder = decoders.ByteLevel()
    _add_special_tokens(backend, tokens, fields.get("ggml.token_type", ()))
    if fields.get("ggml.add_bos_token", False):
        bos = tokens[fields["ggml.bos_token_id"]]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A",
            pair=f"{bos} $A {bos} $B:1",
            special_tokens=[(bos, fields["ggml.bos_token_id"])],
        )
    return TextTokenizer(backend, tokens[fields["ggml.eos_token_id"]])


def _add_special_tokens(backend: Tokenizer, tokens: list[str], token_types) -> None:
    """Control tokens become special tokens and user-defined ones added tokens: both are matched
    whole in the text, as llama.cpp does, rather than cut into pieces by the merges."""
    typed = list(zip(tokens, token_types, strict=False))
    control = [token for token, kind in typed if kind == _CONTROL]
    user_defined = [token for token, kind in typed if kind == _USER_DEFINED]
    backend.add_special_tokens(
        [AddedToken(token, special=True, normalized=False) for token in control]
    )
    backend.add_tokens(
        [AddedToken(token, special=False, normalized=False) for token in user_defined]
    )


def _eos_token(folder: Path, backend: Tokenizer) -> str:
    """The EOS token from ``tokenizer_config.json``, else from ``config.json``'s id."""
    tokenizer_config = folder / "tokenizer_config.json"
    if tokenizer_config.is_file():
        eos = json.loads(tokenizer_config.read_text()).get("eos_token")
        if isinstance(eos, Mapping):
            eos = eos.get("content")
        if isinstance(eos, str):
            return eos
    model_config = folder / "config.json"
    if model_config.is_file():
        eos_id = json.loads(model_config.read_text()).get("eos_token_id")
        eos_id = eos_id[0] if isinstance(eos_id, list) and eos_id else eos_id
        if isinstance(eos_id, int) and backend.id_to_token(eos_id) is not None:
            return backend.id_to_token(eos_id)
    raise ValueError(
        f"{folder}: neither tokenizer_config.json's eos_token nor config.json's eos_token_id "
        "names the EOS token"
    )


def folder_tokenizer(folder: str | os.PathLike) -> TextTokenizer:
    """The tokenizer of a transformers folder: ``tokenizer.json`` and its EOS token.

    Raises:
      ValueError: naming the folder, if ``tokenizer.json`` is missing or no EOS token is given.
    """
    folder = Path(folder)
    file = folder / "tokenizer.json"
    if not file.is_file():
        raise ValueError(f"{folder} has no tokenizer.json")
    backend = Tokenizer.from_file(str(file))
    return TextTokenizer(backend, _eos_token(folder, backend))
