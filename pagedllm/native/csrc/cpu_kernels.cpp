// Paged decode attention on the CPU: one query token per sequence attends its context
// straight from the block pool, so no step copies K/V out of the cache first.
//
// Work items are (sequence, KV head) pairs, spread over ATen's threads. Each item loads
// the G = Hq / Hkv query rows that share its KV head once, reads every key of the
// sequence once for all G rows (GQA without repeating K/V), keeps the scores in a
// per-thread buffer, and accumulates the values in float32. The cache is read in place
// by block table; nothing is written to it.
#include "isa.h"  // first: the library headers, and the level this object is compiled for
#include "quant_common.h"  // pq::exp8

namespace PAGEDLLM_ISA {

namespace {

inline float to_float(float x) { return x; }
inline float to_float(c10::Half x) { return static_cast<float>(x); }
inline float to_float(c10::BFloat16 x) {
  // bf16 is the high half of a float32: a shift, which the compiler vectorizes.
  uint32_t u = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

template <typename T>
inline void load_row(const T* src, float* dst, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) dst[i] = to_float(src[i]);
}

#ifdef PQ_X86
// float16 widened 8 at a time (exact, as the scalar conversion): c10::Half's bit-twiddling
// conversion does not vectorize, and an f16 cache read that way was slower at 32 sequences.
inline void load_row(const c10::Half* src, float* dst, int64_t d) {
  int64_t i = 0;
  for (; i + 8 <= d; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  for (; i < d; ++i) dst[i] = static_cast<float>(src[i]);
}
#endif

// A key or value row as floats: plain caches are widened; an int8 cache's values are scaled by
// their (token, head) scale `s` in float32, not rounded to the compute dtype as the PyTorch
// path's dequantization is.
template <typename C>
inline void load_kv(const C* src, const float*, float* dst, int64_t d) { load_row(src, dst, d); }
inline void load_kv(const int8_t* src, const float* s, float* dst, int64_t d) {
  const float f = *s;
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<float>(src[i]) * f;
}

// An f8e4m3 row (its bytes) scaled by its (layer, head) scale `s` in float32. Each byte's sign,
// exponent and mantissa fields moved into a float32's places read as the value times 2^-120
// (subnormals included: e4m3's exponent bias is 7, float32's 127), so one multiply by
// s * 2^120 (exact: a power of two; kv/quant.py keeps scales in range) gives value * s rounded
// once, as c10's conversion then the multiply would, and it vectorizes.
inline void load_kv(const uint8_t* src, const float* s, float* dst, int64_t d) {
  const float f = *s * 0x1p120f;
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) {
    const uint32_t b = src[i], u = ((b & 0x80u) << 24) | ((b & 0x7Fu) << 20);
    float v;
    std::memcpy(&v, &u, sizeof v);  // (a bit cast that every compiler this builds with takes)
    dst[i] = v * f;
  }
}

#ifdef PQ_HAS_VNNI
// out[j] = the sum of a[j]'s 16 lanes, for 16 vectors at once: pairs, then quads of lanes
// within each 128-bit lane, then across the four 128-bit lanes. Every a[j] is summed in the
// same order: ((l0 + l2) + (l1 + l3)) in each 128-bit lane, then (L0 + L1) + (L2 + L3).
inline __m512 hsum16(const __m512* a) {
  __m512 b[8], c[4];
  for (int k = 0; k < 8; ++k)
    b[k] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * k], a[2 * k + 1]), _mm512_unpackhi_ps(a[2 * k], a[2 * k + 1]));
  for (int k = 0; k < 4; ++k)
    c[k] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * k], b[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(b[2 * k], b[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 e0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 e1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(e0, e1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(e0, e1, _MM_SHUFFLE(3, 1, 3, 1)));
}

// AVX-512 BF16 (Zen 4, Cooper Lake, Sapphire Rapids): a bf16 query against a bf16 cache's keys
// by vdpbf16ps, two products a lane per instruction, straight from the pool. Each pair's
// products are exact in float32 and added one at a time, as an fma of the widened values
// would; the sums' order differs (lane i takes values 2i and 2i + 1 of each 32) and the scale
// multiplies the sum, not the query. It halves the scores' multiply-adds and drops the keys'
// widening into a buffer. Used where the library runs at the avx512bf16 level (the CPU has the
// instructions and PAGEDLLM_NATIVE_ISA does not cap the kernels below it).
bool bf16_dots() { return pagedllm::native_level() >= pagedllm::LEVEL_AVX512BF16; }

// The scores of 16 keys (rows k[j], D values each) for one query vector q, times scale, in the
// order of hsum16.
template <int D>
__attribute__((target("avx512bf16"))) __m512 key_dots_bf16(const c10::BFloat16* q, const c10::BFloat16* const* k,
                                                            float scale) {
  static_assert(D % 32 == 0, "32 bf16 values a vector");
  __m512bh qb[D / 32];
  for (int c = 0; c < D / 32; ++c) qb[c] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(q + 32 * c));
  __m512 acc[16];
  for (int j = 0; j < 16; ++j) {
    acc[j] = _mm512_dpbf16_ps(_mm512_setzero_ps(), qb[0], reinterpret_cast<__m512bh>(_mm512_loadu_si512(k[j])));
    for (int c = 1; c < D / 32; ++c)
      acc[j] = _mm512_dpbf16_ps(acc[j], qb[c], reinterpret_cast<__m512bh>(_mm512_loadu_si512(k[j] + 32 * c)));
  }
  return _mm512_mul_ps(hsum16(acc), _mm512_set1_ps(scale));
}
#endif

// The blocked scores and values of decode() below, at each x86 level: LANES float32 lanes a
// vector, key_sums the scores of LANES keys at once for one query vector (one accumulator a
// key, one transposing reduction for all the sums), add_values a run of keys' weighted value
// rows into one query vector's D accumulators, held in registers across the run. Key rows are
// given by pointer: read in place from a float32 pool, or widened into a buffer.
#ifdef PQ_HAS_VNNI
constexpr int LANES = 16;

// sums[j] = q . k[j] for the 16 keys, in the order of hsum16.
template <int D>
inline void key_sums(const float* q, const float* const* k, float* sums) {
  __m512 qr[D / 16], acc[16];
  for (int c = 0; c < D / 16; ++c) qr[c] = _mm512_loadu_ps(q + 16 * c);
  for (int j = 0; j < 16; ++j) {
    acc[j] = _mm512_mul_ps(qr[0], _mm512_loadu_ps(k[j]));
    for (int c = 1; c < D / 16; ++c) acc[j] = _mm512_fmadd_ps(qr[c], _mm512_loadu_ps(k[j] + 16 * c), acc[j]);
  }
  _mm512_store_ps(sums, hsum16(acc));
}

// a[i] += p[t] * v[t][i] for t < n, key by key: the same FMAs in the same order as one key at a time.
template <int D>
inline void add_values(float* a, const float* p, const float* const* v, int64_t n) {
  __m512 acc[D / 16];
  for (int j = 0; j < D / 16; ++j) acc[j] = _mm512_loadu_ps(a + 16 * j);
  for (int64_t t = 0; t < n; ++t) {
    const __m512 w = _mm512_set1_ps(p[t]);
    for (int j = 0; j < D / 16; ++j) acc[j] = _mm512_fmadd_ps(w, _mm512_loadu_ps(v[t] + 16 * j), acc[j]);
  }
  for (int j = 0; j < D / 16; ++j) _mm512_storeu_ps(a + 16 * j, acc[j]);
}
#elif defined(PQ_X86)
constexpr int LANES = 8;

// out[j] = the sum of a[j]'s 8 lanes, for 8 vectors at once: pairs, then quads of lanes within
// each 128-bit lane, then the two 128-bit lanes. Every a[j] is summed in the same order:
// ((l0 + l2) + (l1 + l3)) in each 128-bit lane, then L0 + L1 (hsum16's first steps).
inline __m256 hsum8(const __m256* a) {
  __m256 b[4], c[2];
  for (int k = 0; k < 4; ++k)
    b[k] = _mm256_add_ps(_mm256_unpacklo_ps(a[2 * k], a[2 * k + 1]), _mm256_unpackhi_ps(a[2 * k], a[2 * k + 1]));
  for (int k = 0; k < 2; ++k)
    c[k] = _mm256_add_ps(_mm256_shuffle_ps(b[2 * k], b[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm256_shuffle_ps(b[2 * k], b[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm256_add_ps(_mm256_permute2f128_ps(c[0], c[1], 0x20), _mm256_permute2f128_ps(c[0], c[1], 0x31));
}

// sums[j] = q . k[j] for the 8 keys, in the order of hsum8. AVX2 has 16 vector registers: the
// query of D = 128 (16 vectors) and 8 accumulators do not fit, so the query is read a vector
// at a time across the 8 keys (each key's products still added in order of i).
template <int D>
inline void key_sums(const float* q, const float* const* k, float* sums) {
  __m256 acc[8];
  const __m256 q0 = _mm256_loadu_ps(q);
  for (int j = 0; j < 8; ++j) acc[j] = _mm256_mul_ps(q0, _mm256_loadu_ps(k[j]));
  for (int c = 1; c < D / 8; ++c) {
    const __m256 qc = _mm256_loadu_ps(q + 8 * c);
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k[j] + 8 * c), acc[j]);
  }
  _mm256_store_ps(sums, hsum8(acc));
}

// a[i] += p[t] * v[t][i] for t < n, key by key, in slices of up to 64 values: 8 accumulators,
// which with the weight and a row's vector fit the 16 registers (D = 128 at once would spill).
template <int D>
inline void add_values(float* a, const float* p, const float* const* v, int64_t n) {
  constexpr int H = D % 64 == 0 ? 64 : D % 32 == 0 ? 32 : 8;
  for (int h0 = 0; h0 < D; h0 += H) {
    __m256 acc[H / 8];
    for (int j = 0; j < H / 8; ++j) acc[j] = _mm256_loadu_ps(a + h0 + 8 * j);
    for (int64_t t = 0; t < n; ++t) {
      const __m256 w = _mm256_set1_ps(p[t]);
      for (int j = 0; j < H / 8; ++j) acc[j] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v[t] + h0 + 8 * j), acc[j]);
    }
    for (int j = 0; j < H / 8; ++j) _mm256_storeu_ps(a + h0 + 8 * j, acc[j]);
  }
}
#endif

// Rows that are consecutive positions of one sequence (speculative verification: the last
// token and its proposals) share the block table and have lengths L, L + 1, ...: they form a
// group whose keys and values are read once for all its rows (row i sees the first L + i).
// Each row's arithmetic is the same as alone, so grouping changes no bit of the output.
constexpr int64_t MAX_GROUP = 16;

template <typename I>
std::vector<std::pair<int64_t, int64_t>> row_groups(const I* tables, int64_t max_blocks, const I* lens,
                                                    int64_t n_seqs, int64_t block_size, int64_t window) {
  std::vector<std::pair<int64_t, int64_t>> groups;  // (first row, rows)
  for (int64_t n = 0; n < n_seqs; ++n) {
    if (!groups.empty() && window <= 0) {
      auto& [first, count] = groups.back();
      const int64_t prev = first + count - 1;
      const int64_t used = (static_cast<int64_t>(lens[prev]) + block_size - 1) / block_size;
      if (count < MAX_GROUP && static_cast<int64_t>(lens[n]) == static_cast<int64_t>(lens[prev]) + 1 &&
          std::equal(tables + n * max_blocks, tables + n * max_blocks + used, tables + prev * max_blocks)) {
        // (the new row's extra key, if it starts a block, is read from its own table)
        if ((static_cast<int64_t>(lens[n]) + block_size - 1) / block_size == used ||
            tables[n * max_blocks + used] == tables[prev * max_blocks + used]) {
          ++count;
          continue;
        }
      }
    }
    groups.emplace_back(n, 1);
  }
  return groups;
}

// sg[t] = exp(sg[t] - m) for t < len. The loop of expf calls did not vectorize (glibc's vector
// expf is declared only under -ffast-math), and took a large share of the kernel's time; here 8 lanes at a time with the Cephes exp the fused epilogue and prefill attention use. The
// last vector may write lanes past len: a row's scores have CHUNK (a multiple of 8) floats.
inline void exp_shifted(float* sg, int64_t len, float m) {
#ifdef PQ_X86
  const __m256 mv = _mm256_set1_ps(m);
  for (int64_t t = 0; t < len; t += 8) _mm256_storeu_ps(sg + t, pq::exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + t), mv)));
