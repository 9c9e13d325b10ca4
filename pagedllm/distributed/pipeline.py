"""Pipeline parallelism: each rank runs one stage's layers over its own paged KV cache.

Rank 0 is the engine: it schedules, runs the first stage and samples. Each step it broadcasts
the plan on the control group (messages.py, as tensor parallelism does), so every stage builds
the same positions, slots and block tables; then the hidden states go stage to stage by
point-to-point (p2p.py), and the last stage sends the logits rows of the plan back to rank 0.
Where the first stage shares the LM head (models/stages.py `share_head`), the last stage sends
the rows' final hidden states first, then its columns of the logits; rank 0 computes the first
columns from the hidden states meanwhile, and puts the two side by side.
`PipelineExecutor` is rank 0's side, passed to the engine's constructor (engine/factory.py)
like tensor parallelism's executor; `pipeline_worker_main` (stage.py) is a rank > 0's whole life.

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
import time
from collections import deque
from datetime import timedelta

import torch
import torch.distributed as dist

from .. import settings
from . import messages
from .executor import Executor, torchrun_rank, torchrun_world
from .group import TPInfo
from .p2p import StageLink, StageLinkError
from .stage import StageStats, _idle, _link, init_pipeline_groups, logits_from_argmax, pipeline_worker_main, plan_for
from .stage_kv import check_cache, stage_kv, stage_slots

logger = logging.getLogger(__name__)


class PipelineExecutor(Executor):
    """Rank 0's side of pipeline parallelism, as the engine uses it (engine/factory.py): the
    other stages started (or joined under torchrun), rank 0's stage loaded and its cache built,
    each step's plan sent and the first stage run (`forward`), everything stopped by `shutdown`
    (STOP, join, kill what does not exit). A stage that dies or hangs fails the step with
    `StageLinkError` within the link's bound (PAGEDLLM_PP_TIMEOUT_S), and every later step at once.
    `info`: this rank's place in its stage's TP group (rank 0 of stage 0's); `rank`: its global rank."""

    kind = "pipeline stage"
    size_arg = "pipeline_parallel_size"
    error = StageLinkError

    def __init__(self, rank: int, info: TPInfo, stages: list, timeout_s: float | None) -> None:
        super().__init__(info, len(stages) * info.size, [], [], None)
        self.rank, self.stages = rank, stages
        self.pp, self.tp = len(stages), info.size
        self.stage = stages[rank // self.tp]
        self.timeout_s = settings.get("pp_timeout_s") if timeout_s is None else timeout_s
        self.link: StageLink | None = None
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
        from .worker import rank_device

        stages = plan_for(spec.source, size, tp)
        want = size * tp
        world = torchrun_world()
        if world > 1:  # torchrun: the other ranks run the same command on their nodes
            if world != want:
                raise ValueError(
                    f"pipeline_parallel_size={size} x tensor_parallel_size={tp} is {want} ranks "
                    f"but torchrun started {world}; they must be equal"
                )
            rank = torchrun_rank()
            info = init_pipeline_groups(rank, size, tp, rank_device(spec.device, rank), None)
            return cls(rank, info, stages, timeout_s)
        cls.check_alone()
        logger.info(
            "pipeline parallel: %d stages on this machine (layers %s)%s, %d thread(s) a rank",
            size,
            ", ".join(f"{s.start}-{s.end - 1}" for s in stages),
            f", each over {tp} tensor-parallel ranks" if tp > 1 else "",
            spec.threads,
        )
        ex = cls(0, TPInfo(0, tp), stages, timeout_s)
        init = ex.spawn(pipeline_worker_main, lambda r, init: (r, size, init, spec, tp), spec.threads, "pagedllm-pp")
        try:
            ex.info = init_pipeline_groups(0, size, tp, rank_device(spec.device, 0), init)
        except BaseException:
            ex.shutdown()
            raise
        return ex

    def load_args(self) -> dict:
        """What load_model takes to load this rank's part: its stage, and its shard of it."""
        return {"stage": self.stage, "tp": self.info if self.tp > 1 else None}

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
        return backend, self.recorded_copy(copy_fn)

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
        ended = self.ended_ranks()
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
    def _before_stop(self) -> None:
        while self.launched:  # steps left in flight (an error or abort in between): drained
            self.collect()
        if self.sending:
            self.link.wait(self.sending)
        self._wait_plan()

    def _after_stop(self) -> None:
        if self.set_up:
            self._gather_stats()
