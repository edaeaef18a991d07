"""InvisibleInk peer: the per-token mechanism, its zCDP analysis, calibration and decoding, and
agreement with the authors' package `invink` 0.1.0 on the same inputs."""

import dataclasses
import importlib
import importlib.util
import math
import pathlib
import shutil
import sys

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import optimize, special

from dpmix_jax.pate.peers import PeerResult
from dpmix_jax.pate.peers import invisibleink as ink
from dpmix_jax.pate.teachers import TableTeachers
from dpmix_jax.privacy import accounting as privacy

ORDERS = (1.0, 1.5, 2.0, 5.0, 20.0, 100.0)


def config(**overrides):
    settings_ = dict(clip_norm=1.0, max_new_tokens=8, num_teachers=4, delta=1e-6)
    return ink.InvisibleInkConfig(**{**settings_, **overrides})


def probabilities(teacher_logits, public_logits, *, clip_norm, temperature, top_k):
    log_probs = ink.token_log_probs(
        jnp.asarray(teacher_logits, jnp.float32),
        jnp.asarray(public_logits, jnp.float32),
        clip_norm=clip_norm,
        temperature=temperature,
        top_k=top_k,
    )
    return np.exp(np.asarray(log_probs, np.float64))


def naive_probabilities(teacher_logits, public_logits, *, clip_norm, temperature, top_k):
    """The mechanism written token by token and row by row, in float64."""
    teacher_logits = np.asarray(teacher_logits, np.float64)
    public_logits = np.asarray(public_logits, np.float64)
    n, vocab = teacher_logits.shape
    if top_k is None or top_k >= vocab:
        threshold = -math.inf
    else:
        threshold = sorted(public_logits, reverse=True)[top_k - 1] - 2 * clip_norm / n
    weights = np.zeros(vocab)
    for token in range(vocab):
        if public_logits[token] < threshold:
            continue
        total = 0.0
        for row in range(n):
            difference = teacher_logits[row, token] - public_logits[token]
            total += min(max(0.0 if math.isnan(difference) else difference, -clip_norm), clip_norm)
        weights[token] = math.exp((public_logits[token] + total / n) / temperature)
    return weights / weights.sum()


def renyi_divergence(p, q, alpha):
    """D_α(P‖Q) of two distributions on the same support (KL at α = 1)."""
    support = p > 0
    p, q = p[support], q[support]
    if alpha == 1.0:
        return float(np.sum(p * (np.log(p) - np.log(q))))
    return float(special.logsumexp(alpha * np.log(p) - (alpha - 1) * np.log(q)) / (alpha - 1))


def random_case(seed, n=3, vocab=6, spread=4.0):
    rng = np.random.default_rng(seed)
    public = rng.normal(0, spread, vocab).astype(np.float32)
    teachers = (public + rng.normal(0, spread, (n, vocab))).astype(np.float32)
    return teachers, public


# ---------------------------------------------------------------------------------------------
# The per-token mechanism.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("top_k", [None, 1, 2, 4, 6, 100])
@pytest.mark.parametrize("seed", range(4))
def test_log_probs_equal_a_token_by_token_computation(top_k, seed):
    teachers, public = random_case(seed, n=4)
    teachers[0, 0] = 1e4  # far outside ±C: clipped to +C
    teachers[1, 1] = -np.inf
    teachers[2, 2] = np.nan
    kwargs = dict(clip_norm=0.7, temperature=0.8, top_k=top_k)
    np.testing.assert_allclose(
        probabilities(teachers, public, **kwargs),
        naive_probabilities(teachers, public, **kwargs),
        atol=1e-6,
    )