#else
  for (int64_t t = 0; t < len; ++t) sg[t] = expf(sg[t] - m);
#endif
}

// Keys per work item. A (row group, KV head) pair is split at fixed multiples of CHUNK so a
// long context spreads over the threads (one sequence has only Hkv pairs); each chunk keeps
// its own max, sum and weighted values, merged after. The boundaries are absolute positions,
// so a row's result does not depend on what else is in the batch, and a context of up to
// CHUNK keys computes exactly as without chunks.
constexpr int64_t CHUNK = 256;

// D > 0 fixes the head dim at compile time (64, 128: unrolled, no remainder loops);
// D == 0 reads it at run time.
template <typename T, typename C, typename I, int D>
void decode(const T* q, int64_t q_sn, int64_t q_sh, const C* kc, const C* vc, const float* ks, const float* vs,
            int64_t s_stride, int64_t blk_stride, int64_t tok_stride, const I* tables, int64_t max_blocks,
            const I* lens, T* out, int64_t n_seqs, int64_t hq, int64_t hkv, int64_t d_run,
            int64_t block_size, int64_t window, float scale) {
  const int64_t d = D > 0 ? D : d_run;
  const int64_t g_per_kv = hq / hkv;
  const auto groups = row_groups(tables, max_blocks, lens, n_seqs, block_size, window);
  const int64_t n_groups = static_cast<int64_t>(groups.size());
  auto row_start = [&](int64_t n) {
    const int64_t ctx = static_cast<int64_t>(lens[n]);
    return window > 0 ? std::max<int64_t>(0, ctx - window) : int64_t{0};
  };
  // Work items (group, head, chunk) and where each keeps its partial results.
  std::vector<int64_t> item_group, item_chunk, item_off{0};
  for (int64_t gi = 0; gi < n_groups; ++gi) {
    const auto [n0, rows] = groups[gi];
    int64_t first = std::numeric_limits<int64_t>::max(), last = 0;
    for (int64_t r = 0; r < rows; ++r) {
      first = std::min(first, row_start(n0 + r));
      last = std::max(last, static_cast<int64_t>(lens[n0 + r]));
    }
    const int64_t per_item = rows * g_per_kv * (d + 2);  // per query vector: max, sum, values
    for (int64_t h = 0; h < hkv; ++h)
      for (int64_t c = first / CHUNK; c <= (last - 1) / CHUNK; ++c) {
        item_group.push_back(gi * hkv + h);
        item_chunk.push_back(c);
        item_off.push_back(item_off.back() + per_item);
      }
  }
  const int64_t n_items = static_cast<int64_t>(item_group.size());
  // Every (group, head) in one chunk (contexts of up to CHUNK keys, the common decode step):
  // each item writes its output itself, and the merge pass, a second parallel region a
  // layer, is skipped. The same arithmetic as the merge of one chunk: the same bits.
  const bool single = n_items == n_groups * hkv;
#ifdef PQ_HAS_VNNI
  // A bf16 query and cache, a head dim the blocked scores unroll, a CPU with AVX-512 BF16:
  // key_dots_bf16 reads the query and keys as stored, so the query is not widened either.
  constexpr bool bf16_pair = std::is_same_v<T, c10::BFloat16> && std::is_same_v<C, c10::BFloat16> && D > 0 &&
                             D % 32 == 0 && D <= 128;
  const bool bf16_scores = bf16_pair && bf16_dots();
#else
  const bool bf16_scores = false;
#endif
  // A float32 cache holds the rows as the FMAs read them: the blocked paths take them in place.
  constexpr bool in_place = std::is_same_v<C, float>;
  std::vector<float> part(item_off.back());
  at::parallel_for(0, n_items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf, row(d), scores, vbuf, kbuf;
    std::vector<int64_t> lo_r, hi_r;
    for (int64_t item = begin; item < end; ++item) {
      const auto [n0, rows] = groups[item_group[item] / hkv];
      const int64_t h = item_group[item] % hkv;
      const int64_t nq = rows * g_per_kv;  // query vectors: row r's G heads at r * G + g
      float* pm = part.data() + item_off[item];  // [nq] max, [nq] sum, [nq, d] values
      float* ps = pm + nq;
      float* pa = ps + nq;
      std::fill(pa, pa + nq * d, 0.f);
      // Where `single`: the merge's steps for one chunk (its max is the top, so the weight
      // is expf(0) = 1), written out here.
      auto finish = [&] {
        if (!single) return;
        for (int64_t v = 0; v < nq; ++v) {
          const float inv = ps[v] > 0.f ? 1.f / ps[v] : 0.f;
          const float* av = pa + v * d;
          const int64_t r = v / g_per_kv, g = v % g_per_kv;
          T* o = out + ((n0 + r) * hq + h * g_per_kv + g) * d;
          for (int64_t i = 0; i < d; ++i) o[i] = static_cast<T>((0.f + av[i]) * inv);
        }
      };
      qf.resize(nq * d);
      lo_r.resize(rows);
      hi_r.resize(rows);
      const int64_t c_lo = item_chunk[item] * CHUNK, c_hi = c_lo + CHUNK;
      int64_t lo = c_hi, hi = c_lo;
      for (int64_t r = 0; r < rows; ++r) {
        lo_r[r] = std::max(row_start(n0 + r), c_lo);
        hi_r[r] = std::min(static_cast<int64_t>(lens[n0 + r]), c_hi);
        if (lo_r[r] < hi_r[r]) {
          lo = std::min(lo, lo_r[r]);
          hi = std::max(hi, hi_r[r]);
        }
        for (int64_t g = 0; g < g_per_kv && !bf16_scores; ++g) {
          const T* src = q + (n0 + r) * q_sn + (h * g_per_kv + g) * q_sh;
          float* dst = qf.data() + (r * g_per_kv + g) * d;
          load_row(src, dst, d);
#pragma omp simd
          for (int64_t i = 0; i < d; ++i) dst[i] *= scale;
        }
      }
      const I* table = tables + (n0 + rows - 1) * max_blocks;  // the longest row's (a superset)
      // Position t's key or value row of head h as floats (scaled, for a quantized cache).
      auto load_at = [&](const C* cache, const float* scales, int64_t t, float* dst) {
        const int64_t blk = static_cast<int64_t>(table[t / block_size]);
        const C* src = cache + blk * blk_stride + (t % block_size) * tok_stride + h * d;
        load_kv(src, scales == nullptr ? nullptr : scales + (blk * block_size + t % block_size) * s_stride + h, dst, d);
      };
      scores.resize(nq * CHUNK);
      // Scores: each key row is converted once and used by every query vector that sees it.
#ifdef PQ_X86
      // Position t's row of head h in a float32 pool, read in place (no scale, no widening).
      auto row_at = [&](const C* cache, int64_t t) {
        return cache + static_cast<int64_t>(table[t / block_size]) * blk_stride + (t % block_size) * tok_stride + h * D;
      };
      constexpr bool blocked = D % LANES == 0 && D > 0 && D <= 128;
      if constexpr (blocked) {
        // LANES keys at a time: one accumulator a key and one transposing reduction for their
        // sums (key_sums), where a dot product at a time reduced each key's vector alone.
        // Every key's sum takes the same order whatever its place in the block, so a score
        // does not depend on the batch or the chunk. A float32 cache's keys are read in place
        // (a zero row outside the item's); other caches' are widened into kbuf first. bf16
        // scores read a bf16 cache's keys in place as well.
        alignas(64) static const float zeros[D > 0 ? D : 1] = {};
        const C* krow[LANES];     // bf16 scores
        const float* kf[LANES];   // the float32 rows key_sums reads
        if (!bf16_scores && !in_place) kbuf.resize(LANES * D);
        for (int64_t t0 = lo - lo % LANES; t0 < hi; t0 += LANES) {
          for (int64_t j = 0; j < LANES; ++j) {
            const int64_t t = t0 + j;
            const bool outside = t < lo || t >= hi;  // never read from the pool
            if (bf16_scores) {
              krow[j] = outside ? reinterpret_cast<const C*>(zeros) : row_at(kc, t);
            } else if (outside) {
              kf[j] = zeros;
            } else if constexpr (in_place) {
              kf[j] = row_at(kc, t);
            } else {
              load_at(kc, ks, t, kbuf.data() + j * D);
              kf[j] = kbuf.data() + j * D;
            }
          }
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t a = std::max(t0, lo_r[r]), b = std::min(t0 + LANES, hi_r[r]);
            if (a >= b) continue;
            for (int64_t g = 0; g < g_per_kv; ++g) {
              const int64_t qv = r * g_per_kv + g;
              alignas(64) float sums[LANES];
              if (bf16_scores) {
#ifdef PQ_HAS_VNNI
                if constexpr (bf16_pair)  // (compiled for a bf16 query and cache alone)
                  _mm512_store_ps(sums, key_dots_bf16<D>(reinterpret_cast<const c10::BFloat16*>(
                                                             q + (n0 + r) * q_sn + (h * g_per_kv + g) * q_sh),
                                                         reinterpret_cast<const c10::BFloat16* const*>(krow), scale));
#endif
              } else {
                key_sums<D>(qf.data() + qv * D, kf, sums);
              }
              float* sc = scores.data() + qv * CHUNK;
              for (int64_t t = a; t < b; ++t) sc[t - lo_r[r]] = sums[t - t0];
            }
          }
        }
      }
      if constexpr (!blocked)
#endif
      for (int64_t t = lo; t < hi; ++t) {
        load_at(kc, ks, t, row.data());
        for (int64_t r = 0; r < rows; ++r) {
          if (t < lo_r[r] || t >= hi_r[r]) continue;
          for (int64_t g = 0; g < g_per_kv; ++g) {
            const float* qg = qf.data() + (r * g_per_kv + g) * d;
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int64_t i = 0; i < d; ++i) s += qg[i] * row[i];
            scores[(r * g_per_kv + g) * CHUNK + (t - lo_r[r])] = s;
          }
        }
      }
      for (int64_t v = 0; v < nq; ++v) {
        const int64_t len = std::max<int64_t>(0, hi_r[v / g_per_kv] - lo_r[v / g_per_kv]);
        float* sg = scores.data() + v * CHUNK;
        float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
        for (int64_t t = 0; t < len; ++t) m = std::max(m, sg[t]);
        exp_shifted(sg, len, m);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < len; ++t) sum += sg[t];
        pm[v] = m;
        ps[v] = sum;
      }
