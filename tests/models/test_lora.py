"""LoRA on GPT-2: adapters, masks, merging, checkpoint loading and private training.

Clipped sums over the adapters are compared with a naive loop (one `jax.grad` per unit, clip,
sum) on both paths the Trainer can select; an adversarial construction bounds every unit's
contribution by C; a one-run audit with dirac canaries on adapter coordinates checks that the
Trainer's noise keeps the ε lower bound below the claim, and that without noise it does not.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from dpmix_jax.models import lora
from dpmix_jax.models.gpt2 import GPT2, GPT2Config
from dpmix_jax.privacy import audit
from dpmix_jax.train import TrainConfig, engine
from dpmix_jax.train.checkpoint import Checkpointer
from dpmix_jax.train.losses import next_token_nll
from tests.privacy.test_adversarial_clipping import CLIP, assert_sound, cancelling

TINY = GPT2Config.tiny(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
ADAPTERS = lora.LoraConfig(rank=4, alpha=8.0)
SEQ = 8
NUM_EXAMPLES = 24
LOSS = next_token_nll()


def lora_model(*, seed=0, random_b=False, config=ADAPTERS):
    """A tiny GPT-2 with adapters; `random_b` gives B nonzero values (A then has gradients)."""
    model = lora.add_lora(GPT2(TINY, rngs=nnx.Rngs(seed)), config, rngs=nnx.Rngs(seed + 1))
    if random_b:
        rng = np.random.default_rng(seed)
        for _, module in nnx.iter_modules(model):
            if isinstance(module, lora.LoraLinear):
                shape = module.lora_b.kernel.value.shape
                module.lora_b.kernel.value = jnp.asarray(0.2 * rng.standard_normal(shape))
    return model


def _data(seed=0, n=NUM_EXAMPLES):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, TINY.vocab_size, (n, SEQ)).astype(np.int32)
    lengths = rng.integers(2, SEQ + 1, n)
    mask = (np.arange(SEQ)[None] < lengths[:, None]).astype(np.int32)
    return tokens, mask


TOKENS, MASK = _data()


def gather(indices):
    rows = np.maximum(indices, 0)
    return {"tokens": TOKENS[rows], "mask": MASK[rows] * (indices >= 0)[:, None]}


def _private_config(**overrides):
    settings = dict(
        steps=3, batch_size=8, learning_rate=0.05, optimizer="sgd", private=True, clip_norm=0.5,
        delta=1e-5, noise_multiplier=1.0, pad_multiple=8, progress=False, log_every=None,
    )  # fmt: skip
    return TrainConfig(**{**settings, **overrides})


def _trainer(model, **overrides):
    config = _private_config(**overrides)
    return engine.Trainer(
        config, model, LOSS, trainable_mask=lora.trainable_mask(model),
        num_units=NUM_EXAMPLES, noise_key=jax.random.key(3),
    )  # fmt: skip


def _logits(model, tokens=TOKENS[:4], mask=MASK[:4]):
    return np.asarray(model(jnp.asarray(tokens), attention_mask=jnp.asarray(mask)))


# ---------------------------------------------------------------------------------------------
# Config, adapters, mask and merging.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rank": 0, "alpha": 1.0}, "rank"),
        ({"rank": 2.0, "alpha": 1.0}, "rank"),
        ({"rank": 2, "alpha": 0.0}, "alpha"),
        ({"rank": 2, "alpha": float("nan")}, "alpha"),
        ({"rank": 2, "alpha": 1.0, "targets": ()}, "targets"),
        ({"rank": 2, "alpha": 1.0, "targets": ("attention", "embedding")}, "targets"),
        ({"rank": 2, "alpha": 1.0, "targets": ("mlp", "mlp")}, "targets"),
        ({"rank": 2, "alpha": 1.0, "init_std": -1.0}, "init_std"),
    ],
)
def test_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        lora.LoraConfig(**kwargs)


def test_config_scaling_and_single_target():
    config = lora.LoraConfig(rank=4, alpha=2.0, targets="mlp")
    assert config.scaling == 0.5 and config.targets == ("mlp",)


def test_adapters_start_as_the_identity_and_only_where_targeted():
    base = GPT2(TINY, rngs=nnx.Rngs(0))
    before = _logits(base)
    model = lora.add_lora(base, lora.LoraConfig(rank=4, alpha=8.0, targets=("mlp",)),
                          rngs=nnx.Rngs(1))  # fmt: skip
    np.testing.assert_array_equal(_logits(model), before)
    for block in model.h:
        assert type(block.attn.c_attn) is nnx.Linear and type(block.attn.c_proj) is nnx.Linear
        assert isinstance(block.mlp.c_fc, lora.LoraLinear)
        assert isinstance(block.mlp.c_proj, lora.LoraLinear)
        assert block.mlp.c_fc.lora_a.kernel.shape == (TINY.n_embd, 4)
        assert block.mlp.c_fc.lora_b.kernel.shape == (4, TINY.mlp_dim)
        assert not np.any(np.asarray(block.mlp.c_fc.lora_b.kernel.value))
    with pytest.raises(ValueError, match="already has adapters"):
        lora.add_lora(model, lora.LoraConfig(rank=2, alpha=1.0, targets=("mlp",)),
                      rngs=nnx.Rngs(2))  # fmt: skip
    with pytest.raises(ValueError, match="rank 64 exceeds"):
        lora.add_lora(GPT2(TINY, rngs=nnx.Rngs(0)), lora.LoraConfig(rank=64, alpha=1.0),
                      rngs=nnx.Rngs(2))  # fmt: skip


def test_adapter_output_is_the_scaled_low_rank_update():
    # The layer's output minus the base layer's output is (α / r) · x A B, computed in float64.
    model = lora_model(random_b=True)
    layer = model.h[0].attn.c_attn
    x = np.random.default_rng(1).standard_normal((3, TINY.n_embd)).astype(np.float32)
    a = np.asarray(layer.lora_a.kernel.value, np.float64)
    b = np.asarray(layer.lora_b.kernel.value, np.float64)
    update = np.asarray(layer(jnp.asarray(x)), np.float64) - np.asarray(layer.base(x), np.float64)
    np.testing.assert_allclose(update, ADAPTERS.scaling * x @ a @ b, rtol=1e-4, atol=1e-5)
    # A's default initialisation: normal with standard deviation 1 / sqrt(d_in).
    a_all = np.concatenate([np.asarray(lay.lora_a.kernel.value).ravel() for lay in
                            (blk.mlp.c_fc for blk in model.h)])  # fmt: skip
    assert abs(np.std(a_all) * np.sqrt(TINY.n_embd) - 1.0) < 0.1


def test_mask_marks_exactly_the_adapters():
    model = lora_model()
    mask = lora.trainable_mask(model)
    flat = jax.tree_util.tree_flatten_with_path(mask)[0]
    for path, trainable in flat:
        assert trainable == ("lora_a" in jax.tree_util.keystr(path)
                             or "lora_b" in jax.tree_util.keystr(path))  # fmt: skip
    assert sum(trainable for _, trainable in flat) == 2 * 4 * TINY.n_layer
    with pytest.raises(ValueError, match="no LoRA adapters"):
        lora.trainable_mask(GPT2(TINY, rngs=nnx.Rngs(0)))


def test_merged_weights_give_the_adapted_outputs():
    model = lora_model(random_b=True)
    adapted = _logits(model)
    merged = lora.merge_lora(model)
    assert all(not isinstance(m, lora.LoraLinear) for _, m in nnx.iter_modules(merged))
    np.testing.assert_allclose(_logits(merged), adapted, rtol=1e-4, atol=1e-4)
    # The merged model has the plain GPT-2 layout; the adapted model is left unchanged.
    plain = nnx.state(GPT2(TINY, rngs=nnx.Rngs(0)), nnx.Param)
    assert jax.tree.structure(nnx.state(merged, nnx.Param)) == jax.tree.structure(plain)
    np.testing.assert_array_equal(_logits(model), adapted)
    with pytest.raises(ValueError, match="no LoRA adapters"):
        lora.merge_lora(merged)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=TINY.vocab_size, n_positions=TINY.n_positions, n_embd=TINY.n_embd,
        n_layer=TINY.n_layer, n_head=TINY.n_head, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    hf_model = transformers.GPT2LMHeadModel(config).eval()
    folder = tmp_path_factory.mktemp("hf_gpt2_lora")
    hf_model.save_pretrained(folder)
    with torch.no_grad():
        logits = hf_model(torch.tensor(TOKENS[:4].astype(np.int64))).logits.numpy()
    return folder, logits


def test_adapters_on_a_transformers_checkpoint(hf_folder):
    folder, hf_logits = hf_folder
    model = lora.lora_from_pretrained(folder, ADAPTERS, seed=5)
    ones = np.ones_like(MASK[:4])
    np.testing.assert_allclose(_logits(model, mask=ones), hf_logits, rtol=1e-4, atol=1e-4)
    base = GPT2.from_pretrained(folder)
    base_params = nnx.state(base, nnx.Param)
    merged = nnx.state(lora.merge_lora(model), nnx.Param)
    # B = 0: merging gives back the checkpoint's weights exactly.
    for a, b in zip(jax.tree.leaves(base_params), jax.tree.leaves(merged), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ---------------------------------------------------------------------------------------------
# Private training through the Trainer.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("level", ["example", "user"])
def test_private_training_moves_only_the_adapters(level):
    model = lora_model()
    before = nnx.state(model, nnx.Param)
    before = {jax.tree_util.keystr(p): np.asarray(v) for p, v in
              jax.tree_util.tree_flatten_with_path(before)[0]}  # fmt: skip
    extra = {"level": "user", "max_examples_per_user": 2} if level == "user" else {}
    trainer = _trainer(model, **extra)
    assert trainer.clipping == "ghost"  # "auto" selects the ghost tape for the adapters
    users = np.arange(NUM_EXAMPLES) // 2 if level == "user" else None
    data = engine.IndexedData(gather=gather, num_examples=NUM_EXAMPLES, user_ids=users)
    result = engine.fit(trainer, data, rng=np.random.default_rng(0))
    after = jax.tree_util.tree_flatten_with_path(nnx.state(result.model, nnx.Param))[0]
    changed = set()
    for path, value in after:
        name = jax.tree_util.keystr(path)
        if "lora_" in name:
            changed.add(name) if not np.array_equal(np.asarray(value), before[name]) else None
        else:
            assert np.asarray(value).tobytes() == before[name].tobytes(), name
    assert len(changed) == 2 * 4 * TINY.n_layer  # the noise moves every adapter


def _naive_clipped_sum(trainer, params, indices, mask, clip_norm):
    """Σ_units min(1, C/||g||)·g with g = jax.grad of the unit's mean example loss, one by one."""
    indices, mask = np.atleast_2d(indices.T).T, np.atleast_2d(mask.T).T  # (units, group)
    total = jax.tree.map(lambda x: np.zeros(x.shape, np.float64), params)
    norms = []
    for unit_rows, unit_mask in zip(indices, mask, strict=True):
        rows = unit_rows[unit_mask]
        if not len(rows):
            continue

        def unit_loss(p, rows=rows):
            model = trainer.split.merge(p, trainer.frozen, trainer.rest)
            return jnp.mean(jnp.stack([LOSS(model, gather(np.array([r])))[0] for r in rows]))

        grad = jax.tree.map(lambda g: np.asarray(g, np.float64), jax.grad(unit_loss)(params))
        norm = np.sqrt(sum(np.sum(g**2) for g in jax.tree.leaves(grad)))
        norms.append(norm)
        factor = min(1.0, clip_norm / norm)
        total = jax.tree.map(lambda t, g, f=factor: t + f * g, total, grad)
    return total, np.array(norms)


