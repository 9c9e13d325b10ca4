// The one registration of the `pagedllm` torch ops: when the library loads, the best
// instruction-set level this CPU runs is picked from its flags, and every op is registered
// from that level's objects (isa.h; setup.py compiles each source once per level).
// PAGEDLLM_NATIVE_ISA (base, avx2, avxvnni, avx512vnni, avx512bf16) caps the level: a test runs
// the baseline objects on any machine that way. The levels are one order but not nested (a Zen 4
// has AVX-512 VNNI but no AVX-VNNI), so the level used is the highest at or below the cap that
// this build compiled (setup.py writes which into pagedllm_built_levels.h) and this CPU runs.
// The avxvnni level has two builds of one source (isa.h): the VEX one, for CPUs with AVX-VNNI,
// and its EVEX twin, for CPUs with AVX-512 VL + VNNI but no AVX-VNNI; the twin is registered
// only where the VEX build cannot run, and native_isa() names it. Nothing here may throw: it
// runs inside dlopen.
#include <torch/library.h>
#include <torch/version.h>

#include "lora_stack.h"
#include "pagedllm_built_levels.h"
#include "moe_stack.h"
#include "tuning.h"
#include "weight_memory.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__linux__)
#include <climits>
#include <dlfcn.h>
#include <stdlib.h>
#endif

#define PAGEDLLM_DECLARE(ns)                         \
  namespace ns {                                     \
  void register_cpu_kernels(torch::Library& m);      \
  void register_decode_stack(torch::Library& m);     \
  void register_quant_kernels(torch::Library& m);    \
  void register_quant_packed(torch::Library& m);     \
  void register_sample_kernels(torch::Library& m);   \
  }

PAGEDLLM_DECLARE(isa_base)
namespace isa_base { void register_prefill_attention(torch::Library& m); }
#if defined(__x86_64__)
PAGEDLLM_DECLARE(isa_avx2)
PAGEDLLM_DECLARE(isa_avxvnni)  // (only decode_stack and quant_* are compiled at avxvnni)
PAGEDLLM_DECLARE(isa_avxvnni_evex)
PAGEDLLM_DECLARE(isa_avx512vnni)
namespace isa_avx512bf16 { void register_prefill_attention(torch::Library& m); }
#else
#undef PAGEDLLM_BUILT_AVX2
#undef PAGEDLLM_BUILT_AVXVNNI
#undef PAGEDLLM_BUILT_AVXVNNI_EVEX
#undef PAGEDLLM_BUILT_AVX512VNNI
#undef PAGEDLLM_BUILT_AVX512BF16
#define PAGEDLLM_BUILT_AVX2 0
#define PAGEDLLM_BUILT_AVXVNNI 0
#define PAGEDLLM_BUILT_AVXVNNI_EVEX 0
#define PAGEDLLM_BUILT_AVX512VNNI 0
#define PAGEDLLM_BUILT_AVX512BF16 0
#endif

