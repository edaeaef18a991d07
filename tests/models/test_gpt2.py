"""Tests for GPT-2: transformers parity, loading, KV cache, generation, mask, per-example grads."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from dpmix_jax.models import GPT2, GPT2Config, generate, trainable_mask

HF_VOCAB, HF_POSITIONS, HF_WIDTH = 97, 40, 32


def _param_count(tree) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


@nnx.jit
def _forward(model, ids, mask=None):
    return model(ids, attention_mask=mask)


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    """A random tiny transformers GPT-2 saved with save_pretrained, and the torch model."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=HF_VOCAB,
        n_positions=HF_POSITIONS,
        n_embd=HF_WIDTH,
        n_layer=2,
        n_head=4,
        bos_token_id=0,
        eos_token_id=0,
    )
    hf_model = transformers.GPT2LMHeadModel(config).eval()
    # Random init leaves LayerNorms at identity; perturb them so the mapping is exercised.
    with torch.no_grad():
        for name, tensor in hf_model.named_parameters():
            if "ln" in name:
                tensor.add_(0.1 * torch.randn_like(tensor))
    folder = tmp_path_factory.mktemp("hf_gpt2")
    hf_model.save_pretrained(folder)
    return folder, hf_model


@pytest.fixture(scope="module")
def tiny_model():
    return GPT2(GPT2Config.tiny(), rngs=nnx.Rngs(0))


def _hf_logits(hf_model, ids, **kwargs):
    with torch.no_grad():
        tensors = {k: torch.tensor(np.asarray(v)) for k, v in kwargs.items()}
        return hf_model(torch.tensor(np.asarray(ids)), **tensors).logits.numpy()


def _random_ids(seed, shape, vocab):
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, shape), jnp.int32)


def test_logits_match_transformers(hf_checkpoint):
    folder, hf_model = hf_checkpoint
    model = GPT2.from_pretrained(folder)
    assert model.config == GPT2Config(
        vocab_size=HF_VOCAB, n_positions=HF_POSITIONS, n_embd=HF_WIDTH, n_layer=2, n_head=4
    )
    ids = _random_ids(0, (3, HF_POSITIONS), HF_VOCAB)
    np.testing.assert_allclose(_forward(model, ids), _hf_logits(hf_model, ids), atol=1e-4)


def test_left_padded_logits_match_transformers(hf_checkpoint):
    folder, hf_model = hf_checkpoint
    model = GPT2.from_pretrained(folder)
    ids = _random_ids(1, (2, 10), HF_VOCAB)
    mask = jnp.ones((2, 10), jnp.int32).at[0, :4].set(0)
    positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
    ours = _forward(model, ids, mask)
    ref = _hf_logits(hf_model, ids, attention_mask=mask, position_ids=positions)
    real = np.asarray(mask, bool)
    np.testing.assert_allclose(np.asarray(ours)[real], ref[real], atol=1e-4)
    # Row 0's real tokens see exactly what an unpadded 6-token sequence sees.
    np.testing.assert_allclose(ours[0, 4:], _forward(model, ids[:1, 4:])[0], atol=1e-5)