@pytest.mark.parametrize("clipping", ["ghost", "vmap"])
@pytest.mark.parametrize("level", ["example", "user"])
def test_clipped_sum_equals_a_naive_loop(clipping, level):
    model = lora_model(random_b=True)  # B != 0: A has gradients too
    extra = {"level": "user", "max_examples_per_user": 3} if level == "user" else {}
    if level == "user":
        indices = np.array([[0, 1, 2], [3, 4, -1], [5, -1, -1], [-1, -1, -1], [6, 7, 8]])
    else:
        indices = np.array([0, 1, 2, 3, 4, 5, -1, 6])
    mask = indices >= 0
    probe = _trainer(model, clipping=clipping, **extra)
    params = probe.init_state().params
    _, norms = _naive_clipped_sum(probe, params, indices, mask, 1.0)
    clip_norm = float(np.median(norms))  # about half the units are clipped
    trainer = _trainer(model, clipping=clipping, clip_norm=clip_norm, pad_multiple=indices.shape[0],
                       **extra)  # fmt: skip
    assert trainer.clipping == clipping
    expected, _ = _naive_clipped_sum(trainer, params, indices, mask, clip_norm)
    total = trainer.clipped_sum(params, gather, indices, mask)
    assert set(total) == set(expected) and all("lora_" in name for name in total)
    for name, value in total.items():
        np.testing.assert_allclose(value, expected[name], rtol=2e-4, atol=2e-6 * clip_norm)


