"""Build a model from a source: config -> model family -> weights -> tokenizer."""

from __future__ import annotations

import json
import logging
import math
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch
from tqdm.auto import tqdm

from ..config import ModelConfig
from ..kv.calibration import kv_scale_key
from ..models import materialize, model_class
from ..models.contract import check_contract
from ..quant.formats import QuantTensor
from ..tokenizer import Tokenizer
from .source import ModelSource

logger = logging.getLogger(__name__)


@dataclass
class WeightsInfo:
    """What the weights are in memory: formats, resident bytes, and the kernel that runs them."""

    formats: dict[str, int]  # format name -> number of weight matrices (or float dtype -> count)
    resident_bytes: int
    kernel: str | None  # the quantized kernel path ("avx512-vnni", "avx2", ...) or None
    reason: str  # why that path (or why weights are dequantized)

    def summary(self) -> str:
        fmts = ", ".join(f"{n} x{c}" for n, c in sorted(self.formats.items(), key=lambda kv: -kv[1]))
        path = f"quantized kernels: {self.kernel}" if self.kernel else "dequantized, float GEMMs"
        return f"{self.resident_bytes / 2**20:.1f} MB ({fmts}); {path} ({self.reason})"


@dataclass
class LoadedModel:
    model: torch.nn.Module
    config: ModelConfig
    tokenizer: Tokenizer
    source: ModelSource
    weight_bytes: int
    # KV-cache scales the checkpoint carries (fp8 KV), by (layer, 0=K / 1=V / 2=both).
    kv_scales: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    weights: WeightsInfo | None = None
    mmproj: Any = None  # the MMProj (loading/mmproj.py) a GGUF model's vision tower came from


def quantized_path(device: torch.device, dequantize_weights: bool) -> tuple[str | None, str]:
    """The kernel path quantized weights will run on, or None and why they are dequantized."""
    if dequantize_weights:
        return None, "dequantize_weights=True"
    if device.type != "cpu":
        return None, f"no quantized kernels for {device.type} yet"
    from ..quant.kernels import kernel_path

    return kernel_path()


# The GGUF file read_config opened last, handed to the load that follows: opening one walks
# its whole header and builds its tokenizer (a 49k-token vocabulary: ~0.4 s of a cold start),
# and LLM() reads the config before it loads. One slot, taken by the load, keyed by the
# file's identity so an edited file is read again.
_OPENED: dict[tuple, object] = {}
_OPENED_LOCK = threading.Lock()


def _open_gguf(path: Path, take: bool):
    from .gguf import read_gguf

    try:
        st = os.stat(path)
        key = (os.fspath(path), st.st_mtime_ns, st.st_size)
    except OSError:
        return read_gguf(path)  # read_gguf says what is wrong with the path
    with _OPENED_LOCK:
        ckpt = _OPENED.pop(key, None) if take else _OPENED.get(key)
    if ckpt is None:
        ckpt = read_gguf(path)
        if not take:
            with _OPENED_LOCK:
                _OPENED.clear()
                _OPENED[key] = ckpt
    return ckpt


def read_config(source: ModelSource) -> ModelConfig:
    """The model's config alone (cheap: no weights are read), to check options before loading."""
    if source.kind == "gguf":
        return ModelConfig.from_hf_dict(_open_gguf(source.path, take=False).config)
    return ModelConfig.from_hf_dict(_read_json(source.path / "config.json"))


def checkpoint_part_bytes(source: ModelSource, cfg: ModelConfig) -> tuple[list[int], int, int]:
    """(per-layer bytes, embedding bytes, final norm + head bytes) as the checkpoint stores them,
    quantized or not, without reading a weight: what a pipeline's stage plan balances. The
    file's own sizes, because a quantized file often keeps its head wider than its embedding
    (Q8_0 against Q5_0 in llama.cpp's Q4_K_M mixes), which a plan from the config cannot see."""
    from ..models.stages import bytes_by_part

    if source.kind == "gguf":
        named = _open_gguf(source.path, take=False).tensor_bytes()
    else:
        named = [nb for f in sorted(source.path.glob("*.safetensors")) for nb in _safetensors_bytes(f)]
    return bytes_by_part(named, cfg.num_layers, cfg.tie_word_embeddings)


