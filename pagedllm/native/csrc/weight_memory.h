// Where packed weights live: slabs of 2 MiB-aligned memory that Linux is asked to back with
// transparent huge pages (weight_memory.cpp). Included by isa.h before its target pragmas, and
// by dispatch.cpp, which registers the op that reports the slabs.
#pragma once

#include <ATen/ATen.h>

#include <atomic>
#include <cstdint>
#include <vector>

namespace pagedllm {

// A uint8 CPU tensor of `bytes` bytes, 64-byte aligned, from the weight slabs (at::empty where
// huge pages are off or unavailable). The caller writes every byte: the memory is not zeroed.
at::Tensor weight_buffer(int64_t bytes);

// [bytes handed out and alive from slabs, bytes mapped for slabs, slabs mapped, whether slabs
// are used, bytes of every weight_buffer alive (slabs or not), the weight prefetch distance].
std::vector<int64_t> weight_memory_stats();

// `bytes` >= 0 fixes the distance below (0: no software prefetch); < 0 lets it follow the
// weights alive and the CPU again (tuning.h's set_tuning calls it).
void set_weight_prefetch(int64_t bytes);

// How many bytes ahead of its reads a kernel streaming packed weights prefetches them, set
// from the weights alive and the CPU (weight_memory.cpp) and read once per group of rows.
extern std::atomic<int> weight_prefetch;
inline int weight_prefetch_bytes() { return weight_prefetch.load(std::memory_order_relaxed); }

// The same for a tile of `rows` activation rows: from 4 rows a block takes long enough that
// even AMD's prefetcher falls behind, and 2 KiB ahead beat 256 B there (AMD EPYC Zen 4, a
// Q4_K weight streamed from DRAM, 2 threads: 4 rows 1.15x, 6 rows 1.17x, 8 rows 1.22x, 16 rows
// 1.10x; 1-3 rows the same or slower).
constexpr int MANY_ROWS = 4, MANY_ROWS_PREFETCH = 2 << 10;
inline int weight_prefetch_bytes(int rows) {
  const int d = weight_prefetch_bytes();
  return rows >= MANY_ROWS && d > 0 && d < MANY_ROWS_PREFETCH ? MANY_ROWS_PREFETCH : d;
}

}  // namespace pagedllm
