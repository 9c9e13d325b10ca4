"""Prompt lookup: propose the tokens that followed the last earlier occurrence of the
sequence's own suffix (its last n tokens, the longest n that matches first).

Each sequence keeps an index from n-gram to where it last ended, extended by the tokens
added since the previous step, so a proposal costs O(max_ngram) dict operations, not a
scan of the context.
"""

from __future__ import annotations


class NgramIndex:
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.end: dict[tuple[int, ...], int] = {}  # n-gram -> end (exclusive) of its last occurrence
        self.indexed = 0  # n-grams ending before this position are in `end`

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix."""
        n_tok = len(tokens)
        # Index the n-grams that now have at least one token after them (ending at < n_tok),
        # so a lookup of the suffix finds an earlier occurrence, never itself.
        for e in range(max(self.indexed, self.min_n), n_tok):
            for n in range(self.min_n, min(self.max_n, e) + 1):
                self.end[tuple(tokens[e - n : e])] = e
        self.indexed = max(self.indexed, n_tok)
        for n in range(min(self.max_n, n_tok), self.min_n - 1, -1):
            e = self.end.get(tuple(tokens[n_tok - n :]))
            if e is not None:
                return tokens[e : e + k]
        return []
