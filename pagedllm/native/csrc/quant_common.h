// Shared by the quantized-weight kernels: the GGUF block formats, their reference
// unpacking, the activation quantization and the ISA checks.
#pragma once
// Matrix products with weights kept in GGUF's quantized block formats (the llama.cpp
// formats Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K), read straight from
// the file's bytes: nothing is repacked and no float copy of a weight is ever kept.
//
// Every format is read through one shape: a block of 32 (legacy) or 256 (K-quants) values
// is unpacked into small unsigned integers q (Q8_0: signed) and, per 16 values, a float
// scale s and offset m, so that w = s * q + m exactly as gguf's reference dequantization
// computes it. The activation row is quantized once per call to int8 with one float scale
// per 32 values (da) and its sums per 16 values kept, so
//     sum_i w_i x_i = sum_groups da * (s * sum(q * a) + m * sum(a)).
// The integer dot products sum(q * a) are where the ISA paths differ: AVX2 maddubs/madd,
// AVX-VNNI's 256-bit vpdpbusd (the avxvnni level, isa.h: VEX, or its EVEX twin), AVX-512 VNNI
// vpdpbusd (256-bit, AVX512VL), and a plain C++ reference that every machine
// can run and that the tests compare all paths against. The path is picked at run time
// from the CPU's flags (isa = 0), or forced by the caller (tests, benchmarks), among those this
// object's level (isa.h) was compiled for.
//
// Many rows (prefill, wide batches) take the other route: `quant_dequant` writes tiles of
// the weight as float/bf16 into a reused buffer and the caller runs the GEMM.
#include "isa.h"  // the library headers and this object's level: PQ_X86, PQ_HAS_VNNI

