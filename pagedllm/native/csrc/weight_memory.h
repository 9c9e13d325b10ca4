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

// How many bytes ahead of its reads a kernel streaming packed weights prefetches them, set
// from the weights alive (weight_memory.cpp) and read once per group of rows.
extern std::atomic<int> weight_prefetch;
inline int weight_prefetch_bytes() { return weight_prefetch.load(std::memory_order_relaxed); }

}  // namespace pagedllm