#ifdef PQ_X86
      if constexpr (D % LANES == 0 && D > 0 && D <= 256) {
        // Values a block of VB keys at a time: each query vector's D accumulators stay in
        // registers across the block (add_values), where key by key they were loaded and
        // stored for every key and query vector (8 loads, 8 FMAs and 8 stores a key at D = 128
        // on AVX-512). A float32 cache's rows are read in place; others are widened once into
        // vbuf. The same FMAs in the same key order: the same bits.
        constexpr int64_t VB = 32;
        const float* vrow[VB];
        if (!in_place) vbuf.resize(VB * D);
        for (int64_t t0 = lo; t0 < hi; t0 += VB) {
          const int64_t t1 = std::min(hi, t0 + VB);
          for (int64_t t = t0; t < t1; ++t) {
            if constexpr (in_place) {
              vrow[t - t0] = row_at(vc, t);
            } else {
              load_at(vc, vs, t, vbuf.data() + (t - t0) * D);
              vrow[t - t0] = vbuf.data() + (t - t0) * D;
            }
          }
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t a = std::max(t0, lo_r[r]), b = std::min(t1, hi_r[r]);
            if (a >= b) continue;
            for (int64_t g = 0; g < g_per_kv; ++g) {
              const int64_t qv = r * g_per_kv + g;
              add_values<D>(pa + qv * D, scores.data() + qv * CHUNK + (a - lo_r[r]), vrow + (a - t0), b - a);
            }
          }
        }
        finish();
        continue;
      }
