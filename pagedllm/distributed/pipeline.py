"""Pipeline parallelism: each rank runs one stage's layers over its own paged KV cache.

Rank 0 schedules, runs the first stage and samples. Each step it broadcasts the plan on the
control group (messages.py, as tensor parallelism does), so every stage builds the same
positions, slots and block tables; then the hidden states go stage to stage by
point-to-point (p2p.py), and the last stage sends the logits rows of the plan back to rank 0.

A stage's cache holds only its own layers: rank 0's block tables index blocks of a pool
whose pages have one slot per layer of a KV group (kv/groups.py), and a stage keeps, per
block, slots for its own layers of each group only. With one group (all layers attend alike)
that is 1/P of the layers; with Gemma's sliding groups a stage keeps as many slots as its
fullest group, so the saving is smaller where a stage holds a whole group's worth of layers.

`PipelineExecutor.start` spawns the other stages on this machine (torch.multiprocessing, as
tensor parallelism's executor does) or, under torchrun (WORLD_SIZE set), joins the group the
other nodes' ranks join; `pipeline_worker_main` is a rank > 0's whole life.

Not yet here (issue 65): rank 0's side inside the engine (`LLM(pipeline_parallel_size=...)`),
tensor parallelism inside a stage, several micro-batches in flight.
"""
from __future__ import annotations

import logging
import os
import sys

import torch
import torch.distributed as dist

from . import messages
from .group import TPInfo
from .p2p import StageLink, StageLinkError

logger = logging.getLogger(__name__)


def stage_kv(cfg, stage, kv_heads: int, cache_cfg, num_blocks: int, device: torch.device, dtype: torch.dtype):
    """(paged cache, attention backend, prefix-copy function) for `stage`'s layers, read with
    rank 0's block tables (the whole model's KV groups). `cfg`: the ModelConfig."""
    from ..attention.paged import PagedAttentionBackend
    from ..kv.cache import KVCacheSpec, PagedKVCache
    from ..kv.groups import plan_groups

    if not cache_cfg.paged_attention:
        raise ValueError("pipeline parallelism runs on the paged KV cache (paged_attention=True)")
    groups = plan_groups(cfg.layer_windows, cfg.num_layers, hybrid=True)
    group_of, slot_of = groups.layer_group, {}
    for layers in groups.layers:  # this stage's layers of each group, in slot order
        for j, layer in enumerate(x for x in layers if stage.holds(x)):
            slot_of[layer] = j
    slots = max(slot_of.values()) + 1
    spec = KVCacheSpec(slots, kv_heads, cfg.head_dim, cache_cfg.block_size, dtype, cache_cfg.kv_cache_dtype)
    if spec.mode.head_scales:
        raise ValueError(f"kv_cache_dtype={cache_cfg.kv_cache_dtype!r} calibrates its scales over the whole model; "
                         "pipeline parallelism does not run it yet (use auto or int8)")
    cache = PagedKVCache(spec, num_blocks, device, None, [slot_of[i] for i in stage.layers])
    backend = PagedAttentionBackend(cache, [group_of[i] for i in stage.layers])
    return cache, backend, cache.copy_block_prefix


class StageRunner:
    """One stage's forward for a plan: the previous stage's hidden states in (the first stage
    embeds), this stage's layers over its cache, the hidden states out to the next stage (the
    last stage: the plan's logits rows to rank 0). `runner`: an engine ModelRunner built on
    the stage's model and backend, used for the plan's tensors only."""

    def __init__(self, model, runner, link: StageLink, stage) -> None:
        self.model, self.runner, self.link, self.stage = model, runner, link, stage

    @torch.inference_mode()
    def run(self, plan) -> torch.Tensor | None:
        """This stage's part of `plan`; on the first stage (rank 0) the logits rows as the
        last stage computed them (None where the plan asks for none)."""
        input_ids, positions, meta = self.runner.tensors(plan)
        h = None if self.stage.first else self.link.recv(device=input_ids.device)
        out = self.model(input_ids, positions, meta, inputs_embeds=h)
        wants = plan.logits_rows is None or bool(plan.logits_rows)
        if not self.stage.last:
            self.link.send(out)
        elif wants:
            if plan.logits_rows is not None:
                out = out.index_select(0, self.runner.upload.ints([plan.logits_rows])[0])
            logits = self.model.compute_logits(out)
            if self.stage.first:  # a pipeline of one stage
                return logits
            self.link.send(logits, dst=0)
        if self.stage.first and wants:
            return self.link.recv(src=self.stage.size - 1, device=input_ids.device)
        return None


class PipelineDriver:
    """Rank 0's side: send each step's plan to every stage, run the first stage, get the logits."""

    def __init__(self, info: TPInfo, stage_runner: StageRunner) -> None:
        self.info, self.stage = info, stage_runner
        self.ops: list[int] = []
        self.steps = 0

    def forward(self, plan) -> torch.Tensor | None:
        """The plan's logits rows; a stage that died or hangs raises StageLinkError (within the
        link's bound), and every later step raises it at once."""
        link = self.stage.link
        if link.failed:
            raise StageLinkError(link.failed)
        try:
            messages.send(self.info.control, messages.STEP, messages.step_lists(plan, self.ops))
        except (RuntimeError, dist.DistBackendError) as e:  # a peer's control socket closed
            raise link._fail("send the step plan to", "any", e) from e
        self.ops.clear()
        self.steps += 1
        return self.stage.run(plan)

    def setup(self, num_blocks: int) -> None:
        messages.send(self.info.control, messages.SETUP, [[num_blocks]])

    def stop(self) -> None:
        messages.send(self.info.control, messages.STOP)