def test_step_samples_follow_the_exact_distribution():
    teachers, public = random_case(7, n=3, vocab=5, spread=1.0)
    kwargs = dict(clip_norm=1.5, temperature=1.3, top_k=3)
    exact = naive_probabilities(teachers, public, **kwargs)
    keys = jax.random.split(jax.random.key(0), 40_000)
    draw = jax.vmap(lambda k: ink.step(k, teachers, public, **kwargs))
    counts = np.bincount(np.asarray(draw(keys)), minlength=5)
    assert counts[exact == 0].sum() == 0
    assert 0.5 * np.abs(counts / counts.sum() - exact).sum() < 0.015
    assert np.count_nonzero(exact) >= 3  # the case exercises the top-k+ band


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    top_k=st.integers(1, 5),
    clip_norm=st.floats(0.01, 5.0),
    num_teachers=st.integers(1, 4),
)
def test_top_k_plus_set_reads_only_the_public_logits(seed, top_k, clip_norm, num_teachers):
    rng = np.random.default_rng(seed)
    public = rng.normal(0, 2, 5).astype(np.float32)
    mask = np.asarray(
        ink.top_k_plus_mask(public, top_k=top_k, clip_norm=clip_norm, num_teachers=num_teachers)
    )
    for scale in (0.1, 10.0, 1e4):
        teachers = rng.normal(0, scale, (num_teachers, 5)).astype(np.float32)
        support = probabilities(teachers, public, clip_norm=clip_norm, temperature=1.0, top_k=top_k)
        np.testing.assert_array_equal(support > 0, mask)
    kth = np.sort(public)[::-1][top_k - 1]
    np.testing.assert_array_equal(mask, public >= kth - np.float32(2 * clip_norm / num_teachers))


# ---------------------------------------------------------------------------------------------
# Privacy analysis: the zCDP bound on exact output distributions of neighbouring inputs.
# ---------------------------------------------------------------------------------------------

adversarial_value = st.one_of(
    st.floats(-1e3, 1e3, width=32),
    st.sampled_from([np.inf, -np.inf, np.nan]),
)


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    num_teachers=st.integers(1, 4),
    vocab=st.integers(2, 6),
    top_k=st.one_of(st.none(), st.integers(1, 6)),
    clip_norm=st.floats(0.05, 3.0),
    temperature=st.floats(0.5, 2.0),
)
def test_replacing_one_row_costs_at_most_rho_per_token(
    data, num_teachers, vocab, top_k, clip_norm, temperature
):
    row = st.lists(adversarial_value, min_size=vocab, max_size=vocab)
    public = np.array(data.draw(st.lists(st.floats(-20, 20), min_size=vocab, max_size=vocab)))
    teachers = np.array([data.draw(row) for _ in range(num_teachers)], np.float32)
    neighbour = teachers.copy()
    neighbour[data.draw(st.integers(0, num_teachers - 1))] = data.draw(row)
    kwargs = dict(clip_norm=clip_norm, temperature=temperature, top_k=top_k)
    p = probabilities(teachers, public, **kwargs)
    q = probabilities(neighbour, public, **kwargs)
    np.testing.assert_array_equal(p > 0, q > 0)
    rho = ink.per_token_rho(
        config(clip_norm=clip_norm, temperature=temperature, num_teachers=num_teachers)
    )
    for alpha in ORDERS:
        for first, second in ((p, q), (q, p)):
            assert renyi_divergence(first, second, alpha) <= alpha * rho * (1 + 1e-4) + 1e-6


def worst_case_pair(clip_norm, num_teachers, temperature):
    """Row 0 pushes token 0 up and token 1 down as far as clipping allows; its neighbour does
    the opposite (two tokens, public logits 0, the other rows equal to the public ones)."""
    teachers = np.zeros((num_teachers, 2), np.float32)
    teachers[0] = (50.0, -50.0)
    neighbour = teachers.copy()
    neighbour[0] = (-50.0, 50.0)
    zero_out = teachers.copy()
    zero_out[0] = 0.0  # the row replaced by the public prompt's logits
    kwargs = dict(clip_norm=clip_norm, temperature=temperature, top_k=None)
    public = np.zeros(2, np.float32)
    return [probabilities(t, public, **kwargs) for t in (teachers, neighbour, zero_out)]