#endif
      for (int64_t t = lo; t < hi; ++t) {
        load_at(vc, vs, t, row.data());
        for (int64_t r = 0; r < rows; ++r) {
          if (t < lo_r[r] || t >= hi_r[r]) continue;
          for (int64_t g = 0; g < g_per_kv; ++g) {
            const int64_t qv = r * g_per_kv + g;
            const float p = scores[qv * CHUNK + (t - lo_r[r])];
            float* ag = pa + qv * d;
#pragma omp simd
            for (int64_t i = 0; i < d; ++i) ag[i] += p * row[i];
          }
        }
      }
      finish();
    }
  });
  if (single) return;
  // Merge each (group, head)'s chunks in order: rescale to the largest max, sum, divide.
  std::vector<int64_t> first_item(n_groups * hkv + 1, n_items);
  for (int64_t item = n_items - 1; item >= 0; --item) first_item[item_group[item]] = item;
  at::parallel_for(0, n_groups * hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(d);
    for (int64_t gh = begin; gh < end; ++gh) {
      const auto [n0, rows] = groups[gh / hkv];
      const int64_t h = gh % hkv, nq = rows * g_per_kv;
      int64_t stop = first_item[gh];
      while (stop < n_items && item_group[stop] == gh) ++stop;
      for (int64_t v = 0; v < nq; ++v) {
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t it = first_item[gh]; it < stop; ++it) top = std::max(top, part[item_off[it] + v]);
        std::fill(acc.begin(), acc.end(), 0.f);
        float sum = 0.f;
        for (int64_t it = first_item[gh]; it < stop; ++it) {
          const float* pm = part.data() + item_off[it];
          if (pm[nq + v] == 0.f) continue;  // no key of this row in the chunk
          const float w = expf(pm[v] - top);
          sum += pm[nq + v] * w;
          const float* pa = pm + 2 * nq + v * d;
#pragma omp simd
          for (int64_t i = 0; i < d; ++i) acc[i] += pa[i] * w;
        }
        const float inv = sum > 0.f ? 1.f / sum : 0.f;
        const int64_t r = v / g_per_kv, g = v % g_per_kv;
        T* o = out + ((n0 + r) * hq + h * g_per_kv + g) * d;
        for (int64_t i = 0; i < d; ++i) o[i] = static_cast<T>(acc[i] * inv);
      }
    }
  });
}