def test_load_single_files(hf_checkpoint, tmp_path):
    folder, hf_model = hf_checkpoint
    ids = _random_ids(2, (2, 12), HF_VOCAB)
    expected = _hf_logits(hf_model, ids)
    # A lone safetensors file: the head count is inferred from GPT-2's 64-wide heads, which
    # this 32-wide model does not have, so the config must be passed.
    with pytest.raises(ValueError, match="n_head"):
        GPT2.from_pretrained(folder / "model.safetensors")
    config = GPT2Config.from_hf(json.loads((folder / "config.json").read_text()))
    model = GPT2.from_pretrained(folder / "model.safetensors", config=config)
    np.testing.assert_allclose(model(ids), expected, atol=1e-4)
    # A torch state dict (pytorch_model.bin) in a folder with config.json.
    torch.save(hf_model.state_dict(), tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    np.testing.assert_allclose(GPT2.from_pretrained(tmp_path)(ids), expected, atol=1e-4)


def test_infer_config_from_gpt2_shaped_tensors(tmp_path):
    from safetensors.numpy import save_file

    config = GPT2Config.tiny(vocab_size=50, n_positions=12, n_embd=128, n_head=2, n_inner=96)
    model = nnx.eval_shape(lambda: GPT2(config, rngs=nnx.Rngs(0)))
    state = nnx.state(model, nnx.Param)
    rng = np.random.default_rng(0)
    state = jax.tree.map(lambda x: rng.normal(size=x.shape).astype(np.float32), state)
    leaf_names = {"embedding": "weight", "scale": "weight", "kernel": "weight", "bias": "bias"}
    tensors = {}
    for path, value in jax.tree_util.tree_flatten_with_path(state)[0]:
        keys = [str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey)]
        tensors[".".join(["transformer", *keys[:-1], leaf_names[keys[-1]]])] = value
    save_file(tensors, tmp_path / "weights.safetensors")
    loaded = GPT2.from_pretrained(tmp_path / "weights.safetensors")
    # Heads are taken as 64 wide: 128 / 64 = 2 heads, as saved.
    assert loaded.config == config
    for got, want in zip(
        jax.tree.leaves(nnx.state(loaded, nnx.Param)), jax.tree.leaves(state), strict=True
    ):
        np.testing.assert_array_equal(got, want)


def test_from_pretrained_errors(tmp_path, hf_checkpoint):
    with pytest.raises(ValueError, match="not a local path"):
        GPT2.from_pretrained("no-such-org/no-such-gpt2-model")
    with pytest.raises(ValueError, match="holds none of"):
        GPT2.from_pretrained(tmp_path)
    folder, _ = hf_checkpoint
    with pytest.raises(ValueError, match="shape"):
        GPT2.from_pretrained(folder, config=GPT2Config.tiny(vocab_size=HF_VOCAB + 1, n_embd=32))
    bad = json.loads((folder / "config.json").read_text()) | {"activation_function": "relu"}
    with pytest.raises(ValueError, match="activation"):
        GPT2Config.from_hf(bad)


@pytest.mark.parametrize(
    ("config", "expected"),
    [(GPT2Config.small(), 124_439_808), (GPT2Config.medium(), 354_823_168)],
)
def test_parameter_counts(config, expected):
    model = nnx.eval_shape(lambda: GPT2(config, rngs=nnx.Rngs(0)))
    assert _param_count(nnx.state(model, nnx.Param)) == expected
    d, layers = config.n_embd, config.n_layer
    closed_form = (config.vocab_size + config.n_positions) * d + layers * (12 * d * d + 13 * d)
    assert expected == closed_form + 2 * d


def test_kv_cache_logits_equal_full_forward(tiny_model):
    ids = _random_ids(4, (2, 11), tiny_model.config.vocab_size)
    full = _forward(tiny_model, ids)
    extend = nnx.jit(lambda m, x, c: m.extend(x, c))
    cache = tiny_model.init_cache(2, 16)
    chunks = [ids[:, :5], ids[:, 5:7], *(ids[:, t : t + 1] for t in range(7, 11))]
    pieces = []
    for chunk in chunks:
        logits, cache = extend(tiny_model, chunk, cache)
        pieces.append(logits)
    np.testing.assert_allclose(jnp.concatenate(pieces, axis=1), full, atol=1e-5)
    assert int(cache.index) == 11
    np.testing.assert_array_equal(cache.position, [11, 11])


def _greedy_without_cache(model, prompt, steps):
    """Argmax decoding with full forward passes over a fixed-size buffer (causal: the unused
    tail of the buffer cannot affect earlier positions)."""
    length = prompt.shape[1]
    seq = jnp.concatenate([prompt, jnp.zeros((prompt.shape[0], steps), jnp.int32)], axis=1)
    for t in range(steps):
        next_token = jnp.argmax(_forward(model, seq)[:, length + t - 1], axis=-1)
        seq = seq.at[:, length + t].set(next_token.astype(jnp.int32))
    return seq[:, length:]


