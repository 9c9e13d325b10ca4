"""Our tokenizer against transformers' for SmolLM2 (GGUF and a saved HF folder)."""

from __future__ import annotations

import json

import pytest

from pagedllm.tokenizer import IncrementalDetokenizer, Tokenizer, TokenizerLoadError

SAMPLES = {
    "english": "Hello, world! This is a test of the tokenizer, isn't it? We'll see.",
    "french": "Les élèves ont déjà mangé des crêpes à Noël — où ça ? À bientôt, garçon.",
    "german": "Größenwahn: Die Straße ist über 100 Meter lang. Äpfel & Öl für Jürgen.",
    "chinese": "我们今天去公园散步，天气非常好。人工智能正在改变世界。",
    "japanese": "東京は日本の首都です。ひらがなとカタカナ、そして漢字。",
    "russian": "Привет, как дела? Съешь же ещё этих мягких французских булок.",
    "arabic": "مرحبا بالعالم، كيف حالك؟ اللغة العربية جميلة.",
    "emoji": "I love 🦀 and 🐍! Family: 👨‍👩‍👧‍👦, flag: 🇫🇷, thumbs 👍🏽 ✨",
    "code": "def f(x):\n\tif x  >  1:\n\t\treturn x ** 2   # square\n\n\n    else:\r\n        pass\t\t\n",
    "numbers": "Pi is 3.14159, 1,000,000 people, year 2024, ½ and ² and ١٢٣.",
    "specials": "<|im_start|>user\nhi there<|im_end|>\n<|endoftext|>",
    "spaces": "   leading and trailing spaces   ",
    "empty": "",
}
MIXED = "\n".join(SAMPLES.values())

