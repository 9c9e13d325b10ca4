"""The encoder cache: image embeddings by content hash, least recently used first out.

The runner fills it as the scheduled step encodes images and reads it for every chunk that
holds image tokens; the scheduler asks it what is cached to charge only the images still to
encode against the step's encoder budget. A step holds the embeddings it uses by reference, so
an eviction never takes one from under a running step: the cache only saves recomputation."""

from __future__ import annotations

from collections import OrderedDict

import torch


class EncoderCache:
    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens  # embedding rows held at most (one per placeholder token)
        self.entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.tokens = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, key: str) -> torch.Tensor | None:
        emb = self.entries.get(key)
        if emb is None:
            self.misses += 1
            return None
        self.entries.move_to_end(key)
        self.hits += 1
        return emb

    def put(self, key: str, emb: torch.Tensor) -> None:
        if key in self.entries:
            return
        self.entries[key] = emb
        self.tokens += emb.shape[0]
        while self.tokens > self.max_tokens and len(self.entries) > 1:
            _, old = self.entries.popitem(last=False)
            self.tokens -= old.shape[0]
            self.evictions += 1

    def nbytes(self) -> int:
        return sum(e.numel() * e.element_size() for e in self.entries.values())
