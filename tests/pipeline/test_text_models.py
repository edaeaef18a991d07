"""The text pipeline with a pretrained public model as its downstream LM: a tiny transformers
Llama folder (grouped-query attention, its own BPE with an end-of-turn token) is named the way
`dpmix generate --model` names one, trained further on the λ-mixture from its own weights and
fine-tuned privately through LoRA adapters, with the pipeline tokenizing by its tokenizer; the
stored stages are keyed by the weights' content."""

import dataclasses
import json

import jax
import numpy as np
import pytest
from flax import nnx
from tokenizers import ByteLevelBPETokenizer

from dpmix_jax.cli import main
from dpmix_jax.data.pretrained_tokenizers import folder_tokenizer
from dpmix_jax.models.llama import Llama
from dpmix_jax.models.lora import LoraConfig
from dpmix_jax.pipeline.text import (
    LanguageModelSpec,
    PretrainedModelSpec,
    TextPipeline,
)
from dpmix_jax.pipeline.text_presets import text_demo_config
from tests.pipeline.test_text import TINY, three_domains, tiny_config

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")


def _write_llama_folder(folder, texts, *, seed=0):
    """A 2-layer Llama (4 query heads on 2 key/value heads, tied head) with a BPE of its own."""
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        texts, vocab_size=400, show_progress=False, special_tokens=["<|endoftext|>", "<|im_end|>"]
    )
    bpe.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    torch.manual_seed(seed)
    hf_config = transformers.LlamaConfig(
        vocab_size=bpe.get_vocab_size(), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=True,
    )  # fmt: skip
    transformers.LlamaForCausalLM(hf_config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def task():
    from dpmix_jax.pipeline.text_presets import text_task

    return three_domains(text_task(num_users=24, documents_per_user=(2, 4), max_chars=400))


@pytest.fixture(scope="module")
def llama_folder(task, tmp_path_factory):
    public = [doc for docs in task.public_domains.values() for doc in docs]
    return _write_llama_folder(tmp_path_factory.mktemp("llama"), public[:200])


def pretrained_config(folder, **overrides):
    settings = dict(
        tokenizer="model",
        model=PretrainedModelSpec(name=str(folder), seq_len=32),
        finetune_last_blocks=None,
        finetune_lora=LoraConfig(rank=4, alpha=8.0),
    )
    return tiny_config(**{**settings, **overrides})


def _params(model) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


def test_a_pretrained_llama_is_trained_further_and_fine_tuned_through_lora(
    task, llama_folder, tmp_path
):
    computed = []
    config = pretrained_config(llama_folder)
    pipeline = TextPipeline(task, config, tmp_path, on_stage=computed.append, reproducible=True)
    reference = folder_tokenizer(llama_folder)
    text = task.train.texts[0]
    assert pipeline.tokenizer.encode(text) == reference.encode(text)
    assert pipeline.tokenizer.eos_id == reference.eos_id

    checkpoint = config.model.build(pipeline.tokenizer.vocab_size, seed=0)
    hf = transformers.LlamaForCausalLM.from_pretrained(llama_folder)
    embedding = hf.model.embed_tokens.weight.detach().numpy()
    np.testing.assert_array_equal(np.asarray(checkpoint.embed_tokens.embedding[...]), embedding)

    # Random Init is the architecture at random, not the checkpoint.
    fresh = pipeline.pretrained(None, seed=0)
    assert isinstance(fresh, Llama)
    assert not np.allclose(np.asarray(fresh.embed_tokens.embedding[...]), embedding)

    weights = np.full(task.k, 1.0 / task.k)
    further = pipeline.pretrained(weights, seed=0)
    pairs = zip(_params(checkpoint), _params(further), strict=True)
    moved = [not np.array_equal(before, after) for before, after in pairs]
    assert all(moved), "further pretraining starts from the checkpoint and trains every weight"

    _, ft = pipeline.split(0)
    trainer, _ = pipeline.finetune_trainer(
        further, dataclasses.replace(config.finetune), ft, jax.random.key(0)
    )
    split = trainer.split
    trainable = [n for n, t in zip(split.names, split.trainable, strict=True) if t]
    assert len(trainable) == 2 * 7 * 2  # A and B of q, k, v, o, gate, up, down in 2 layers
    assert all("lora_a" in name or "lora_b" in name for name in trainable)
    assert trainer.clipping == "ghost"

    result = pipeline.run("dp_mixmin", 1.0, 0)
    assert np.isfinite(result.utility) and result.utility > 1
    assert result.spent.epsilon <= 1.0 + 1e-9
    assert "finetune" in computed and any(s.startswith("pretrain_") for s in computed)
    # Small proxies keep a small BPE of their own, trained on the public documents.
    assert pipeline.proxy_tokenizer.vocab_size == config.vocab_size < reference.vocab_size
    proxies = pipeline.proxies(0)
    assert {p.config.vocab_size for p in proxies} == {config.vocab_size}


def test_the_base_weights_stay_frozen_under_lora(task, llama_folder, tmp_path):
    config = pretrained_config(llama_folder)
    pipeline = TextPipeline(task, config, tmp_path, reproducible=True)
    init = config.model.build(pipeline.tokenizer.vocab_size, seed=0)
    model, _ = pipeline.finetune(init, "checkpoint", "ft", 2.0, 0)
    base = {
        path: np.asarray(leaf)
        for path, leaf in jax.tree_util.tree_flatten_with_path(nnx.state(init, nnx.Param))[0]
    }
    trained = jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]
    adapters_moved = False
    for path, leaf in trained:
        if path in base:
            np.testing.assert_array_equal(np.asarray(leaf), base[path])
        elif "lora_b" in jax.tree_util.keystr(path):
            adapters_moved |= bool(np.any(np.asarray(leaf) != 0))
    assert adapters_moved