class _FrozenThenLora(nnx.Module):
    """A frozen identity layer, then an adapted 16 x 16 layer (rank 8: Gram form for A and B)."""

    def __init__(self):
        self.frozen = nnx.Linear(16, 16, rngs=nnx.Rngs(0))
        self.frozen.kernel.value = jnp.eye(16)
        self.head = lora.LoraLinear(
            nnx.Linear(16, 16, rngs=nnx.Rngs(1)), rank=8, scaling=2.0, init_std=0.3,
            rngs=nnx.Rngs(2),
        )  # fmt: skip
        self.head.lora_b.kernel.value = jnp.asarray(
            np.random.default_rng(3).standard_normal((8, 16)), jnp.float32
        )

    def __call__(self, x):
        return self.head(self.frozen(x))


@pytest.mark.parametrize("clipping", ["auto", "vmap"])
@pytest.mark.parametrize("level", ["example", "user"])
def test_adversarial_units_move_the_adapter_sum_by_at_most_c(clipping, level):
    # Positions (example level) or a user's examples (user level) whose gradients nearly cancel
    # (see test_adversarial_clipping), through the Trainer with only the adapters trainable.
    x, v = cancelling(np.random.default_rng(7), 8, 2, 16, 16)
    if level == "user":  # user u's two examples are its two cancelling positions
        x, v = x.reshape(16, 1, 16), v.reshape(16, 1, 16)
        indices, mask = np.arange(16).reshape(8, 2), np.ones((8, 2), bool)
        mask[5, 1] = False
        extra = {"level": "user", "max_examples_per_user": 2}
    else:
        indices, mask, extra = np.arange(8), np.ones(8, bool), {}
    model = _FrozenThenLora()
    config = _private_config(
        clip_norm=CLIP, batch_size=4, pad_multiple=8, clipping=clipping, **extra
    )
    trainer = engine.Trainer(
        config, model, lambda m, b: jnp.sum(m(b["x"]) * b["v"], axis=(1, 2)),
        trainable_mask=lora.trainable_mask(model), num_units=8, noise_key=jax.random.key(0),
    )  # fmt: skip
    assert trainer.clipping == ("ghost" if clipping == "auto" else "vmap")

    def adversarial_gather(rows):
        rows = np.maximum(rows, 0)
        return {"x": x[rows], "v": v[rows]}

    def grad_sum(params, unit_indices, unit_mask):
        return trainer.clipped_sum(params, adversarial_gather, unit_indices, unit_mask), None

    params = trainer.init_state().params
    assert_sound(grad_sum, params, indices, mask)


