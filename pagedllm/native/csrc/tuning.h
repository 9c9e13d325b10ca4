// Kernel routes and tuning constants that benchmarks vary: set from Python (pagedllm/tuning.py,
// one parser for both languages) through the op `set_tuning`, never read from the environment.
// Included by isa.h before its target pragmas (quant_packed.cpp reads the AMX rows) and by
// dispatch.cpp, which registers the op.
#pragma once

#include <atomic>
#include <cstdint>

namespace pagedllm {

// Rows from which a bfloat16 step over packed weights takes the AMX tile product (0: never).
extern std::atomic<int64_t> tuned_amx_rows;

// `amx_rows` as above; `prefetch_bytes` >= 0 fixes the packed kernels' prefetch distance, < 0
// lets it follow the weights and the CPU (weight_memory.cpp). Returns 0.
int64_t set_tuning(int64_t amx_rows, int64_t prefetch_bytes);

}  // namespace pagedllm
