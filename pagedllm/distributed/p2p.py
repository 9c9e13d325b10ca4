"""Stage-to-stage transport for pipeline parallelism: hidden states by torch.distributed
point-to-point (gloo on the CPU, NCCL on CUDA), each with its dtype and shape.

A tensor goes as two messages on one tag: a fixed 8-value int64 header [dtype code, ndim,
shape...] and the payload, so the receiver allocates exactly what arrives without a
second round trip. Every wait is bounded: a peer that died closes its sockets and fails the
wait at once; one that hangs trips `timeout_s`. Either way the caller gets a `StageLinkError`
naming the peer and how it failed, never a hang, and the link refuses further use (the
process group is no longer trustworthy after a failed wait).
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from .. import settings


_HEADER = 8  # dtype code, ndim, up to 6 dimensions
_DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.int64,
    torch.int32,
    torch.uint8,
    torch.int8,
    torch.float64,
]
_CODE = {dt: i for i, dt in enumerate(_DTYPES)}


class StageLinkError(RuntimeError):
    """A pipeline peer did not answer (dead, or stuck past the timeout); the pipeline cannot go on."""


class StageLink:
    """Point-to-point with this rank's neighbours in the pipeline: `prev` (the stage before,
    which sends hidden states here) and `next` (the stage after); None at either end."""

    def __init__(
        self, rank: int, prev: int | None, next: int | None, group=None, timeout_s: float | None = None
    ) -> None:
        self.rank, self.prev, self.next = rank, prev, next
        self.group = group
        # How long one send or receive may wait for its peer (PAGEDLLM_PP_TIMEOUT_S): well under
        # the 30 s in which a dead or stuck stage must fail the requests in flight.
        self.timeout = timedelta(seconds=settings.get("pp_timeout_s") if timeout_s is None else timeout_s)
        self.failed: str | None = None
        self.sent_bytes = 0
        self.received_bytes = 0

    # -- sending -----------------------------------------------------------------------------
    def send(self, t: torch.Tensor, dst: int | None = None, tag: int = 0) -> None:
        """Send `t` (any shape up to 6-D, a dtype in _DTYPES) to `dst` (default: the next stage)
        and wait until it has gone."""
        for work in self.isend(t, dst, tag):
            self._wait(work, "send to", dst if dst is not None else self.next)

    def isend(self, t: torch.Tensor, dst: int | None = None, tag: int = 0) -> list:
        """Start sending `t`; the returned works are waited with `wait` (the tensor must live
        until then)."""
        self._check()
        dst = self.next if dst is None else dst
        if dst is None:
            raise ValueError("the last stage has no next stage to send to")
        if t.dim() > _HEADER - 2:
            raise ValueError(f"a stage message holds at most {_HEADER - 2} dimensions, got {t.dim()}")
        if t.dtype not in _CODE:
            raise ValueError(f"a stage message cannot carry {t.dtype}; one of {_DTYPES}")
        header = torch.zeros(_HEADER, dtype=torch.int64)
        header[0], header[1] = _CODE[t.dtype], t.dim()
        header[2 : 2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
        t = t.contiguous()
        self.sent_bytes += t.numel() * t.element_size() + 8 * _HEADER
        try:
            works = [dist.isend(header, dst, group=self.group, tag=tag)]
            if t.numel():
                works.append(dist.isend(t, dst, group=self.group, tag=tag))
        except (RuntimeError, dist.DistBackendError) as e:
            raise self._fail("send to", dst, e) from e
        # The works keep their tensors alive only as long as the caller keeps the list.
        return [_Pending(w, (header, t)) for w in works]

    def wait(self, works: list, peer: int | None = None) -> None:
        for w in works:
            self._wait(w, "send to", self.next if peer is None else peer)

    # -- receiving ---------------------------------------------------------------------------
    def recv(self, src: int | None = None, tag: int = 0, device: torch.device | None = None) -> torch.Tensor:
        """The next tensor from `src` (default: the previous stage)."""
        self._check()
        src = self.prev if src is None else src
        if src is None:
            raise ValueError("the first stage has no previous stage to receive from")
        header = torch.empty(_HEADER, dtype=torch.int64)
        self._wait(self._irecv(header, src, tag), "receive from", src)
        code, ndim, *dims = header.tolist()
        if not 0 <= code < len(_DTYPES) or not 0 <= ndim <= _HEADER - 2:
            self.failed = f"stage link: a malformed header from rank {src}: {header.tolist()}"
            raise StageLinkError(self.failed)
        out = torch.empty(dims[:ndim], dtype=_DTYPES[code])
        if out.numel():
            self._wait(self._irecv(out, src, tag), "receive from", src)
        self.received_bytes += out.numel() * out.element_size() + 8 * _HEADER
        return out if device is None else out.to(device)

    def _irecv(self, t: torch.Tensor, src: int, tag: int):
        try:
            return dist.irecv(t, src, group=self.group, tag=tag)
        except (RuntimeError, dist.DistBackendError) as e:
            raise self._fail("receive from", src, e) from e

    # -- faults ------------------------------------------------------------------------------
    def _wait(self, work, what: str, peer: int | None) -> None:
        try:
            ok = work.wait(self.timeout)
        except (RuntimeError, dist.DistBackendError) as e:
            raise self._fail(what, peer, e) from e
        if ok is False:  # some backends report a timeout by returning False
            raise self._fail(what, peer, TimeoutError(f"no answer in {self.timeout.total_seconds():g} s"))

    def _fail(self, what: str, peer, err: BaseException) -> StageLinkError:
        text = str(err).splitlines()[0] if str(err) else type(err).__name__
        kind = "timed out" if "timeout" in text.lower() or "timed out" in text.lower() else "failed"
        who = "the other ranks" if peer == "any" else f"rank {peer}"
        self.failed = (
            f"pipeline stage link {kind}: rank {self.rank} could not {what} {who} ({text}); "
            f"the peer died or is stuck (waits are bounded by {self.timeout.total_seconds():g} s, "
            "PAGEDLLM_PP_TIMEOUT_S). The requests in flight failed; restart the pipeline to go on"
        )
        return StageLinkError(self.failed)

    def _check(self) -> None:
        if self.failed:
            raise StageLinkError(self.failed)


class _Pending:
    """A started send and the tensors it reads, kept alive until it is waited."""

    def __init__(self, work, keep) -> None:
        self.work, self.keep = work, keep

    def wait(self, timeout: timedelta):
        return self.work.wait(timeout)
