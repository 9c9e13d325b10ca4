"""What speculation costs in this run, measured as it runs, and the proposal lengths worth
their cost.

A target step's time is a curve in its decode rows: the median of the recent steps of each
row count seen often enough, joined by straight pieces, and past the last of them a line
fitted to all of them; the prices of its extra rows are then made non-decreasing (`rising`).
A line alone does not fit: a step that streams the weights once takes its second row almost
free and later rows at a growing share, and one slope through both overpriced a single
proposal and declined free chat that one proposal a step speeds up (docs/benchmarks/from-code.md,
"The speculative planner's step curve"). A draft forward's time is the median of the
recent ones. Medians, not means: one step slowed by the machine (twice its usual time is
common on a shared 2-core host) moved a running mean enough to decline a code edit whose
drafts were 99% accepted. Both are taken relative to a plain decode step of the same
sequences, so the planner works in "plain steps" and needs no clock of its own.

A sequence whose proposals are each accepted with probability a (independently, the usual
model) adds 1 + a + ... + a^k tokens a step when it proposes k. The planner gives out
proposals one at a time, to the sequence where one more raises the step's expected tokens per
unit of time most, and stops when none does: a sequence with low acceptance, or a draft whose
forwards cost more than they bring, proposes nothing.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

# Before two row counts are timed: one more verification row costs this share of a step.
ROW_PRIOR = 0.1
# Before a draft forward is timed: its time as a share of a target step.
DRAFT_PRIOR = 0.3
RECENT = 15  # timings kept per row count (and of draft forwards): the median of these
FIT_WEIGHT_CAP = 16  # a row count's weight in the fit: how often it was seen, at most this
TRUSTED = 3  # a row count's median joins the curve once this many of its steps were timed
EXTRA_ROWS = 32  # verification rows `relative` prices one by one (past them: the last price)

# One more verification row's cost as a share of a plain step: the same for every row (a
# float), or the j-th extra row's at index j (the last one's for any row past the list).
RowCost = float | Sequence[float]


def row_price(row_cost: RowCost, j: int) -> float:
    """The cost of the step's j-th extra row (from 0)."""
    if isinstance(row_cost, (int, float)):
        return float(row_cost)
    return row_cost[min(j, len(row_cost) - 1)]


def _recent() -> deque:
    return deque(maxlen=RECENT)


@dataclass
class StepCosts:
    steps: dict[int, deque] = field(default_factory=dict)  # decode rows -> recent step seconds
    step_s: dict[int, float] = field(default_factory=dict)  # decode rows -> their median
    seen: dict[int, int] = field(default_factory=dict)  # decode rows -> steps timed
    drafts: deque = field(default_factory=_recent)  # recent seconds of one draft forward
    draft_s: float | None = None  # their median

    def observe_step(self, rows: int, secs: float) -> None:
        """A decode-only target step of `rows` rows took `secs`."""
        recent = self.steps.setdefault(rows, _recent())
        recent.append(secs)
        self.step_s[rows] = statistics.median(recent)
        self.seen[rows] = self.seen.get(rows, 0) + 1

    def observe_draft(self, forwards: int, secs: float) -> None:
        if forwards > 0:
            self.drafts.append(secs / forwards)
            self.draft_s = statistics.median(self.drafts)

    def _line(self) -> tuple[float, float] | None:
        """(intercept, seconds per row) of the weighted least-squares line; None under two row counts."""
        if len(self.step_s) < 2:
            return None
        w = {r: min(n, FIT_WEIGHT_CAP) for r, n in self.seen.items()}
        sw = sum(w.values())
        mr = sum(w[r] * r for r in w) / sw
        mt = sum(w[r] * t for r, t in self.step_s.items()) / sw
        var = sum(w[r] * (r - mr) ** 2 for r in w)
        slope = max(0.0, sum(w[r] * (r - mr) * (t - mt) for r, t in self.step_s.items()) / var)
        return mt - slope * mr, slope

    def _time(self, rows: int, line: tuple[float, float] | None, pts: list[tuple[int, float]]) -> float | None:
        """A step of `rows` decode rows: on the curve through the trusted medians `pts` (row
        count, seconds; in order) between its ends, the line past them (from the last of them
        where there is one)."""
        for (r0, t0), (r1, t1) in zip(pts, pts[1:]):
            if r0 <= rows <= r1:
                return t0 + (t1 - t0) * (rows - r0) / (r1 - r0)
        if line is None:
            return self.step_s.get(rows)
        if pts and rows > pts[-1][0]:
            return pts[-1][1] + line[1] * (rows - pts[-1][0])
        if pts and rows == pts[0][0]:
            return pts[0][1]
        return line[0] + line[1] * rows

    def relative(self, rows: int) -> tuple[RowCost, float]:
        """(the price of each verification row added to a step of `rows` decode rows, in order,
        and of one draft forward), each as a share of a plain decode step of `rows` rows."""
        line = self._line()
        pts = sorted((r, t) for r, t in self.step_s.items() if self.seen[r] >= TRUSTED)
        base = self._time(rows, line, pts)
        if base is None or base <= 0:
            return ROW_PRIOR, DRAFT_PRIOR
        draft = DRAFT_PRIOR if self.draft_s is None else self.draft_s / base
        if line is None:
            return ROW_PRIOR, draft
        times = [base] + [self._time(rows + j, line, pts) for j in range(1, EXTRA_ROWS + 1)]
        return rising([max(0.0, b - a) / base for a, b in zip(times, times[1:])]), draft