namespace {

enum Level { BASE = 0, AVX2 = 1, AVXVNNI = 2, AVX512VNNI = 3, AVX512BF16 = 4 };  // as isa.h's NativeLevel
const char* const LEVEL_NAMES[] = {"base", "avx2", "avxvnni", "avx512vnni", "avx512bf16"};
const char* const TWIN_NAME = "avxvnni (EVEX twin)";  // the avxvnni level's EVEX build, as reported
// A level is built where either of its builds is (the avxvnni level: VEX or EVEX twin).
const bool BUILT[] = {true, PAGEDLLM_BUILT_AVX2, PAGEDLLM_BUILT_AVXVNNI || PAGEDLLM_BUILT_AVXVNNI_EVEX,
                      PAGEDLLM_BUILT_AVX512VNNI, PAGEDLLM_BUILT_AVX512BF16};

// Which builds of the avxvnni level this CPU runs (isa.h's pragmas): the VEX one needs AVX-VNNI,
// the twin AVX-512 F + VL + VNNI.
bool cpu_avx2() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}
bool cpu_avxvnni_vex() {
#if defined(__x86_64__)
  return cpu_avx2() && __builtin_cpu_supports("avxvnni");
#else
  return false;
#endif
}
bool cpu_avxvnni_evex() {
#if defined(__x86_64__)
  return cpu_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

// Whether this CPU has the instructions of `level`'s objects (of the build that is there, for avxvnni).
bool cpu_runs(int level) {
#if defined(__x86_64__)
  switch (level) {
    case BASE: return true;
    case AVX2: return cpu_avx2();
    case AVXVNNI:
      return (PAGEDLLM_BUILT_AVXVNNI && cpu_avxvnni_vex()) || (PAGEDLLM_BUILT_AVXVNNI_EVEX && cpu_avxvnni_evex());
    case AVX512VNNI:
    case AVX512BF16:
      return cpu_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512cd") &&
             __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
             (level == AVX512VNNI || __builtin_cpu_supports("avx512bf16"));
  }
#endif
  return level == BASE;
}

// The highest level at or below PAGEDLLM_NATIVE_ISA's cap (an unknown name caps nothing here;
// the Python side refuses it before loading) that this build compiled and this CPU runs.
// avxvnni only where the cap names it: its VEX objects have not yet run on an AVX-VNNI CPU,
// and its EVEX twin decoded one sequence slower than avx2 on the CPU it was measured on
// (docs/benchmarks/avx2.md), so until it is measured on such a CPU the default stays avx2.
int chosen_level() {
  int cap = AVX512BF16;
  const char* env = std::getenv("PAGEDLLM_NATIVE_ISA");
  if (env != nullptr)
    for (int i = BASE; i <= AVX512BF16; ++i)
      if (std::strcmp(env, LEVEL_NAMES[i]) == 0) cap = i;
  int level = cap;
  while (level > BASE && !(BUILT[level] && cpu_runs(level) && (level != AVXVNNI || cap == AVXVNNI))) --level;
  return level;
}

const int LEVEL = chosen_level();
// At the avxvnni level: the EVEX twin, where the VEX build is missing or this CPU lacks AVX-VNNI.
const bool TWIN = LEVEL == AVXVNNI && !(PAGEDLLM_BUILT_AVXVNNI && cpu_avxvnni_vex());

std::string native_isa() { return TWIN ? TWIN_NAME : LEVEL_NAMES[LEVEL]; }
// The op set's stamp: bumped whenever an op or class is added, removed or changes its schema.
// native/__init__.py expects one number (NATIVE_ABI there) and refuses a library with another,
// so the Python side asks this once instead of probing for each op.
constexpr int64_t NATIVE_ABI = 3;
int64_t native_abi() { return NATIVE_ABI; }
// The levels compiled, comma-separated; the avxvnni level's twin by its name in native_isa().
std::string native_built_levels() {
  std::string out;
  auto add = [&](const char* name) { out += (out.empty() ? "" : ",") + std::string(name); };
  for (int i = BASE; i <= AVX512BF16; ++i) {
    if (i == AVXVNNI) {
      if (PAGEDLLM_BUILT_AVXVNNI) add(LEVEL_NAMES[i]);
      if (PAGEDLLM_BUILT_AVXVNNI_EVEX) add(TWIN_NAME);
    } else if (BUILT[i]) {
      add(LEVEL_NAMES[i]);
    }
  }
  return out;
}
// The torch release these kernels were compiled against: its C++ ABI is what they link to.
std::string native_torch_version() { return TORCH_VERSION; }

// Lets the calling thread's OpenMP worker threads go: 0 where done, else nonzero and nothing
// done. Why (native/__init__.py): libgomp counts every pool's workers, and once they outnumber
// the CPUs its workers sleep between parallel regions instead of spinning.
// Only GNU libgomp is asked: its omp_pause_resource_all frees the calling thread's pool alone
// (a later parallel region of that thread makes a new one). LLVM's libomp pauses the whole
// runtime, other threads' regions too, so where the symbol resolves to another runtime (conda's
// libgomp.so.1 is a link to libomp) nothing is called. (GCC defines _OPENMP as 201511 but has
// had the call since GCC 9.)
#if defined(__linux__) && defined(_OPENMP) && \
    ((defined(__clang__) && __clang_major__ >= 9) || (!defined(__clang__) && __GNUC__ >= 9))
bool gnu_openmp() {
  Dl_info info;
  if (dladdr(reinterpret_cast<void*>(&omp_pause_resource_all), &info) == 0 || info.dli_fname == nullptr) return false;
  char buf[PATH_MAX];
  const char* path = realpath(info.dli_fname, buf) != nullptr ? buf : info.dli_fname;
  const char* base = std::strrchr(path, '/');
  return std::strncmp(base != nullptr ? base + 1 : path, "libgomp", 7) == 0;
}

int64_t release_omp_threads() {
  static const bool gnu = gnu_openmp();
  return gnu ? omp_pause_resource_all(omp_pause_hard) : -2;
}
#else
int64_t release_omp_threads() { return -1; }
#endif

}  // namespace