namespace PAGEDLLM_ISA {
namespace pq {

// ggml type ids (gguf.GGMLQuantizationType).
enum Type : int64_t {
  Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8,
  Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14,
};

struct Fmt {
  int64_t type;
  int vals;    // values per block: 32 or 256
  int bytes;   // bytes per block
  bool is_signed;  // q is int8 (Q8_0), else uint8
};

inline Fmt fmt_of(int64_t t) {
  switch (t) {
    case Q4_0: return {t, 32, 18, false};
    case Q4_1: return {t, 32, 20, false};
    case Q5_0: return {t, 32, 22, false};
    case Q5_1: return {t, 32, 24, false};
    case Q8_0: return {t, 32, 34, true};
    case Q2_K: return {t, 256, 84, false};
    case Q3_K: return {t, 256, 110, false};
    case Q4_K: return {t, 256, 144, false};
    case Q5_K: return {t, 256, 176, false};
    case Q6_K: return {t, 256, 210, false};
  }
  TORCH_CHECK(false, "quantized kernels: unsupported ggml type id ", t);
}

// The integer paths (quant/isa.py names them). AVXVNNI is the AVX2 kernels with one vpdpbusd
// (u8 x s8, 4 products a lane into int32) where AVX2 takes maddubs + madd: only the avxvnni
// level's objects hold it, as only the AVX-512 levels' hold AVX512VNNI.
enum Isa : int64_t { AUTO = 0, SCALAR = 1, AVX2 = 2, AVX512VNNI = 3, AVXVNNI = 4 };
// Flag or-ed into the isa argument of quant_matmul / quant_linear: two-level activations.
constexpr int64_t ACT_X2 = 256;
// quant_decode_layers only: bit ACT_X2_PROJ << j makes projection j of every layer (0 q|k|v,
// 1 o, 2 gate|up, 3 down) two-level whatever ACT_X2 says, so a wide step can round in two
// levels only where that pays (quant/kernels.py).
constexpr int64_t ACT_X2_PROJ = 512;
inline int64_t isa_of_projection(int64_t isa, int64_t j) {
  const bool x2 = (isa & ACT_X2) || (isa & (ACT_X2_PROJ << j));
  return (isa & (ACT_X2 - 1)) | (x2 ? ACT_X2 : 0);
}

inline float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#ifdef PQ_X86
  return _cvtsh_ss(h);  // one instruction; the bit-twiddling fallback below costs ~15
#else
  return c10::detail::fp16_ieee_to_fp32_value(h);
#endif
}
inline bool half_finite(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return (h & 0x7C00) != 0x7C00;
}
inline uint32_t u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// 6-bit scale and min j of a Q4_K / Q5_K block (12 packed bytes for 8 sub-blocks).
inline void scale_min_k4(int j, const uint8_t* s, int& sc, int& m) {
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Scales and offsets of one block, per 16 values (a 32-value group fills two entries).
inline void block_scales(int64_t t, const uint8_t* b, float* sc, float* mn) {
  switch (t) {
    case Q4_0: { float d = half(b); sc[0] = sc[1] = d; mn[0] = mn[1] = -8.f * d; break; }
    case Q4_1: { float d = half(b), m = half(b + 2); sc[0] = sc[1] = d; mn[0] = mn[1] = m; break; }
    case Q5_0: { float d = half(b); sc[0] = sc[1] = d; mn[0] = mn[1] = -16.f * d; break; }
    case Q5_1: { float d = half(b), m = half(b + 2); sc[0] = sc[1] = d; mn[0] = mn[1] = m; break; }
    case Q8_0: { float d = half(b); sc[0] = sc[1] = d; mn[0] = mn[1] = 0.f; break; }
    case Q2_K: {
      const float d = half(b + 80), dmin = half(b + 82);
      for (int g = 0; g < 16; ++g) {
        sc[g] = d * static_cast<float>(b[g] & 0xF);
        mn[g] = -dmin * static_cast<float>(b[g] >> 4);
      }
      break;
    }
    case Q3_K: {
      const uint8_t* s = b + 96;
      const float d = half(b + 108);
      for (int k = 0; k < 16; ++k) {
        const int lo = (s[k % 8] >> (4 * (k / 8))) & 0xF;
        const int hi = (s[8 + k % 4] >> (2 * (k / 4))) & 3;
        const float v = d * static_cast<float>((lo | (hi << 4)) - 32);
        sc[k] = v;
        mn[k] = -4.f * v;  // q is stored as 0..7 here, the format's value is q - 4
      }
      break;
    }
    case Q4_K:
    case Q5_K: {
      const float d = half(b), dmin = half(b + 2);
      for (int j = 0; j < 8; ++j) {
        int s, m;
        scale_min_k4(j, b + 4, s, m);
        sc[2 * j] = sc[2 * j + 1] = d * static_cast<float>(s);
        mn[2 * j] = mn[2 * j + 1] = -dmin * static_cast<float>(m);
      }
      break;
    }
    case Q6_K: {
      const float d = half(b + 208);
      const int8_t* s = reinterpret_cast<const int8_t*>(b + 192);
      for (int g = 0; g < 16; ++g) {
        sc[g] = d * static_cast<float>(s[g]);
        mn[g] = -32.f * sc[g];
      }
      break;
    }
  }
}

// Reference unpacking of a block's quantized values (plain C++; the layouts follow gguf).
inline void unpack_ref(int64_t t, const uint8_t* b, uint8_t* q) {
  switch (t) {
    case Q4_0:
    case Q4_1: {
      const uint8_t* qs = b + (t == Q4_0 ? 2 : 4);
      for (int l = 0; l < 16; ++l) { q[l] = qs[l] & 0xF; q[l + 16] = qs[l] >> 4; }
      break;
    }
    case Q5_0:
    case Q5_1: {
      const int off = t == Q5_0 ? 2 : 4;
      const uint32_t qh = u32(b + off);
      const uint8_t* qs = b + off + 4;
      for (int l = 0; l < 16; ++l) {
        q[l] = (qs[l] & 0xF) | (((qh >> l) & 1) << 4);
        q[l + 16] = (qs[l] >> 4) | (((qh >> (l + 16)) & 1) << 4);
      }
      break;
    }
    case Q8_0: std::memcpy(q, b + 2, 32); break;
    case Q2_K: {
      const uint8_t* qs = b + 16;
      for (int n = 0; n < 2; ++n)
        for (int j = 0; j < 4; ++j)
          for (int l = 0; l < 32; ++l) q[n * 128 + j * 32 + l] = (qs[n * 32 + l] >> (2 * j)) & 3;
      break;
    }
    case Q3_K: {
      const uint8_t* hm = b;
      const uint8_t* qs = b + 32;
      for (int n = 0; n < 2; ++n)
        for (int j = 0; j < 4; ++j)
          for (int l = 0; l < 32; ++l)
            q[n * 128 + j * 32 + l] = ((qs[n * 32 + l] >> (2 * j)) & 3) | (((hm[l] >> (4 * n + j)) & 1) << 2);
      break;
    }
    case Q4_K: {
      const uint8_t* qs = b + 16;
      for (int p = 0; p < 4; ++p)
        for (int l = 0; l < 32; ++l) {
          q[64 * p + l] = qs[32 * p + l] & 0xF;
          q[64 * p + 32 + l] = qs[32 * p + l] >> 4;
        }
      break;
    }
    case Q5_K: {
      const uint8_t* qh = b + 16;
      const uint8_t* qs = b + 48;
      for (int j = 0; j < 8; ++j)
        for (int l = 0; l < 32; ++l)
          q[32 * j + l] = ((qs[32 * (j / 2) + l] >> (4 * (j % 2))) & 0xF) | (((qh[l] >> j) & 1) << 4);
      break;
    }
    case Q6_K: {
      const uint8_t* ql = b;
      const uint8_t* qh = b + 128;
      for (int n = 0; n < 2; ++n)
        for (int j = 0; j < 4; ++j)
          for (int l = 0; l < 32; ++l)
            q[n * 128 + j * 32 + l] = ((ql[64 * n + (j % 2) * 32 + l] >> (4 * (j / 2))) & 0xF) |
                                      (((qh[32 * n + l] >> (2 * j)) & 3) << 4);
      break;
    }
  }
}

#ifdef PQ_X86
// The same unpacking with AVX2 byte operations: each 32-value chunk is one register.
#define PQ_AVX2 inline

PQ_AVX2 __m256i nib_lo(__m256i x) { return _mm256_and_si256(x, _mm256_set1_epi8(0x0F)); }
PQ_AVX2 __m256i nib_hi(__m256i x) {
  return _mm256_and_si256(_mm256_srli_epi16(x, 4), _mm256_set1_epi8(0x0F));
}
// byte l of the result is `val` where bit l of the 32-bit mask is set, else 0.
PQ_AVX2 __m256i bits_to_bytes(uint32_t bits, uint8_t val) {
  const __m256i shuf = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                        2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i sel = _mm256_set1_epi64x(0x8040201008040201LL);
  __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)), shuf);
  v = _mm256_cmpeq_epi8(_mm256_and_si256(v, sel), sel);
  return _mm256_and_si256(v, _mm256_set1_epi8(static_cast<char>(val)));
}
// byte l: `val` where (x_l & bit) != 0.
PQ_AVX2 __m256i test_bit(__m256i x, uint8_t bit, uint8_t val) {
  const __m256i b = _mm256_set1_epi8(static_cast<char>(bit));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(x, b), b), _mm256_set1_epi8(static_cast<char>(val)));
}
PQ_AVX2 void st(uint8_t* q, __m256i v) { _mm256_store_si256(reinterpret_cast<__m256i*>(q), v); }
PQ_AVX2 __m256i ld(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

PQ_AVX2 void unpack_avx2(int64_t t, const uint8_t* b, uint8_t* q) {
  switch (t) {
    case Q4_0:
    case Q4_1: {
      const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + (t == Q4_0 ? 2 : 4)));
      const __m256i xx = _mm256_set_m128i(_mm_srli_epi16(x, 4), x);
      st(q, _mm256_and_si256(xx, _mm256_set1_epi8(0x0F)));
      break;
    }
    case Q5_0:
    case Q5_1: {
      const int off = t == Q5_0 ? 2 : 4;
      const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + off + 4));
      const __m256i xx = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(x, 4), x), _mm256_set1_epi8(0x0F));
      st(q, _mm256_or_si256(xx, bits_to_bytes(u32(b + off), 0x10)));
      break;
    }
    case Q8_0: st(q, ld(b + 2)); break;
    case Q2_K: {
      const __m256i m3 = _mm256_set1_epi8(3);
      for (int n = 0; n < 2; ++n) {
        const __m256i x = ld(b + 16 + 32 * n);
        st(q + n * 128, _mm256_and_si256(x, m3));
        st(q + n * 128 + 32, _mm256_and_si256(_mm256_srli_epi16(x, 2), m3));
        st(q + n * 128 + 64, _mm256_and_si256(_mm256_srli_epi16(x, 4), m3));
        st(q + n * 128 + 96, _mm256_and_si256(_mm256_srli_epi16(x, 6), m3));
      }
      break;
    }
    case Q3_K: {
      const __m256i m3 = _mm256_set1_epi8(3);
      const __m256i hm = ld(b);
      for (int n = 0; n < 2; ++n) {
        const __m256i x = ld(b + 32 + 32 * n);
        for (int j = 0; j < 4; ++j) {
          const __m256i lo = _mm256_and_si256(_mm256_srli_epi16(x, 2 * j), m3);
          st(q + n * 128 + 32 * j, _mm256_or_si256(lo, test_bit(hm, static_cast<uint8_t>(1u << (4 * n + j)), 4)));
        }
      }
      break;
    }
    case Q4_K: {
      for (int p = 0; p < 4; ++p) {
        const __m256i x = ld(b + 16 + 32 * p);
        st(q + 64 * p, nib_lo(x));
        st(q + 64 * p + 32, nib_hi(x));
      }
      break;
    }
    case Q5_K: {
      const __m256i qh = ld(b + 16);
      for (int p = 0; p < 4; ++p) {
        const __m256i x = ld(b + 48 + 32 * p);
        st(q + 64 * p, _mm256_or_si256(nib_lo(x), test_bit(qh, static_cast<uint8_t>(1u << (2 * p)), 0x10)));
        st(q + 64 * p + 32, _mm256_or_si256(nib_hi(x), test_bit(qh, static_cast<uint8_t>(1u << (2 * p + 1)), 0x10)));
      }
      break;
    }
    case Q6_K: {
      const __m256i m3 = _mm256_set1_epi8(3);
      for (int n = 0; n < 2; ++n) {
        const __m256i l0 = ld(b + 64 * n), l1 = ld(b + 64 * n + 32), h = ld(b + 128 + 32 * n);
        const __m256i h0 = _mm256_slli_epi16(_mm256_and_si256(h, m3), 4);
        const __m256i h1 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), m3), 4);
        const __m256i h2 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4), m3), 4);
        const __m256i h3 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 6), m3), 4);
        st(q + n * 128, _mm256_or_si256(nib_lo(l0), h0));
        st(q + n * 128 + 32, _mm256_or_si256(nib_lo(l1), h1));
        st(q + n * 128 + 64, _mm256_or_si256(nib_hi(l0), h2));
        st(q + n * 128 + 96, _mm256_or_si256(nib_hi(l1), h3));
      }
      break;
    }
  }
}

