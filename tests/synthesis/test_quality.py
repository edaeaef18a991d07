"""Text-quality measures: hand-computed shares and distinct-n, MAUVE on near and far samples,
the GPT-2 featuriser against the model's own forward pass, and downstream accuracy."""

import importlib
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dpmix_jax.data.tokenizer import train_bpe_tokenizer
from dpmix_jax.models.gpt2 import GPT2, GPT2Config
from dpmix_jax.models.llama import Llama, LlamaConfig
from dpmix_jax.synthesis import quality

SPORT = [
    "goal",
    "match",
    "team",
    "score",
    "player",
    "coach",
    "league",
    "season",
    "win",
    "ball",
    "kick",
    "referee",
    "stadium",
]
COOKING = [
    "oven",
    "flour",
    "sugar",
    "butter",
    "recipe",
    "bake",
    "salt",
    "pepper",
    "onion",
    "garlic",
    "simmer",
    "boil",
    "spoon",
]
FILLER = ["the", "a", "of", "and", "to", "in", "with"]
TOY_VOCABULARY = sorted({*SPORT, *COOKING, *FILLER})


def topic_texts(topic, count, seed):
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(topic + FILLER, size=rng.integers(4, 20))) for _ in range(count)]


_PROJECTION = np.random.default_rng(0).normal(size=(len(TOY_VOCABULARY), 16))


def bag_of_words_features(texts):
    counts = np.zeros((len(texts), len(TOY_VOCABULARY)))
    for row, text in enumerate(texts):
        for word in quality.words(text):
            counts[row, TOY_VOCABULARY.index(word)] += 1
    return counts @ _PROJECTION


@pytest.fixture(scope="module")
def samples():
    return {
        "sport": topic_texts(SPORT, 200, 1),
        "sport_again": topic_texts(SPORT, 200, 2),
        "cooking": topic_texts(COOKING, 200, 3),
    }


@pytest.fixture(scope="module")
def tiny_gpt2(samples):
    tokenizer = train_bpe_tokenizer(samples["sport"] + samples["cooking"], vocab_size=300)
    model = GPT2(GPT2Config.tiny(n_positions=64), rngs=nnx.Rngs(0))
    return model, tokenizer


def test_words_are_lowercased_letter_digit_runs_joined_by_inner_apostrophes():
    assert quality.words("Don't STOP_now, e-mail 42x ok'") == [
        "don't",
        "stop",
        "now",
        "e",
        "mail",
        "42x",
        "ok",
    ]


def test_vocabulary_share_counts_every_occurrence_against_the_lowercased_vocabulary():
    texts = ["The cat sat.", "A dog sat on THE mat"]
    # 9 words; the, sat, sat, the, mat are in the vocabulary.
    assert quality.vocabulary_share(texts, {"The", "sat", "mat"}) == pytest.approx(5 / 9)
    assert quality.corpus_vocabulary(texts) == frozenset(
        {"the", "cat", "sat", "a", "dog", "on", "mat"}
    )
    assert quality.vocabulary_share(texts, quality.corpus_vocabulary(texts)) == 1.0
    with pytest.raises(ValueError, match="no words"):
        quality.vocabulary_share(["", "?!"], {"the"})


@pytest.mark.parametrize(
    ("texts", "n", "expected"),
    [
        (["a b a b", "a b c"], 1, 3 / 7),
        (["a b a b", "a b c"], 2, 3 / 5),  # ab ba ab | ab bc
        (["a b a b", "a b c"], 3, 3 / 3),
        (["a b a b", "a b c"], 4, 1 / 1),
        (["a b", "a b"], 2, 1 / 2),  # no "b a" across the two texts
        (["a", "b c"], 2, 1 / 1),  # a one-word text has no bigram
    ],
)
def test_distinct_n_by_hand(texts, n, expected):
    assert quality.distinct_n(texts, n) == pytest.approx(expected)


def test_distinct_n_rejects_a_bad_order_and_texts_without_ngrams():
    with pytest.raises(ValueError, match="no text holds 5 words"):
        quality.distinct_n(["a b a b", "a b c"], 5)
    with pytest.raises(ValueError, match="positive int"):
        quality.distinct_n(["a b"], 0)


