"""The pipeline's stage-to-stage transport (distributed/p2p.py) between two gloo ranks on
loopback: tensors arrive with their dtype, shape and values; a peer that dies or hangs fails
the waiting rank with StageLinkError within the bound, never a hang."""

from __future__ import annotations

import os
import socket
import time

import pytest
import torch
import torch.multiprocessing as mp


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank: int, port: int):
    import torch.distributed as dist
    from datetime import timedelta

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}", timeout=timedelta(seconds=60)
    )


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [
        torch.randn(5, 64, generator=g),
        torch.randn(1, 896, generator=g).to(torch.bfloat16),
        torch.randint(-9, 9, (3, 2, 4), generator=g),
        torch.empty(0, 64),
        torch.tensor(3.5),
        torch.randn(130, 7, generator=g).t(),
    ]  # not contiguous


def _echo_peer(port: int, mode: str) -> None:
    """Rank 1: receive each tensor and send it back doubled ("echo"), or die / hang after the
    first ("die" / "hang")."""
    from pagedllm.distributed.p2p import StageLink

    _init(1, port)
    link = StageLink(1, prev=0, next=0)
    n = len(_tensors())
    for i in range(n):
        t = link.recv()
        if mode == "die":
            os._exit(3)
        if mode == "hang":
            time.sleep(60)
        link.send(t * 2 if t.dtype != torch.bool else t)
    import torch.distributed as dist

    dist.destroy_process_group()


def _start(mode: str):
    ctx = mp.get_context("spawn")
    port = _port()
    p = ctx.Process(target=_echo_peer, args=(port, mode), daemon=True)
    p.start()
    _init(0, port)
    return p


def _stop(p) -> None:
    import torch.distributed as dist

    try:
        dist.destroy_process_group()
    except Exception:
        pass
    p.join(timeout=10)
    if p.is_alive():
        p.kill()
        p.join()


@pytest.mark.slow
def test_tensors_cross_with_dtype_shape_and_values():
    from pagedllm.distributed.p2p import StageLink

    p = _start("echo")
    try:
        link = StageLink(0, prev=1, next=1)
        for t in _tensors():
            link.send(t)
            back = link.recv()
            assert back.dtype == t.dtype and back.shape == t.shape
            assert torch.equal(back, t * 2)
        assert link.sent_bytes > 0 and link.received_bytes == link.sent_bytes
    finally:
        _stop(p)
    assert p.exitcode == 0


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["die", "hang"])
def test_dead_or_stuck_peer_fails_within_the_bound(mode):
    from pagedllm.distributed.p2p import StageLink, StageLinkError

    p = _start(mode)
    try:
        link = StageLink(0, prev=1, next=1, timeout_s=5)
        link.send(torch.ones(4, 8))
        t0 = time.monotonic()
        with pytest.raises(StageLinkError, match="rank 0 could not receive from rank 1") as err:
            link.recv()
        waited = time.monotonic() - t0
        assert waited < 30, waited
        if mode == "hang":
            assert waited >= 4, waited  # the bound, not an early failure
            assert "timed out" in str(err.value)
        with pytest.raises(StageLinkError):  # a failed link refuses further use
            link.send(torch.ones(1))
    finally:
        p.kill()
        _stop(p)