template <typename T, typename C, typename I>
void dispatch_dim(const T* qp, int64_t q_sn, int64_t q_sh, const C* kp, const C* vp, const float* ks,
                  const float* vs, int64_t ss, int64_t blk, int64_t tok, const I* tables, int64_t max_blocks, const I* lens,
                  T* op, int64_t n, int64_t hq, int64_t hkv, int64_t d, int64_t bs, int64_t window, float scale) {
  switch (d) {
    case 64: decode<T, C, I, 64>(qp, q_sn, q_sh, kp, vp, ks, vs, ss, blk, tok, tables, max_blocks, lens, op, n, hq, hkv, d, bs, window, scale); break;
    case 128: decode<T, C, I, 128>(qp, q_sn, q_sh, kp, vp, ks, vs, ss, blk, tok, tables, max_blocks, lens, op, n, hq, hkv, d, bs, window, scale); break;
    default: decode<T, C, I, 0>(qp, q_sn, q_sh, kp, vp, ks, vs, ss, blk, tok, tables, max_blocks, lens, op, n, hq, hkv, d, bs, window, scale);
  }
}

template <typename T, typename C>
void dispatch_index(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                    const at::Tensor& tables, const at::Tensor& lens, at::Tensor& out,
                    int64_t window, double scale, const float* ks = nullptr, const float* vs = nullptr,
                    int64_t ss = 0) {
  const int64_t n = q.size(0), hq = q.size(1), d = q.size(2);
  const int64_t bs = kc.size(1), hkv = kc.size(2);
  const T* qp = q.data_ptr<T>();
  const C* kp = static_cast<const C*>(kc.data_ptr());  // (an f8e4m3 cache is read as its bytes)
  const C* vp = static_cast<const C*>(vc.data_ptr());
  T* op = out.data_ptr<T>();
  const int64_t blk = kc.stride(0), tok = kc.stride(1);
  if (tables.scalar_type() == at::kLong) {
    dispatch_dim<T, C, int64_t>(qp, q.stride(0), q.stride(1), kp, vp, ks, vs, ss, blk, tok, tables.data_ptr<int64_t>(),
                       tables.size(1), lens.data_ptr<int64_t>(), op, n, hq, hkv, d, bs, window,
                       static_cast<float>(scale));
  } else {
    dispatch_dim<T, C, int32_t>(qp, q.stride(0), q.stride(1), kp, vp, ks, vs, ss, blk, tok, tables.data_ptr<int32_t>(),
                       tables.size(1), lens.data_ptr<int32_t>(), op, n, hq, hkv, d, bs, window,
                       static_cast<float>(scale));
  }
}

// The cache holds q's dtype, or (a bf16 / f16 cache under float32 compute) a narrower float
// that every key and value is widened from as it is read.
bool cache_dtype_ok(at::ScalarType q, at::ScalarType cache) {
  return cache == q || (q == at::kFloat && (cache == at::kBFloat16 || cache == at::kHalf));
}

// Every block id a sequence's length reaches must name a block of the pool, and every length
// fit its table: a bookkeeping bug then raises here instead of reading stray memory. O(blocks).
template <typename I>
void check_tables_t(const I* tables, int64_t width, const I* lens, int64_t n, int64_t num_blocks, int64_t bs) {
  for (int64_t s = 0; s < n; ++s) {
    const int64_t len = static_cast<int64_t>(lens[s]);
    TORCH_CHECK(len >= 1 && len <= width * bs, "paged_decode: sequence ", s, " has context length ", len,
                " but its block table holds ", width, " blocks of ", bs);
    const int64_t used = (len + bs - 1) / bs;
    for (int64_t i = 0; i < used; ++i) {
      const int64_t b = static_cast<int64_t>(tables[s * width + i]);
      TORCH_CHECK(b >= 0 && b < num_blocks, "paged_decode: sequence ", s, " names block ", b,
                  " at table position ", i, ", outside the pool of ", num_blocks, " blocks");
    }
  }
}

void check_tables(const at::Tensor& tables, const at::Tensor& lens, int64_t n, int64_t num_blocks, int64_t bs) {
  if (tables.scalar_type() == at::kLong)
    check_tables_t(tables.data_ptr<int64_t>(), tables.size(1), lens.data_ptr<int64_t>(), n, num_blocks, bs);
  else
    check_tables_t(tables.data_ptr<int32_t>(), tables.size(1), lens.data_ptr<int32_t>(), n, num_blocks, bs);
}

}  // namespace

