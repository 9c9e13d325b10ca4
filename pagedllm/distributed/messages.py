"""Rank 0's messages to the other ranks, on the control group: a command and int64 lists.

A message is two broadcasts: a header [command, payload length], then the payload (skipped
when empty): [k, len_1 .. len_k, list_1 ..., list_k]. A step's message carries its whole plan
(token ids, positions, slots, block tables, lengths, logits rows) and the cache operations the
block manager made since the last step (prefix copies, copy-on-write, contiguous frees/forks),
which every rank applies before the forward so all caches stay identical.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..engine.model_runner import StepPlan

STEP, STOP, SETUP = 1, 2, 3
# Cache operations, as (op, a, b, c) quadruples in a step's message; and a pipeline stage's
# time records started afresh (after a benchmark's warm-up).
OP_COPY_PREFIX, OP_FREE_SEQ, OP_FORK_SEQ, OP_RESET_STATS = 1, 2, 3, 4


def send(group, command: int, lists: list[list[int]] = ()) -> int:
    """Broadcast from rank 0; returns the bytes sent."""
    return send_async(group, command, lists, wait=True)[0]


def send_async(group, command: int, lists: list[list[int]] = (), wait: bool = False) -> tuple[int, list]:
    """Start the broadcast from rank 0 (the other ranks may still be busy with an earlier
    step); (the bytes sent, the works to `wait()` on, which hold the tensors until then)."""
    payload: list[int] = [len(lists), *(len(x) for x in lists)]
    for x in lists:
        payload.extend(x)
    header = torch.tensor([command, len(payload)], dtype=torch.int64)
    body = torch.tensor(payload, dtype=torch.int64)
    if wait:
        dist.broadcast(header, src=0, group=group)
        dist.broadcast(body, src=0, group=group)
        return 8 * (2 + len(payload)), []
    works = [
        dist.broadcast(header, src=0, group=group, async_op=True),
        dist.broadcast(body, src=0, group=group, async_op=True),
    ]
    return 8 * (2 + len(payload)), [(w, header, body) for w in works]


def recv(group) -> tuple[int, list[list[int]]]:
    header = torch.empty(2, dtype=torch.int64)
    dist.broadcast(header, src=0, group=group)
    command, n = header.tolist()
    body = torch.empty(n, dtype=torch.int64)
    dist.broadcast(body, src=0, group=group)
    flat = body.tolist()
    k = flat[0]
    lens, out, off = flat[1 : 1 + k], [], 1 + k
    for n_i in lens:
        out.append(flat[off : off + n_i])
        off += n_i
    return command, out


def step_lists(plan: StepPlan, ops: list[int]) -> list[list[int]]:
    """The plan as lists; the KV groups after the first (sliding layers beside global ones:
    Gemma 2/3, under tensor or pipeline parallelism) follow as their widths, then each group's
    slots and table."""
    rows = plan.logits_rows
    scalars = [plan.num_decodes, plan.width, 1 if rows is None else 0, int(plan.argmax_only)]
    groups = [list(plan.group_widths)]
    for slots, table in zip(plan.group_slots, plan.group_tables):
        groups += [_ints(slots), _ints(table)]
    return [
        scalars,
        plan.ids,
        _ints(plan.pos),
        plan.query_start_loc,
        plan.context_lens,
        plan.seq_ids,
        _ints(plan.slots),
        _ints(plan.tables),
        rows or [],
        ops,
        *groups,
    ]


def _ints(x) -> list[int]:
    """The runner builds positions, slots and tables as int64 arrays; messages carry lists."""
    return x.tolist() if hasattr(x, "tolist") else x


def step_from_lists(lists: list[list[int]]) -> tuple[StepPlan, list[int]]:
    (nd, width, all_rows, argmax_only), ids, pos, qsl, ctx, seq_ids, slots, tables, rows, ops, widths, *groups = lists
    plan = StepPlan(
        ids,
        pos,
        qsl,
        ctx,
        nd,
        seq_ids,
        slots,
        tables,
        width,
        None if all_rows else rows,
        group_slots=groups[0::2],
        group_tables=groups[1::2],
        group_widths=widths,
        argmax_only=bool(argmax_only),
    )
    return plan, ops