def test_greedy_generation_equals_argmax_decoding(tiny_model):
    prompt = _random_ids(5, (2, 6), tiny_model.config.vocab_size)
    tokens = generate(tiny_model, prompt, max_new_tokens=6)
    assert tokens.shape == (2, 6) and tokens.dtype == jnp.int32
    np.testing.assert_array_equal(tokens, _greedy_without_cache(tiny_model, prompt, 6))


def test_generation_compiles_once_per_shape(tiny_model):
    from dpmix_jax.models import gpt2

    before = gpt2._generate._cache_size()
    for seed in (6, 7, 8):
        generate(tiny_model, _random_ids(seed, (2, 6), 512), max_new_tokens=6)
    assert gpt2._generate._cache_size() - before <= 1


def test_left_padded_prompt_generates_like_unpadded(tiny_model):
    prompts = _random_ids(9, (2, 6), tiny_model.config.vocab_size)
    padded = jnp.concatenate([jnp.zeros((2, 3), jnp.int32), prompts], axis=1)
    mask = jnp.ones((2, 9), bool).at[:, :3].set(False)
    got = generate(tiny_model, padded, max_new_tokens=6, prompt_mask=mask)
    np.testing.assert_array_equal(got, generate(tiny_model, prompts, max_new_tokens=6))


def test_sampling(tiny_model):
    prompt = _random_ids(11, (2, 6), tiny_model.config.vocab_size)
    key = jax.random.key(0)
    greedy = generate(tiny_model, prompt, max_new_tokens=6)
    np.testing.assert_array_equal(
        generate(tiny_model, prompt, max_new_tokens=6, key=key, top_k=1), greedy
    )
    sampled = generate(tiny_model, prompt, max_new_tokens=6, key=key, top_k=3)
    np.testing.assert_array_equal(
        sampled, generate(tiny_model, prompt, max_new_tokens=6, key=key, top_k=3)
    )
    # Every sampled token is among the 3 most likely under the full forward pass.
    logits = _forward(tiny_model, jnp.concatenate([prompt, sampled], axis=1))[:, 5:-1]
    top3 = np.asarray(jax.lax.top_k(logits, 3)[1])
    assert np.all((top3 == np.asarray(sampled)[..., None]).any(-1))
    # Very high temperature is close to uniform over 512 tokens: draws are almost all distinct.
    hot = generate(tiny_model, prompt, max_new_tokens=6, key=jax.random.key(1), temperature=1e4)
    assert len(np.unique(np.asarray(hot))) > 9
    assert not np.array_equal(hot, greedy)


def test_eos_pads_after_first_occurrence(tiny_model):
    prompt = _random_ids(12, (2, 6), tiny_model.config.vocab_size)
    greedy = np.asarray(generate(tiny_model, prompt, max_new_tokens=6))
    eos = int(greedy[0, 2])
    got = np.asarray(generate(tiny_model, prompt, max_new_tokens=6, eos_id=eos))
    for row_greedy, row in zip(greedy, got, strict=True):
        hits = np.flatnonzero(row_greedy == eos)
        stop = hits[0] + 1 if hits.size else len(row)
        np.testing.assert_array_equal(row[:stop], row_greedy[:stop])
        assert np.all(row[stop:] == eos)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": 200}, "n_positions"),
        ({"max_new_tokens": 2, "temperature": 0.0}, "temperature"),
        ({"max_new_tokens": 2, "top_k": 0}, "top_k"),
        ({"max_new_tokens": 2, "eos_id": 512}, "eos_id"),
    ],
)
def test_generate_validation(tiny_model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        generate(tiny_model, jnp.zeros((1, 4), jnp.int32), **kwargs)


def test_trainable_mask_selects_last_blocks_and_head():
    model = nnx.eval_shape(lambda: GPT2(GPT2Config.tiny(n_layer=3), rngs=nnx.Rngs(0)))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    mask = trainable_mask(params, last_n_blocks=2)
    assert jax.tree.structure(mask) == jax.tree.structure(params)
    flat = {
        tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey)): value
        for path, value in jax.tree_util.tree_flatten_with_path(mask)[0]
    }
    expected_true = {p for p in flat if p[0] in ("wte", "ln_f") or (p[0] == "h" and p[1] >= 1)}
    assert {p for p, v in flat.items() if v} == expected_true
    assert ("wpe", "embedding") in flat and not flat[("wpe", "embedding")]
    assert len([p for p in flat if p[:2] == ("h", 0)]) == 12  # 2 LNs x 2 + 4 Linears x 2
    # The module and its Param state give the same mask; head=False drops wte and ln_f.
    assert jax.tree.leaves(trainable_mask(model, last_n_blocks=2)) == jax.tree.leaves(mask)
    only_blocks = trainable_mask(model, last_n_blocks=1, head=False)
    n_true = sum(jax.tree.leaves(only_blocks))
    assert n_true == 12
    assert not any(jax.tree.leaves(trainable_mask(model, last_n_blocks=0, head=False)))
    with pytest.raises(ValueError, match="last_n_blocks"):
        trainable_mask(model, last_n_blocks=4)