// 8 int32 lanes, lanes 0-3 summing q*a over bytes 0-15 and lanes 4-7 over bytes 16-31.
template <bool SIGNED>
PQ_AVX2 __m256i dot_avx2(__m256i w, __m256i a) {
  if (SIGNED) {  // maddubs wants unsigned x signed: move w's sign onto a
    a = _mm256_sign_epi8(a, w);
    w = _mm256_sign_epi8(w, w);
  }
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), _mm256_set1_epi16(1));
}

#ifdef PQ_AVXVNNI
// dot_avx2's sums by one vpdpbusd: the same int32 lanes (maddubs' pairs never saturate here:
// |w| <= 128 and |a| <= 127), so the same results bit for bit.
template <bool SIGNED>
inline __m256i dot_avxvnni(__m256i w, __m256i a) {
  if (SIGNED) {
    a = _mm256_sign_epi8(a, w);
    w = _mm256_sign_epi8(w, w);
  }
  return PQ_DPBUSD256(_mm256_setzero_si256(), w, a);
}
#endif

template <bool SIGNED>
inline __m256i dot_vnni(__m256i w, __m256i a) {
#ifdef PQ_HAS_VNNI
  if (SIGNED) {
    a = _mm256_sign_epi8(a, w);
    w = _mm256_sign_epi8(w, w);
  }
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, a);
#else
  return dot_avx2<SIGNED>(w, a);  // never dispatched: isa_supported() says no