@pytest.mark.parametrize("alpha", [1.0, 2.0])
def test_worst_case_pair_attains_the_bound_and_exceeds_the_zero_out_rate(alpha):
    clip_norm, n, temperature = 0.1, 2, 1.0
    p, q, zero_out = worst_case_pair(clip_norm, n, temperature)
    rho = ink.per_token_rho(config(clip_norm=clip_norm, num_teachers=n, temperature=temperature))
    papers_rate = 0.5 * (clip_norm / (n * temperature)) ** 2
    assert rho == pytest.approx(4 * papers_rate)
    assert 0.98 * alpha * rho <= renyi_divergence(p, q, alpha) <= alpha * rho
    assert renyi_divergence(p, q, alpha) > 3.9 * alpha * papers_rate
    assert renyi_divergence(p, zero_out, alpha) <= alpha * papers_rate


def test_event_and_epsilon_are_the_rdp_accountant_of_the_composed_zcdp():
    cfg = config(clip_norm=0.5, num_teachers=5, temperature=0.7)
    rho = 2 * (0.5 / (5 * 0.7)) ** 2
    assert ink.per_token_rho(cfg) == pytest.approx(rho)
    assert ink.dp_event(cfg, steps=30) == dp_accounting.SelfComposedDpEvent(
        dp_accounting.ZCDpEvent(ink.per_token_rho(cfg)), 30
    )
    accountant = dp_accounting.rdp.RdpAccountant()
    accountant.compose(dp_accounting.ZCDpEvent(30 * rho))
    assert ink.epsilon(cfg, steps=30) == pytest.approx(accountant.get_epsilon(1e-6), rel=1e-9)
    assert ink.epsilon(cfg, steps=30, delta=1e-3) < ink.epsilon(cfg, steps=30)


# ---------------------------------------------------------------------------------------------
# Calibration.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("target", "steps", "n", "temperature"),
    [(0.5, 32, 4, 1.0), (1.0, 100, 8, 1.0), (4.0, 256, 16, 0.7), (20.0, 500, 3, 1.2)],
)
def test_calibrate_meets_the_target_tightly(target, steps, n, temperature):
    cfg = ink.calibrate(
        epsilon=target, delta=1e-6, max_new_tokens=steps, num_teachers=n, temperature=temperature
    )
    spent = ink.epsilon(cfg, steps=steps)
    assert spent <= target
    assert spent >= 0.999 * target
    looser = dataclasses.replace(cfg, clip_norm=cfg.clip_norm * 1.01)
    assert ink.epsilon(looser, steps=steps) > target
    assert (cfg.num_teachers, cfg.max_new_tokens, cfg.temperature) == (n, steps, temperature)


def test_calibrate_rejects_unreachable_or_invalid_targets():
    with pytest.raises(ValueError, match="epsilon must be in"):
        ink.calibrate(epsilon=1e-4, delta=1e-6, max_new_tokens=8, num_teachers=4)
    with pytest.raises(ValueError, match="epsilon must be a finite number"):
        ink.calibrate(epsilon=-1.0, delta=1e-6, max_new_tokens=8, num_teachers=4)
    with pytest.raises(ValueError, match="delta"):
        ink.calibrate(epsilon=1.0, delta=0.3, max_new_tokens=8, num_teachers=4)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("clip_norm", 0.0),
        ("clip_norm", math.nan),
        ("temperature", -1.0),
        ("top_k", 0),
        ("top_k", 2.5),
        ("top_k", True),
        ("max_new_tokens", 0),
        ("num_teachers", 0),
        ("num_teachers", 2.0),
        ("delta", 1.5),
        ("delta", 0.25),
    ],
)
def test_config_rejects_bad_settings_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field) as error:
        config(**{field: value})
    assert "\n" not in str(error.value)


# ---------------------------------------------------------------------------------------------
# Decoding.
# ---------------------------------------------------------------------------------------------

V = 6