def _safetensors_bytes(path: Path) -> Iterator[tuple[str, int]]:
    """(tensor name, stored bytes) from a safetensors file's header (an 8-byte little-endian
    length, then JSON giving each tensor's data offsets), which the safetensors package reads
    but does not expose."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    for name, entry in header.items():
        if name != "__metadata__":
            start, end = entry["data_offsets"]
            yield name, end - start


def load_model(
    source: ModelSource,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int | None = None,
    dequantize_weights: bool = False,
    isq: str | None = None,
    tp=None,
    headless: bool = False,
    keep_float_head: bool = False,
    stage=None,
) -> LoadedModel:
    """`tp`: a TPInfo when this process is one rank of a tensor-parallel group: it builds and
    loads only its shard (models/parallel.py). `stage`: a models.stages.Stage when this process
    runs one pipeline stage: it builds and reads only that stage's layers (and the embedding on
    the first stage, the final norm and head on the last). `headless`: an embedding model, built without
    the LM head (any head in the checkpoint is skipped). `keep_float_head`: a GPTQ / AWQ /
    compressed-tensors checkpoint's float LM head stays float instead of HEAD_FORMAT."""
    qpath, qwhy = quantized_path(device, dequantize_weights)
    ck = _read_checkpoint(source, dtype, qpath is not None, qwhy, isq, tp, stage)
    cfg = ModelConfig.from_hf_dict(ck.hf_config)
    if not cfg.eos_token_ids and ck.tokenizer.eos_token_id is not None:
        cfg.eos_token_ids = [ck.tokenizer.eos_token_id]
    model = _build(cfg, max_positions or cfg.max_position_embeddings, tp, stage, headless, ck)
    if ck.quantized and source.kind != "gguf" and ck.hf_config.get("quantization_config") and not keep_float_head:
        head = _float_head(model, ck.files, ck.quantized)
        if head is not None:
            from ..quant.isq import isq_stream

            ck.weights = isq_stream(ck.weights, HEAD_FORMAT, {head})
            ck.quantized = ck.quantized | {head}
            ck.qwhy = f"{ck.qwhy}; float head {head} quantized to {HEAD_FORMAT} at load"
    if isq:
        from ..models.linear import linear_weight_names
        from ..quant.isq import isq_stream

        if qpath is None:
            raise ValueError(f"isq={isq!r} needs the quantized CPU kernels, which are not in use here: {qwhy}")
        ck.quantized = linear_weight_names(model, _safetensors_keys(ck.files))
        ck.weights = isq_stream(ck.weights, isq, ck.quantized)
        ck.qwhy = f"{ck.qwhy}; ISQ {isq} at load"
    model.expect_quantized(ck.quantized)
    model = materialize(model, device, dtype)
    for m in model.modules():
        if hasattr(m, "reset_buffers"):  # the rope tables
            m.reset_buffers()
            m.to(device)
    model.tie_weights()
    kv_scales: dict[tuple[int, int], torch.Tensor] = {}
    weights = _set_aside_kv_scales(ck.weights, kv_scales)
    weights = ((n, t if isinstance(t, QuantTensor) else t.to(dtype)) for n, t in weights)
    bar = tqdm(weights, total=ck.total, desc=f"loading {source.path.name}", unit="tensor", leave=False, disable=None)
    model.load_weights(bar, dtype)
    model.eval()
    info = _weights_info(model, qpath if ck.quantized else None, ck.qwhy)
    logger.info("loaded %s (%s, %d layers); weights: %s", source.name, cfg.architecture, cfg.num_layers, info.summary())
    return LoadedModel(model, cfg, ck.tokenizer, source, info.resident_bytes, kv_scales, info, ck.mmproj)