#endif
}

// The 32-byte dot of path ISA (AVX2, AVXVNNI or AVX512VNNI) in this object.
template <int64_t ISA, bool SIGNED>
inline __m256i dot_isa(__m256i w, __m256i a) {
#ifdef PQ_AVXVNNI
  if constexpr (ISA == AVXVNNI) return dot_avxvnni<SIGNED>(w, a);
#endif
  if constexpr (ISA == AVX512VNNI) return dot_vnni<SIGNED>(w, a);
  return dot_avx2<SIGNED>(w, a);
}

PQ_AVX2 float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif  // PQ_X86

#ifdef PQ_X86
// 8 floats at a time in T (float, bf16, fp16): load, round through T (what storing as T and
// reading back gives), store. bf16 rounds to nearest even, as c10::BFloat16 does.
template <typename T> inline __m256 load8(const T* p) {
  if constexpr (std::is_same_v<T, float>) return _mm256_loadu_ps(p);
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (std::is_same_v<T, c10::BFloat16>) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  else return _mm256_cvtph_ps(h);
}
inline __m256i bf16_bits(__m256 v) {  // the rounded bf16 in each lane's high half
  const __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  return _mm256_and_si256(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))),
                          _mm256_set1_epi32(static_cast<int>(0xFFFF0000u)));
}
template <typename T> inline __m256 round8(__m256 v) {
  if constexpr (std::is_same_v<T, float>) return v;
  else if constexpr (std::is_same_v<T, c10::BFloat16>) return _mm256_castsi256_ps(bf16_bits(v));
  else return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}