def chain_teachers(n=3):
    """Every teacher continues t -> t + 1 (mod V) with probability ~1."""
    table = np.full((n, V, V), -30.0, np.float32)
    for t in range(V):
        table[:, t, (t + 1) % V] = 30.0
    return TableTeachers(table, start_token=0)


def uniform_public(prefix):
    return jnp.zeros(V)


def decoding_config(**overrides):
    return config(clip_norm=60.0, temperature=0.05, num_teachers=3, max_new_tokens=10, **overrides)


def test_generate_stops_on_eos_and_counts_forward_passes():
    cfg = decoding_config()
    result = ink.generate(
        chain_teachers(), uniform_public, prompt=[0], config=cfg, key=jax.random.key(1), eos_id=4
    )
    assert isinstance(result, PeerResult)
    assert result.tokens == [1, 2, 3, 4]
    assert result.stop_reason == "eos"
    assert result.sources == ["private"] * 4 and result.private_steps == 4
    assert (result.teacher_forward_passes, result.public_forward_passes) == (12, 4)
    assert result.event == ink.dp_event(cfg, steps=4)
    assert result.charges == {"steps": 4}
    assert result.epsilon == ink.epsilon(cfg, delta=cfg.delta, **result.charges)
    assert result.epsilon < ink.epsilon(cfg, delta=cfg.delta, **ink.worst_case_charges(cfg))
    assert result.delta == cfg.delta and result.seeded


def test_generate_stops_on_length_and_stop_sequences():
    cfg = decoding_config()
    teachers = chain_teachers()
    by_length = ink.generate(
        teachers, uniform_public, prompt=[2], config=cfg, key=jax.random.key(2)
    )
    assert by_length.tokens == [(3 + i) % V for i in range(10)]
    assert by_length.stop_reason == "max_new_tokens"
    assert by_length.teacher_forward_passes == 30
    assert by_length.charges == ink.worst_case_charges(cfg) == {"steps": 10}
    stopped = ink.generate(
        teachers,
        uniform_public,
        prompt=[2],
        config=cfg,
        key=jax.random.key(2),
        stop_sequences=[(5, 0)],
    )
    assert stopped.tokens == [3, 4, 5, 0] and stopped.stop_reason == "stop_sequence"


def test_generate_reproduces_with_the_same_key_and_is_secret_without_one():
    rng = np.random.default_rng(3)
    teachers = TableTeachers(rng.normal(0, 1, (4, V, V)).astype(np.float32))
    cfg = config(clip_norm=1.0, num_teachers=4, max_new_tokens=12, top_k=4)
    runs = [
        ink.generate(teachers, uniform_public, prompt=[], config=cfg, key=jax.random.key(s))
        for s in (5, 5, 6)
    ]
    assert runs[0].tokens == runs[1].tokens != runs[2].tokens
    secret = ink.generate(teachers, uniform_public, prompt=[], config=cfg)
    assert not secret.seeded and len(secret.tokens) == 12


def test_generate_rejects_inconsistent_inputs_before_sampling():
    teachers = chain_teachers(n=3)
    with pytest.raises(ValueError, match="num_teachers"):
        ink.generate(teachers, uniform_public, prompt=[0], config=config(num_teachers=4))
    with pytest.raises(ValueError, match="non-finite"):
        ink.generate(
            teachers,
            lambda prefix: jnp.full(V, -jnp.inf),
            prompt=[0],
            config=decoding_config(),
        )
    with pytest.raises(ValueError, match="empty sequence"):
        ink.generate(
            teachers, uniform_public, prompt=[0], config=decoding_config(), stop_sequences=[()]
        )


# ---------------------------------------------------------------------------------------------
# Agreement with the authors' package.
# ---------------------------------------------------------------------------------------------

# invink 0.1.0's utils.py holds one f-string with nested double quotes, which only Python >= 3.12
# parses; on older Pythons the package is imported from a copy with that expression's inner
# quotes made single (a log message; nothing else changes).
_NESTED_QUOTES = '{"all devices" if device_map == "auto" else device_map}'
_SINGLE_QUOTES = "{'all devices' if device_map == 'auto' else device_map}"


