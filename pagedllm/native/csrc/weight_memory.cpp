// Packed weights in huge pages. A batch-1 decode step streams every weight once, and on a VM
// the weights' 4 KiB pages cost twice in the TLB (the guest's page and the host's); the weights
// of a loaded model lie scattered over many physically separate runs of pages. The same bytes
// in 2 MiB pages decoded faster (docs/benchmarks/quantized-kernels.md, "Packed weights in huge
// pages"; docs/benchmarks/from-code.md).
//
// Weights are carved, in the order they are packed, from slabs of SLAB bytes mapped 2 MiB
// aligned with madvise(MADV_HUGEPAGE) (Linux grants them where transparent huge pages are
// "always" or "madvise"; elsewhere the slab is plain pages, as at::empty's). A weight larger
// than half a slab gets a mapping of its own. Each tensor holds its slab; a slab is unmapped
// when its last tensor goes, and the open slab is reused from its start once every tensor cut
// from it is gone (a model loaded and dropped leaves at most one slab mapped).
// PAGEDLLM_HUGE_PAGES=0: plain memory, as before.
//
// The kernels' software prefetch distance follows the bytes of weights alive. While they exceed
// half the last-level cache, a decode step reads them from DRAM, and 2 KiB ahead was fastest on
// Intel (nearer or farther, slower). While they fit, the step reads them from cache, and
// farther was faster. AMD's cores (Zen 4) ran fastest with little or no software prefetch,
// whatever the weights, so they get 256 B. The measurements: docs/benchmarks/quantized-kernels.md.
// A benchmark may fix the distance (pagedllm/tuning.py prefetch_bytes; 0: none).
#include "weight_memory.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <unistd.h>
#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace pagedllm {
namespace {

constexpr size_t HUGE = size_t{2} << 20;
constexpr size_t SLAB = size_t{128} << 20;
constexpr size_t ALIGN = 64;

std::atomic<int64_t> live_bytes{0}, mapped_bytes{0}, mapped_slabs{0}, weight_bytes{0};

constexpr int NEAR = 2 << 10, FAR = 8 << 10;  // bytes (above)

// The last-level cache one core sees: Linux's word (on AMD, glibc's sysconf counted every
// CCD's L3: 320 MiB where a core's share is 32 MiB), else the C library's; 0 where neither says.
int64_t llc_bytes() {
  if (std::FILE* f = std::fopen("/sys/devices/system/cpu/cpu0/cache/index3/size", "r")) {
    long v = 0;
    char unit = 0;
    const int got = std::fscanf(f, "%ld%c", &v, &unit);
    std::fclose(f);
    if (got >= 1 && v > 0) return unit == 'K' ? int64_t{v} << 10 : unit == 'M' ? int64_t{v} << 20 : v;
  }
  long n = 0;
#if defined(_SC_LEVEL3_CACHE_SIZE)
  n = sysconf(_SC_LEVEL3_CACHE_SIZE);
#endif
  return n > 0 ? n : 0;
}

// AMD's cores (Zen 4) need no help beyond the next lines at batch 1: farther distances ran
// slower (above). Tiles of 4+ rows still take 2 KiB (weight_memory.h).
constexpr int AMD_DISTANCE = 256;

bool amd_cpu() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  return __builtin_cpu_is("amd");
#else
  return false;
#endif
}

// A distance that does not follow the weights: the one set (set_weight_prefetch), else AMD's;
// -1 otherwise.
std::atomic<int> set_distance{-1};
int fixed_prefetch() {
  static const bool amd = amd_cpu();
  const int set = set_distance.load(std::memory_order_relaxed);
  return set >= 0 ? set : (amd ? AMD_DISTANCE : -1);
}

// Weights of `delta` bytes came (> 0) or went (< 0): the prefetch distance follows.
void account(int64_t delta) {
  static const int64_t llc = llc_bytes();
  const int fixed = fixed_prefetch();
  const int64_t now = weight_bytes += delta;
  weight_prefetch.store(fixed >= 0 ? fixed : (llc > 0 && now <= llc / 2 ? FAR : NEAR), std::memory_order_relaxed);
}

