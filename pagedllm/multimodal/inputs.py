"""A prompt with images, as the engine sees it: token ids in which each image is a run of
placeholder tokens, and per image its content hash and the processor's pixel tensors.

The placeholder runs are what the model's own processor wrote (processor.py); the runner puts
each image's embeddings in place of its run, slice by slice when a prefill chunk cuts through
it. The hash names the image everywhere its content matters: the encoder cache's key, and the
extra key of every KV block that holds any of its tokens (engine/block_manager.py), so two
different images never share K/V and one image's blocks are found again on the next turn.
"""

from __future__ import annotations

import bisect
import hashlib
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(eq=False)
class ImageItem:
    hash: str  # the image's content hash (image_hash)
    offset: int  # its first placeholder token in the prompt
    length: int  # tokens from its first placeholder to its last (its span)
    pixels: dict[str, torch.Tensor]  # the processor's tensors of this image alone
    # The span positions that are placeholders, in order, each taking the next embedding row;
    # None: all of them. (An image split into tiles, Idefics3's, has text tokens between its
    # tiles' runs: row and column markers.)
    embed_pos: list[int] | None = None

    @property
    def end(self) -> int:
        return self.offset + self.length

    @property
    def num_embeds(self) -> int:
        """Rows of its embeddings: the encoder's output for it."""
        return self.length if self.embed_pos is None else len(self.embed_pos)

    def rows(self, lo: int, hi: int) -> tuple[list[int] | None, int, int]:
        """Span positions [lo, hi): (their placeholder positions relative to lo, or None when
        all are; the first and end embedding row they take)."""
        if self.embed_pos is None:
            return None, lo, hi
        k0, k1 = bisect.bisect_left(self.embed_pos, lo), bisect.bisect_left(self.embed_pos, hi)
        return [p - lo for p in self.embed_pos[k0:k1]], k0, k1


@dataclass(eq=False)
class MultiModalInput:
    prompt_token_ids: list[int]
    images: list[ImageItem]  # in prompt order
    prompt: str | None = None  # the text the processor expanded, when there was one
    # Image tokens attend to their whole image (Gemma 3): a prefill chunk may then not end inside one.
    bidirectional: bool = False
    # M-RoPE (Qwen2.5-VL): the prompt's (temporal, height, width) positions [3, prompt tokens],
    # and what a token past the prompt adds to its index (positions go on from the largest + 1);
    # None: one position per token, its index. Set by the engine from the model.
    rope_positions: np.ndarray | None = None
    rope_delta: int = 0
    _keys: dict[tuple[int, int], tuple[str, ...] | None] = field(default_factory=dict, repr=False)

    def overlapping(self, start: int, end: int) -> list[ImageItem]:
        """The images with placeholder tokens in positions [start, end)."""
        return [im for im in self.images if im.offset < end and im.end > start]

    def block_key(self, i: int, block_size: int) -> tuple[str, ...] | None:
        """The hashes of the images with tokens in KV block i (None: a text-only block)."""
        k = (i, block_size)
        if k not in self._keys:
            hs = tuple(im.hash for im in self.overlapping(i * block_size, (i + 1) * block_size))
            self._keys[k] = hs or None
        return self._keys[k]

    def rope_rows(self, start: int, end: int) -> np.ndarray:
        """M-RoPE positions [3, end - start] of tokens [start, end): the prompt's from its table,
        the generated ones' their index plus the delta (the same on a recompute)."""
        table = self.rope_positions
        k = max(start, min(end, table.shape[1]))
        rows = np.empty((3, end - start), dtype=np.int64)
        rows[:, : k - start] = table[:, start:k]
        rows[:, k - start :] = np.arange(k, end) + self.rope_delta
        return rows

    def spans(self, start: int, end: int) -> list[tuple[int, int]]:
        """[offset, end) of each image with tokens among the queries [start, end)."""
        return [(im.offset, im.end) for im in self.overlapping(start, end)]


def image_hash(image) -> str:
    """A PIL image's content hash: its mode, size and pixels (not the file's bytes: one picture
    sent as PNG and as a data URL is one image)."""
    h = hashlib.sha256()
    h.update(f"{image.mode}:{image.size[0]}x{image.size[1]}:".encode())
    h.update(image.tobytes())
    return h.hexdigest()
