"""GPT-2's byte alphabet, the one table byte-level BPE vocabularies spell their tokens in.

Kept here, beside the tokenizer, so every reader of token spellings (the GGUF tokenizer
builder, the protocols' logprob bytes) shares one definition."""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """Printable Latin-1 bytes stand for themselves; the rest map to chr(256 + k)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


@lru_cache(maxsize=1)
def unicode_to_bytes() -> dict[str, int]:
    """The table's inverse: a token's spelled character -> the byte it stands for."""
    return {c: b for b, c in bytes_to_unicode().items()}
