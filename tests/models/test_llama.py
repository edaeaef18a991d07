"""Tests for the Llama-family decoder: transformers parity, KV cache, generation, LoRA, ghost."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from dpmix_jax.models import (
    Llama,
    LlamaConfig,
    LoraConfig,
    RopeScaling,
    add_lora,
    generate,
    llama_trainable_mask,
    load_llama,
    merge_lora,
)
from dpmix_jax.models import lora as lora_module
from dpmix_jax.train.ghost_models import check_ghost_support, model_clipped_grad_sum

HF_VOCAB, HF_WIDTH, HF_POSITIONS = 97, 32, 64
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
# name: (model class, config class, overrides); all use GQA but "llama_tied_linear" (4 kv heads).
FAMILIES = {
    "llama_untied_llama3": (
        transformers.LlamaForCausalLM,
        transformers.LlamaConfig,
        {"num_key_value_heads": 2, "tie_word_embeddings": False, "rope_scaling": LLAMA3_SCALING},
    ),
    "llama_tied_linear": (
        transformers.LlamaForCausalLM,
        transformers.LlamaConfig,
        {
            "num_key_value_heads": 4,
            "tie_word_embeddings": True,
            "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        },
    ),
    "qwen2_bias": (
        transformers.Qwen2ForCausalLM,
        transformers.Qwen2Config,
        {"num_key_value_heads": 2, "tie_word_embeddings": True},
    ),
    "mistral_window": (
        transformers.MistralForCausalLM,
        transformers.MistralConfig,
        {"num_key_value_heads": 1, "tie_word_embeddings": False, "sliding_window": 6},
    ),
}


@nnx.jit
def _forward(model, ids, mask=None):
    return model(ids, attention_mask=mask)


def _random_ids(seed, shape, vocab=HF_VOCAB):
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, shape), jnp.int32)


def _save_family(name, folder, dtype=torch.float32):
    """A random tiny transformers model of family `name`, saved to `folder`; returns it."""
    model_class, config_class, overrides = FAMILIES[name]
    torch.manual_seed(0)
    config = config_class(
        vocab_size=HF_VOCAB,
        hidden_size=HF_WIDTH,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=HF_POSITIONS,
        rms_norm_eps=1e-5,
        **overrides,
    )
    hf_model = model_class(config).eval()
    # Random init leaves norms at one and biases at zero; perturb them so the mapping is exercised.
    with torch.no_grad():
        for parameter_name, tensor in hf_model.named_parameters():
            if "norm" in parameter_name or "bias" in parameter_name:
                tensor.add_(0.1 * torch.randn_like(tensor))
    hf_model.to(dtype).save_pretrained(folder)
    return hf_model.float()


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf_model = _save_family(request.param, folder)
    return request.param, folder, hf_model


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    """The untied Llama with GQA and llama3 rope scaling, saved once, and its torch model."""
    folder = tmp_path_factory.mktemp("llama")
    return folder, _save_family("llama_untied_llama3", folder)


def _hf_logits(hf_model, ids, **kwargs):
    with torch.no_grad():
        tensors = {k: torch.tensor(np.asarray(v)) for k, v in kwargs.items()}
        return hf_model(torch.tensor(np.asarray(ids)), **tensors).logits.numpy()


def test_logits_match_transformers(family):
    name, folder, hf_model = family
    model = load_llama(folder)
    _, _, overrides = FAMILIES[name]
    assert model.config.tie_word_embeddings == overrides["tie_word_embeddings"]
    assert model.config.num_kv_heads == overrides["num_key_value_heads"]
    assert model.config.attention_bias == (name == "qwen2_bias")
    assert hasattr(model, "lm_head") != model.config.tie_word_embeddings
    ids = _random_ids(0, (3, 24))
    np.testing.assert_allclose(_forward(model, ids), _hf_logits(hf_model, ids), atol=1e-4)


def test_left_padded_logits_match_transformers(family):
    _, folder, hf_model = family
    model = load_llama(folder)
    ids = _random_ids(1, (2, 16))
    mask = jnp.ones((2, 16), jnp.int32).at[0, :5].set(0)
    positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
    ours = _forward(model, ids, mask)
    ref = _hf_logits(hf_model, ids, attention_mask=mask, position_ids=positions)
    real = np.asarray(mask, bool)
    np.testing.assert_allclose(np.asarray(ours)[real], ref[real], atol=1e-4)
    # Row 0's real tokens see exactly what an unpadded 11-token sequence sees.
    np.testing.assert_allclose(ours[0, 5:], _forward(model, ids[:1, 5:])[0], atol=1e-5)


def test_rms_norm_matches_transformers():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x = np.random.default_rng(3).normal(size=(2, 5, 16)).astype(np.float32) * 3
    scale = np.random.default_rng(4).normal(size=16).astype(np.float32)
    reference = LlamaRMSNorm(16, eps=1e-5)
    reference.weight.data = torch.tensor(scale)
    ours = nnx.RMSNorm(16, epsilon=1e-5, rngs=nnx.Rngs(0))
    ours.scale.value = jnp.asarray(scale)
    with torch.no_grad():
        expected = reference(torch.tensor(x)).numpy()
    np.testing.assert_allclose(ours(jnp.asarray(x)), expected, rtol=1e-6, atol=1e-6)


def test_bfloat16_checkpoint_loads(tmp_path):
    hf_model = _save_family("llama_untied_llama3", tmp_path, dtype=torch.bfloat16)
    rounded = hf_model.to(torch.bfloat16).float()
    ids = _random_ids(2, (2, 12))
    np.testing.assert_allclose(
        _forward(load_llama(tmp_path), ids), _hf_logits(rounded, ids), atol=1e-4
    )


@pytest.mark.parametrize("name", ["llama_untied_llama3", "mistral_window"])
def test_kv_cache_logits_equal_full_forward(name, tmp_path):
    _save_family(name, tmp_path)
    model = load_llama(tmp_path)
    ids = _random_ids(4, (2, 14))
    mask = jnp.ones((2, 14), bool).at[1, :3].set(False)
    full = _forward(model, ids, mask)
    extend = nnx.jit(lambda m, x, c, k: m.extend(x, c, attention_mask=k))
    cache = model.init_cache(2, 20)
    pieces = []
    for start, stop in [(0, 5), (5, 7), *((t, t + 1) for t in range(7, 14))]:
        logits, cache = extend(model, ids[:, start:stop], cache, mask[:, start:stop])
        pieces.append(logits)
    real = np.asarray(mask)
    np.testing.assert_allclose(
        np.asarray(jnp.concatenate(pieces, axis=1))[real], full[real], atol=1e-5
    )
    assert int(cache.index) == 14
    np.testing.assert_array_equal(cache.position, [14, 11])


def test_greedy_generate_matches_transformers(llama_folder):
    folder, hf_model = llama_folder
    model = load_llama(folder)
    prompts = _random_ids(5, (2, 7))
    mask = jnp.ones((2, 7), jnp.int32).at[0, :2].set(0)
    ours = generate(model, prompts, max_new_tokens=8, prompt_mask=mask)
    with torch.no_grad():
        ref = hf_model.generate(
            torch.tensor(np.asarray(prompts)),
            attention_mask=torch.tensor(np.asarray(mask)),
            max_new_tokens=8,
            min_new_tokens=8,
            do_sample=False,
            pad_token_id=0,
        )[:, 7:]
    np.testing.assert_array_equal(ours, ref.numpy())


def test_smollm2_parameter_count():
    model = nnx.eval_shape(lambda: Llama(LlamaConfig(), rngs=nnx.Rngs(0)))
    params = nnx.state(model, nnx.Param)
    assert sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params)) == 134_515_008


def test_trainable_mask_selects_last_blocks_and_head():
    def flat_mask(config, **kwargs):
        model = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
        mask = llama_trainable_mask(model, **kwargs)
        return {
            tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey)): value
            for path, value in jax.tree_util.tree_flatten_with_path(mask)[0]
        }

    tied = flat_mask(LlamaConfig.tiny(num_layers=3), last_n_blocks=2)
    expected = {
        p
        for p in tied
        if p[0] in ("embed_tokens", "norm") or p[:2] in {("layers", 1), ("layers", 2)}
    }
    assert {p for p, v in tied.items() if v} == expected
    assert len([p for p in tied if p[:2] == ("layers", 0)]) == 9  # 7 kernels + 2 norm scales
    untied = flat_mask(LlamaConfig.tiny(tie_word_embeddings=False), last_n_blocks=0)
    assert {p for p, v in untied.items() if v} == {("norm", "scale"), ("lm_head", "kernel")}
    headless = flat_mask(LlamaConfig.tiny(), last_n_blocks=1, head=False)
    assert {p[:2] for p, v in headless.items() if v} == {("layers", 1)}
    with pytest.raises(ValueError, match="last_n_blocks"):
        flat_mask(LlamaConfig.tiny(), last_n_blocks=3)


def test_lora_adapts_and_merges():
    model = Llama(LlamaConfig.tiny(attention_bias=True), rngs=nnx.Rngs(0))
    ids = _random_ids(6, (2, 9), 512)
    base = _forward(model, ids)
    model = add_lora(model, LoraConfig(rank=4, alpha=8.0), rngs=nnx.Rngs(1))
    np.testing.assert_array_equal(_forward(model, ids), base)
    adapters = [
        module
        for _, module in nnx.iter_modules(model)
        if isinstance(module, lora_module.LoraLinear)
    ]
    assert len(adapters) == 2 * 7  # q, k, v, o, gate, up, down in each of the 2 layers
    for index, adapter in enumerate(adapters):
        kernel = adapter.lora_b.kernel
        kernel.value = 0.05 * jax.random.normal(jax.random.key(index), kernel.value.shape)
    adapted = _forward(model, ids)
    assert not np.allclose(adapted, base, atol=1e-3)
    merged = merge_lora(model)
    assert type(merged.layers[0].self_attn.q_proj) is nnx.Linear
    np.testing.assert_allclose(_forward(merged, ids), adapted, atol=1e-5)
    mask = lora_module.trainable_mask(model)
    assert sum(jax.tree.leaves(mask)) == 2 * len(adapters)


def _next_token_loss(model, batch):
    ids = batch["ids"]
    logits = model(ids[:, :-1], attention_mask=batch["mask"][:, :-1])
    log_probs = jax.nn.log_softmax(logits)
    token_loss = -jnp.take_along_axis(log_probs, ids[:, 1:, None], axis=-1)[..., 0]
    weights = batch["mask"][:, 1:].astype(jnp.float32)
    return (token_loss * weights).sum(axis=1) / weights.sum(axis=1)


@pytest.mark.parametrize("tied", [True, False])
def test_ghost_clipping_matches_vmap(tied):
    model = Llama(LlamaConfig.tiny(tie_word_embeddings=tied, vocab_size=64), rngs=nnx.Rngs(2))
    check_ghost_support(model)  # every parameter, the RMSNorm scales included, is tapped
    batch = {
        "ids": _random_ids(7, (4, 10), 64),
        "mask": jnp.ones((4, 10), jnp.int32).at[1, :3].set(0),
    }
    keep = jnp.array([True, True, False, True])
    params = nnx.state(model, nnx.Param)
    results = {}
    for method in ("vmap", "ghost"):
        grad_sum = model_clipped_grad_sum(model, _next_token_loss, clip_norm=0.5, method=method)
        results[method] = jax.jit(grad_sum.function)(params, batch, keep)
    (ref, ref_stats), (got, stats) = results["vmap"], results["ghost"]
    np.testing.assert_allclose(stats["grad_norm"], ref_stats["grad_norm"], rtol=1e-4)
    assert np.sum(np.asarray(ref_stats["grad_norm"]) > 0.5) >= 2  # clipping is active
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(g, r, atol=1e-5)


def test_config_from_hf(family):
    _, folder, _ = family
    hf_config = json.loads((folder / "config.json").read_text())
    assert LlamaConfig.from_hf(hf_config) == load_llama(folder).config
    legacy = {k: v for k, v in hf_config.items() if k != "rope_parameters"}
    legacy |= {"rope_theta": 500000.0, "rope_scaling": LLAMA3_SCALING}
    config = LlamaConfig.from_hf(legacy)
    assert config.rope_theta == 500000.0 and config.rope_scaling.kind == "llama3"
    for bad, message in [
        ({"model_type": "bert"}, "model_type"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
    ]:
        with pytest.raises(ValueError, match=message):
            LlamaConfig.from_hf(hf_config | bad)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"num_kv_heads": 3}, "num_kv_heads"),
        ({"num_heads": 3, "num_kv_heads": 1}, "hidden_size"),
        ({"head_dim": 7}, "head_dim"),
        ({"rms_norm_eps": 0.0}, "rms_norm_eps"),
        ({"sliding_window": 0}, "sliding_window"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "dynamic"),
        ({"dtype": "int8"}, "dtype"),
    ],
)
def test_config_validation(overrides, message):
    with pytest.raises(ValueError, match=message):
        LlamaConfig.tiny(**overrides)


def test_rope_scaling_validation():
    with pytest.raises(ValueError, match="low_freq_factor"):
        RopeScaling(kind="llama3", factor=8.0, low_freq_factor=4.0, high_freq_factor=1.0)
    with pytest.raises(ValueError, match="factor"):
        RopeScaling(kind="linear", factor=0.0)
    assert RopeScaling.from_hf({"rope_type": "default", "rope_theta": 1e4}) is None


def test_bad_folders(tmp_path, llama_folder):
    folder, _ = llama_folder
    with pytest.raises(ValueError, match="no config.json"):
        load_llama(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 5}))
    with pytest.raises(ValueError, match=r"config\.json: unsupported model_type 'gpt2'"):
        load_llama(tmp_path)
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(ValueError, match="neither model.safetensors"):
        load_llama(tmp_path)
    with pytest.raises(ValueError, match="neither a transformers folder nor a GGUF file"):
        load_llama(tmp_path / "missing.gguf")


def test_input_validation():
    model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="input_ids"):
        model(jnp.zeros((4,), jnp.int32))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model(jnp.zeros((1, 129), jnp.int32))
    with pytest.raises(ValueError, match="capacity"):
        model.init_cache(1, 129)
    with pytest.raises(ValueError, match="n_positions"):
        generate(model, jnp.zeros((1, 4), jnp.int32), max_new_tokens=200)


def test_bfloat16_compute():
    model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
    _, state = nnx.split(model)
    bf16 = nnx.merge(
        nnx.graphdef(Llama(LlamaConfig.tiny(dtype="bfloat16"), rngs=nnx.Rngs(1))), state
    )
    ids = _random_ids(8, (2, 8), 512)
    out = _forward(bf16, ids)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, _forward(model, ids), atol=0.1)
    assert generate(bf16, ids, max_new_tokens=3).shape == (2, 3)