template <typename T> inline void store8(T* p, __m256 v) {
  if constexpr (std::is_same_v<T, float>) {
    _mm256_storeu_ps(p, v);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __m256i b = _mm256_srli_epi32(bf16_bits(v), 16);
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
  } else {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  }
}
// exp(x) to about 1 ulp (the Cephes polynomial), for silu in the fused epilogue.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#endif  // PQ_X86

// The activation rows, quantized: int8 values, a scale per 32 and sums per 16.
struct QAct {
  std::vector<int8_t> a;
  std::vector<float> d;
  std::vector<int32_t> s16;
  // Per 32 values, 8 floats: d * s16 (what the weights' offsets multiply) of the first 16 in
  // lane 0 and of the second in lane 4, zeros elsewhere, so the offsets' term is one vector fma
  // per chunk with no serial scalar chain (the file-layout kernels; quantize_rows' msv).
  std::vector<float> msv;
  std::vector<int32_t> s32;  // sums per 32 values, and d * s32 (the packed kernels' offsets)
  std::vector<float> ds32;
  // Per 16 values, where quantize_rows is asked for them (packed Q6_K weights at the AVX2 path),
  // what Q6_K's offset of 32 takes from a maddubs' int16 sums over those 16 values: 32 x the sum
  // of the values 4i and 4i + 1 (low int16) and of 4i + 2 and 4i + 3 (high int16), each within
  // +-32512, so the AVX2 kernel's int16 sums of 6-bit weights minus these stay in int16
  // (quant_packed.cpp, group_avx2_q6).
  std::vector<int32_t> off6;
  int64_t m = 0, k = 0;
  // Block-major: the index of row `row`'s 32-value block `c`. A kernel tile of rows reads one
  // contiguous run per block; row-major, each of its rows was a stream of its own, and tiles of
  // 8+ rows starved the hardware prefetcher of the weights' stream when read from DRAM.
  int64_t at(int64_t row, int64_t c) const { return c * m + row; }
};

// One block's 32 values to int8 with scale d (round to nearest), and its sums.
inline void quantize_block(const float* v, int8_t* dst, float& d, int32_t& s0, int32_t& s1) {
  float amax = 0.f;
  for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(v[i]));
  d = amax / 127.f;
  const float id = d > 0.f ? 1.f / d : 0.f;
  s0 = s1 = 0;
  for (int i = 0; i < 32; ++i) {
    const int qv = static_cast<int>(std::nearbyint(v[i] * id));
    dst[i] = static_cast<int8_t>(qv);
    (i < 16 ? s0 : s1) += qv;
  }
}

