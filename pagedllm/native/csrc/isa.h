// The instruction-set level an object is compiled for, and every library header the kernels use.
//
// One build serves every x86-64 CPU. setup.py compiles each kernel source once per level (a
// two-line wrapper: `#define PAGEDLLM_LEVEL n` and an #include of the source), each level's code
// in a namespace of its own (PAGEDLLM_ISA), and dispatch.cpp registers, when the library loads,
// the ops of the best level this CPU runs (`__builtin_cpu_supports`). No -march flag is used.
//
// The level's instructions come from `#pragma GCC target` below, placed AFTER the library
// headers on purpose: their inline and template code (std::vector, ATen, c10) keeps the
// baseline x86-64 target in every object, so the linker, which keeps one copy of each such
// function for the whole library, can never hand an AVX-512 copy to the AVX2 or baseline code.
// Every system or torch header a kernel needs is therefore included here, never in a source
// after this file (tests/test_native_build.py checks the built library's instructions).
// GCC does not define __AVX2__ and the like under the pragma in C++: the kernels test the
// PQ_X86 / PQ_AVXVNNI / PQ_HAS_VNNI / PA_BF16 macros set here instead.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "lora_stack.h"
#include "moe_stack.h"
#include "tuning.h"
#include "weight_memory.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif
#if defined(__x86_64__) && defined(__linux__)
#include <cpuid.h>        // AMX: the CPU's tile instructions (quant_packed.cpp)
#include <sys/syscall.h>  // AMX: the kernel's grant of the tile state to this process
#include <unistd.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace pagedllm {
// The level whose ops dispatch.cpp registered (0 base, 1 avx2, 2 avxvnni, 3 avx512vnni, 4 avx512bf16): the
// CPU's best, capped by PAGEDLLM_NATIVE_ISA. Code of a lower level with a faster path for a
// higher one asks this, rather than the CPU's flags, so that the cap reaches that path too.
int native_level();
// The levels' numbers (setup.py's LEVELS and dispatch.cpp's Level are the same list).
enum NativeLevel : int { LEVEL_BASE = 0, LEVEL_AVX2 = 1, LEVEL_AVXVNNI = 2, LEVEL_AVX512VNNI = 3, LEVEL_AVX512BF16 = 4 };
}  // namespace pagedllm

#ifndef PAGEDLLM_LEVEL
#define PAGEDLLM_LEVEL 0
#endif

#if PAGEDLLM_LEVEL > 0 && !defined(__x86_64__)
#error "levels above 0 are x86-64 instruction sets"
#endif

#if PAGEDLLM_LEVEL == 0
// Baseline: whatever the compiler targets by default (x86-64: SSE2). The scalar reference paths.
#define PAGEDLLM_ISA isa_base
#elif PAGEDLLM_LEVEL == 1
// Haswell and later, Zen 1 and later.
#pragma GCC target("avx2,fma,f16c")
#define PAGEDLLM_ISA isa_avx2
#define PQ_X86 1
#elif PAGEDLLM_LEVEL == 2 && !defined(PAGEDLLM_EVEX_TWIN)
// Alder Lake, Sapphire Rapids and later, Zen 5: AVX2 with AVX-VNNI's VEX-encoded 256-bit int8
// dot product (vpdpbusd), on CPUs with or without AVX-512. Only the int8 kernels (quant_*,
// decode_stack) are compiled at this level; the rest register their AVX2 objects here.
#pragma GCC target("avx2,fma,f16c,avxvnni")
#define PAGEDLLM_ISA isa_avxvnni
#define PQ_X86 1
#define PQ_AVXVNNI 1
#define PQ_DPBUSD256(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#elif PAGEDLLM_LEVEL == 2
// The same source and level as an EVEX twin: the same 256-bit vpdpbusd as AVX-512 VL + VNNI
// encode it, for CPUs that have those but no AVX-VNNI (Ice Lake, Zen 4), so that such a CPU
// capped at avxvnni runs (and tests) this level's code; dispatch.cpp names it "avxvnni (EVEX
// twin)". The object is compiled for AVX2 alone and that one instruction is written out: with
// AVX-512 in the target, GCC 12 moves and clears 64-byte blocks (struct copies, memset) through
// zmm registers (prefer-vector-width=256 does not stop it; -mmove-max is a command-line option
// only), and the twin must stay the VEX build's 256-bit code (tests/test_native_build.py checks
// that its only EVEX instruction is vpdpbusd and that no zmm register appears).
#pragma GCC target("avx2,fma,f16c")
#define PAGEDLLM_ISA isa_avxvnni_evex
#define PQ_X86 1
#define PQ_AVXVNNI 1
// acc += u (u8) x s (s8), 4 products a lane: _mm256_dpbusd_epi32, EVEX-encoded (AVX512VL + VNNI).
static inline __attribute__((always_inline)) __m256i pq_dpbusd_evex(__m256i acc, __m256i u, __m256i s) {
  asm("%{evex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(u), "xm"(s));
  return acc;
}
#define PQ_DPBUSD256(acc, u, s) pq_dpbusd_evex(acc, u, s)
#elif PAGEDLLM_LEVEL == 3
// Ice Lake / Cascade Lake and later, Zen 4 and later: AVX-512 with VNNI's int8 dot products.
#pragma GCC target("avx2,fma,f16c,avx512f,avx512cd,avx512bw,avx512dq,avx512vl,avx512vnni")
#define PAGEDLLM_ISA isa_avx512vnni
#define PQ_X86 1
#define PQ_HAS_VNNI 1
#elif PAGEDLLM_LEVEL == 4
// Cooper Lake, Sapphire Rapids and later, Zen 4 and later: also bf16 dot products.
#pragma GCC target("avx2,fma,f16c,avx512f,avx512cd,avx512bw,avx512dq,avx512vl,avx512vnni,avx512bf16")
#define PAGEDLLM_ISA isa_avx512bf16
#define PQ_X86 1
#define PQ_HAS_VNNI 1
#define PA_BF16 1
#else
#error "unknown PAGEDLLM_LEVEL"
#endif

// The namespace of the cpu_kernels.cpp object registered at this level (decode_stack.cpp calls
// its attention): cpu_kernels is not compiled at avxvnni, whose AVX2 object runs there.
#if PAGEDLLM_LEVEL == 2
#define PAGEDLLM_ISA_CPU_KERNELS isa_avx2
#else
#define PAGEDLLM_ISA_CPU_KERNELS PAGEDLLM_ISA
#endif

// Each source registers its ops through a function of its level's namespace, which
// dispatch.cpp calls for the level it picked.
#define PAGEDLLM_REGISTER(name) void register_##name(torch::Library& m)