def test_mauve_is_one_against_itself_high_for_two_samples_of_a_topic_low_across_topics(samples):
    def score(p, q):
        return quality.mauve_score(p, q, featurize=bag_of_words_features, seed=0)

    itself = score(samples["sport"], samples["sport"])
    same_topic = score(samples["sport"], samples["sport_again"])
    other_topic = score(samples["sport"], samples["cooking"])
    assert itself.mauve == pytest.approx(1.0)
    assert same_topic.mauve > 0.9
    assert other_topic.mauve < 0.2
    assert same_topic.num_buckets == 20 and same_topic.num_p == same_topic.num_q == 200
    assert sum(same_topic.p_histogram) == pytest.approx(1.0)
    assert score(samples["sport"], samples["sport_again"]) == same_topic


def test_mauve_featurizes_here_and_never_loads_a_model(samples, monkeypatch):
    mauve_module = importlib.import_module("mauve.compute_mauve")

    def no_model(*args, **kwargs):
        raise AssertionError("mauve tried to load a model")

    for name in ("get_model", "get_tokenizer"):
        monkeypatch.setattr(mauve_module, name, no_model, raising=False)
    result = quality.mauve_score(
        samples["sport"][:30], samples["cooking"][:40], featurize=bag_of_words_features, seed=1
    )
    assert result.num_buckets == 3


def test_mauve_rejects_too_few_texts_bad_buckets_and_bad_features(samples):
    sport = samples["sport"]
    with pytest.raises(ValueError, match="at least 20 texts on each side, got 19 and 200"):
        quality.mauve_score(sport[:19], sport, featurize=bag_of_words_features, seed=0)
    with pytest.raises(ValueError, match=r"num_buckets must be an int in \[2, 30\]"):
        quality.mauve_score(
            sport[:30], sport, featurize=bag_of_words_features, seed=0, num_buckets=31
        )
    with pytest.raises(ValueError, match="one row per text"):
        quality.mauve_score(sport, sport, featurize=lambda texts: np.zeros((3, 2)), seed=0)
    with pytest.raises(ValueError, match="non-finite"):
        quality.mauve_score(
            sport, sport, featurize=lambda texts: np.full((len(texts), 2), np.nan), seed=0
        )


def test_last_token_features_are_the_last_token_state_the_model_reads_its_logits_from(tiny_gpt2):
    model, tokenizer = tiny_gpt2
    featurize = quality.last_token_features(model, tokenizer, max_tokens=64, batch_size=4)
    text = "the coach and the team kick the ball"
    ids = tokenizer.encode(text)
    features = featurize([text])
    logits = model(jnp.asarray([ids]))[0, -1]
    np.testing.assert_allclose(model.wte.attend(features[0]), logits, atol=1e-4, rtol=1e-4)


def test_last_token_features_do_not_depend_on_padding_or_batch_neighbours(tiny_gpt2):
    model, tokenizer = tiny_gpt2
    featurize = quality.last_token_features(model, tokenizer, max_tokens=64, batch_size=2)
    short = "the goal"
    longer = ["the coach and the team kick the ball", "salt pepper onion garlic simmer boil"]
    alone = featurize([short])[0]
    batch = featurize([longer[0], short, longer[1]])
    np.testing.assert_allclose(batch[1], alone, atol=1e-5)
    np.testing.assert_allclose(batch[0], featurize([longer[0]])[0], atol=1e-5)
    assert not np.allclose(batch[0], batch[2], atol=1e-3)


@pytest.fixture(scope="module")
def tiny_llama(tiny_gpt2):
    _, tokenizer = tiny_gpt2
    config = LlamaConfig.tiny(vocab_size=512, max_position_embeddings=64, tie_word_embeddings=True)
    return Llama(config, rngs=nnx.Rngs(1)), tokenizer


def test_llama_features_are_the_state_its_head_reads_and_ignore_padding(tiny_llama):
    model, tokenizer = tiny_llama
    featurize = quality.last_token_features(model, tokenizer, max_tokens=64, batch_size=2)
    texts = ["the goal", "the coach and the team kick the ball", "salt pepper onion"]
    features = featurize(texts)
    assert features.shape == (3, model.config.hidden_size)
    for text, feature in zip(texts, features, strict=True):
        logits = model(jnp.asarray([tokenizer.encode(text)]))[0, -1]
        head = model.embed_tokens.attend(jnp.asarray(feature))
        np.testing.assert_allclose(head, logits, atol=1e-4, rtol=1e-4)
        np.testing.assert_allclose(featurize([text])[0], feature, atol=1e-5)


