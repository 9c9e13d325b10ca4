// The values tuning.h declares, one copy for every instruction-set level's kernels.
#include "tuning.h"

#include <algorithm>

#include "weight_memory.h"

namespace pagedllm {

std::atomic<int64_t> tuned_amx_rows{16};

int64_t set_tuning(int64_t amx_rows, int64_t prefetch_bytes) {
  tuned_amx_rows.store(std::max<int64_t>(0, amx_rows), std::memory_order_relaxed);
  set_weight_prefetch(prefetch_bytes);
  return 0;
}

}  // namespace pagedllm
