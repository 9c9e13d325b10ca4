"""Per-sequence rows kept between steps (the idea of vLLM's persistent batch, our own code).

Every sequence the runner has planned holds a row of a persistent int64 array: its block
table in each KV group, padded with the null block. A step copies into the rows only what
changed since the last one: the blocks a table gained, or, when the block manager changed a
table in place (a copy-on-write, a window release, a trim or a free bumps
`Sequence.table_version`), the whole row. The step's block tables, slot mapping and
positions are then a few array operations over the rows, not Python loops over tokens and
table entries.
"""

from __future__ import annotations

import numpy as np

from .sequence import Sequence


class InputBatch:
    def __init__(self, num_groups: int, rows: int = 64, width: int = 32) -> None:
        self.num_groups = num_groups
        # [group, row, block index] block ids, 0 (the null block) past each table's end.
        self.tables = np.zeros((num_groups, rows, width), dtype=np.int64)
        self.lens = np.zeros((num_groups, rows), dtype=np.int64)  # entries written per row
        self.lens0 = [0] * rows  # group 0's, as Python ints: the per-step check reads these
        self.versions = [-1] * rows  # the table_version each row was last written at
        self.row_of: dict[int, int] = {}  # seq_id -> row
        self.free_rows = list(range(rows - 1, -1, -1))

    @property
    def num_rows(self) -> int:
        return len(self.versions)

    def row(self, seq: Sequence) -> int:
        """seq's row, brought up to date with its tables."""
        r = self.row_of.get(seq.seq_id)
        if r is None:
            r = self._assign(seq.seq_id)
        elif self.versions[r] == seq.table_version and self.num_groups == 1 and self.lens0[r] == len(seq.block_table):
            return r  # most steps: nothing changed
        full = self.versions[r] != seq.table_version
        if self.num_groups == 1:
            self._write(0, r, seq.block_table, full)
        else:
            self._write(0, r, seq.block_table, full)
            for g, table in enumerate(seq.group_tables, start=1):
                self._write(g, r, table, full)
        self.versions[r] = seq.table_version
        return r

    def _write(self, g: int, r: int, table: list[int], full: bool) -> None:
        n = len(table)
        old = self.lens0[r] if g == 0 else int(self.lens[g, r])
        if n > self.tables.shape[2]:
            self._widen(n)
        if full or n < old:
            self.tables[g, r, :n] = table
            if old > n:
                self.tables[g, r, n:old] = 0
        elif n > old:
            self.tables[g, r, old:n] = table[old:]
        else:
            return
        self.lens[g, r] = n
        if g == 0:
            self.lens0[r] = n

    def release(self, seq_id: int) -> None:
        """seq left the runner's care (finished, preempted, aborted, scored): its row is free."""
        r = self.row_of.pop(seq_id, None)
        if r is None:
            return
        self.tables[:, r, : int(self.lens[:, r].max())] = 0
        self.lens[:, r] = 0
        self.lens0[r] = 0
        self.versions[r] = -1
        self.free_rows.append(r)

    def _assign(self, seq_id: int) -> int:
        if not self.free_rows:
            self._grow_rows()
        r = self.free_rows.pop()
        self.row_of[seq_id] = r
        self.versions[r] = -1
        return r

    def _grow_rows(self) -> None:
        old = self.num_rows
        new = 2 * old
        tables = np.zeros((self.num_groups, new, self.tables.shape[2]), dtype=np.int64)
        tables[:, :old] = self.tables
        lens = np.zeros((self.num_groups, new), dtype=np.int64)
        lens[:, :old] = self.lens
        self.tables, self.lens = tables, lens
        self.versions += [-1] * (new - old)
        self.lens0 += [0] * (new - old)
        self.free_rows[:0] = range(new - 1, old - 1, -1)

    def _widen(self, n: int) -> None:
        width = max(n, 2 * self.tables.shape[2])
        tables = np.zeros((self.num_groups, self.num_rows, width), dtype=np.int64)
        tables[:, :, : self.tables.shape[2]] = self.tables
        self.tables = tables
