"""The tokenizer a GGUF file describes (tokenizer.ggml.*), built with `tokenizers` as
transformers builds it from the same file: byte-level BPE or SentencePiece-style BPE."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pagedllm.tokenizer import Tokenizer
from pagedllm.tokenizer import template_guard
from pagedllm.tokenizer.byte_level import bytes_to_unicode as _bytes_to_unicode

from .arch import _GEMMA_ARCHS
from .config import _eos_token_ids
from .container import GGUFError

# llama.cpp token types (tokenizer.ggml.token_type).
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

# Split regexes for byte-level BPE vocabularies, by tokenizer.ggml.pre. Any other value (default,
# gpt2, smollm, ...) uses the GPT-2 regex built into the ByteLevel pre-tokenizer, as transformers does.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "dbrx", "smaug-bpe"),
        _LLAMA3_SPLIT,
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "megrez"), _QWEN2_SPLIT),
}


def _build_tokenizer(path: Path, meta: dict) -> Tokenizer:
    import tokenizers

    model = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise GGUFError(f"{path}: the file has no tokenizer (tokenizer.ggml.tokens is missing)")
    token_types = meta.get("tokenizer.ggml.token_type") or []
    if model == "gpt2":
        tk = _byte_level_bpe(meta, tokens)
        default_specials: tuple[str, ...] = ("<|endoftext|>",)
        add_bos_default = False
    elif model == "llama":
        tk = _sentencepiece_bpe(path, meta, tokens)
        default_specials = ("<unk>", "<s>", "</s>")
        add_bos_default = True  # llama.cpp adds BOS for SentencePiece vocabularies unless told not to
    else:
        raise GGUFError(f"{path}: unsupported tokenizer model {model!r}; supported: gpt2, llama")

    def token_at(key: str) -> str | None:
        index = meta.get(key)
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    bos, eos = token_at("tokenizer.ggml.bos_token_id"), token_at("tokenizer.ggml.eos_token_id")
    unk, pad = token_at("tokenizer.ggml.unknown_token_id"), token_at("tokenizer.ggml.padding_token_id")
    _add_gguf_added_tokens(tk, model, tokens, token_types)
    # transformers also registers the named special tokens (and its tokenizer class's defaults) as
    # special, so decode(skip_special_tokens=True) drops them; only ones already in the vocabulary,
    # so the vocabulary never grows past what the model's embedding covers.
    named = [t for t in (*default_specials, bos, eos, unk, pad) if t is not None]
    already = {tok.content for tok in tk.get_added_tokens_decoder().values()}
    extra = [t for t in dict.fromkeys(named) if t not in already and tk.token_to_id(t) is not None]
    if extra:
        tk.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in extra])

    tokenizer = Tokenizer(
        tk,
        bos_token=bos,
        eos_token=eos,
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default)),
        add_eos_token=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        chat_template=meta.get("tokenizer.chat_template"),
        eos_token_ids=_eos_token_ids(meta),
        pad_token=pad,
        unk_token=unk,
        fim_token_ids={
            k: int(meta[f"tokenizer.ggml.fim_{k}_token_id"])
            for k in ("pre", "suf", "mid", "rep", "sep")
            if f"tokenizer.ggml.fim_{k}_token_id" in meta
        },
    )
    # A template is code, and this one came with a (maybe downloaded) file: check it runs.
    tokenizer.chat_template_source = f"GGUF metadata (tokenizer.chat_template of {path.name})"
    template_guard.check_gguf_template(tokenizer)
    return tokenizer


def _merge_pairs(merges: list[str]) -> list[tuple[str, str]]:
    pairs = []
    for merge in merges:
        left, sep, right = merge.partition(" ")
        if sep and left and right:
            pairs.append((left, right))
    return pairs


def _byte_level_bpe(meta: dict, tokens: list[str]) -> Any:
    from tokenizers import Regex, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

    spelling = _bytes_to_unicode()
    # A token written with characters outside the byte alphabet (llama.cpp stores some that way)
    # is respelled in it, so lookups of its bytes work. One regex search a token: a set per
    # token cost ~0.1 s of a cold start on a 49k vocabulary.
    outside = re.compile("[^" + re.escape("".join(spelling.values())) + "]").search
    vocab = {
        "".join(spelling[b] for b in tok.encode("utf-8")) if outside(tok) else tok: i for i, tok in enumerate(tokens)
    }
    merges = _merge_pairs(meta.get("tokenizer.ggml.merges") or [])
    tk = HFTokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    split = _PRE_TOKENIZER_SPLITS.get(meta.get("tokenizer.ggml.pre"))
    if split is None:
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tk.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tk.decoder = decoders.ByteLevel()
    return tk


def _sentencepiece_bpe(path: Path, meta: dict, tokens: list[str]) -> Any:
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

    gemma = meta.get("general.architecture") in _GEMMA_ARCHS
    if gemma:
        # Gemma files store a token of two or more spaces as spaces; the text it matches has ▁s.
        tokens = ["▁" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if meta.get("tokenizer.ggml.merges"):
        merges = _merge_pairs(meta["tokenizer.ggml.merges"])
    else:
        scores = meta.get("tokenizer.ggml.scores")
        if not scores or len(scores) != len(tokens):
            raise GGUFError(f"{path}: SentencePiece vocabulary has neither merges nor one score per token")
        if gemma:  # Gemma's scores do not follow its merge order; the file's token order does
            scores = [-float(i) for i in range(len(tokens))]
        merges = _merges_from_scores(tokens, scores)
    tk = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None))
    tk.normalizer = None
    # add_space_prefix false (Gemma): no "▁" before the text, and none to strip when decoding.
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    tk.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tk.decoder = decoders.Sequence(steps + [decoders.Strip(" ", 1, 0)] if prefix else steps)
    return tk


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Recover BPE merges from a SentencePiece vocabulary: every split of a token into two tokens is a
    merge, ranked by the merged token's score (best first), ties by the pieces' lengths then ids."""
    vocab = {tok: i for i, tok in enumerate(tokens)}
    score_of = dict(zip(tokens, scores))
    ranked: list[tuple[str, str, float]] = []
    for piece, score in score_of.items():
        splits = [
            (piece[:k], piece[k:], score) for k in range(1, len(piece)) if piece[:k] in vocab and piece[k:] in vocab
        ]
        splits.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        ranked.extend(splits)
    ranked.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in ranked]


def _add_gguf_added_tokens(tk: Any, model: str, tokens: list[str], token_types: list[int]) -> None:
    """Control tokens become special added tokens, user-defined ones plain added tokens, so neither is
    split by BPE. In a byte-level vocabulary a control token outside the byte alphabet is a llama.cpp
    mislabel whose text is not in the vocabulary; adding it would grow the vocabulary, so skip it."""
    from tokenizers import AddedToken

    alphabet = set(_bytes_to_unicode().values()) if model == "gpt2" else None
    control = [
        AddedToken(tok, special=True, normalized=False)
        for tok, kind in zip(tokens, token_types)
        if kind == _TOKEN_CONTROL and (alphabet is None or set(tok) <= alphabet)
    ]
    if control:
        tk.add_special_tokens(control)
    user_defined = [tok for tok, kind in zip(tokens, token_types) if kind == _TOKEN_USER_DEFINED]
    vocab = tk.get_vocab(with_added_tokens=True) if user_defined else {}
    user = [AddedToken(tok, special=False, normalized=False) for tok in user_defined if tok in vocab]
    if user:
        tk.add_tokens(user)
