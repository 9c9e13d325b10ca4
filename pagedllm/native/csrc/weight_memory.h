// Where packed weights live: slabs of 2 MiB-aligned memory that Linux is asked to back with
// transparent huge pages (weight_memory.cpp). Included by isa.h before its target pragmas, and
// by dispatch.cpp, which registers the op that reports the slabs.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace pagedllm {

// A uint8 CPU tensor of `bytes` bytes, 64-byte aligned, from the weight slabs (at::empty where
// huge pages are off or unavailable). The caller writes every byte: the memory is not zeroed.
at::Tensor weight_buffer(int64_t bytes);

// [bytes handed out and alive, bytes mapped for slabs, slabs mapped, whether slabs are used].
std::vector<int64_t> weight_memory_stats();

}  // namespace pagedllm