bool wanted() {
#if defined(__linux__)
  const char* env = std::getenv("PAGEDLLM_HUGE_PAGES");
  return env == nullptr || std::strcmp(env, "0") != 0;
#else
  return false;
#endif
}

struct Slab {
  uint8_t* base = nullptr;
  size_t size = 0, used = 0;
  ~Slab() {
#if defined(__linux__)
    if (base != nullptr) munmap(base, size);
#endif
    mapped_bytes -= static_cast<int64_t>(size);
    --mapped_slabs;
  }
};

// `size` (a multiple of HUGE) bytes at a HUGE-aligned address, or null.
std::shared_ptr<Slab> map_slab(size_t size) {
#if defined(__linux__)
  void* p = mmap(nullptr, size + HUGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return nullptr;
  const uintptr_t at = reinterpret_cast<uintptr_t>(p), start = (at + HUGE - 1) & ~(HUGE - 1);
  if (start > at) munmap(p, start - at);                                   // the unaligned head
  if (start - at < HUGE) munmap(reinterpret_cast<void*>(start + size), HUGE - (start - at));  // and tail
  madvise(reinterpret_cast<void*>(start), size, MADV_HUGEPAGE);  // (refused: plain pages, still correct)
  auto slab = std::make_shared<Slab>();
  slab->base = reinterpret_cast<uint8_t*>(start);
  slab->size = size;
  mapped_bytes += static_cast<int64_t>(size);
  ++mapped_slabs;
  return slab;
#else
  (void)size;
  return nullptr;
#endif
}

std::mutex mu;
std::shared_ptr<Slab> open_slab;  // where the next small weights are cut from

}  // namespace

std::atomic<int> weight_prefetch{fixed_prefetch() >= 0 ? fixed_prefetch() : FAR};  // (no weights yet)

at::Tensor weight_buffer(int64_t bytes) {
  TORCH_CHECK(bytes >= 0, "weight_buffer: a negative size");
  const auto plain = [&] {
    // (c10's allocator, counted: the prefetch distance follows these bytes too)
    at::Tensor t = at::empty({bytes}, at::TensorOptions().dtype(at::kByte));
    account(bytes);
    return at::from_blob(t.data_ptr(), {bytes}, [t, bytes](void*) mutable { account(-bytes); t.reset(); },
                         at::TensorOptions().dtype(at::kByte));
  };
  if (bytes == 0 || !wanted()) return plain();
  const size_t need = (static_cast<size_t>(bytes) + ALIGN - 1) / ALIGN * ALIGN;
  std::shared_ptr<Slab> slab;
  size_t offset = 0;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (need > SLAB / 2) {
      slab = map_slab((need + HUGE - 1) / HUGE * HUGE);
    } else {
      if (open_slab && open_slab.use_count() == 1) open_slab->used = 0;  // all its weights are gone
      if (!open_slab || open_slab->used + need > open_slab->size) open_slab = map_slab(SLAB);
      slab = open_slab;
    }
    if (slab) {
      offset = slab->used;
      slab->used += need;
    }
  }
  if (!slab) return plain();
  live_bytes += bytes;
  account(bytes);
  return at::from_blob(
      slab->base + offset, {bytes},
      [slab, bytes](void*) mutable {
        live_bytes -= bytes;
        account(-bytes);
        std::lock_guard<std::mutex> lock(mu);  // (the open slab's count is read under it)
        slab.reset();
      },
      at::TensorOptions().dtype(at::kByte));
}

void set_weight_prefetch(int64_t bytes) {
  set_distance.store(bytes < 0 ? -1 : static_cast<int>(std::min<int64_t>(bytes, 1 << 20)), std::memory_order_relaxed);
  account(0);
}

std::vector<int64_t> weight_memory_stats() {
  return {live_bytes.load(), mapped_bytes.load(), mapped_slabs.load(), wanted() ? 1 : 0, weight_bytes.load(),
          weight_prefetch_bytes()};
}

}  // namespace pagedllm