def test_last_token_features_compile_once_per_length_bucket(tiny_gpt2, caplog):
    model, tokenizer = tiny_gpt2
    featurize = quality.last_token_features(model, tokenizer, max_tokens=64, batch_size=8)
    words = " ".join(SPORT * 5).split()
    texts = [" ".join(words[:k]) for k in range(1, 40, 3)]
    lengths = {len(ids) for ids in tokenizer.encode_batch(texts)}
    assert len(lengths) > 6 and max(lengths) > 32

    def compiles(texts):
        caplog.clear()
        with caplog.at_level(logging.WARNING), jax.log_compiles():
            featurize(texts)
        messages = [record.getMessage() for record in caplog.records]
        return sum(m.startswith("Compiling jit(pooled_states)") for m in messages)

    assert 1 <= compiles(texts) <= 3  # buckets 16, 32, 64
    assert compiles([" ".join(words[:k]) for k in range(2, 40, 5)]) == 0


def test_mean_token_features_are_the_mean_of_the_states_the_model_reads_its_logits_from(
    tiny_gpt2,
):
    # The head is linear, so the head of the mean state is the mean of every position's logits.
    model, tokenizer = tiny_gpt2
    featurize = quality.mean_token_features(model, tokenizer, max_tokens=64, batch_size=4)
    for text in ("the coach and the team kick the ball", "salt"):
        logits = model(jnp.asarray([tokenizer.encode(text)]))[0]
        mean_logits = model.wte.attend(jnp.asarray(featurize([text])[0]))
        np.testing.assert_allclose(mean_logits, logits.mean(0), atol=1e-4, rtol=1e-4)


def test_llama_mean_features_are_the_mean_state_and_ignore_padding_and_neighbours(tiny_llama):
    model, tokenizer = tiny_llama
    featurize = quality.mean_token_features(model, tokenizer, max_tokens=64, batch_size=2)
    texts = ["the goal", "the coach and the team kick the ball", "salt pepper onion"]
    features = featurize(texts)
    for text, feature in zip(texts, features, strict=True):
        logits = model(jnp.asarray([tokenizer.encode(text)]))[0]
        head = model.embed_tokens.attend(jnp.asarray(feature))
        np.testing.assert_allclose(head, logits.mean(0), atol=1e-4, rtol=1e-4)
        np.testing.assert_allclose(featurize([text])[0], feature, atol=1e-5)
    last = quality.last_token_features(model, tokenizer, max_tokens=64)(texts)
    assert not np.allclose(features[1], last[1], atol=1e-3)


FEATURISERS = {"last": quality.last_token_features, "mean": quality.mean_token_features}


@pytest.mark.parametrize("pooling", sorted(FEATURISERS))
def test_token_features_keep_the_first_max_tokens_tokens(tiny_gpt2, pooling):
    model, tokenizer = tiny_gpt2
    featurize = FEATURISERS[pooling](model, tokenizer, max_tokens=20)
    text = " ".join(SPORT * 3)
    ids = tokenizer.encode(text)
    assert len(ids) > 20
    logits = model(jnp.asarray([ids[:20]]))[0]
    expected = logits[-1] if pooling == "last" else logits.mean(0)
    np.testing.assert_allclose(
        model.wte.attend(featurize([text])[0]), expected, atol=1e-4, rtol=1e-4
    )


@pytest.mark.parametrize("pooling", sorted(FEATURISERS))
def test_token_features_reject_empty_texts_and_bad_settings(tiny_gpt2, pooling):
    model, tokenizer = tiny_gpt2
    name = f"{pooling}_token_features"
    with pytest.raises(
        ValueError, match=rf"{name}: max_tokens must be an int in \[1, n_positions = 64\]"
    ):
        FEATURISERS[pooling](model, tokenizer, max_tokens=65)
    with pytest.raises(ValueError, match=f"{name}: batch_size must be a positive int"):
        FEATURISERS[pooling](model, tokenizer, max_tokens=16, batch_size=0)
    featurize = FEATURISERS[pooling](model, tokenizer, max_tokens=16)
    with pytest.raises(ValueError, match=f"{name}: text 1 has no tokens"):
        featurize(["the goal", ""])


def test_mauve_on_tiny_gpt2_features_separates_topics(samples, tiny_gpt2):
    model, tokenizer = tiny_gpt2
    featurize = quality.last_token_features(model, tokenizer, max_tokens=64)

    def score(p, q):
        return quality.mauve_score(p, q, featurize=featurize, seed=0).mauve

    assert score(samples["sport"], samples["sport"]) == pytest.approx(1.0)
    same_topic = score(samples["sport"], samples["sport_again"])
    other_topic = score(samples["sport"], samples["cooking"])
    assert same_topic > 0.85
    assert other_topic < 0.5