#ifdef PQ_X86
// quantize_block, 8 lanes at a time, from four vectors of the block's values: the same max, scale,
// products and rounding (round to nearest even: the default mode nearbyint follows), so the same
// bytes and sums. The scalar loops made quantizing a wide projection's input a visible part of
// a batch-1 step, twice that in two levels.
inline void quantize_block8(const __m256 (&v)[4], int8_t* dst, float& d, int32_t& s0, int32_t& s1) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                 _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  const float amax = _mm_cvtss_f32(h);
  d = amax / 127.f;
  const __m256 id = _mm256_set1_ps(d > 0.f ? 1.f / d : 0.f);
  __m256i q[4];
  for (int j = 0; j < 4; ++j)
    q[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[j], id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  auto hsum_i = [](__m256i a) {
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
    return _mm_cvtsi128_si32(t);
  };
  s0 = hsum_i(_mm256_add_epi32(q[0], q[1]));
  s1 = hsum_i(_mm256_add_epi32(q[2], q[3]));
  // int32 -> int8 (all within +-127): the packs work within 128-bit halves, so their output
  // comes in the dword order 0 4 1 5 2 6 3 7, which the permute puts back.
  const __m256i w01 = _mm256_packs_epi32(q[0], q[1]), w23 = _mm256_packs_epi32(q[2], q[3]);
  const __m256i b = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w01, w23), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), b);
}

// QAct::off6 of a quantized block's two 16-value halves, from its 32 int8 values.
inline void offsets6(const int8_t* q, int32_t* o) {
  // pairs p[i] = q[2i] + q[2i + 1]; a 32-bit lane holds a low and a high pair: the 4 lanes of
  // each 128-bit half (16 values) summed as int16 pairs
  const __m256i p = _mm256_maddubs_epi16(_mm256_set1_epi8(1), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)));
  __m256i s = _mm256_add_epi16(p, _mm256_shuffle_epi32(p, 0x4E));
  s = _mm256_slli_epi16(_mm256_add_epi16(s, _mm256_shuffle_epi32(s, 0xB1)), 5);
  o[0] = _mm256_extract_epi32(s, 0);
  o[1] = _mm256_extract_epi32(s, 4);
}
#endif

// x [m, k] quantized per 32 values. levels = 2 adds the rounding error of each row, quantized
// the same way, as the row after it (x ~ d1 q1 + d2 q2, about 14 bits instead of 7): the
// kernels then see 2m rows that share each decoded weight tile, and the caller sums the pairs.
// off6: also QAct::off6 (on x86 levels; the other formats and paths do without its cost).
// msv: also QAct::msv, which only the file-layout kernels read; a product of packed weights
// alone skips it (zeroing it costs a wide step a pass over eight floats a block).
template <typename T>
void quantize_rows(const T* x, int64_t m, int64_t k, QAct& out, int levels = 1, bool off6 = false, bool msv = true) {
  const int64_t kc = k / 32, rows = m * levels;
  out.m = rows;
  out.k = k;
  out.a.resize(rows * k);
  out.d.resize(rows * kc);
  out.s16.resize(rows * (k / 16));
  out.s32.resize(rows * kc);
  out.ds32.resize(rows * kc);
  if (msv) out.msv.assign(rows * kc * 8, 0.f);
#ifdef PQ_X86
  if (off6) out.off6.resize(rows * (k / 16));
#endif
  auto record = [&](int64_t c, float d, int32_t s0, int32_t s1) {
    out.d[c] = d;
    out.s16[2 * c] = s0;
    out.s16[2 * c + 1] = s1;
    if (msv) {
      out.msv[c * 8] = d * static_cast<float>(s0);
      out.msv[c * 8 + 4] = d * static_cast<float>(s1);
    }
    out.s32[c] = s0 + s1;
    out.ds32[c] = d * static_cast<float>(s0 + s1);
  };
  // (a block is some 10 ns: a region pays off from a few thousand of them)
  at::parallel_for(0, m * kc, 2048, [&](int64_t b, int64_t e) {
    for (int64_t c = b; c < e; ++c) {
      const T* src = x + c * 32;  // rows are contiguous, k % 32 == 0
      const int64_t row = c / kc, col = c % kc;
      const int64_t c1 = out.at(row * levels, col);  // this block in the (first) quantized row
#ifdef PQ_X86
      __m256 v8[4] = {load8(src), load8(src + 8), load8(src + 16), load8(src + 24)};
      float d8;
      int32_t t0, t1;
      quantize_block8(v8, out.a.data() + c1 * 32, d8, t0, t1);
      record(c1, d8, t0, t1);
      if (off6) offsets6(out.a.data() + c1 * 32, out.off6.data() + 2 * c1);
      if (levels == 2) {  // the rounding error, v - d q (a product, then a difference: no fma)
        const int8_t* q = out.a.data() + c1 * 32;
        const __m256 dv = _mm256_set1_ps(d8);
        for (int j = 0; j < 4; ++j) {
          const __m256 qf = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * j))));
          v8[j] = _mm256_sub_ps(v8[j], _mm256_mul_ps(dv, qf));
        }
        quantize_block8(v8, out.a.data() + (c1 + 1) * 32, d8, t0, t1);
        record(c1 + 1, d8, t0, t1);
        if (off6) offsets6(out.a.data() + (c1 + 1) * 32, out.off6.data() + 2 * (c1 + 1));
      }