// A scaled cache's scales, checked; the stride between consecutive slots' scales: int8 keeps
// one float32 per (token, head), [num_blocks, block_size, Hkv] (stride Hkv); f8e4m3 one per
// (layer, head), [Hkv] (stride 0). -1: a plain cache (no scales, and none may be given).
int64_t scale_stride(const at::Tensor& k_cache, const c10::optional<at::Tensor>& k_scale,
                     const c10::optional<at::Tensor>& v_scale, const char* op) {
  const auto t = k_cache.scalar_type();
  const bool int8 = t == at::kChar, fp8 = t == at::kFloat8_e4m3fn;
  TORCH_CHECK((int8 || fp8) == (k_scale.has_value() && v_scale.has_value()) && (int8 || fp8 || !k_scale.has_value()),
              op, ": an int8 or f8e4m3 cache needs k_scale and v_scale (and only those caches take them)");
  if (!int8 && !fp8) return -1;
  for (const auto* sc : {&*k_scale, &*v_scale}) {
    const bool ok = sc->scalar_type() == at::kFloat && sc->is_contiguous() &&
                    (int8 ? sc->dim() == 3 && sc->sizes() == k_cache.sizes().slice(0, 3)
                          : sc->dim() == 1 && sc->size(0) == k_cache.size(2));
    TORCH_CHECK(ok, op, ": k_scale and v_scale must be contiguous float32 ",
                int8 ? "[num_blocks, block_size, Hkv] (int8)" : "[Hkv] (f8e4m3)");
  }
  return int8 ? k_cache.size(2) : 0;
}

// q [N, Hq, D] (last dim contiguous); k_cache, v_cache [num_blocks, block_size, Hkv, D]
// contiguous, in q's dtype (or bf16 / f16 under a float32 q), or int8 / f8e4m3 with their
// k_scale, v_scale (scale_stride; value = stored * scale, kv/quant.py); block_tables
// [N, max_blocks]; context_lens [N] (int32 or int64, both the same). window <= 0 means no
// sliding window. Returns [N, Hq, D].
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& block_tables,
                           const at::Tensor& context_lens, double scale, int64_t window,
                           const c10::optional<at::Tensor>& k_scale = c10::nullopt,
                           const c10::optional<at::Tensor>& v_scale = c10::nullopt) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), "paged_decode runs on the CPU");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [N, Hq, D] with a contiguous last dim");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes(),
              "k_cache and v_cache must be contiguous [num_blocks, block_size, Hkv, D]");
  const int64_t ss = scale_stride(k_cache, k_scale, v_scale, "paged_decode");
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type() &&
                  (ss >= 0 || cache_dtype_ok(q.scalar_type(), k_cache.scalar_type())),
              "the cache must be in q's dtype, bfloat16 / float16 under a float32 q, or int8 / f8e4m3 with scales");
  TORCH_CHECK(k_cache.size(3) == q.size(2) && q.size(1) % k_cache.size(2) == 0,
              "head dims differ or query heads are not a multiple of KV heads");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.is_contiguous() && context_lens.is_contiguous() &&
                  block_tables.size(0) >= q.size(0) && context_lens.size(0) >= q.size(0) &&
                  block_tables.scalar_type() == context_lens.scalar_type() &&
                  (block_tables.scalar_type() == at::kLong || block_tables.scalar_type() == at::kInt),
              "block_tables [N, max_blocks] and context_lens [N] must be contiguous int32 or int64");
  check_tables(block_tables, context_lens, q.size(0), k_cache.size(0), k_cache.size(1));
  auto out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  const auto cache = k_cache.scalar_type();
  if (ss >= 0) {
    const float* ks = k_scale->data_ptr<float>();
    const float* vs = v_scale->data_ptr<float>();
    auto run = [&](auto stored) {
      using C = decltype(stored);
      switch (q.scalar_type()) {
        case at::kFloat: dispatch_index<float, C>(q, k_cache, v_cache, block_tables, context_lens, out, window, scale, ks, vs, ss); break;
        case at::kBFloat16: dispatch_index<c10::BFloat16, C>(q, k_cache, v_cache, block_tables, context_lens, out, window, scale, ks, vs, ss); break;
        case at::kHalf: dispatch_index<c10::Half, C>(q, k_cache, v_cache, block_tables, context_lens, out, window, scale, ks, vs, ss); break;
        default: TORCH_CHECK(false, "paged_decode supports float32, bfloat16 and float16");
      }
    };
    if (cache == at::kChar) run(int8_t{}); else run(uint8_t{});  // (f8e4m3 read as its bytes)
    return out;
  }
  switch (q.scalar_type()) {
    case at::kFloat:
      if (cache == at::kBFloat16)
        dispatch_index<float, c10::BFloat16>(q, k_cache, v_cache, block_tables, context_lens, out, window, scale);
      else if (cache == at::kHalf)
        dispatch_index<float, c10::Half>(q, k_cache, v_cache, block_tables, context_lens, out, window, scale);
      else
        dispatch_index<float, float>(q, k_cache, v_cache, block_tables, context_lens, out, window, scale);
      break;
    case at::kBFloat16: dispatch_index<c10::BFloat16, c10::BFloat16>(q, k_cache, v_cache, block_tables, context_lens, out, window, scale); break;
    case at::kHalf: dispatch_index<c10::Half, c10::Half>(q, k_cache, v_cache, block_tables, context_lens, out, window, scale); break;
    default: TORCH_CHECK(false, "paged_decode supports float32, bfloat16 and float16");
  }
  return out;
}


namespace {
// Rotate-half rope of one head, rounding each product and sum to T as the PyTorch path's
// elementwise ops do (x1*cos - x2*sin, x2*cos + x1*sin), so both paths give the same bits.
template <typename T>
__attribute__((optimize("fp-contract=off"))) void rope_head(const T* x, const T* c, const T* s, T* o,
                                                             int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const T x1 = x[i], x2 = x[i + half];
    const T a = static_cast<T>(static_cast<float>(x1) * static_cast<float>(c[i]));
    const T b = static_cast<T>(static_cast<float>(x2) * static_cast<float>(s[i]));
    const T e = static_cast<T>(static_cast<float>(x2) * static_cast<float>(c[i]));
    const T f = static_cast<T>(static_cast<float>(x1) * static_cast<float>(s[i]));
    o[i] = static_cast<T>(static_cast<float>(a) - static_cast<float>(b));
    o[i + half] = static_cast<T>(static_cast<float>(e) + static_cast<float>(f));
  }
}