@pytest.fixture(scope="module")
def invink(tmp_path_factory):
    spec = importlib.util.find_spec("invink")
    if spec is None:
        pytest.skip("invink is not installed (pip install invink==0.1.0)")
    try:
        importlib.import_module("invink")
        added = None
    except SyntaxError as error:
        source_dir = spec.submodule_search_locations[0]
        added = str(tmp_path_factory.mktemp("invink_py311"))
        copy = shutil.copytree(source_dir, f"{added}/invink")
        utils_path = pathlib.Path(copy, "utils.py")
        utils_text = utils_path.read_text()
        if utils_text.count(_NESTED_QUOTES) != 1:
            pytest.skip(f"invink cannot be imported on this Python: {error}")
        utils_path.write_text(utils_text.replace(_NESTED_QUOTES, _SINGLE_QUOTES))
        sys.path.insert(0, added)
        importlib.invalidate_caches()
        importlib.import_module("invink")
    yield sys.modules["invink.utils"], sys.modules["invink.generate"]
    if added is not None:
        sys.path.remove(added)
        for name in [m for m in sys.modules if m == "invink" or m.startswith("invink.")]:
            del sys.modules[name]


def package_probabilities(utils, teacher_logits, public_logits, *, clip, temperature, k, batch):
    """The package's per-token code path (`invink.generate`'s loop body) as a distribution."""
    clipped = utils.difference_clip(logit=teacher_logits, publogit=public_logits, clip_norm=clip)
    average = np.mean(clipped, axis=0)
    mask, _ = utils.get_topk(pub_logits=public_logits, k=k, clip=clip, batch=batch)
    return special.softmax(np.where(mask, average, -np.inf) / temperature)


@pytest.mark.parametrize("seed", range(5))
def test_clipped_average_and_top_k_plus_mask_match_invink(invink, seed):
    utils, _ = invink
    teachers, public = random_case(seed, n=4, vocab=6)
    teachers[seed % 4, seed % 6] = -1e4
    clip = 0.3 + seed
    np.testing.assert_allclose(
        np.asarray(ink.clipped_mean_logits(teachers, public, clip)),
        np.mean(utils.difference_clip(logit=teachers, publogit=public, clip_norm=clip), axis=0),
        atol=1e-5,
    )
    for k in range(1, 7):
        for batch in (1, 4, 5):
            theirs, _ = utils.get_topk(pub_logits=public, k=k, clip=clip, batch=batch)
            ours = ink.top_k_plus_mask(public, top_k=k, clip_norm=clip, num_teachers=batch)
            np.testing.assert_array_equal(np.asarray(ours), theirs)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("top_k", [None, 2, 4])
def test_step_distribution_matches_invink_code_path(invink, seed, top_k):
    utils, _ = invink
    teachers, public = random_case(seed, n=3, vocab=6, spread=2.0)
    temperature = 0.6 + 0.2 * seed
    ours = probabilities(teachers, public, clip_norm=1.2, temperature=temperature, top_k=top_k)
    theirs = package_probabilities(
        utils,
        teachers.astype(np.float64),
        public.astype(np.float64),
        clip=1.2,
        temperature=temperature,
        k=6 if top_k is None else top_k,
        batch=3,
    )
    np.testing.assert_allclose(ours, theirs, atol=2e-6)


def test_zcdp_conversion_is_invinks_on_a_grid_of_orders(invink):
    utils, _ = invink
    for rho in np.geomspace(1e-5, 30, 8):
        for delta in (1e-5, 1e-9):
            ours = privacy.epsilon(dp_accounting.ZCDpEvent(rho), delta=delta, accountant="rdp")
            theirs = utils.cdp_eps(float(rho), delta)
            assert theirs * (1 - 1e-9) <= ours <= theirs * 1.1
            if theirs >= 0.5:
                assert ours <= theirs * 1.002