def test_checkpoint_resume_of_a_lora_run_is_exact(tmp_path):
    data = engine.IndexedData(gather=gather, num_examples=NUM_EXAMPLES)
    config = {"steps": 4, "optimizer": "adam", "learning_rate": 0.01}
    reference = engine.fit(_trainer(lora_model(), **config), data, rng=np.random.default_rng(7))
    engine.fit(
        _trainer(lora_model(), **config), data, rng=np.random.default_rng(7),
        checkpointer=Checkpointer(tmp_path), until=2,
    )  # fmt: skip
    resumed = engine.fit(
        _trainer(lora_model(), **config), data, rng=np.random.default_rng(99),
        checkpointer=Checkpointer(tmp_path),
    )  # fmt: skip
    assert int(resumed.state.step) == 4 and resumed.ledger.count == 4
    for name, value in reference.state.params.items():
        assert np.asarray(value).tobytes() == np.asarray(resumed.state.params[name]).tobytes()
    assert resumed.ledger.epsilon(1e-5) == reference.ledger.epsilon(1e-5)


# ---------------------------------------------------------------------------------------------
# One-run audit: dirac canaries on adapter coordinates.
# ---------------------------------------------------------------------------------------------

CANARIES = 128
ORDINARY = 64


def _canary_loss(clip_norm):
    """LM loss; a canary example's loss is -C·A[coord] (layer 0's c_attn adapter A, flattened).

    B starts at zero, so ordinary examples barely move A: a canary's coordinate rises by
    lr·C / b each time it is sampled, and by little else.
    """

    def loss_fn(model, batch):
        flat = model.h[0].attn.c_attn.lora_a.kernel.value.reshape(-1)
        canary = -clip_norm * flat[batch["coord"]]
        return jnp.where(batch["is_canary"], canary, LOSS(model, batch))

    return loss_fn


