"""A pipeline stage's side (every rank but 0 runs `pipeline_worker_main` for its whole life;
rank 0 runs its first stage through pipeline.py's executor): the stage plan every rank computes
alike, the groups, and the loop that takes each plan, runs the stage's layers over its own KV
cache and sends the hidden states on (the last stage: the logits rows to rank 0). pipeline.py's
docstring tells the whole design."""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist

from .. import settings, tuning
from . import messages
from .group import CONTROL_TIMEOUT, RENDEZVOUS_TIMEOUT, TPInfo, destroy_groups
from .p2p import StageLink
from .stage_kv import stage_kv
from .worker import await_setup, load_part, rank_device, rank_main, report_sizes

logger = logging.getLogger(__name__)


class StageStats:
    """Where a rank's time went, for the bubble's profile: building a step's tensors and
    computing its layers (and its rows of the head) (`busy_s`), waiting for another rank: the
    previous stage's hidden states, the last stage's logits, a send or plan still under way
    (`wait_s`), over the window from its first step's start to its last step's end. The rest is
    rank 0's engine (scheduling, sampling, output) and, on the other ranks, waiting for the
    next plan, i.e. for rank 0's engine. The steps that carry prompt
    tokens are also counted apart (`prompt_*`): a prefill weighs the stages by their layers, a
    decode step by their layers and the head, so each kind leaves a different stage waiting."""

    FIELDS = ("busy_s", "wait_s", "window_s", "steps", "prompt_busy_s", "prompt_wait_s", "prompt_steps")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Start afresh: the window opens at the next step."""
        self.busy_s = self.wait_s = self.prompt_busy_s = self.prompt_wait_s = 0.0
        self.first = self.last = None
        self.steps = self.prompt_steps = 0

    def add(self, busy: float, wait: float, prompt: bool) -> None:
        self.busy_s += busy
        self.wait_s += wait
        if prompt:
            self.prompt_busy_s += busy
            self.prompt_wait_s += wait

    def step(self, t0: float, t1: float, prompt: bool) -> None:
        self.first = t0 if self.first is None else self.first
        self.last = t1
        self.steps += 1
        self.prompt_steps += prompt

    def values(self) -> list[float]:
        window = (self.last - self.first) if self.first is not None else 0.0
        return [
            self.busy_s,
            self.wait_s,
            window,
            float(self.steps),
            self.prompt_busy_s,
            self.prompt_wait_s,
            float(self.prompt_steps),
        ]


class StageRunner:
    """One stage's forward for a plan: the previous stage's hidden states in (the first stage
    embeds), this stage's layers over its cache, the hidden states out to the next stage (the
    last stage: the plan's logits rows to rank 0). `runner`: an engine ModelRunner built on
    the stage's model and backend, used for the plan's tensors only."""

    def __init__(self, model, runner, link: StageLink, stage, tp_size: int = 1) -> None:
        self.model, self.runner, self.link, self.stage = model, runner, link, stage
        self.logits_src = (stage.size - 1) * tp_size  # the last stage's TP rank 0
        # The last stage of a pipeline whose first stage computes some of the head's rows.
        self.shares_head = stage.last and stage.shares_head
        self.stats = StageStats()
        # The step's sends under way, (peer, works) (the works hold the tensors): a stage goes
        # on to the next plan while its output travels, and waits for it only before its next
        # step's first send.
        self.sending: list = []

    def _send(self, t: torch.Tensor, dst: int | None = None, more: bool = False) -> None:
        """Start sending `t`; `more`: a second message of the same step, sent without waiting
        for the first (the receiver takes them in order)."""
        if not more:
            self.flush()
        self.sending.append((dst, self.link.isend(t, dst)))

    def flush(self) -> None:
        """Wait for the sends under way (before the next step's, and before the rank stops)."""
        for peer, works in self.sending:
            self.link.wait(works, peer)
        self.sending = []

    @torch.inference_mode()
    def run(self, plan) -> torch.Tensor | None:
        """This stage's part of `plan`; on rank 0 the logits rows as the last stage computed
        them (None where the plan asks for none)."""
        st, clock = self.stats, time.perf_counter
        t0 = clock()
        prompt = plan.has_prompt
        input_ids, positions, meta = self.runner.tensors(plan)
        ta = clock()
        h = None if self.stage.first else self.link.recv(device=input_ids.device)
        t1 = clock()
        # Busy: the step's tensors and its layers; waiting: for the previous stage's output.
        prep, waited = ta - t0, t1 - ta
        out = self.model(input_ids, positions, meta, inputs_embeds=h)
        wants = plan.logits_rows is None or bool(plan.logits_rows)
        if not self.stage.last:
            st.add(prep + clock() - t1, waited, prompt)
            self._send(out)
        elif wants:
            if plan.logits_rows is not None:
                out = out.index_select(0, self.runner.upload.ints([plan.logits_rows])[0])
            if self.shares_head:  # first, so that rank 0 computes its rows while this stage computes the rest
                self._send(out, dst=0)
            logits = self.model.compute_logits(out)  # None on a TP rank other than the stage's first
            if self.link.rank == 0:  # a pipeline of one stage
                st.add(prep + clock() - t1, waited, prompt)
                return logits
            if logits is not None and plan.argmax_only:
                logits = argmax_summary(logits)
            st.add(prep + clock() - t1, waited, prompt)
            if logits is not None:
                self._send(logits, dst=0, more=self.shares_head)
        else:
            st.add(prep + clock() - t1, waited, prompt)
        st.step(t0, clock(), prompt)
        if self.link.rank == 0 and wants:
            return self.link.recv(src=self.logits_src, device=input_ids.device)
        return None


def argmax_summary(logits: torch.Tensor) -> torch.Tensor:
    """What a greedy step's sampler reads of the last stage's logits rows (`StepPlan.argmax_only`),
    [rows, 3] float64: each row's largest logit, its column (the first of equal ones, as the
    sampler takes it) and whether the row is all finite (the sampler's check). A few bytes a
    row cross the link instead of the vocabulary's."""
    idx = logits.argmax(dim=1, keepdim=True)
    finite = logits.sum(-1, dtype=torch.float32).isfinite()
    return torch.stack((logits.gather(1, idx).squeeze(1).double(), idx.squeeze(1).double(), finite.double()), dim=1)


def logits_from_argmax(summary: torch.Tensor, mine: torch.Tensor | None, vocab: int) -> torch.Tensor:
    """[rows, vocab] logits whose argmax and finiteness are those of `mine` (rank 0's first
    columns of a shared head, None where it has none) beside the last stage's columns that
    `summary` describes: those hold each row's largest value where it was and the next float
    below it elsewhere, a NaN where the row was not all finite. The greedy sampler reads no
    more than that."""
    rows, lo = summary.shape[0], 0 if mine is None else mine.shape[1]
    out = torch.empty(rows, vocab, dtype=torch.float32, device=summary.device)
    if mine is not None:
        out[:, :lo] = mine
    top = summary[:, 0].float()
    out[:, lo:] = torch.nextafter(top, torch.full_like(top, float("-inf"))).unsqueeze(1)
    at = summary[:, 1].long().unsqueeze(1) + lo
    out.scatter_(1, at, top.unsqueeze(1))
    out[:, lo] = torch.where(summary[:, 2] > 0, out[:, lo], float("nan"))
    return out


def _idle(rank: int, busy: float, wait: float, window: float) -> float:
    """The share of a rank's window it had nothing to do: waiting for another rank. Rank 0's
    time outside its layers and waits is its engine's work (scheduling, sampling, output), which
    the other ranks' steps overlap; theirs is waiting for the next plan."""
    if not window:
        return 0.0
    return wait / window if rank == 0 else 1 - busy / window


def _report_stats(control, stats: StageStats) -> None:
    """A rank > 0's part of rank 0's stats gather after STOP."""
    dist.gather(torch.tensor(stats.values(), dtype=torch.float64), None, dst=0, group=control)


def serve_stage(info: TPInfo, stage, model, runner, link: StageLink, copy_fn, backend) -> None:
    """A rank > 0's loop: apply rank 0's cache operations, run its stage of each step, until STOP.
    `info`: its place in its stage's TP group."""
    stage_runner = StageRunner(model, runner, link, stage, info.size)
    apply = {
        messages.OP_COPY_PREFIX: copy_fn,
        messages.OP_FREE_SEQ: lambda a, b, c: backend.free_seq(a),
        messages.OP_FORK_SEQ: lambda a, b, c: backend.fork_seq(a, b),
        messages.OP_RESET_STATS: lambda a, b, c: stage_runner.stats.reset(),
    }
    while True:
        command, lists = messages.recv(info.control)
        if command == messages.STOP:
            stage_runner.flush()
            _report_stats(info.control, stage_runner.stats)
            return
        plan, ops = messages.step_from_lists(lists)
        for i in range(0, len(ops), 4):
            apply[ops[i]](*ops[i + 1 : i + 4])
        stage_runner.run(plan)


def plan_for(source, size: int, tp: int = 1) -> list:
    """The stage plan every rank computes alike, from the bytes the checkpoint stores (each
    node reads its own copy of the same file): the layers cut, and the head's rows shared by
    the first and last stage (models/stages.py `share_head`; not under tensor parallelism, whose
    last stage splits its head by vocabulary among its own ranks already)."""
    from ..loading.loader import checkpoint_part_bytes, read_config
    from ..models.stages import plan_stages, share_head

    cfg = read_config(source)
    layers, embed, head = checkpoint_part_bytes(source, cfg)
    stages = plan_stages(layers, size, embed, head)
    if tp > 1 or not tuning.get("pp_share_head"):
        return stages
    return share_head(stages, layers, embed, head, cfg.vocab_size, cfg.tie_word_embeddings)


def _link(rank: int, pp: int, tp: int, timeout_s: float | None) -> StageLink:
    """Global rank `rank`'s link: the same TP rank of the stages before and after."""
    stage = rank // tp
    return StageLink(rank, rank - tp if stage else None, rank + tp if stage + 1 < pp else None, timeout_s=timeout_s)


def init_pipeline_groups(rank: int, pp: int, tp: int, device: torch.device, init_method: str | None) -> TPInfo:
    """Join (or create) the world of pp x tp ranks, then make the control group (all ranks:
    the plans) and each stage's compute group (its TP ranks' all-reduces and logits gather;
    every rank makes every stage's, as torch.distributed wants). Returns this rank's place in
    its stage's TP group."""
    world = pp * tp
    if not dist.is_initialized():
        kw = {} if init_method is None else {"init_method": init_method}
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=RENDEZVOUS_TIMEOUT, **kw)
    elif dist.get_world_size() != world:
        raise ValueError(
            f"pipeline_parallel_size={pp} x tensor_parallel_size={tp} is {world} ranks but "
            f"torch.distributed already runs {dist.get_world_size()}; they must be equal"
        )
    info = TPInfo(rank % tp, tp)
    info.control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    for s in range(pp):
        g = dist.new_group(
            ranks=list(range(s * tp, (s + 1) * tp)),
            backend="nccl" if device.type == "cuda" else "gloo",
            timeout=timedelta(seconds=settings.get("tp_timeout_s")),
        )
        if s == rank // tp:
            info.group = g
    return info