// Rope on each token's q heads (into q) and k heads, then write(slot, h, k, v) for each of its KV
// heads: k after rope in T (as the PyTorch path rotates it), v as projected. The cache writers
// below differ only in what they store.
template <typename T, typename Write>
void rope_tokens(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const int64_t* slots,
                 at::Tensor& q, int64_t hq, int64_t hkv, int64_t d, Write write) {
  const int64_t n = qkv.size(0), half = d / 2, row = qkv.stride(0);
  const T* src = qkv.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  T* qp = q.data_ptr<T>();
  at::parallel_for(0, n, 1, [&](int64_t b, int64_t e) {
    std::vector<T> krot(d);
    for (int64_t t = b; t < e; ++t) {
      const T* x = src + t * row;
      const T* c = cp + t * half;
      const T* s = sp + t * half;
      for (int64_t h = 0; h < hq; ++h) rope_head(x + h * d, c, s, qp + (t * hq + h) * d, half);
      for (int64_t h = 0; h < hkv; ++h) {
        rope_head(x + (hq + h) * d, c, s, krot.data(), half);
        write(slots[t], h, krot.data(), x + (hq + hkv + h) * d);
      }
    }
  });
}

// Into a plain cache (contiguous pools: slot s is row s of [slots, Hkv, D]): k and v as they
// are, or rounded once to the cache's dtype (a bf16 / f16 cache under float32).
template <typename T, typename C>
void rope_and_write(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& kc,
                    at::Tensor& vc, const int64_t* slots, at::Tensor& q, int64_t hq, int64_t hkv) {
  const int64_t d = kc.size(3);
  C* kp = kc.data_ptr<C>();
  C* vp = vc.data_ptr<C>();
  rope_tokens<T>(qkv, cos, sin, slots, q, hq, hkv, d, [&](int64_t slot, int64_t h, const T* k, const T* v) {
    C* kd = kp + (slot * hkv + h) * d;
    C* vd = vp + (slot * hkv + h) * d;
    for (int64_t i = 0; i < d; ++i) {
      kd[i] = static_cast<C>(static_cast<float>(k[i]));
      vd[i] = static_cast<C>(static_cast<float>(v[i]));
    }
  });
}
// One head's row to int8 as kv/quant.py's quantize_int8 does it, bit for bit: scale = amax / 127
// in float32, values x / scale rounded half to even and clamped to +-127 (an all-zero row: scale 0).
template <typename T>
void quantize_row_int8(const T* x, int64_t d, int8_t* q, float* scale) {
  float amax = 0.f;
  for (int64_t i = 0; i < d; ++i) amax = std::max(amax, std::fabs(static_cast<float>(x[i])));
  const float sc = amax / 127.f, den = std::max(sc, std::numeric_limits<float>::min());
  for (int64_t i = 0; i < d; ++i)
    q[i] = static_cast<int8_t>(std::clamp(std::nearbyint(static_cast<float>(x[i]) / den), -127.f, 127.f));
  *scale = sc;
}

// One head's row to f8e4m3 as kv/quant.py's quantize_fp8 does it, bit for bit: x / scale in
// float32, clamped to +-448, rounded to nearest even by c10's conversion (what .to() uses).
template <typename T>
void quantize_row_fp8(const T* x, int64_t d, float scale, uint8_t* q) {
  for (int64_t i = 0; i < d; ++i)
    q[i] = c10::Float8_e4m3fn(std::clamp(static_cast<float>(x[i]) / scale, -448.f, 448.f)).x;
}

// Into an int8 or f8e4m3 cache: k and v quantized per (token, head) as kv/cache.py's
// KVLayer.write does; int8 writes each row's scale beside it, f8e4m3 reads its (layer, head) scales.
template <typename T, bool INT8>
void rope_and_write_scaled(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& kc,
                           at::Tensor& vc, at::Tensor& ks, at::Tensor& vs, const int64_t* slots, at::Tensor& q,
                           int64_t hq, int64_t hkv) {
  const int64_t d = kc.size(3);
  using C = std::conditional_t<INT8, int8_t, uint8_t>;
  C* kp = static_cast<C*>(kc.data_ptr());
  C* vp = static_cast<C*>(vc.data_ptr());
  float* ksp = ks.data_ptr<float>();
  float* vsp = vs.data_ptr<float>();
  rope_tokens<T>(qkv, cos, sin, slots, q, hq, hkv, d, [&](int64_t slot, int64_t h, const T* k, const T* v) {
    C* kd = kp + (slot * hkv + h) * d;
    C* vd = vp + (slot * hkv + h) * d;
    if constexpr (INT8) {
      quantize_row_int8(k, d, kd, ksp + slot * hkv + h);
      quantize_row_int8(v, d, vd, vsp + slot * hkv + h);
    } else {
      quantize_row_fp8(k, d, ksp[h], kd);
      quantize_row_fp8(v, d, vsp[h], vd);
    }
  });
}
}  // namespace