@pytest.mark.parametrize(("steps", "n", "temperature"), [(64, 4, 1.0), (300, 8, 0.8)])
def test_epsilon_and_calibrate_equal_invinks_at_twice_the_clip(invink, steps, n, temperature):
    utils, _ = invink
    cfg = config(clip_norm=0.4, num_teachers=n, temperature=temperature, max_new_tokens=steps)
    assert ink.per_token_rho(cfg) == pytest.approx(4 * utils.compute_rho(1, 0.4, n, temperature))
    theirs = utils.get_epsilon(steps, 0.8, n + 1, temperature, 1e-6)
    assert theirs <= ink.epsilon(cfg, steps=steps) <= theirs * 1.002
    calibrated = ink.calibrate(
        epsilon=2.0, delta=1e-6, max_new_tokens=steps, num_teachers=n, temperature=temperature
    )
    their_clip = utils.get_clip(2.0, steps, temperature, n + 1, 1e-6)
    assert calibrated.clip_norm <= their_clip / 2 * (1 + 1e-4)
    assert calibrated.clip_norm == pytest.approx(their_clip / 2, rel=2e-3)


def tiny_gpt2_folder(path, vocab_words):
    """A random one-layer GPT-2 and a word-level tokenizer with a chat template, saved in `path`."""
    tokenizers = pytest.importorskip("tokenizers")
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    vocab = {word: i for i, word in enumerate(vocab_words)}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<pad>", unk_token="<pad>"
    )
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}assistant : {% endif %}"
    )
    model_config = transformers.GPT2Config(
        n_layer=1,
        n_embd=32,
        n_head=2,
        vocab_size=len(vocab_words),
        n_positions=256,
        initializer_range=0.5,
        eos_token_id=0,
        bos_token_id=0,
        pad_token_id=1,
    )
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(model_config).save_pretrained(path)
    fast.save_pretrained(path)


def test_invink_generate_runs_offline_and_agrees_with_ours(invink, tmp_path, monkeypatch):
    utils, generate_module = invink
    words = ["<eos>", "<pad>", "system", "user", "assistant", ":"] + [f"w{i}" for i in range(34)]
    tiny_gpt2_folder(tmp_path, words)
    calls = []

    def recording_clip(*, logit, publogit, clip_norm):
        calls.append({"teachers": logit, "public": publogit, "clip": clip_norm})
        return utils.difference_clip(logit=logit, publogit=publogit, clip_norm=clip_norm)

    def recording_topk(*, pub_logits, k, clip, batch):
        mask, band = utils.get_topk(pub_logits=pub_logits, k=k, clip=clip, batch=batch)
        calls[-1].update(mask=mask, k=k, batch=batch)
        return mask, band

    monkeypatch.setattr(generate_module, "difference_clip", recording_clip)
    monkeypatch.setattr(generate_module, "get_topk", recording_topk)
    references = ["w1 w2 w3 w4", "w5 w6 w7", "w8 w9 w10 w11", "w12 w13", "w14 w15", "w16 w17"]
    out = generate_module.generate(
        references,
        model_name_or_path=str(tmp_path),
        dataset_desc="w20 w21",
        system_prompt="w22",
        pub_prompt="w23 {}",
        prv_prompt="w24 {} w25 {}",
        epsilon=2.0,
        batch_size=4,
        num=2,
        max_toks=6,
        delta=1e-5,
        temperature=1.0,
        topk=3,
        dtype="float32",
        device_map=-1,
        allow_download=False,
        print_text=True,
    )
    n, temperature, top_k = 3, 1.0, 3  # batch_size 4 = 3 references + the public prompt
    assert len(calls) == sum(out.lens)
    clip = calls[0]["clip"]
    assert clip == pytest.approx(utils.get_clip(2.0, 6, temperature, n + 1, 1e-5))
    their_sizes, our_sizes = [], []
    for call in calls:
        assert (call["k"], call["batch"]) == (top_k, n + 1)
        public = call["public"].astype(np.float32)
        teachers = call["teachers"].astype(np.float32)
        their_mask = call["mask"]
        np.testing.assert_array_equal(
            np.asarray(
                ink.top_k_plus_mask(public, top_k=top_k, clip_norm=clip, num_teachers=n + 1)
            ),
            their_mask,
        )
        ours = probabilities(teachers, public, clip_norm=clip, temperature=temperature, top_k=top_k)
        assert np.all(ours[their_mask] > 0)
        theirs = package_probabilities(
            utils, teachers, public, clip=clip, temperature=temperature, k=top_k, batch=n + 1
        )
        np.testing.assert_allclose(
            np.where(their_mask, ours, 0) / ours[their_mask].sum(), theirs, atol=1e-5
        )
        their_sizes.append(their_mask.sum())
        our_sizes.append(np.count_nonzero(ours))
    assert out.topk_avg == pytest.approx(np.mean(their_sizes))
    assert np.mean(our_sizes) >= out.topk_avg
    assert 3 <= np.mean(their_sizes) < len(words) / 2  # a real truncation, not the full vocabulary
    for length, spent in zip(out.lens, out.epsilon_spent, strict=True):
        half_clip = config(clip_norm=clip / 2, num_teachers=n, delta=1e-5, max_new_tokens=6)
        assert spent <= ink.epsilon(half_clip, steps=length) <= spent * 1.002
        full_clip = dataclasses.replace(half_clip, clip_norm=clip)
        assert ink.epsilon(full_clip, steps=length) == pytest.approx(
            utils.get_epsilon(length, 2 * clip, n + 1, temperature, 1e-5), rel=2e-3
        )