#else
      float v[32];
      for (int i = 0; i < 32; ++i) v[i] = static_cast<float>(src[i]);
      float d;
      int32_t s0, s1;
      quantize_block(v, out.a.data() + c1 * 32, d, s0, s1);
      record(c1, d, s0, s1);
      if (levels == 2) {
        const int8_t* q = out.a.data() + c1 * 32;
        for (int i = 0; i < 32; ++i) v[i] -= d * static_cast<float>(q[i]);
        const int64_t c2 = c1 + 1;  // the next row, the same block
        quantize_block(v, out.a.data() + c2 * 32, d, s0, s1);
        record(c2, d, s0, s1);
      }
#endif
    }
  });
}

inline bool isa_supported(int64_t isa) {
  switch (isa) {
    case SCALAR: return true;
#ifdef PQ_X86
    case AVX2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#endif
#ifdef PQ_HAS_VNNI
    case AVX512VNNI:
      return isa_supported(AVX2) && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
             __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni");
#endif
#ifdef PQ_AVXVNNI
    case AVXVNNI:
#ifdef PAGEDLLM_EVEX_TWIN
      return isa_supported(AVX2) && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
             __builtin_cpu_supports("avx512vnni");
#else
      return isa_supported(AVX2) && __builtin_cpu_supports("avxvnni");
#endif
#endif
    default: return false;
  }
}

inline int64_t best_isa() {
  static const int64_t best = isa_supported(AVX512VNNI) ? AVX512VNNI
                             : isa_supported(AVXVNNI)  ? AVXVNNI
                             : isa_supported(AVX2)     ? AVX2
                                                       : SCALAR;
  return best;
}

inline void check_weight(const at::Tensor& w, const Fmt& f, int64_t k) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.dim() == 2 && w.stride(1) == 1,
              "quantized weight must be a CPU uint8 [rows, row_bytes] tensor with contiguous rows");
  TORCH_CHECK(k > 0 && k % f.vals == 0, "row length ", k, " is not a multiple of the format's block of ", f.vals);
  TORCH_CHECK(w.size(1) == k / f.vals * f.bytes, "quantized weight rows hold ", w.size(1), " bytes, expected ",
              k / f.vals * f.bytes, " for ", k, " values");
}

// A [shape] tensor of `opts`' dtype: a view of the caller's flat scratch buffer where one is
// given (prefill dequantizes a tile per GEMM: a fresh multi-MB allocation each time came back
// as new pages from the kernel, and their faults cost more than the dequantization), else new.
inline at::Tensor scratch_view(const c10::optional<at::Tensor>& scratch, at::IntArrayRef shape,
                               const at::TensorOptions& opts) {
  if (!scratch.has_value()) return at::empty(shape, opts);
  int64_t n = 1;
  for (auto d : shape) n *= d;
  const at::Tensor& s = *scratch;
  TORCH_CHECK(s.device().is_cpu() && s.scalar_type() == opts.dtype().toScalarType() && s.is_contiguous(),
              "scratch must be a contiguous CPU tensor of the output dtype");
  TORCH_CHECK(s.numel() >= n, "scratch holds ", s.numel(), " values; this tile needs ", n);
  return s.view({-1}).narrow(0, 0, n).view(shape);
}

inline int64_t grain_for(int64_t rows) {
  // Enough rows per task to stream a long run of the weight, and at least 4 tasks per thread
  // so no core idles at the end.
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  return std::max<int64_t>(1, rows / (4 * threads));
}