def test_trainable_mask_freezes_parameters_with_optax(tiny_model):
    import optax

    graphdef, params, rest = nnx.split(tiny_model, nnx.Param, ...)
    mask = trainable_mask(params, last_n_blocks=1)
    grads = jax.tree.map(jnp.ones_like, params)
    opt = optax.multi_transform({True: optax.sgd(1.0), False: optax.set_to_zero()}, mask)
    updates, _ = opt.update(grads, opt.init(params), params)
    for update, trainable in zip(jax.tree.leaves(updates), jax.tree.leaves(mask), strict=True):
        assert bool(jnp.any(update != 0)) == trainable


def test_per_example_grads_vmap_match_loop(tiny_model):
    graphdef, params, rest = nnx.split(tiny_model, nnx.Param, ...)
    ids = _random_ids(
        13, (3, 1, 9), tiny_model.config.vocab_size
    )  # three examples, batch axis of 1

    def loss(p, x):
        logits = nnx.merge(graphdef, p, rest)(x[:, :-1])
        logp = jax.nn.log_softmax(logits)
        return -jnp.take_along_axis(logp, x[:, 1:, None], axis=-1).mean()

    batched = jax.jit(jax.vmap(jax.grad(loss), in_axes=(None, 0)))(params, ids)
    single_grad = jax.jit(jax.grad(loss))
    for i in range(3):
        single = single_grad(params, ids[i])
        for b, s in zip(jax.tree.leaves(batched), jax.tree.leaves(single), strict=True):
            np.testing.assert_allclose(b[i], s, rtol=1e-4, atol=1e-6)
    wte = batched["wte"]["embedding"][...]
    assert not np.allclose(wte[0], wte[1])


def test_bfloat16_compute(tiny_model):
    _, state = nnx.split(tiny_model)
    bf16 = nnx.merge(nnx.graphdef(GPT2(GPT2Config.tiny(dtype="bfloat16"), rngs=nnx.Rngs(1))), state)
    ids = _random_ids(14, (2, 8), 512)
    out = _forward(bf16, ids)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, _forward(tiny_model, ids), atol=0.1)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"n_head": 3}, "n_head"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"n_inner": -1}, "n_inner"),
        ({"layer_norm_eps": 0.0}, "layer_norm_eps"),
        ({"dtype": "int8"}, "dtype"),
    ],
)
def test_config_validation(overrides, message):
    with pytest.raises(ValueError, match=message):
        GPT2Config.tiny(**overrides)


def test_input_validation(tiny_model):
    with pytest.raises(ValueError, match="input_ids"):
        tiny_model(jnp.zeros((4,), jnp.int32))
    with pytest.raises(ValueError, match="n_positions"):
        tiny_model(jnp.zeros((1, 129), jnp.int32))
    with pytest.raises(ValueError, match="capacity"):
        tiny_model.init_cache(1, 129)
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
