"""Fine-tuned teachers: each adapter learns its own part only, and the batched, cached logits
equal a naive per-teacher forward pass."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from dpmix_jax.models import lora
from dpmix_jax.models.gpt2 import GPT2, GPT2Config
from dpmix_jax.synthesis.finetuned_teachers import (
    FineTunedTeachers,
    TeacherTuning,
    finetune_teachers,
)

CONTEXT, END = [1], [2]
DOCUMENTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13], [5, 6, 7, 8], [14, 15, 16], [17]]
PARTS = [[0, 3], [1, 2], [4, 5]]
TUNING = TeacherTuning(steps=25, learning_rate=3e-2, chunk=2)


def _model(n_layer: int = 2) -> GPT2:
    """A tiny GPT-2 whose tied embedding has a trained model's scale (at init, 0.02 per entry
    caps every logit near 1, which no adapter behind the frozen head could overcome)."""
    config = GPT2Config.tiny(vocab_size=24, n_positions=16, n_layer=n_layer)
    model = GPT2(config, rngs=nnx.Rngs(0))
    model.wte.embedding.value = model.wte.embedding.value * 20
    return model


def _teacher_model(teachers: FineTunedTeachers, i: int) -> GPT2:
    adapter = jax.tree.map(lambda x: x[i], teachers._adapters)
    return nnx.merge(teachers._graphdef, adapter, teachers._frozen)


def _next_logits(model: GPT2, tokens) -> jax.Array:
    return model(jnp.asarray([tokens], jnp.int32))[0, -1]


@pytest.fixture(scope="module")
def teachers():
    return finetune_teachers(_model(), DOCUMENTS, PARTS, context=CONTEXT, end=END, tuning=TUNING)


def test_batched_cached_logits_equal_each_teachers_own_forward_pass(teachers):
    for prefix in ([], [5], [5, 6], [5, 6, 7], [9]):  # extends the cache, then restarts it
        logits = teachers(prefix)
        assert logits.shape == (3, 24) and logits.dtype == jnp.float32
        for i in range(3):
            naive = _next_logits(_teacher_model(teachers, i), CONTEXT + prefix)
            np.testing.assert_allclose(logits[i], naive, rtol=2e-5, atol=2e-5)


def test_each_teacher_learns_its_own_documents(teachers):
    public = _model()
    after_5 = teachers([5])
    public_after_5 = jax.nn.log_softmax(_next_logits(public, CONTEXT + [5]))
    log_probs = jax.nn.log_softmax(after_5, axis=-1)
    # Teacher 0 saw "5 6 7 8" twice; teachers 1 and 2 never saw 5 followed by 6.
    assert log_probs[0, 6] > max(-1.0, public_after_5[6] + 1)
    assert log_probs[0, 6] > log_probs[1, 6] + 2 and log_probs[0, 6] > log_probs[2, 6] + 2
    after_9 = jax.nn.log_softmax(teachers([9]), axis=-1)
    assert after_9[1, 10] > -1.0 and after_9[1, 10] > after_9[0, 10] + 2


def test_one_teachers_documents_move_that_teacher_alone(teachers):
    """The privacy contract, to the last bit: teacher 1 gets a changed document and one more,
    longer than any before (so the ensemble's largest part and longest document both change),
    and only teacher 1's logits move."""
    changed = [list(d) for d in DOCUMENTS] + [[20, 21, 22, 23, 9, 10, 11, 12]]
    changed[2] = [20, 21, 22, 23]
    parts = [PARTS[0], [*PARTS[1], len(DOCUMENTS)], PARTS[2]]
    other = finetune_teachers(_model(), changed, parts, context=CONTEXT, end=END, tuning=TUNING)
    for prefix in ([], [5, 6], [20]):
        before, after = teachers(prefix), other(prefix)
        np.testing.assert_array_equal(before[0], after[0])
        np.testing.assert_array_equal(before[2], after[2])
        assert not np.allclose(before[1], after[1])


def test_a_teacher_without_documents_is_the_public_model():
    teachers = finetune_teachers(
        _model(), DOCUMENTS, [[0, 1, 2], []], context=CONTEXT, end=END, tuning=TUNING
    )
    np.testing.assert_allclose(
        teachers([5, 6])[1], _next_logits(_model(), CONTEXT + [5, 6]), rtol=1e-5, atol=1e-5
    )


def test_only_the_last_blocks_adapters_train():
    model = _model(n_layer=3)
    tuning = dataclasses.replace(TUNING, last_blocks=1, steps=3)
    teachers = finetune_teachers(model, DOCUMENTS, PARTS, context=CONTEXT, end=END, tuning=tuning)
    paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(teachers._adapters)[0]]
    blocks = {int(p[1].key) for p in paths}
    assert blocks == {2} and paths
    # The earlier blocks' adapters stay at B = 0: the frozen copy's B kernels are all zero.
    frozen_b = [
        leaf
        for path, leaf in jax.tree_util.tree_flatten_with_path(teachers._frozen)[0]
        if "lora_b" in jax.tree_util.keystr(path)
    ]
    assert frozen_b and all(not np.any(np.asarray(b)) for b in frozen_b)


def test_training_lowers_each_teachers_loss_on_its_own_documents(teachers):
    public = _model()

    def loss(model, part):
        total = 0.0
        for index in part:
            row = jnp.asarray([CONTEXT + DOCUMENTS[index] + END], jnp.int32)
            logits = model(row[:, :-1])[0, len(CONTEXT) - 1 :]
            targets = row[0, len(CONTEXT) :]
            total += float(optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean())
        return total / len(part)

    for i, part in enumerate(PARTS):
        assert loss(_teacher_model(teachers, i), part) < 0.5 * loss(public, part)


def test_the_public_model_is_left_unchanged():
    model = _model()
    before = nnx.state(model, nnx.Param)
    finetune_teachers(model, DOCUMENTS, PARTS, context=CONTEXT, end=END, tuning=TUNING)
    after = nnx.state(model, nnx.Param)
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
        np.testing.assert_array_equal(a, b)
    assert not any(isinstance(m, lora.LoraLinear) for _, m in model.iter_modules())


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(parts=[[0, 1, 2]]), "need at least 2 teachers"),
        (dict(context=[]), "context must hold at least one token"),
        (dict(documents=[[3] * 15, [4]]), "split it into shorter documents"),
        (dict(tuning=TeacherTuning(last_blocks=3)), "the model has 2 blocks"),
    ],
)
def test_bad_inputs_are_one_line_errors(kwargs, message):
    arguments = dict(documents=DOCUMENTS[:2], parts=[[0], [1]], context=CONTEXT, end=END)
    arguments |= kwargs
    with pytest.raises(ValueError, match=message):
        finetune_teachers(_model(), **arguments)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(steps=0), "steps"),
        (dict(last_blocks=0), "last_blocks"),
        (dict(chunk=1.5), "chunk"),
        (dict(learning_rate=0.0), "learning_rate must be > 0"),
        (dict(lora=8), "lora must be a LoraConfig"),
    ],
)
def test_bad_tuning_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TeacherTuning(**kwargs)


def test_a_prefix_longer_than_the_context_is_refused(teachers):
    with pytest.raises(ValueError, match="more than the model's 16"):
        teachers(list(range(3, 19)))