def test_stages_are_keyed_by_the_weights_content(task, llama_folder, tmp_path_factory, tmp_path):
    other = tmp_path_factory.mktemp("llama_other")
    public = [doc for docs in task.public_domains.values() for doc in docs]
    _write_llama_folder(other, public[:200], seed=0)
    config = pretrained_config(other)
    first = TextPipeline(task, config, tmp_path).settings_folder()
    assert TextPipeline(task, config, tmp_path).settings_folder() == first
    _write_llama_folder(other, public[:200], seed=1)  # the same path, other weights
    assert TextPipeline(task, config, tmp_path).settings_folder() != first


def test_bad_pretrained_settings_are_one_line(task, llama_folder, tmp_path):
    with pytest.raises(ValueError, match="tokenizer='model' goes with a PretrainedModelSpec"):
        pretrained_config(llama_folder, tokenizer="bpe")
    with pytest.raises(ValueError, match="tokenizer='model' goes with a PretrainedModelSpec"):
        tiny_config(tokenizer="model", model=TINY)
    with pytest.raises(ValueError, match="seq_len must be an integer >= 2"):
        PretrainedModelSpec(name="smollm2", seq_len=1)
    with pytest.raises(ValueError, match="proxy_model must be a LanguageModelSpec"):
        pretrained_config(llama_folder, proxy_model=PretrainedModelSpec(name="x", seq_len=8))
    too_long = pretrained_config(llama_folder, model=PretrainedModelSpec(
        name=str(llama_folder), seq_len=65))  # fmt: skip
    with pytest.raises(ValueError, match="seq_len 65 exceeds the 64 positions"):
        _ = TextPipeline(task, too_long, tmp_path).tokenizer
    deep = pretrained_config(llama_folder, finetune_lora=None, finetune_last_blocks=3)
    pipeline = TextPipeline(task, deep, tmp_path)
    init = deep.model.build(pipeline.tokenizer.vocab_size, seed=0)
    with pytest.raises(ValueError, match=r"finetune_last_blocks: last_n_blocks must be .*\[0, 2\]"):
        pipeline.finetune_trainer(init, deep.finetune, np.arange(4), jax.random.key(0))
    with pytest.raises(ValueError, match="does not exist"):
        PretrainedModelSpec(name=str(tmp_path / "missing"), seq_len=8).public_model()
    assert LanguageModelSpec(config=TINY.config).identity() is None


def test_the_text_demo_takes_a_pretrained_model(llama_folder):
    config = text_demo_config(model=str(llama_folder))
    assert config.tokenizer == "model" and config.model.name == str(llama_folder)
    assert config.finetune_lora == LoraConfig(rank=8, alpha=16.0)
    assert text_demo_config(model=str(llama_folder), lora_rank=2).finetune_lora.rank == 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["demo", "image", "--model", "smollm2"], "argument --model: a pretrained model applies"),
        (["demo", "text", "--model", "/nonexistent/model"], "argument --model: model /nonexis"),
    ],
)
def test_dpmix_demo_model_mistakes_are_one_line(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--out", str(tmp_path / "out"), "--quiet"])
    assert exit_info.value.code == 2
    usage, error = capsys.readouterr().err.strip().splitlines()
    assert usage.startswith("usage: dpmix") and message in error