@dataclass
class _Checkpoint:
    """A checkpoint opened for loading: its config, tokenizer and the stream of its tensors,
    with which of them stay quantized (and why, or why not)."""

    hf_config: dict
    tokenizer: Tokenizer
    weights: Iterator
    quantized: set[str]
    total: int  # tensors in the stream (the progress bar's length)
    qwhy: str
    mmproj: Any = None  # a GGUF model's vision tower and projector file
    files: list[Path] = field(default_factory=list)  # a safetensors folder's files


def _read_checkpoint(source: ModelSource, dtype, keep_quantized: bool, qwhy: str, isq, tp, stage) -> _Checkpoint:
    if source.kind == "gguf":
        if isq:
            raise ValueError(
                f"isq={isq!r} quantizes a safetensors model at load; {source.path.name} is a GGUF "
                "file whose weights are already quantized (drop isq)"
            )
        gg = _open_gguf(source.path, take=True)
        tokenizer = Tokenizer.from_pretrained_dir(source.tokenizer_dir) if source.tokenizer_dir else gg.tokenizer
        quantized = gg.quantized_names() if keep_quantized else set()
        ck = _Checkpoint(
            gg.config,
            tokenizer,
            gg.tensors(dtype, keep_quantized=keep_quantized),
            quantized,
            len(gg.tensor_names()),
            qwhy,
        )
        if source.mmproj is not None:
            ck.mmproj, ck.hf_config, ck.weights = _with_mmproj(source, gg, ck.hf_config, tokenizer, ck.weights, dtype)
            ck.total += ck.mmproj.num_tensors()
        return ck
    hf_config = _read_json(source.path / "config.json")
    tokenizer = Tokenizer.from_pretrained_dir(source.tokenizer_dir or source.path)
    files = sorted(source.path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{source.path} has no *.safetensors weight files")
    keep = None
    if stage is not None and not stage.whole:  # the other stages' tensors are never read
        tied = ModelConfig.from_hf_dict(hf_config).tie_word_embeddings
        keep = lambda name: stage.keeps_tensor(name, tied)  # noqa: E731
    ck = _Checkpoint(
        hf_config, tokenizer, _safetensors(files, keep), set(), len(_safetensors_keys(files)), qwhy, files=files
    )
    if hf_config.get("quantization_config"):
        ck.weights, ck.quantized, ck.total, ck.qwhy = _quantized_checkpoint(
            hf_config["quantization_config"], files, ck.weights, keep_quantized, qwhy, isq, tp
        )
    return ck


def _build(cfg: ModelConfig, positions: int, tp, stage, headless: bool, ck: _Checkpoint) -> torch.nn.Module:
    """The family's model on the meta device (its shard, its stage), held to its contract; a
    stage's stream keeps only that stage's tensors."""
    cls = model_class(cfg.architecture)
    staged = stage is not None and not stage.whole
    if staged:
        if not cls.pipeline_stages or ck.mmproj is not None or headless:
            raise ValueError(
                f"pipeline parallelism runs causal language models; {cfg.architecture}"
                f"{' with a vision tower' if ck.mmproj is not None else ''}"
                f"{' as an embedding model' if headless else ''} is not split into stages yet "
                "(use pipeline_parallel_size=1)"
            )
        ck.weights = ((n, t) for n, t in ck.weights if stage.keeps_tensor(n, cfg.tie_word_embeddings))
    with torch.device("meta"):
        model = cls(cfg, positions, tp, stage) if staged else cls(cfg, positions, tp)
    check_contract(model)
    if headless:
        model.drop_head()
    return model


def check_rank_memory(weight_bytes: int, limit_mb: float | None, rank: int = 0, pp: int = 1, tp: int = 1) -> None:
    """Refuse a rank whose weights (the loaded stage's or shard's resident bytes: the figure the
    KV trace gives per rank) exceed `limit_mb` (max_rank_memory_mb), before its KV cache is sized;
    the message says how many pipeline stages would fit it."""
    if limit_mb is None or weight_bytes <= limit_mb * 2**20:
        return
    mb = weight_bytes / 2**20
    need = max(pp + 1, math.ceil(mb * pp / limit_mb))  # the stages split the weights about evenly
    where = (
        "the model's weights"
        if pp * tp == 1
        else f"rank {rank}'s weights" + (f" (stage {rank // tp} of {pp})" if pp > 1 else "")
    )
    raise ValueError(
        f"{where} take {mb:.1f} MB, over max_rank_memory_mb={limit_mb:g} (--max-rank-memory-mb): "
        f"split the model into stages on several ranks or machines with "
        f"--pipeline-parallel-size (-pp) {need} or more (LLM(pipeline_parallel_size={need})), "
        "or raise the limit"
    )


def _with_mmproj(source: ModelSource, ckpt, text_config: dict, tokenizer: Tokenizer, weights, dtype: torch.dtype):
    """A GGUF language model and llama.cpp's mmproj file as one vision-language model: the
    mmproj (checked against the text model), the whole model's config, and the text weights
    followed by the tower's and projector's under their checkpoint names."""
    import itertools

    from .mmproj import read_mmproj

    mm = read_mmproj(source.mmproj)
    mm.check_text_model(source.path, ckpt.arch, int(text_config["hidden_size"]))
    config = mm.model_config(text_config, tokenizer.token_to_id)
    logger.info(
        "%s + %s: %s, %d image tokens an image",
        source.path.name,
        source.mmproj.name,
        config["architectures"][0],
        config["mm_tokens_per_image"],
    )
    return mm, config, itertools.chain(weights, mm.tensors(dtype))


def _quantized_checkpoint(
    qcfg: dict,
    files: list[Path],
    weights: Iterator[tuple[str, torch.Tensor]],
    keep_quantized: bool,
    qwhy: str,
    isq: str | None,
    tp,
):
    """A GPTQ / AWQ / compressed-tensors folder: its quantized weights gathered and repacked into
    block formats (quant/checkpoint.py), or dequantized where the kernels are not in use.
    Returns the stream, the names that arrive quantized, the tensor count and the path's reason."""
    from ..quant import checkpoint as qc

    scheme = qc.read_scheme(qcfg)
    if isq:
        raise ValueError(
            f"isq={isq!r} quantizes float weights at load; this checkpoint is already quantized "
            f"({scheme.describe()}): drop isq"
        )
    if tp is not None and tp.size > 1:
        raise ValueError(
            f"a {scheme.method} checkpoint does not run under tensor parallelism yet (use tensor_parallel_size=1)"
        )
    keys = _safetensors_keys(files)
    cp = qc.plan(scheme, keys, *_safetensors_readers(files))
    logger.info("%s checkpoint: %s", scheme.method, cp.summary())
    parts = sum(len(p) for p in cp.prefixes.values())
    total = len(keys) - parts + len(cp.prefixes)
    if not keep_quantized:
        path = "dequantized to float at load"
    elif any(cp.formats.values()):
        path = "repacked losslessly at load"
    else:
        path = "no block format holds them exactly: float at load"
    return (
        qc.convert_stream(weights, cp, keep_quantized),
        cp.weight_names(keep_quantized),
        total,
        f"{qwhy}; {cp.summary()}, {path}",
    )


# The format a quantized checkpoint's float LM head is quantized to at load: a GPTQ / AWQ tool
# leaves the head (and a tied embedding, which is the head) in fp16, where at batch 1 it is as
# many bytes a token as all of a 0.5B model's 4-bit layers together. llama.cpp's quantizer keeps
# a 4-bit file's output head in Q6_K, or Q8_0 where Q6_K's 256-value blocks do not tile its rows
# (Qwen2.5-0.5B's 896); Q8_0 always here: rounded as llama.cpp's own (quant/isq.py), and tiles any
# row of whole 32-value blocks.
HEAD_FORMAT = "Q8_0"


def _float_head(model: torch.nn.Module, files: list[Path], quantized: set[str]) -> str | None:
    """The checkpoint name of the LM head's float weight (the embedding table when tied), when
    the model has a head, it arrives float and its rows are whole HEAD_FORMAT blocks; else None."""
    from ..quant.formats import FORMATS

    if model.lm_head is None:
        return None
    target = "embed_tokens.weight" if model.config.tie_word_embeddings else "lm_head.weight"
    _, shape_of = _safetensors_readers(files)
    for key in _safetensors_keys(files):
        mapped = model.map_weight_name(key)
        if key in quantized or mapped is None or mapped[0] != target:
            continue
        shape = shape_of(key)
        if len(shape) != 2 or shape[1] % FORMATS[HEAD_FORMAT][1]:
            logger.info(
                "%s (shape %s): its rows are not whole %s blocks; the head stays float", key, shape, HEAD_FORMAT
            )
            return None
        return key
    return None


def _safetensors_readers(files: list[Path]):
    """read(key) and shape_of(key) over a folder's safetensors files."""
    from safetensors import safe_open

    where: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as st:
            where.update((k, f) for k in st.keys())

    def read(key: str) -> torch.Tensor:
        with safe_open(str(where[key]), framework="pt", device="cpu") as st:
            return st.get_tensor(key)

    def shape_of(key: str) -> list[int]:
        with safe_open(str(where[key]), framework="pt", device="cpu") as st:
            return st.get_slice(key).get_shape()

    return read, shape_of


def _weights_info(model: torch.nn.Module, kernel: str | None, reason: str) -> WeightsInfo:
    from collections import Counter

    from ..models.linear import Embedding, Linear

    formats: Counter[str] = Counter()
    spans: list[tuple[int, int]] = []  # each weight's bytes in memory
    for m in model.modules():
        if isinstance(m, Linear) and m.qparts:
            formats.update(p.fmt for p in m.qparts)
            spans += [_span(p.data) for p in m.qparts]
        elif isinstance(m, Embedding) and m.qweight is not None:
            formats[m.qweight.fmt] += 1
            spans.append(_span(m.qweight.data))
    for p in model.parameters():
        spans.append(_span(p))
        if p.dim() == 2:
            formats[str(p.dtype).removeprefix("torch.")] += 1
    # Bytes held, each once: a tied head is its table's bytes (or a view of some of its rows).
    nbytes, end = 0, 0
    for lo, hi in sorted(spans):
        if hi > end:
            nbytes += hi - max(lo, end)
            end = hi
    return WeightsInfo(dict(formats), nbytes, kernel, reason)


def _span(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


def _set_aside_kv_scales(
    weights: Iterator[tuple[str, torch.Tensor]], out: dict[tuple[int, int], torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """KV-cache scales are not weights: keep them for the cache (kv/calibration.py)."""
    for name, t in weights:
        key = kv_scale_key(name)
        if key is None:
            yield name, t
        else:
            out[key] = t.float()


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found")
    with open(path) as f:
        return json.load(f)


def _safetensors(files: list[Path], keep=None) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors as stored, one at a time (the consumer casts or quantizes);
    `keep`: a test on the name, the tensors it refuses left unread."""
    from safetensors import safe_open

    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as st:
            for name in st.keys():
                if keep is None or keep(name):
                    yield name, st.get_tensor(name)


def _safetensors_keys(files: list[Path]) -> list[str]:
    from safetensors import safe_open

    keys: list[str] = []
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as st:
            keys.extend(st.keys())
    return keys
