"""What SGLang's model gateway (PyPI `sglang-router`) asks of a worker, answered from the engine.

The gateway (0.3.x, HTTP mode) reads, per worker:
- `GET /server_info` (SGLang's older name `/get_server_info`) when it registers the worker: it keeps
  `model_path` and `served_model_name` as labels, and reads `max_running_requests`,
  `max_total_tokens`, `max_prefill_tokens` and `dp_size` where given.
- `GET /model_info` (`/get_model_info`): `model_type`, `architectures`, `is_generation`,
  `tokenizer_path` (a folder or hub id the gateway's own tokenizer could load; sent only when the
  model came with one, never a path to a GGUF file it cannot read).
- `GET /health` every `--health-check-interval-secs`: a 200 keeps the worker in routing.
- `GET /health_generate`: SGLang's deeper check, one real token through the engine.
- `GET /get_load`: the load report for the load-aware policies (`power_of_two`, and the load bound
  of `cache_aware`): SGLang's shape, one entry per data-parallel rank with `num_reqs`,
  `num_waiting_reqs` and `num_tokens` (tokens held in the KV cache).
Its cache-aware policy in HTTP mode keeps its own approximate tree of the request text per worker;
the KV-event and token-id interfaces are on its gRPC path only, which speaks SGLang's scheduler
protocol, not HTTP. `/get_load` carries what the prefix cache holds (`num_cached_tokens`,
`prefix_cache_hit_rate`) for the operator and `pagedllm bench router`.
"""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from .._version import __version__
from ..engine.driver import Item
from ..protocols.common.context import ServingContext
from ..sampling.params import SamplingParams
from .async_engine import AsyncEngine
from .errors import error_response


def load_report(llm: Any) -> dict[str, Any]:
    """The engine's load right now. Plain int reads from the handler thread: a figure one step old
    is as good as a fresh one to a router."""
    eng = llm.engine
    sched, bm = eng.scheduler, eng.block_manager
    used, total = bm.num_used_blocks, bm.num_usable_blocks
    block = eng.cache_config.block_size
    return {
        "dp_rank": 0,
        "num_reqs": sched.num_running + sched.num_waiting,
        "num_running_reqs": sched.num_running,
        "num_waiting_reqs": sched.num_waiting,
        "num_tokens": used * block,
        "kv_cache_usage": used / total if total else 0.0,
        "num_cached_tokens": bm.num_cached_blocks * block,
        "prefix_cache_hit_rate": bm.stats.hit_rate,
    }


def install(
    app: FastAPI, llm: Any, engine: AsyncEngine, ctx: ServingContext, names: list[str], tokenizer_path: str | None
) -> None:
    eng = llm.engine
    server_info = {
        "model_path": ctx.model_name,
        "served_model_name": names[0],
        "version": __version__,
        "dp_size": 1,
        "max_running_requests": eng.sched_config.max_num_seqs,
        "max_total_tokens": ctx.usable_blocks * ctx.block_size,
        "max_prefill_tokens": eng.sched_config.max_num_batched_tokens,
        "context_length": ctx.max_model_len,
        "engine": "pagedllm",
    }
    model_info = {
        "model_path": ctx.model_name,
        "is_generation": True,
        "model_type": None,  # (SGLang's field; ModelConfig keeps the architecture only)
        "architectures": [eng.model_config.architecture],
    }
    if tokenizer_path:
        model_info["tokenizer_path"] = tokenizer_path

    async def server_info_route() -> Response:
        return JSONResponse({**server_info, "load": load_report(llm)})

    async def model_info_route() -> Response:
        return JSONResponse(model_info)

    for path in ("/server_info", "/get_server_info"):
        app.get(path, include_in_schema=False)(server_info_route)
    for path in ("/model_info", "/get_model_info"):
        app.get(path, include_in_schema=False)(model_info_route)

    @app.get("/get_load", include_in_schema=False)
    async def get_load() -> Response:
        return JSONResponse([load_report(llm)])

    @app.get("/health_generate", include_in_schema=False)
    async def health_generate() -> Response:
        if not engine.alive:
            return error_response(503, "the engine is not running", "server_error")
        sub = await engine.submit(
            [
                Item(
                    f"health-{uuid.uuid4().hex}",
                    ctx.tokenizer.encode("ping"),
                    SamplingParams(max_tokens=1, temperature=0.0),
                )
            ]
        )
        try:
            async for _ in sub:
                pass
        finally:
            sub.abort_unfinished()
        return JSONResponse({"status": "ok"})