def rising(prices: list[float]) -> list[float]:
    """The closest non-decreasing prices (least squares: adjacent violators pooled into their
    mean). A step's rows cost more each as it turns from streaming the weights to computing,
    never less; medians of row counts timed in different phases of a shared machine did: a
    1.5B's 2nd to 5th rows priced 0.18, 0.00, 0.33 and 0.16 of a step (0.01-0.11 measured
    alone), and an 80%-accepted lookup proposed 2 tokens where 5 paid."""
    blocks: list[list[float]] = []  # [sum, count] of each pooled run
    for p in prices:
        blocks.append([p, 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, n = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += n
    return [s / n for s, n in blocks for _ in range(int(n))]


@dataclass
class Candidate:
    acceptance: float  # per-token acceptance probability of its proposer
    cap: int  # proposals it may make at most (what fits, or what the lookup found)
    draft: bool  # its proposals come from draft forwards


def best_rate(c: Candidate, row_cost: RowCost, draft_cost: float) -> float:
    """A lone sequence's expected tokens per plain step's time at its best length (1.0: none pays)."""
    best = tokens = cost = 1.0
    for k in range(1, c.cap + 1):
        tokens += c.acceptance**k
        cost += row_price(row_cost, k - 1) + (draft_cost if c.draft else 0.0)
        best = max(best, tokens / cost)
    return best


def plan_lengths(cands: list[Candidate], plain_rows: int, room: int, row_cost: RowCost, draft_cost: float) -> list[int]:
    """Proposals per candidate: greedily the next proposal that raises expected tokens per unit
    of step time most, while one does and the step has `room` rows for it. `plain_rows`: the
    step's decode rows without proposals (each adds one token for sure, at cost 1 in all)."""
    ks = [0] * len(cands)
    tokens, cost = float(plain_rows), 1.0
    forwards = 0  # sequential draft forwards so far: the longest draft proposal
    while room > 0:
        best, best_rate, best_dt = -1, tokens / cost, 0.0
        row = row_price(row_cost, sum(ks))
        for i, c in enumerate(cands):
            k = ks[i]
            if k >= c.cap:
                continue
            dt = row + (draft_cost if c.draft and k == forwards else 0.0)
            rate = (tokens + c.acceptance ** (k + 1)) / (cost + dt)
            if rate > best_rate:
                best, best_rate, best_dt = i, rate, dt
        if best < 0:
            break
        c, k = cands[best], ks[best]
        tokens += c.acceptance ** (k + 1)
        cost += best_dt
        if c.draft and k == forwards:
            forwards += 1
        ks[best] = k + 1
        room -= 1
    return ks
