"""Step inputs to the device, as the runner hands them over once a step."""

from __future__ import annotations

import numpy as np
import torch

Ints = list[int] | np.ndarray  # int64 arrays for what the runner computes with numpy


class HostUpload:
    """Step inputs to the device. On CUDA: one copy per call from a reused pinned buffer,
    non_blocking, waiting only before the buffer is refilled. Elsewhere: plain torch.tensor."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self._buf: torch.Tensor | None = None
        self._copied = None  # event: the last copy out of _buf has finished

    def ints(self, parts: list[Ints]) -> list[torch.Tensor]:
        """int64 tensors on the device, one per list or array (an int64 array is shared, not
        copied, on the CPU)."""
        if not self.pinned:
            return [
                torch.from_numpy(p).to(self.device)
                if isinstance(p, np.ndarray)
                else torch.tensor(p, dtype=torch.int64, device=self.device)
                for p in parts
            ]
        sizes = [len(p) for p in parts]
        total = sum(sizes)
        if self._copied is not None:
            self._copied.synchronize()
        if self._buf is None or self._buf.numel() < total:
            self._buf = torch.empty(
                max(total, 4096, 2 * (0 if self._buf is None else self._buf.numel())),
                dtype=torch.int64,
                pin_memory=True,
            )
        host = self._buf.numpy()
        off = 0
        for p in parts:
            host[off : off + len(p)] = p
            off += len(p)
        out = self._buf[:total].to(self.device, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        return list(out.split(sizes))