# --- The disjoint setting: one batch of rows per text, parallel composition ---------------------


def run_settings(**overrides):
    from dpmix_jax.pate.method import RunSettings

    base = dict(
        epsilon=1.0, delta=1e-5, num_samples=4, max_new_tokens=6, num_teachers=10, vocab_size=5
    )
    return RunSettings(**{**base, **overrides})


@pytest.mark.parametrize("n, texts", [(10, 4), (8, 8), (64, 9), (5, 1)])
def test_text_batches_are_disjoint_cover_the_rows_and_differ_by_at_most_one(n, texts):
    batches = ink.text_batches(n, texts)
    assert len(batches) == texts
    rows = np.concatenate(batches)
    assert sorted(rows.tolist()) == list(range(n))  # disjoint and covering
    sizes = [len(b) for b in batches]
    assert min(sizes) == n // texts and max(sizes) - min(sizes) <= 1


def test_text_batches_refuse_fewer_rows_than_texts():
    with pytest.raises(ValueError, match="num_teachers must be at least num_samples = 5"):
        ink.text_batches(4, 5)
    with pytest.raises(ValueError, match="num_teachers must be at least num_samples"):
        ink.DISJOINT_METHOD.calibrate(run_settings(num_teachers=3, num_samples=4))


def test_changing_one_row_changes_only_the_text_of_its_batch():
    """Text i reads only batch i: with the same keys, one row changed arbitrarily leaves every
    other text bit for bit, and moves its own text under some key."""
    rng = np.random.default_rng(0)
    table = rng.normal(0, 1, (10, 5, 5)).astype(np.float32)
    method = ink.DISJOINT_METHOD
    plan = method.calibrate(run_settings(epsilon=10.0, num_teachers=10, num_samples=4))
    public = lambda prefix: jnp.zeros(5)  # noqa: E731
    keys = [jax.random.key(seed) for seed in range(4)]
    before = [method.generate(plan, TableTeachers(table), public, prompt=[0], key=k) for k in keys]
    for text, rows in enumerate(ink.text_batches(10, 4)):
        changed = table.copy()
        changed[rows[-1]] = -1e9  # one row: every token at -C but token 3 at +C
        changed[rows[-1], :, 3] = 1e9
        moved = False
        for key, texts in zip(keys, before, strict=True):
            after = method.generate(plan, TableTeachers(changed), public, prompt=[0], key=key)
            for other in range(4):
                if other != text:
                    assert after[other].tokens == texts[other].tokens
            moved |= after[text].tokens != texts[text].tokens
        assert moved