namespace pagedllm {
int native_level() { return LEVEL; }  // (declared in isa.h)
}  // namespace pagedllm

TORCH_LIBRARY(pagedllm, m) {
  // (before the ops: quant_decode_layers' schema names it)
  using Tensors = c10::List<c10::optional<at::Tensor>>;
  m.class_<pagedllm::LoRAStack>("LoRAStack").def(torch::init<Tensors, Tensors, Tensors, int64_t>());
  m.class_<pagedllm::MoeStack>("MoeStack")
      .def(torch::init<>())
      .def("add_dense", &pagedllm::MoeStack::add_dense)
      .def("add_sparse", &pagedllm::MoeStack::add_sparse)
      .def("size", &pagedllm::MoeStack::size)
      .def("last_ids", &pagedllm::MoeStack::last_ids);
  m.def("native_abi() -> int", &native_abi);
  m.def("native_isa() -> str", &native_isa);
  m.def("native_torch_version() -> str", &native_torch_version);
  m.def("native_built_levels() -> str", &native_built_levels);
  m.def("release_omp_threads() -> int", &release_omp_threads);
  m.def("weight_memory_stats() -> int[]", &pagedllm::weight_memory_stats);
  m.def("weight_buffer(int bytes) -> Tensor", &pagedllm::weight_buffer);
  m.def("set_tuning(int amx_rows, int prefetch_bytes) -> int", &pagedllm::set_tuning);
#if defined(__x86_64__)
#if PAGEDLLM_BUILT_AVX512VNNI
  if (LEVEL >= AVX512VNNI) {
    isa_avx512vnni::register_cpu_kernels(m);
    isa_avx512vnni::register_decode_stack(m);
    isa_avx512vnni::register_quant_kernels(m);
    isa_avx512vnni::register_quant_packed(m);
    isa_avx512vnni::register_sample_kernels(m);
  } else
#endif
#if PAGEDLLM_BUILT_AVXVNNI
  if (LEVEL == AVXVNNI && !TWIN) {  // (the rest at this level: their AVX2 objects)
    isa_avx2::register_cpu_kernels(m);
    isa_avxvnni::register_decode_stack(m);
    isa_avxvnni::register_quant_kernels(m);
    isa_avxvnni::register_quant_packed(m);
    isa_avx2::register_sample_kernels(m);
  } else
#endif
#if PAGEDLLM_BUILT_AVXVNNI_EVEX
  if (LEVEL == AVXVNNI && TWIN) {
    isa_avx2::register_cpu_kernels(m);
    isa_avxvnni_evex::register_decode_stack(m);
    isa_avxvnni_evex::register_quant_kernels(m);
    isa_avxvnni_evex::register_quant_packed(m);
    isa_avx2::register_sample_kernels(m);
  } else
#endif
#if PAGEDLLM_BUILT_AVX2
  if (LEVEL == AVX2) {
    isa_avx2::register_cpu_kernels(m);
    isa_avx2::register_decode_stack(m);
    isa_avx2::register_quant_kernels(m);
    isa_avx2::register_quant_packed(m);
    isa_avx2::register_sample_kernels(m);
  } else
#endif
#endif
  {
    isa_base::register_cpu_kernels(m);
    isa_base::register_decode_stack(m);
    isa_base::register_quant_kernels(m);
    isa_base::register_quant_packed(m);
    isa_base::register_sample_kernels(m);
  }
#if PAGEDLLM_BUILT_AVX512BF16
  if (LEVEL == AVX512BF16) {
    isa_avx512bf16::register_prefill_attention(m);
    return;
  }
#endif
  isa_base::register_prefill_attention(m);
}