CHAT = [
    {"role": "system", "content": "You are terse. Répondez en français si possible."},
    {"role": "user", "content": "What is 2+2? 🤔"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And in 中文?"},
]


def _copy_backend(tok: Tokenizer):
    # A Tokenizer owns (and re-configures) its backend, so tests building another one use a copy.
    import tokenizers

    return tokenizers.Tokenizer.from_str(tok.backend.to_str())


@pytest.fixture(scope="module")
def tok(smollm2_checkpoint) -> Tokenizer:
    return smollm2_checkpoint.tokenizer


@pytest.fixture(scope="module")
def saved_dir(hf_smollm2_tokenizer, tmp_path_factory):
    folder = tmp_path_factory.mktemp("smollm2_tokenizer")
    hf_smollm2_tokenizer.save_pretrained(folder)
    return folder


# ------------------------------------------------------------------------------------------------
# encode / decode


@pytest.mark.parametrize("name", list(SAMPLES) + ["mixed"])
def test_encode_matches_transformers(tok, hf_smollm2_tokenizer, name):
    text = MIXED if name == "mixed" else SAMPLES[name]
    assert tok.encode(text) == hf_smollm2_tokenizer(text)["input_ids"]
    assert (
        tok.encode(text, add_special_tokens=False) == hf_smollm2_tokenizer(text, add_special_tokens=False)["input_ids"]
    )


@pytest.mark.parametrize("name", list(SAMPLES) + ["mixed"])
@pytest.mark.parametrize("skip", [True, False])
def test_decode_matches_transformers(tok, hf_smollm2_tokenizer, name, skip):
    text = MIXED if name == "mixed" else SAMPLES[name]
    ids = hf_smollm2_tokenizer(text)["input_ids"]
    assert tok.decode(ids, skip_special_tokens=skip) == hf_smollm2_tokenizer.decode(ids, skip_special_tokens=skip)


def test_roundtrip_without_specials(tok):
    for name, text in SAMPLES.items():
        if name != "specials":
            assert tok.decode(tok.encode(text)) == text


def test_special_tokens_and_vocab(tok, hf_smollm2_tokenizer):
    assert tok.vocab_size == len(hf_smollm2_tokenizer) == 49152
    assert tok.bos_token_id == hf_smollm2_tokenizer.bos_token_id == 1
    assert tok.eos_token_id == hf_smollm2_tokenizer.eos_token_id == 2
    assert tok.eos_token_ids == {2}
    assert tok.add_bos_token is False  # SmolLM2 adds no BOS
    assert tok.special_token_ids >= {0, 1, 2}


# ------------------------------------------------------------------------------------------------
# chat template


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("messages", [CHAT, CHAT[1:]], ids=["with_system", "default_system"])
def test_chat_template_matches_transformers(tok, hf_smollm2_tokenizer, messages, add_generation_prompt):
    ours = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    ref = hf_smollm2_tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    assert ours == ref
    ids = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    assert ids == hf_smollm2_tokenizer(ref, add_special_tokens=False)["input_ids"]
    assert ids[0] == tok.bos_token_id  # the template itself opens with <|im_start|>


def test_chat_template_features_match_transformers(tok, hf_smollm2_tokenizer):
    # tojson (no HTML escaping, indent), loop controls, {% generation %}, tools and extra kwargs.
    template = (
        "{% if messages|length == 0 %}{{ raise_exception('no messages') }}{% endif %}"
        "{% for m in messages %}{% if loop.index > 3 %}{% break %}{% endif %}"
        "{% if m.role == 'assistant' %}{% continue %}{% endif %}"
        "[{{ m.role }}] {% generation %}{{ m.content | tojson }}{% endgeneration %}\n{% endfor %}"
        "{% if tools %}{{ tools | tojson(indent=2) }}{% endif %}"
        "{{ bos_token }}|{{ eos_token }}|{{ flavour | default('none') }}"
    )
    messages = CHAT + [{"role": "user", "content": "<b>&'quoted'</b> ünïcode"}]
    tools = [{"type": "function", "function": {"name": "add", "description": "a < b & c"}}]
    ours = Tokenizer(
        _copy_backend(tok),
        bos_token=tok.bos_token,
        eos_token=tok.eos_token,
        add_bos_token=False,
        chat_template=template,
        eos_token_ids=[],
    ).apply_chat_template(messages, add_generation_prompt=False, tools=tools, flavour="vanilla")
    ref = hf_smollm2_tokenizer.apply_chat_template(
        messages, chat_template=template, tools=tools, tokenize=False, flavour="vanilla"
    )
    assert ours == ref
    assert "a < b & c" in ours and "Répondez en français" in ours


def test_chat_template_raise_exception(tok):
    t = Tokenizer(
        _copy_backend(tok),
        bos_token=None,
        eos_token=None,
        add_bos_token=False,
        chat_template="{{ raise_exception('roles must alternate') }}",
        eos_token_ids=[],
    )
    with pytest.raises(Exception, match="roles must alternate"):
        t.apply_chat_template(CHAT)


def test_no_chat_template_is_a_clear_error(tok):
    t = Tokenizer(
        _copy_backend(tok), bos_token=None, eos_token=None, add_bos_token=False, chat_template=None, eos_token_ids=[]
    )
    with pytest.raises(ValueError, match="no chat template.*prompt"):
        t.apply_chat_template(CHAT)


# ------------------------------------------------------------------------------------------------
# incremental detokenization


def _stream(tok, ids, chunk=1, prompt_ids=None, skip=True):
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt_ids, skip_special_tokens=skip)
    deltas = [detok.add(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    deltas.append(detok.flush())
    assert detok.text == "".join(deltas)
    return deltas


@pytest.mark.parametrize("name", list(SAMPLES) + ["mixed"])
@pytest.mark.parametrize("chunk", [1, 3])
def test_incremental_detokenizer_matches_decode(tok, name, chunk):
    text = MIXED if name == "mixed" else SAMPLES[name]
    ids = tok.encode(text)
    for skip in (True, False):
        deltas = _stream(tok, ids, chunk=chunk, skip=skip)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)
        assert not any("\ufffd" in d for d in deltas)


def test_incremental_detokenizer_holds_back_split_characters(tok):
    text = SAMPLES["emoji"] + SAMPLES["chinese"] + SAMPLES["japanese"]
    ids = tok.encode(text)
    # The sample really does split characters across tokens, so the hold-back path is exercised.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    deltas = _stream(tok, ids)
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)
    assert "" in deltas[:-1]  # something was held back at least once


