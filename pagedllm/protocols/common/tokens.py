"""Single tokens' exact bytes and printable text, for logprobs in any dialect."""

from __future__ import annotations

from typing import Any

from ...tokenizer.byte_level import unicode_to_bytes


class TokenText:
    """The exact bytes and a printable string of single tokens, cached."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        backend = getattr(tokenizer, "backend", None)
        self._byte_level = "ByteLevel" in repr(getattr(backend, "decoder", None))
        self._special = getattr(tokenizer, "special_token_ids", set())
        self._cache: dict[int, bytes] = {}
        self._to_byte = unicode_to_bytes()

    def bytes(self, tid: int) -> bytes:
        b = self._cache.get(tid)
        if b is None:
            b = self._compute(tid)
            self._cache[tid] = b
        return b

    def _compute(self, tid: int) -> bytes:
        piece = self._tok.id_to_token(tid) if hasattr(self._tok, "id_to_token") else None
        if (
            piece is not None
            and self._byte_level
            and tid not in self._special
            and all(c in self._to_byte for c in piece)
        ):
            return bytes(self._to_byte[c] for c in piece)
        return self._tok.decode([tid], skip_special_tokens=False).encode("utf-8")

    def text(self, tid: int) -> str:
        return self.bytes(tid).decode("utf-8", errors="replace")