def _audit_run(noise_multiplier, *, epsilon=None):
    rng = np.random.default_rng(11)
    included = rng.random(CANARIES) < 0.5
    coords = np.concatenate([np.zeros(ORDINARY, np.int32), np.flatnonzero(included)])
    n = len(coords)
    tokens, mask = _data(seed=1, n=n)
    is_canary = np.arange(n) >= ORDINARY

    def audit_gather(indices):
        rows = np.maximum(indices, 0)
        keep = indices >= 0
        return {
            "tokens": tokens[rows], "mask": mask[rows] * keep[:, None],
            "is_canary": is_canary[rows] & keep, "coord": coords[rows].astype(np.int32),
        }  # fmt: skip

    model = lora_model(config=lora.LoraConfig(rank=4, alpha=4.0, targets=("attention",)))
    start = np.asarray(model.h[0].attn.c_attn.lora_a.kernel.value).reshape(-1)
    assert start.size == CANARIES
    config = _private_config(
        steps=20, batch_size=32, learning_rate=1.0, clip_norm=1.0, pad_multiple=32,
        clipping="vmap", noise_multiplier=noise_multiplier, epsilon=epsilon,
    )  # fmt: skip
    trainer = engine.Trainer(
        config, model, _canary_loss(1.0), trainable_mask=lora.trainable_mask(model),
        num_units=n, noise_key=jax.random.key(int(rng.integers(2**31))),
    )  # fmt: skip
    data = engine.IndexedData(gather=audit_gather, num_examples=n)
    result = engine.fit(trainer, data, rng=np.random.default_rng(12))
    released = np.asarray(result.model.h[0].attn.c_attn.lora_a.kernel.value).reshape(-1)
    bound = audit.one_run_epsilon_lower_bound(released - start, included, delta=1e-5)
    return bound.epsilon, trainer.plan.spent().epsilon


def test_one_run_audit_of_private_lora_training():
    # The canary loss reads a parameter directly, which the vmap path differentiates (the ghost
    # tape sees layer outputs only), so this run is pinned to vmap.
    lower, claimed = _audit_run(None, epsilon=1.0)
    assert claimed == pytest.approx(1.0, rel=0.05)
    assert lower < claimed
    # Control: almost no noise. The same canaries are then told apart far above the claim.
    broken_lower, _ = _audit_run(0.01)
    assert broken_lower > claimed, broken_lower


# ---------------------------------------------------------------------------------------------
# The text pipeline and the command line.
# ---------------------------------------------------------------------------------------------


def test_text_pipeline_fine_tunes_lora_adapters(tmp_path):
    from dpmix_jax.pipeline.text import TextPipeline
    from dpmix_jax.pipeline.text_presets import text_task
    from tests.pipeline.test_text import three_domains, tiny_config

    task = three_domains(text_task(num_users=24, documents_per_user=(2, 4), max_chars=400))
    adapters = lora.LoraConfig(rank=2, alpha=4.0)
    config = tiny_config(finetune_lora=adapters, finetune_last_blocks=None)
    pipeline = TextPipeline(task, config, tmp_path, reproducible=True)
    init = pipeline.pretrained(None, 0)
    rows = np.arange(len(task.train))
    trainer, _ = pipeline.finetune_trainer(init, config.finetune, rows, jax.random.key(0))
    assert trainer.clipping == "ghost"
    assert all("lora_" in name for name in trainer.init_state().params)
    model, budget = pipeline.finetune(init, "random", "all", 1.0, 0)
    assert isinstance(model.h[0].mlp.c_fc, lora.LoraLinear)
    assert budget.epsilon == pytest.approx(1.0, rel=0.05)
    # The frozen pretrained weights are the ones the stage started from.
    frozen = nnx.state(lora.merge_lora(model), nnx.Param)["wte"]["embedding"].value
    np.testing.assert_array_equal(np.asarray(frozen), np.asarray(init.wte.embedding.value))
    np.testing.assert_array_equal(
        np.asarray(model.h[0].attn.c_attn.base.kernel.value),
        np.asarray(init.h[0].attn.c_attn.kernel.value),
    )
    with pytest.raises(ValueError, match="finetune_lora"):
        tiny_config(finetune_lora=adapters, finetune_last_blocks=1)


def test_demo_lora_rank_reaches_the_text_pipeline(monkeypatch, tmp_path, capsys):
    from dpmix_jax import cli, pipeline

    seen = {}

    def fake_comparison(stages, **kwargs):
        seen["config"] = stages.config
        (kwargs["out_dir"] / "results.md").write_text("")
        return {"runs": []}

    monkeypatch.setattr(pipeline, "run_comparison", fake_comparison)
    argv = ["demo", "text", "--lora-rank", "4", "--methods", "uniform", "--out", str(tmp_path)]
    assert cli.main(argv) == 0
    assert seen["config"].finetune_lora == lora.LoraConfig(rank=4, alpha=8.0)
    assert seen["config"].finetune_last_blocks is None
    for bad in (["demo", "--lora-rank", "4"], ["demo", "text", "--lora-rank", "0"]):
        with pytest.raises(SystemExit) as exit_info:
            cli.main([*bad, "--out", str(tmp_path)])
        assert exit_info.value.code == 2
        assert "--lora-rank" in capsys.readouterr().err