def pipeline_worker_main(rank: int, pp: int, init_method: str | None, spec, tp: int = 1, conn=None) -> NoReturn:
    """A rank other than 0 (global rank `rank` of pp x tp): join the groups, load its stage's
    shard, wait for rank 0's cache size and the link's wait bound, build its cache, serve steps
    until STOP (worker.rank_main reports to rank 0 and exits the process)."""
    held = [TPInfo(rank % tp, tp)]

    def body() -> None:
        try:
            _serve_rank(rank, pp, tp, init_method, spec, conn, held)
        finally:
            destroy_groups(held[-1])

    rank_main("pp", rank, spec, conn, body)


def _serve_rank(rank: int, pp: int, tp: int, init_method: str | None, spec, conn, held: list) -> None:
    from ..engine.model_runner import ModelRunner

    device = rank_device(spec.device, rank)
    info = init_pipeline_groups(rank, pp, tp, device, init_method)
    held.append(info)
    stage = plan_for(spec.source, pp, tp)[rank // tp]
    loaded = load_part(spec, device, stage=stage, tp=info if tp > 1 else None)
    setup = await_setup(loaded.weight_bytes, spec, (rank, pp, tp), info.control, conn)
    if setup is None:
        return
    num_blocks, timeout_ms = setup
    cache, backend, copy_fn = stage_kv(
        loaded.config, stage, loaded.model.shard.kv_heads, spec.cache_cfg, num_blocks, device, spec.dtype
    )
    report_sizes(info.control, loaded.weight_bytes, cache.nbytes)
    runner = ModelRunner(loaded.model, backend, spec.cache_cfg.block_size, device, sampler=None)
    serve_stage(info, stage, loaded.model, runner, _link(rank, pp, tp, timeout_ms / 1000), copy_fn, backend)
