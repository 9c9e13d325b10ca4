"""LoRA adapters over HTTP, as vLLM serves them: `--lora-modules name=PATH` at start, the
request's `model` picks one, `/v1/models` lists them with their `parent`, and with
`--allow-runtime-lora` `POST /v1/load_lora_adapter` / `/v1/unload_lora_adapter` change the set.

Unloading takes the name away from new requests; requests already running keep their adapter
to the end (their sequences hold its LoRARequest; the slot is reused when the LRU wants it)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response

from ..lora.peft import load_adapter
from ..lora.request import LoRARequest
from ..protocols.common.errors import ApiError

logger = logging.getLogger(__name__)


class Adapters:
    """The adapters this server answers to, by name."""

    def __init__(self, llm: Any, served_names: list[str]) -> None:
        self.llm, self.served_names = llm, served_names
        self.by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.llm.engine.lora is not None

    def add(self, name: str, path: str) -> LoRARequest:
        """Check the adapter against the base model (a ValueError naming the mismatch) and serve it."""
        if not self.enabled:
            raise ValueError("LoRA adapters are not enabled: start the server with --enable-lora")
        if not name or not isinstance(name, str):
            raise ValueError("lora_name must be a non-empty string")
        if name in self.served_names:
            raise ValueError(f"lora_name {name!r} is the base model's name; give the adapter another name")
        if name in self.by_name:
            raise ValueError(f"LoRA adapter {name!r} is already loaded; unload it first")
        mgr = self.llm.engine.lora
        load_adapter(path, mgr.model, mgr.max_rank)  # reads the model's shapes only: safe off the engine thread
        with self._lock:
            req = self.by_name[name] = LoRARequest(name, next(self._ids), str(path))
        logger.info("LoRA adapter %r served from %s", name, path)
        return req

    def remove(self, name: str) -> bool:
        with self._lock:
            return self.by_name.pop(name, None) is not None

    def get(self, name: str | None) -> LoRARequest | None:
        return self.by_name.get(name) if name is not None else None


def parse_modules(specs: list[str] | tuple[str, ...]) -> list[tuple[str, str]]:
    """`name=PATH` entries (vLLM's --lora-modules), checked for form."""
    out = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules entry {spec!r} is not name=PATH")
        out.append((name, path))
    return out


def install(app: FastAPI, adapters: Adapters, allow_runtime: bool) -> None:
    if not allow_runtime:
        return

    async def body(request: Request) -> dict:
        try:
            data = await request.json()
        except ValueError:
            raise ApiError("the body must be a JSON object") from None
        if not isinstance(data, dict):
            raise ApiError("the body must be a JSON object")
        return data

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        data = await body(request)
        name, path = data.get("lora_name"), data.get("lora_path")
        if not isinstance(name, str) or not isinstance(path, str):
            raise ApiError(
                "give lora_name and lora_path (strings)",
                param="lora_name" if not isinstance(name, str) else "lora_path",
            )
        try:
            await asyncio.to_thread(adapters.add, name, path)
        except ValueError as e:
            raise ApiError(str(e), param="lora_path") from None
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        data = await body(request)
        name = data.get("lora_name")
        if not adapters.remove(name):
            raise ApiError(
                f"the LoRA adapter `{name}` is not loaded", status=404, param="lora_name", code="model_not_found"
            )
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