def serve_stage(info: TPInfo, stage, model, runner, link: StageLink, copy_fn, backend) -> None:
    """A rank > 0's loop: apply rank 0's cache operations, run its stage of each step, until STOP."""
    stage_runner = StageRunner(model, runner, link, stage)
    apply = {messages.OP_COPY_PREFIX: copy_fn, messages.OP_FREE_SEQ: lambda a, b, c: backend.free_seq(a),
             messages.OP_FORK_SEQ: lambda a, b, c: backend.fork_seq(a, b)}
    while True:
        command, lists = messages.recv(info.control)
        if command == messages.STOP:
            return
        plan, ops = messages.step_from_lists(lists)
        for i in range(0, len(ops), 4):
            apply[ops[i]](*ops[i + 1:i + 4])
        stage_runner.run(plan)


def plan_for(source, size: int) -> list:
    """The stage plan every rank computes alike, from the model's config."""
    from ..loading.loader import read_config
    from ..models.stages import estimated_bytes, plan_stages

    layers, embed, head = estimated_bytes(read_config(source))
    return plan_stages(layers, size, embed, head)


def build_stage(info: TPInfo, spec, num_blocks: int, timeout_s: float | None = None):
    """This rank's stage: (stage, loaded model, cache, backend, copy function, runner, link)."""
    from ..engine.model_runner import ModelRunner
    from ..loading.loader import load_model
    from .worker import rank_device

    device = rank_device(spec.device, info.rank)
    stage = plan_for(spec.source, info.size)[info.rank]
    loaded = load_model(spec.source, spec.dtype, device, max_positions=spec.max_positions,
                        dequantize_weights=spec.dequantize_weights, isq=spec.isq, stage=stage)
    cache, backend, copy_fn = stage_kv(loaded.config, stage, loaded.model.shard.kv_heads, spec.cache_cfg,
                                       num_blocks, device, spec.dtype)
    runner = ModelRunner(loaded.model, backend, spec.cache_cfg.block_size, device, sampler=None)
    kw = {} if timeout_s is None else {"timeout_s": timeout_s}
    link = StageLink(info.rank, info.rank - 1 if info.rank else None,
                     info.rank + 1 if info.rank + 1 < info.size else None, **kw)
    return stage, loaded, cache, backend, copy_fn, runner, link


def pipeline_worker_main(rank: int, size: int, init_method: str | None, spec, conn=None) -> None:
    """A stage other than the first: join the group, wait for rank 0's cache size, build the
    stage, serve steps until STOP. Exits non-zero on any failure (rank 0's waits then fail)."""
    from .group import destroy_groups, init_groups
    from .worker import _die_with_parent, rank_device

    _die_with_parent()
    logging.basicConfig(level=spec.log_level, format=f"[pp rank {rank}] %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(spec.threads)
    info = TPInfo(rank, size)
    code = 0
    try:
        init_groups(info, rank_device(spec.device, rank), init_method)
        if conn is not None:
            conn.send(("started", os.getpid()))
        command, lists = messages.recv(info.control)
        if command == messages.SETUP:
            stage, loaded, _, backend, copy_fn, runner, link = build_stage(info, spec, lists[0][0])
            if conn is not None:
                conn.send(("loaded", loaded.weight_bytes))
            serve_stage(info, stage, loaded.model, runner, link, copy_fn, backend)
    except BaseException as e:
        code = 1
        logger.error("pipeline stage %d failed: %s: %s", rank, type(e).__name__, e)
    finally:
        destroy_groups(info)
    sys.exit(code)


class PipelineExecutor:
    """Rank 0's processes and group: the other stages started (or joined under torchrun),
    stopped by `shutdown` (STOP, join, kill what does not exit)."""

    def __init__(self, info: TPInfo, procs: list) -> None:
        self.info, self.procs = info, procs
        self.driver: PipelineDriver | None = None
        self.closed = False

    @classmethod
    def start(cls, size: int, spec) -> "PipelineExecutor":
        from .executor import _free_port
        from .group import init_groups
        from .worker import rank_device

        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world > 1:  # torchrun: the other stages run the same command on their nodes
            if world != size:
                raise ValueError(f"pipeline_parallel_size={size} but torchrun started {world} ranks")
            info = TPInfo(int(os.environ["RANK"]), size)
            init_groups(info, rank_device(spec.device, info.rank), None)
            return cls(info, [])
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        init = f"tcp://127.0.0.1:{_free_port()}"
        procs = [ctx.Process(target=pipeline_worker_main, args=(r, size, init, spec), name=f"pagedllm-pp{r}",
                             daemon=True) for r in range(1, size)]
        ex = cls(TPInfo(0, size), procs)
        try:
            for p in procs:
                p.start()
            init_groups(ex.info, rank_device(spec.device, 0), init)
        except BaseException:
            ex.shutdown()
            raise
        return ex

    def build(self, spec, num_blocks: int, timeout_s: float | None = None):
        """Send the cache size, build rank 0's stage; (driver, stage, loaded model)."""
        driver = PipelineDriver(self.info, None)
        driver.setup(num_blocks)
        stage, loaded, _, _, _, runner, link = build_stage(self.info, spec, num_blocks, timeout_s)
        driver.stage = StageRunner(loaded.model, runner, link, stage)
        self.driver = driver
        return driver, stage, loaded

    def shutdown(self) -> None:
        from .group import destroy_groups

        if self.closed:
            return
        self.closed = True
        link = self.driver.stage.link if self.driver is not None and self.driver.stage is not None else None
        if self.info.control is not None and not (link is not None and link.failed):
            try:
                self.driver.stop() if self.driver else messages.send(self.info.control, messages.STOP)
            except Exception:
                pass
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                logger.warning("pipeline stage %s did not stop; killing it", p.name)
                p.kill()
                p.join(timeout=5)
        destroy_groups(self.info)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]