def test_disjoint_run_costs_its_costliest_text_by_the_zcdp_closed_form():
    """Planned ε: ρ = T · 2 (C / (Bτ))² on the smallest batch B = ⌊n/N⌋, not N·T tokens, and
    every text's ε is its own tokens' on its own batch. The accountant's ε is at least the
    continuous optimum of Canonne, Kamath and Steinke's conversion, within 1% of it, and below
    the closed form ρ + 2√(ρ log(1/δ)) (Bun and Steinke 2016)."""
    run = run_settings(epsilon=2.0, num_teachers=10, num_samples=4, max_new_tokens=6)
    plan = ink.DISJOINT_METHOD.calibrate(run)
    config = plan.config
    assert config.num_teachers == 2 and plan.mechanism["batches"] == "disjoint"
    rho = 6 * 2 * (config.clip_norm / 2) ** 2
    closed_form = rho + 2 * math.sqrt(rho * math.log(1 / 1e-5))
    optimum = optimize.minimize_scalar(
        lambda a: a * rho + (math.log(1e5) + (a - 1) * math.log1p(-1 / a) - math.log(a)) / (a - 1),
        bounds=(1.01, 200),
        method="bounded",
    ).fun
    assert optimum <= plan.planned_epsilon <= min(1.01 * optimum, closed_form)
    assert 0.999 * 2.0 <= plan.planned_epsilon <= 2.0
    rng = np.random.default_rng(3)
    teachers = TableTeachers(rng.normal(0, 1, (10, 5, 5)).astype(np.float32))
    public = lambda prefix: jnp.asarray(rng.normal(0, 1, 5), jnp.float32)  # noqa: E731
    samples = ink.DISJOINT_METHOD.generate(plan, teachers, public, prompt=[0], key=None)
    for sample, rows in zip(samples, ink.text_batches(10, 4), strict=True):
        own = dataclasses.replace(config, num_teachers=len(rows))
        assert sample.epsilon == ink.epsilon(own, steps=len(sample.tokens))
    spent = ink.DISJOINT_METHOD.charge(plan, samples)
    assert spent.epsilon == max(s.epsilon for s in samples) <= plan.planned_epsilon
    assert spent.num_queries == sum(len(s.tokens) for s in samples)
    assert spent.teacher_forward_passes == 10 * spent.num_queries  # every call runs all n rows


@pytest.mark.parametrize("texts, tokens", [(9, 32), (18, 16), (4, 8)])
def test_clip_same_rows_is_smaller_by_root_n_native_batches_larger(texts, tokens):
    """At ε = 1 on 64 rows the shared setting's clip is C; split into N batches of 64/N rows it
    is C/√N (each text has N times fewer rows but N times fewer tokens to compose); with the
    package's native batches, 64 references per text (64·N units, one per row), it is √N·C."""
    budget = dict(epsilon=1.0, delta=1e-5)
    shared = ink.METHOD.calibrate(
        run_settings(**budget, num_samples=texts, max_new_tokens=tokens, num_teachers=64)
    ).config.clip_norm
    same_rows = ink.DISJOINT_METHOD.calibrate(
        run_settings(**budget, num_samples=texts, max_new_tokens=tokens, num_teachers=64 * 1)
    ).config
    native = ink.DISJOINT_METHOD.calibrate(
        run_settings(**budget, num_samples=texts, max_new_tokens=tokens, num_teachers=64 * texts)
    ).config.clip_norm
    expected_same = shared / math.sqrt(texts) * (64 // texts) * texts / 64
    assert same_rows.clip_norm == pytest.approx(expected_same, rel=2e-3)
    assert native == pytest.approx(shared * math.sqrt(texts), rel=2e-3) and native > shared
