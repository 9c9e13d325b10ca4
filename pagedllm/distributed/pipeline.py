"""Pipeline parallelism: each rank runs one stage's layers over its own paged KV cache.

Rank 0 is the engine: it schedules, runs the first stage and samples. Each step it broadcasts
the plan on the control group (messages.py, as tensor parallelism does), so every stage builds
the same positions, slots and block tables; then the hidden states go stage to stage by
point-to-point (p2p.py), and the last stage sends the logits rows of the plan back to rank 0.
Where the first stage shares the LM head (models/stages.py `share_head`), the last stage sends
the rows' final hidden states first, then its columns of the logits; rank 0 computes the first
columns from the hidden states meanwhile, and puts the two side by side.
`PipelineExecutor` is rank 0's side, passed to the engine's constructor (engine/factory.py)
like tensor parallelism's executor; `pipeline_worker_main` is a rank > 0's whole life.

A stage's cache holds only its own layers: rank 0's block tables index blocks of a pool
whose pages have one slot per layer of a KV group (kv/groups.py), and a stage keeps, per
block, slots for its own layers of each group only. With one group (all layers attend alike)
that is 1/P of the layers; with Gemma's sliding groups a stage keeps as many slots as its
fullest group, so the saving is smaller where a stage holds a whole group's worth of layers.
The KV budget (kv_cache_memory_mb, ...) is per rank, as under tensor parallelism: the pool gets
the blocks the largest stage's pages fit in it, and every stage holds that many blocks.

Tensor parallelism inside a stage: world = TP x PP ranks, global rank = stage * TP + TP rank.
A stage's TP ranks share a compute group (their all-reduces and the logits gather) and each
runs the stage's shard of every step's plan; each sends its copy of the stage's output (the
all-reduced hidden states) to the same TP rank of the next stage, and the last stage's TP rank
0 sends the gathered logits rows to rank 0. The control group (the plans) spans all ranks.

`PipelineExecutor.start` spawns the other ranks on this machine (torch.multiprocessing, as
tensor parallelism's executor does) or, under torchrun (WORLD_SIZE set), joins the group the
other nodes' ranks join.

Several micro-batches in flight, one a stage (vLLM's batch queue): the engine
(`LLMEngine._step_pipelined`) launches a step of some sequences (`launch`: the plan broadcast
without waiting, stage 0 run, the hidden states sent by isend) and schedules the next step,
of other sequences, while the first is in the later stages; it waits for the oldest step's
logits (`collect`) only once P steps are in flight or nothing more can be scheduled. Every
rank takes the steps in launch order, so the caches stay identical; a sequence in flight is
not scheduled, preempted or freed until its step is collected (Scheduler.schedule_disjoint).
Each stage's sends go without waiting: a stage goes on to its next plan while its output
travels, and waits only before its next send.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections import deque
from datetime import timedelta

import torch
import torch.distributed as dist

from .. import settings
from . import messages
from .children import wait_for_ranks
from .group import CONTROL_TIMEOUT, RENDEZVOUS_TIMEOUT, TPInfo
from .p2p import StageLink, StageLinkError
from .stage_kv import check_cache, stage_kv, stage_slots

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
    if tp > 1 or not settings.get("pp_share_head"):
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


def pipeline_worker_main(rank: int, pp: int, init_method: str | None, spec, conn=None, tp: int = 1) -> None:
    """A rank other than 0 (global rank `rank` of pp x tp): join the groups, load its stage's
    shard, wait for rank 0's cache size and the link's wait bound, build its cache, serve steps
    until STOP. `conn`: a pipe to rank 0 for "started", "loaded" or an error text (spawned
    ranks; None under torchrun). Exits non-zero on any failure (rank 0's waits then fail)."""
    from ..engine.model_runner import ModelRunner
    from ..loading.loader import check_rank_memory, load_model
    from .group import destroy_groups
    from .worker import _die_with_parent, _leave_stops_to_rank0, rank_device

    _die_with_parent()
    if conn is not None:
        _leave_stops_to_rank0()
    logging.basicConfig(level=spec.log_level, format=f"[pp rank {rank}] %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(spec.threads)
    info = TPInfo(rank % tp, tp)
    code = 0
    try:
        if conn is not None:
            conn.send(("started", os.getpid()))
        device = rank_device(spec.device, rank)
        info = init_pipeline_groups(rank, pp, tp, device, init_method)
        stage = plan_for(spec.source, pp, tp)[rank // tp]
        loaded = load_model(
            spec.source,
            spec.dtype,
            device,
            max_positions=spec.max_positions,
            dequantize_weights=spec.dequantize_weights,
            isq=spec.isq,
            stage=stage,
            tp=info if tp > 1 else None,
        )
        check_rank_memory(loaded.weight_bytes, spec.max_rank_memory_mb, rank, pp, tp)
        if conn is not None:
            conn.send(("loaded", loaded.weight_bytes))
        command, lists = messages.recv(info.control)
        if command == messages.SETUP:
            num_blocks, timeout_ms = lists[0]
            cache, backend, copy_fn = stage_kv(
                loaded.config, stage, loaded.model.shard.kv_heads, spec.cache_cfg, num_blocks, device, spec.dtype
            )
            sizes = torch.tensor([loaded.weight_bytes, cache.nbytes], dtype=torch.int64)
            dist.gather(sizes, None, dst=0, group=info.control)
            runner = ModelRunner(loaded.model, backend, spec.cache_cfg.block_size, device, sampler=None)
            serve_stage(info, stage, loaded.model, runner, _link(rank, pp, tp, timeout_ms / 1000), copy_fn, backend)
        elif command != messages.STOP:
            raise RuntimeError(f"expected the setup message from rank 0, got command {command}")
    except BaseException as e:
        code = 1
        logger.error("pipeline stage %d failed: %s: %s", rank, type(e).__name__, e)
        if conn is not None:
            try:
                conn.send(("error", f"{type(e).__name__}: {e}"))
            except Exception:
                pass
    finally:
        destroy_groups(info)
    sys.exit(code)


class PipelineExecutor:
    """Rank 0's side of pipeline parallelism, as the engine uses it (engine/factory.py): the
    other stages started (or joined under torchrun), rank 0's stage loaded and its cache built,
    each step's plan sent and the first stage run (`forward`), everything stopped by `shutdown`
    (STOP, join, kill what does not exit). A stage that dies or hangs fails the step with
    `StageLinkError` within the link's bound (PAGEDLLM_PP_TIMEOUT_S), and every later step at once.
    `info`: this rank's place in its stage's TP group (rank 0 of stage 0's); `rank`: its global rank."""

    def __init__(
        self,
        rank: int,
        info: TPInfo,
        stages: list,
        procs: list,
        conns: list,
        timeout_s: float | None,
        threads_before: int | None = None,
    ) -> None:
        self.rank, self.info, self.stages = rank, info, stages
        self.pp, self.tp = len(stages), info.size
        self.world = self.pp * self.tp
        self.stage = stages[rank // self.tp]
        self.procs, self.conns = procs, conns
        self.timeout_s = settings.get("pp_timeout_s") if timeout_s is None else timeout_s
        self.threads_before = threads_before
        self.link: StageLink | None = None
        self.ops: list[int] = []  # cache operations since the last step, sent with it
        self.rank_bytes: list[tuple[int, int]] = []  # (weight bytes, KV bytes) per stage
        self.steps = 0
        self.message_bytes = 0
        self.dead: str | None = None
        self.closed = False
        self.set_up = False
        self.stats = StageStats()  # rank 0's; every rank's after shutdown, in `stage_stats`
        # Steps launched whose logits have not been collected: (start time, whether logits come
        # back, device); and the hidden states' send under way (its works, holding the tensor).
        self.launched: deque = deque()
        self.sending: list = []
        self.plan_works: list = []  # the last plan's broadcast under way
        # Micro-batches the engine keeps in flight: one a stage, so that each is busy.
        self.micro_batches = self.pp
        self.stage_stats: list[dict] = []

    # -- start -----------------------------------------------------------------------------
    @classmethod
    def start(cls, size: int, spec, timeout_s: float | None = None, tp: int = 1) -> "PipelineExecutor":
        """Rank 0 of a new pipeline of `size` stages, each split over `tp` ranks. `timeout_s`:
        how long a stage-to-stage send or receive may wait (None: PAGEDLLM_PP_TIMEOUT_S), the
        same on every rank."""
        from .executor import _free_port
        from .worker import rank_device

        stages = plan_for(spec.source, size, tp)
        want = size * tp
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world > 1:  # torchrun: the other ranks run the same command on their nodes
            if world != want:
                raise ValueError(
                    f"pipeline_parallel_size={size} x tensor_parallel_size={tp} is {want} ranks "
                    f"but torchrun started {world}; they must be equal"
                )
            rank = int(os.environ["RANK"])
            info = init_pipeline_groups(rank, size, tp, rank_device(spec.device, rank), None)
            return cls(rank, info, stages, [], [], timeout_s)
        if dist.is_initialized():
            raise ValueError(
                "another tensor- or pipeline-parallel LLM is running in this process; call its "
                "shutdown() first (torch.distributed keeps one group per process)"
            )
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        threads_before = torch.get_num_threads()
        torch.set_num_threads(spec.threads)
        logger.info(
            "pipeline parallel: %d stages on this machine (layers %s)%s, %d thread(s) a rank",
            size,
            ", ".join(f"{s.start}-{s.end - 1}" for s in stages),
            f", each over {tp} tensor-parallel ranks" if tp > 1 else "",
            spec.threads,
        )
        init = f"tcp://127.0.0.1:{_free_port()}"
        procs, conns = [], []
        ex = cls(0, TPInfo(0, tp), stages, procs, conns, timeout_s, threads_before)
        try:
            for r in range(1, want):
                parent, child = ctx.Pipe(duplex=False)
                p = ctx.Process(
                    target=pipeline_worker_main,
                    args=(r, size, init, spec, child, tp),
                    name=f"pagedllm-pp{r}",
                    daemon=True,
                )
                p.start()
                child.close()
                procs.append(p)
                conns.append(parent)
            ex._wait_for("started", 120)
            ex.info = init_pipeline_groups(0, size, tp, rank_device(spec.device, 0), init)
        except BaseException:
            ex.shutdown()
            raise
        return ex

    def load_args(self) -> dict:
        """What load_model takes to load this rank's part: its stage, and its shard of it."""
        return {"stage": self.stage, "tp": self.info if self.tp > 1 else None}

    def wait_loaded(self) -> None:
        """Block until every spawned stage has loaded its layers; a stage's error is raised here."""
        self._wait_for("loaded", settings.get("tp_load_timeout_s"))

    def _wait_for(self, what: str, timeout: float) -> None:
        wait_for_ranks(
            self.procs, self.conns, what, timeout, "pipeline stage", "pipeline_parallel_size", StageLinkError
        )

    # -- the cache ----------------------------------------------------------------------------
    def kv_spec(self, loaded, cache_cfg, dtype: torch.dtype, groups):
        """What one block costs on the rank whose pages are largest: the unit of the per-rank
        KV budget, so that every stage's cache of the pool's blocks fits in it."""
        from ..kv.cache import KVCacheSpec

        check_cache(cache_cfg)
        slots = max(stage_slots(groups, s)[1] for s in self.stages)
        cfg = loaded.config
        return KVCacheSpec(
            slots, loaded.model.shard.kv_heads, cfg.head_dim, cache_cfg.block_size, dtype, cache_cfg.kv_cache_dtype
        )

    def setup(self, num_blocks: int) -> None:
        """Tell every stage the pool's size and the link's wait bound (then each builds its cache)."""
        messages.send(self.info.control, messages.SETUP, [[num_blocks, int(self.timeout_s * 1000)]])
        self.set_up = True

    def build_kv(
        self, loaded, kv_spec, cache_cfg, num_blocks: int, device: torch.device, dtype: torch.dtype, groups=None
    ):
        """Rank 0's cache (its stage's layers only), backend and copy function; and its link."""
        self.link = _link(self.rank, self.pp, self.tp, self.timeout_s)
        return stage_kv(loaded.config, self.stage, loaded.model.shard.kv_heads, cache_cfg, num_blocks, device, dtype)

    def recorded(self, backend, copy_fn):
        """The copy function the block manager calls: each prefix copy runs here and is queued
        for the other stages, which apply it before the next step's forward. (Forks and frees
        are the block manager's alone under paged attention.)"""
        ops = self.ops

        def copy(src: int, dst: int, n: int) -> None:
            ops.extend((messages.OP_COPY_PREFIX, src, dst, n))
            copy_fn(src, dst, n)

        return backend, copy

    def gather_sizes(self, weight_bytes: int, kv_bytes: int) -> None:
        """Collect every stage's weight and KV bytes (for the trace), given rank 0's own."""
        mine = torch.tensor([weight_bytes, kv_bytes], dtype=torch.int64)
        parts = [torch.empty_like(mine) for _ in range(self.world)]
        dist.gather(mine, parts, dst=0, group=self.info.control)
        self.rank_bytes = [tuple(int(x) for x in p.tolist()) for p in parts]

    # -- steps ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, plan, runner) -> tuple[torch.Tensor | None, None]:
        """One step whole: `launch`, then `collect`. Pooling is refused under a pipeline, so no
        hidden rows come back."""
        self.launch(plan, runner)
        return self.collect(), None

    @torch.inference_mode()
    def launch(self, plan, runner) -> None:
        """Send the plan, run the first stage on `runner` (the engine's ModelRunner over rank
        0's stage) and start sending its hidden states on, without waiting for them to arrive:
        the engine may launch the next micro-batch (other sequences) while this one is in the
        later stages. Its logits come back, in launch order, by `collect`."""
        if self.dead:
            raise StageLinkError(self.dead)
        link, st, clock = self.link, self.stats, time.perf_counter
        t0 = clock()
        try:
            try:
                # The plan goes out while the later stages finish earlier steps; the one before
                # it has arrived by now (every stage took it before this step's turn).
                self._wait_plan()
                st.add(0.0, clock() - t0, plan.has_prompt)
                sent, self.plan_works = messages.send_async(
                    self.info.control, messages.STEP, messages.step_lists(plan, self.ops)
                )
                self.message_bytes += sent
            except (RuntimeError, dist.DistBackendError) as e:  # a peer's control socket closed
                raise link._fail("send the step plan to", "any", e) from e
            self.ops.clear()
            self.steps += 1
            prompt = plan.has_prompt
            t1 = clock()
            input_ids, positions, meta = runner.tensors(plan)
            try:
                h = runner.model(input_ids, positions, meta)
                st.add(clock() - t1, 0.0, prompt)
            except (RuntimeError, dist.DistBackendError) as e:
                if self.tp == 1:
                    raise
                # A TP peer of stage 0 died or is stuck: its all-reduce failed.
                raise link._fail("run stage 0's collectives with", "any", e) from e
            t2 = clock()
            self._send(h)
            st.add(0.0, clock() - t2, prompt)  # (waiting for the send before it to arrive)
            self.launched.append(
                (
                    t0,
                    plan.logits_rows is None or bool(plan.logits_rows),
                    input_ids.device,
                    prompt,
                    runner.model,
                    plan.argmax_only,
                )
            )
        except StageLinkError as e:
            self._down(str(e))
            raise

    def _wait_plan(self) -> None:
        for work, *_ in self.plan_works:
            if work.wait(self.link.timeout) is False:
                raise TimeoutError(f"no answer in {self.link.timeout.total_seconds():g} s")
        self.plan_works = []

    def _send(self, h: torch.Tensor) -> None:
        """Start sending `h` to the next stage, once the send before it has gone (so at most
        one is under way, holding its tensor)."""
        if self.sending:
            self.link.wait(self.sending)
        self.sending = self.link.isend(h)

    @torch.inference_mode()
    def collect(self) -> torch.Tensor | None:
        """The oldest launched step's logits rows as the last stage computed them (None where
        it asked for none)."""
        if self.dead:
            raise StageLinkError(self.dead)
        t0, wants, device, prompt, model, argmax_only = self.launched.popleft()
        st, clock = self.stats, time.perf_counter
        logits, last = None, (self.pp - 1) * self.tp
        try:
            if wants:
                mine = None
                t2 = clock()
                if self.stage.shares_head:
                    # The last stage sends the final hidden states, then its rows of the head;
                    # this stage computes the first rows meanwhile (models/stages.py share_head).
                    hidden = self.link.recv(src=last, device=device)
                    t3 = clock()
                    mine = model.compute_logits(hidden)
                    st.add(clock() - t3, t3 - t2, prompt)
                    t2 = clock()
                theirs = self.link.recv(src=last, device=device)
                t3 = clock()
                if argmax_only:
                    logits = logits_from_argmax(theirs, mine, model.config.vocab_size)
                else:
                    logits = theirs if mine is None else torch.cat((mine, theirs), dim=1)
                st.add(clock() - t3, t3 - t2, prompt)
        except StageLinkError as e:
            self._down(str(e))
            raise
        st.step(t0, clock(), prompt)
        return logits

    def _down(self, why: str) -> None:
        """The pipeline cannot go on: say which stages ended how, and stop the spawned ones
        (a stuck stage would otherwise hold its memory until rank 0 exits)."""
        ended = [
            f"rank {r} (pid {p.pid}) exited with code {p.exitcode}"
            for r, p in enumerate(self.procs, start=1)
            if not p.is_alive()
        ]
        self.dead = why + (f" [{'; '.join(ended)}]" if ended else "")
        logger.error("%s", self.dead)
        for p in self.procs:
            if p.is_alive():
                p.kill()

    def reset_stats(self) -> None:
        """Every rank's time records start afresh at the next step (a benchmark's measured runs
        without its warm-up); the other ranks hear it with the next plan."""
        self.stats.reset()
        self.ops.extend((messages.OP_RESET_STATS, 0, 0, 0))

    def _gather_stats(self) -> None:
        """Every rank's StageStats (sent after STOP), as `stage_stats`: per rank its busy, wait
        and idle shares of its window."""
        mine = torch.tensor(self.stats.values(), dtype=torch.float64)
        parts = [torch.empty_like(mine) for _ in range(self.world)]
        work = dist.gather(mine, parts, dst=0, group=self.info.control, async_op=True)
        if work.wait(timedelta(seconds=10)) is False:
            raise TimeoutError("the stages did not report their time within 10 s")
        self.stage_stats = []
        for r, p in enumerate(parts):
            busy, wait, window, steps, p_busy, p_wait, p_steps = p.tolist()
            self.stage_stats.append(
                dict(
                    rank=r,
                    stage=r // self.tp,
                    steps=int(steps),
                    window_s=window,
                    busy_s=busy,
                    wait_s=wait,
                    busy_share=busy / window if window else 0.0,
                    idle_share=_idle(r, busy, wait, window),
                    prompt_steps=int(p_steps),
                    prompt_busy_s=p_busy,
                    prompt_wait_s=p_wait,
                )
            )

    def trace_fields(self) -> dict:
        """The KV trace's per-rank figures (kv/trace.py)."""
        return dict(
            pipeline_parallel_size=self.pp,
            tensor_parallel_size=self.tp,
            stage_layers=[f"{s.start}-{s.end - 1}" for s in self.stages],
            rank_weight_mb=[w / 2**20 for w, _ in self.rank_bytes],
            rank_kv_mb=[kv / 2**20 for _, kv in self.rank_bytes],
            p2p_bytes_per_step=(self.link.sent_bytes + self.link.received_bytes) / max(1, self.steps)
            if self.link is not None
            else 0.0,
        )

    # -- stop ----------------------------------------------------------------------------------
    def shutdown(self) -> None:
        from .group import destroy_groups

        if self.closed:
            return
        self.closed = True
        if not self.dead and self.info.control is not None:
            try:
                while self.launched:  # steps left in flight (an error or abort in between): drained
                    self.collect()
                if self.sending:
                    self.link.wait(self.sending)
                self._wait_plan()
                messages.send(self.info.control, messages.STOP)
                if self.set_up:
                    self._gather_stats()
            except Exception as e:
                logger.warning("pipeline stop: %s", e)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                logger.warning("pipeline stage %s did not stop; killing it", p.name)
                p.kill()
                p.join(timeout=5)
        for c in self.conns:
            c.close()
        destroy_groups(self.info)
        if self.threads_before is not None:
            torch.set_num_threads(self.threads_before)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    # -- a pipeline driven without the engine (tests/test_pipeline_run.py) ------------------------
    def build(self, spec, num_blocks: int):
        """Load rank 0's stage and build its cache of `num_blocks` blocks outside an engine;
        (a driver whose `forward(plan)` gives the logits rows, the stage, the loaded model)."""
        from ..engine.model_runner import ModelRunner
        from ..loading.loader import load_model
        from .worker import rank_device

        device = rank_device(spec.device, self.rank)
        loaded = load_model(
            spec.source,
            spec.dtype,
            device,
            max_positions=spec.max_positions,
            dequantize_weights=spec.dequantize_weights,
            isq=spec.isq,
            **self.load_args(),
        )
        self.wait_loaded()
        self.setup(num_blocks)
        cache, backend, _ = self.build_kv(loaded, None, spec.cache_cfg, num_blocks, device, spec.dtype)
        self.gather_sizes(loaded.weight_bytes, cache.nbytes)
        runner = ModelRunner(loaded.model, backend, spec.cache_cfg.block_size, device, sampler=None)
        return _Driver(self, runner), self.stage, loaded


class _Driver:
    def __init__(self, ex: PipelineExecutor, runner) -> None:
        self.ex, self.runner = ex, runner

    def forward(self, plan) -> torch.Tensor | None:
        return self.ex.forward(plan, self.runner)[0]