def test_incremental_detokenizer_with_prompt_context(tok):
    prompt = tok.apply_chat_template(CHAT, tokenize=True)
    output = tok.encode("Sure! 答案是 4 🎉 — voilà.") + [tok.eos_token_id]
    deltas = _stream(tok, output, prompt_ids=prompt)
    assert "".join(deltas) == tok.decode(output)
    assert not any("\ufffd" in d for d in deltas)


def test_incremental_detokenizer_flushes_incomplete_tail(tok):
    ids = tok.encode("ok 🦀")
    partial = ids[:-1]  # the crab's last byte is missing
    assert tok.decode(partial).endswith("\ufffd")
    detok = IncrementalDetokenizer(tok)
    streamed = "".join(detok.add([i]) for i in partial)
    assert "\ufffd" not in streamed
    assert streamed + detok.flush() == tok.decode(partial)
    assert detok.flush() == ""


# ------------------------------------------------------------------------------------------------
# loading a saved Hugging Face folder


def test_from_pretrained_dir_matches(tok, hf_smollm2_tokenizer, saved_dir):
    loaded = Tokenizer.from_pretrained_dir(saved_dir)
    assert loaded.vocab_size == tok.vocab_size
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.add_bos_token) == (1, 2, False)
    ids = loaded.encode(MIXED)
    assert ids == tok.encode(MIXED) == hf_smollm2_tokenizer(MIXED)["input_ids"]
    for skip in (True, False):
        assert loaded.decode(ids, skip_special_tokens=skip) == tok.decode(ids, skip_special_tokens=skip)
    for gen in (True, False):
        assert loaded.apply_chat_template(CHAT, add_generation_prompt=gen) == tok.apply_chat_template(
            CHAT, add_generation_prompt=gen
        )


def test_from_pretrained_dir_bos_and_generation_config(saved_dir, tmp_path):
    import shutil

    import transformers

    folder = tmp_path / "tok"
    shutil.copytree(saved_dir, folder)
    # A tokenizer.json whose post-processor adds BOS (as Llama's do); transformers >= 5 lets that
    # decide and ignores add_bos_token in tokenizer_config.json, so we do too.
    spec = json.loads((folder / "tokenizer.json").read_text())
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]}},
    }
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["add_bos_token"] = False
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))

    loaded = Tokenizer.from_pretrained_dir(folder)
    ref = transformers.AutoTokenizer.from_pretrained(folder)
    assert loaded.add_bos_token is True
    for text in ("hello there", MIXED):
        assert loaded.encode(text) == ref(text)["input_ids"]
        assert loaded.encode(text, add_special_tokens=False) == ref(text, add_special_tokens=False)["input_ids"]
    assert loaded.encode("hello there")[0] == 1
    assert loaded.eos_token_ids == {0, 2}


def test_from_pretrained_dir_template_in_tokenizer_config(saved_dir, tmp_path, tok):
    import shutil

    folder = tmp_path / "tok"
    shutil.copytree(saved_dir, folder)
    template = (folder / "chat_template.jinja").read_text()
    (folder / "chat_template.jinja").unlink()
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": template}]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert Tokenizer.from_pretrained_dir(folder).apply_chat_template(CHAT) == tok.apply_chat_template(CHAT)


def test_from_pretrained_dir_missing_files(tmp_path, saved_dir):
    with pytest.raises(TokenizerLoadError, match="does not exist"):
        Tokenizer.from_pretrained_dir(tmp_path / "nope")
    with pytest.raises(TokenizerLoadError, match=r"no tokenizer\.json") as err:
        Tokenizer.from_pretrained_dir(tmp_path)
    assert str(tmp_path) in str(err.value)
    folder = tmp_path / "only_json"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes((saved_dir / "tokenizer.json").read_bytes())
    with pytest.raises(TokenizerLoadError, match=r"no tokenizer_config\.json"):
        Tokenizer.from_pretrained_dir(folder)
    assert issubclass(TokenizerLoadError, ValueError)