// Runs f(b, e) on [0, n) in one parallel region, each thread one contiguous share, cut where
// the summed cost is even rather than the unit count. The units come in runs of equal cost
// (a fused projection's parts: bytes read per unit; run r ends at unit ends[r]). q|k|v with a
// Q6_K v and Q4_K q and k gave the thread holding v more bytes to read than the other, which
// waited for it.
template <typename F>
void parallel_by_cost(const std::vector<int64_t>& ends, const std::vector<double>& cost, int64_t min_units, F&& f) {
  const int64_t n = ends.empty() ? 0 : ends.back();
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n / std::max<int64_t>(1, min_units));
  if (threads <= 1 || at::in_parallel_region()) { f(0, n); return; }
  double total = 0;
  for (size_t r = 0; r < ends.size(); ++r) total += cost[r] * static_cast<double>(ends[r] - (r ? ends[r - 1] : 0));
  std::vector<int64_t> cut{0};
  double acc = 0;  // cost of units [0, u)
  int64_t u = 0;
  size_t r = 0;
  for (int64_t t = 1; t < threads; ++t) {
    const double goal = total * static_cast<double>(t) / static_cast<double>(threads);
    while (u < n) {  // whole runs, then the units of the run where the goal falls
      while (ends[r] <= u) ++r;
      const double run = cost[r] * static_cast<double>(ends[r] - u);
      if (acc + run <= goal) { acc += run; u = ends[r]; continue; }
      const int64_t take = static_cast<int64_t>((goal - acc) / cost[r] + 0.5);
      acc += cost[r] * static_cast<double>(take);
      u += take;
      break;
    }
    cut.push_back(u);
  }
  cut.push_back(n);
  at::parallel_for(0, threads, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t)
      if (cut[t] < cut[t + 1]) f(cut[t], cut[t + 1]);
  });
}

// The packed layout (quant_packed.cpp): type ids PACKED + ggml type, 16 rows a group.
constexpr int64_t PACKED = 100;
// Whether a product at path isa with weight parts of these type ids needs QAct::off6.
inline bool needs_off6(int64_t isa, at::IntArrayRef types) {
  return isa == AVX2 && std::find(types.begin(), types.end(), PACKED + Q6_K) != types.end();
}
int64_t packed_group_bytes(int64_t type, int64_t k);
void check_packed(const at::Tensor& w, int64_t type, int64_t k);
void packed_matmul(int64_t type, int64_t isa, const uint8_t* w, int64_t gb, int64_t g0, int64_t g1, const QAct& x,
                   float* y, int64_t ldy);
// AMX-BF16 (quant_packed.cpp): the rows from which a step of packed weights takes the tile
// product, 0 where this CPU (or the amx tuning knob) has none; groups [g0, g1) of a packed weight
// against xb, bfloat16 [mp, k] with mp a multiple of 16 (rows past m zero), into y's [m, 16 g].
int64_t amx_rows();
void amx_packed_matmul(int64_t type, const uint8_t* w, int64_t gb, int64_t g0, int64_t g1, const c10::BFloat16* xb,
                       int64_t m, int64_t k, float* y, int64_t ldy);
}  // namespace pq

// quant_linear with a hook between the product and the epilogue (quant_kernels.cpp), to add to
// the float32 product [M, n] in place: `prepare` gets the product's contiguous input before it,
// on the calling thread (float32 when normed here, else in x's dtype); inside the product's
// parallel region each thread then runs `lead(lo, hi)` before its share of the product, the
// output columns [lo, hi), and `columns(y, n, lo, hi)` once they are finished. So the hook's
// own work (LoRA's shrink in `lead`, its expand in `columns`) wakes the threads no second
// time. `columns` may wait for every thread's `lead`.
struct LinearHook {
  std::function<void(const at::Tensor& xin)> prepare;
  std::function<void(int64_t lo, int64_t hi)> lead;
  std::function<void(float* y, int64_t n, int64_t lo, int64_t hi)> columns;
};
at::Tensor quant_linear_hooked(const at::Tensor& x, at::TensorList ws, at::IntArrayRef types, int64_t k,
                               const c10::optional<at::Tensor>& norm_weight, double eps,
                               const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& residual,
                               int64_t act, int64_t isa, const LinearHook* hook);
}  // namespace PAGEDLLM_ISA