def labelled(count, seed):
    sport, cooking = topic_texts(SPORT, count, seed), topic_texts(COOKING, count, seed + 100)
    return sport + cooking, ["sport"] * count + ["cooking"] * count


def test_downstream_accuracy_is_high_on_separable_topics_and_chance_on_shuffled_labels():
    train_texts, train_labels = labelled(100, 10)
    test_texts, test_labels = labelled(200, 20)
    result = quality.downstream_accuracy(train_texts, train_labels, test_texts, test_labels, seed=0)
    assert result.accuracy > 0.95 and result.macro_f1 > 0.95
    assert (result.num_train, result.num_test, result.num_classes) == (200, 400, 2)
    shuffled = list(np.random.default_rng(0).permutation(train_labels))
    chance = quality.downstream_accuracy(train_texts, shuffled, test_texts, test_labels, seed=0)
    assert 0.35 < chance.accuracy < 0.65


def test_downstream_accuracy_rejects_empty_sets_one_class_and_mismatched_labels():
    texts, labels = labelled(5, 0)
    with pytest.raises(ValueError, match="train set is empty"):
        quality.downstream_accuracy([], [], texts, labels, seed=0)
    with pytest.raises(ValueError, match="test set is empty"):
        quality.downstream_accuracy(texts, labels, [], [], seed=0)
    with pytest.raises(ValueError, match="10 train texts but 9 train labels"):
        quality.downstream_accuracy(texts, labels[:9], texts, labels, seed=0)
    with pytest.raises(ValueError, match="hold 1 class"):
        quality.downstream_accuracy(texts, ["sport"] * 10, texts, labels, seed=0)
    with pytest.raises(ValueError, match="hold no words"):
        quality.downstream_accuracy(["!", "?"], ["a", "b"], texts, labels, seed=0)


# Each word's topic, as a pretrained embedding would know it: sport +1, cooking -1, filler 0.
_TOPIC_OF_WORD = {**dict.fromkeys(SPORT, 1.0), **dict.fromkeys(COOKING, -1.0)}


def topic_features(texts):
    rows = []
    for text in texts:
        known = [_TOPIC_OF_WORD.get(word, 0.0) for word in quality.words(text)]
        rows.append([np.mean(known), len(known)])
    return np.asarray(rows)


def test_downstream_accuracy_on_features_reads_topics_in_words_training_never_used():
    # Train on the first half of each topic's words, test on the other half: TF-IDF has no
    # word in common and guesses; features that know each word's topic classify.
    half = len(SPORT) // 2
    train_texts = topic_texts(SPORT[:half], 50, 1) + topic_texts(COOKING[:half], 50, 2)
    test_texts = topic_texts(SPORT[half:], 100, 3) + topic_texts(COOKING[half:], 100, 4)
    train_labels, test_labels = ["s"] * 50 + ["c"] * 50, ["s"] * 100 + ["c"] * 100

    def accuracy(labels, featurize):
        return quality.downstream_accuracy(
            train_texts, labels, test_texts, test_labels, seed=0, featurize=featurize
        ).accuracy

    assert 0.3 < accuracy(train_labels, None) < 0.7
    assert accuracy(train_labels, topic_features) > 0.95


def test_downstream_accuracy_standardizes_features_by_the_training_texts():
    # A feature that carries the topic a million times smaller than a noise feature: without
    # standardization the L2 penalty would leave it unused.
    texts, labels = labelled(100, 5)

    def scaled(batch):
        noise = np.random.default_rng(len(batch)).normal(size=len(batch))
        return np.column_stack([1e-6 * topic_features(batch)[:, 0], noise])

    result = quality.downstream_accuracy(texts, labels, texts, labels, seed=0, featurize=scaled)
    assert result.accuracy > 0.95


def test_downstream_accuracy_rejects_features_that_are_not_one_finite_row_per_text():
    texts, labels = labelled(5, 0)
    with pytest.raises(ValueError, match="downstream_accuracy: featurize returned shape"):
        quality.downstream_accuracy(
            texts, labels, texts, labels, seed=0, featurize=lambda batch: np.zeros((3, 2))
        )
    with pytest.raises(ValueError, match="downstream_accuracy: featurize returned non-finite"):
        quality.downstream_accuracy(
            texts,
            labels,
            texts,
            labels,
            seed=0,
            featurize=lambda batch: np.full((len(batch), 2), np.inf),
        )