// One decode step of attention from the fused q|k|v projection: rope on q and k, k and v
// written to their cache slots, then paged_decode, in one call instead of a dozen ops.
// An int8 or f8e4m3 cache (k_scale, v_scale given, as paged_decode takes them) gets each new
// row quantized.
// qkv [N, (Hq + 2 Hkv) D]; cos, sin [N, 1, D/2] in the same dtype; slot_mapping [N] int64.
// Returns [N, Hq * D].
at::Tensor paged_decode_qkv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                            at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slot_mapping,
                            const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t hq,
                            int64_t hkv, double scale, int64_t window,
                            const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale) {
  TORCH_CHECK(qkv.device().is_cpu() && qkv.dim() == 2 && qkv.stride(1) == 1, "qkv must be a CPU [N, W] tensor");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.size(2) == hkv,
              "k_cache and v_cache must be contiguous [num_blocks, block_size, Hkv, D]");
  const int64_t ss = scale_stride(k_cache, k_scale, v_scale, "paged_decode_qkv");
  const int64_t n = qkv.size(0), d = k_cache.size(3);
  TORCH_CHECK(qkv.size(1) == (hq + 2 * hkv) * d && d % 2 == 0 && hq % hkv == 0, "qkv width does not match the heads");
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type() &&
                  v_cache.scalar_type() == k_cache.scalar_type() &&
                  (ss >= 0 || cache_dtype_ok(qkv.scalar_type(), k_cache.scalar_type())),
              "qkv, cos and sin must share a dtype, and the cache be in it, bfloat16 / float16 under float32, "
              "or int8 / f8e4m3");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == n * d / 2 && sin.numel() == n * d / 2,
              "cos and sin must be contiguous [N, 1, D/2]");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() && slot_mapping.numel() == n,
              "slot_mapping must be [N] int64");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t n_slots = k_cache.size(0) * k_cache.size(1);
  for (int64_t t = 0; t < n; ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < n_slots, "paged_decode_qkv: slot ", slots[t], " of token ", t,
                " is outside the pool of ", n_slots, " slots");
  auto q = at::empty({n, hq, d}, qkv.options());
  if (ss >= 0) {
    at::Tensor ks = *k_scale, vs = *v_scale;
    auto run = [&](auto int8) {
      constexpr bool I8 = decltype(int8)::value;
      switch (qkv.scalar_type()) {
        case at::kFloat: rope_and_write_scaled<float, I8>(qkv, cos, sin, k_cache, v_cache, ks, vs, slots, q, hq, hkv); break;
        case at::kBFloat16: rope_and_write_scaled<c10::BFloat16, I8>(qkv, cos, sin, k_cache, v_cache, ks, vs, slots, q, hq, hkv); break;
        case at::kHalf: rope_and_write_scaled<c10::Half, I8>(qkv, cos, sin, k_cache, v_cache, ks, vs, slots, q, hq, hkv); break;
        default: TORCH_CHECK(false, "paged_decode_qkv supports float32, bfloat16 and float16");
      }
    };
    if (k_cache.scalar_type() == at::kChar) run(std::true_type{}); else run(std::false_type{});
    return paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale, window, ks, vs).view({n, hq * d});
  }
  switch (qkv.scalar_type()) {
    case at::kFloat:
      if (k_cache.scalar_type() == at::kBFloat16)
        rope_and_write<float, c10::BFloat16>(qkv, cos, sin, k_cache, v_cache, slots, q, hq, hkv);
      else if (k_cache.scalar_type() == at::kHalf)
        rope_and_write<float, c10::Half>(qkv, cos, sin, k_cache, v_cache, slots, q, hq, hkv);
      else
        rope_and_write<float, float>(qkv, cos, sin, k_cache, v_cache, slots, q, hq, hkv);
      break;
    case at::kBFloat16: rope_and_write<c10::BFloat16, c10::BFloat16>(qkv, cos, sin, k_cache, v_cache, slots, q, hq, hkv); break;
    case at::kHalf: rope_and_write<c10::Half, c10::Half>(qkv, cos, sin, k_cache, v_cache, slots, q, hq, hkv); break;
    default: TORCH_CHECK(false, "paged_decode_qkv supports float32, bfloat16 and float16");
  }
  return paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale, window).view({n, hq * d});
}

// y [M, N] = x [M, K] @ w [N, K]^T for one or two rows of x (decode at batch 1 or 2), w in
// bf16. A matrix-vector product is bound by reading w once; oneDNN's bf16 GEMM streams it at
// about half the memory bandwidth when M is this small, so each thread here walks its own
// rows of w once and dots the x rows against each (x stays in L1, in float32). From three
// rows on, the per-row reductions cost more than oneDNN's blocking saves.
template <int MR>
void gemv_bf16_rows(const float* x, const c10::BFloat16* w, float* y, int64_t n0, int64_t n1,
                    int64_t k, int64_t n_total) {
  for (int64_t n = n0; n < n1; ++n) {
    const c10::BFloat16* row = w + n * k;
    for (int m = 0; m < MR; ++m) {  // the row stays in L1 for the second x row
      const float* xm = x + m * k;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t i = 0; i < k; ++i) s += xm[i] * to_float(row[i]);
      y[m * n_total + n] = s;
    }
  }
}

at::Tensor linear_small_m(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "linear_small_m runs on the CPU");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.scalar_type() == at::kBFloat16,
              "w must be a contiguous bfloat16 [N, K] matrix");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == w.size(1) && x.size(0) >= 1 && x.size(0) <= 2,
              "x must be [M, K] with M = 1 or 2 and K matching w");
  const int64_t m = x.size(0), k = w.size(1), n = w.size(0);
  auto xf = x.to(at::kFloat).contiguous();
  auto y = at::empty({m, n}, xf.options());
  const float* xp = xf.data_ptr<float>();
  const c10::BFloat16* wp = w.data_ptr<c10::BFloat16>();
  float* yp = y.data_ptr<float>();
  // Grain from the thread count: every core gets rows, each share a long sequential read.
  const int64_t grain = std::max<int64_t>(16, n / (4 * std::max<int64_t>(1, at::get_num_threads())));
  at::parallel_for(0, n, grain, [&](int64_t b, int64_t e) {
    if (m == 1) gemv_bf16_rows<1>(xp, wp, yp, b, e, k, n);
    else gemv_bf16_rows<2>(xp, wp, yp, b, e, k, n);
  });
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

// Whether paged decode takes the scores of a bf16 query against a bf16 cache by vdpbf16ps on
// this CPU (the KV trace names the path).
bool paged_decode_bf16_scores() {
#ifdef PQ_HAS_VNNI
  return bf16_dots();
#else
  return false;
#endif
}

// Registered as torch ops (torch.ops.pagedllm.*): they show in torch.profiler by name and
// torch.compile sees them as opaque calls.
PAGEDLLM_REGISTER(cpu_kernels) {
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor context_lens, "
        "float scale, int window, Tensor? k_scale=None, Tensor? v_scale=None) -> Tensor", &paged_decode);
  m.def("paged_decode_bf16_scores() -> bool", &paged_decode_bf16_scores);
  m.def("linear_small_m(Tensor x, Tensor w) -> Tensor", &linear_small_m);
  m.def("paged_decode_qkv(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slot_mapping, Tensor block_tables, Tensor context_lens, int hq, int hkv, float scale, "
        "int window, Tensor(c!)? k_scale=None, Tensor(d!)? v_scale=None) -> Tensor", &paged_decode_qkv);
}

}  // namespace PAGEDLLM_ISA