# -- SentencePiece GGUFs with and without the space prefix (Gemma 3 has none) -----------------------

SPM_TEXTS = [
    "The capital of France is",
    "Hello world",
    "hello, world!",
    "Paris is the capital.",
    "the",
    "The",
    "12345 and 678",
    "year 2024: 3.14",
    "0",
    "你好，世界",
    "人工智能正在改变世界",
    "東京は日本の首都です",
    "I love 🦀 and 🐍!",
    "👍🏽✨",
    "tab\tand\nnewline",
    "a\n\nb",
    "\n\nleading newlines",
    "trailing newline\n",
    "x  y",
    "x   y    z",
    "  two leading spaces",
    "    four",
    "trailing spaces   ",
    "ünïcode ok",
    "don't stop",
    "<start_of_turn>user\nHi<end_of_turn>",
    "<bos>The",
    "mix 中文 and English 42",
]
SPM_TEXTS += [" " + t for t in SPM_TEXTS[:22]]  # the same with a leading space
SPM_CHAT = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m.role == 'assistant' else m.role }}\n"
    "{{ m.content }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def _write_spm_gguf(path, arch: str, add_space_prefix: bool | None) -> None:
    """A small SentencePiece-style vocabulary (control tokens, byte fallback, characters, words with
    every prefix so BPE reaches them, runs of spaces written as spaces as Gemma files do)."""
    gguf = pytest.importorskip("gguf")
    chars = sorted({c for t in SPM_TEXTS for c in t if c not in " \t\n<>"} | set("▁"))
    words = [
        "▁The",
        "▁the",
        "The",
        "▁capital",
        "▁of",
        "▁France",
        "▁is",
        "▁Hello",
        "▁hello",
        "▁world",
        "world",
        "▁Paris",
        "▁and",
        "▁year",
        "▁love",
        "▁mix",
        "▁English",
        "▁stop",
        "▁leading",
        "▁spaces",
        "▁newline",
        "12",
        "123",
        "20",
        "24",
        "你好",
        "世界",
        "人工",
        "智能",
    ]
    pieces = list(dict.fromkeys([*chars, *(w[:k] for w in words for k in range(2, len(w) + 1))]))
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    tokens = [*specials, *[f"<0x{b:02X}>" for b in range(256)], "  ", "   ", "\n", "\n\n", *pieces]
    types = [3, 3, 3, 2, 3, 3] + [6] * 256 + [1] * (len(tokens) - len(specials) - 256)
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_block_count(1)
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_scores([0.0] * (len(specials) + 256) + [-float(i) for i in range(len(tokens) - len(specials) - 256)])
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    if add_space_prefix is not None:
        w.add_add_space_prefix(add_space_prefix)
    w.add_chat_template(SPM_CHAT)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch,prefix", [("gemma3", False), ("llama", True)])
def test_gguf_space_prefix_matches_transformers(tmp_path, arch, prefix):
    """tokenizer.ggml.add_space_prefix false (Gemma 3): "The" at the start is `The`, not `▁The`;
    true: `▁The`; each exactly as transformers reads the same file, text after special tokens too."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    from pagedllm.loading.gguf import read_gguf

    _write_spm_gguf(tmp_path / "t.gguf", arch, prefix)
    ours = read_gguf(tmp_path / "t.gguf").tokenizer
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="t.gguf")
    assert len(SPM_TEXTS) >= 50
    first = ours.encode("The capital", add_special_tokens=False)[0]
    assert ours.id_to_token(first) == ("▁The" if prefix else "The")
    for text in SPM_TEXTS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == ref(text, add_special_tokens=special)["input_ids"], (text, special)
        assert ours.decode(ids, False) == ref.decode(ids, skip_special_tokens=False), text
    for i in range(0, 20, 4):
        chat = [
            {"role": "user", "content": SPM_TEXTS[i]},
            {"role": "assistant", "content": SPM_TEXTS[i + 22]},
            {"role": "user", "content": SPM_TEXTS[i + 1]},
        ]
        want = ref.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
        assert ours.apply_chat_template(chat, add_generation_prompt=True, tokenize=True) == want, chat
