// Prefill attention for a bfloat16 model on the CPU: one sequence's chunk of n queries over
// its whole context, read in place from the paged cache by block table (no gather copy of a
// cached prefix), FlashAttention's recurrence per query row: scores and weighted values as
// bf16 dot products accumulated in float32 (AVX-512 BF16, 32 multiply-adds an instruction),
// softmax in float32 with a running max and sum. PyTorch's CPU flash attention was slow on
// these shapes (head dim 64-128, a few heads), a large share of a long prefill
// (docs/benchmarks/native-kernels.md).
//
// Work items are (query tile of QT positions, KV head); a tile's G = Hq / Hkv query heads and
// QT positions share every block of KB keys, packed once per block for all of them:
//   keys   as [D/2][KB keys] bf16 pairs: one broadcast query pair advances 16 scores;
//   values as [KB/2 key pairs][D] bf16 pairs: one broadcast probability pair advances 16 dims.
// Against SDPA on the same bf16 inputs (2 threads, AVX-512 BF16): 2.5x at 512 queries x 9 heads
// x 64 dims, 2.8x at 16 heads x 128, 1.6x for 1024 queries over 4096 keys.
// The probabilities are rounded to bf16 for the second product, as PyTorch's bf16 flash
// attention does; everything else accumulates in float32.
#include "isa.h"  // first: the library headers, and the level this object is compiled for
#include "quant_common.h"  // exp8

namespace PAGEDLLM_ISA {

namespace {

#ifdef PA_BF16
constexpr int KB = 64;  // keys per block: four vectors of float32 scores per row
constexpr int NV = KB / 16;
constexpr int QT = 64;  // query positions per work item
constexpr int RB = 4;   // rows whose scores are computed together: RB x NV independent chains

// exp(x), 16 lanes: the quantized kernels' 8-lane Cephes exp on each half.
inline __m512 exp16(__m512 x) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(pq::exp8(_mm512_castps512_ps256(x))),
                            pq::exp8(_mm512_extractf32x8_ps(x, 1)), 1);
}

inline uint32_t u32_at(const c10::BFloat16* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// A quantized cache's row of d values (d a multiple of 16) as bf16, scaled by `s`: int8 values
// times their (token, head) scale; f8e4m3 bytes by their sign, exponent and mantissa fields
// moved into a float32's places (which reads as the value times 2^-120, subnormals included)
// times s * 2^120, an exact power of two. Each value is the float32 product rounded once to
// bf16 (nearest even). (kv/quant.py's int8 read multiplies in bf16 by a bf16-rounded scale, so
// the two may differ by a bf16 unit in the last place.)
inline void scaled_row_bf16(const int8_t* src, float s, uint16_t* dst, int64_t d) {
  const __m512 f = _mm512_set1_ps(s);
  for (int64_t c = 0; c < d; c += 16) {
    const __m512i x = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + c)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + c),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_cvtepi32_ps(x), f)));
  }
}
inline void scaled_row_bf16(const uint8_t* src, float s, uint16_t* dst, int64_t d) {
  const __m512 f = _mm512_set1_ps(s * 0x1p120f);
  const __m512i sign = _mm512_set1_epi32(0x80), rest = _mm512_set1_epi32(0x7F);
  for (int64_t c = 0; c < d; c += 16) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + c)));
    const __m512i u = _mm512_or_si512(_mm512_slli_epi32(_mm512_and_si512(b, sign), 24),
                                      _mm512_slli_epi32(_mm512_and_si512(b, rest), 20));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + c),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_castsi512_ps(u), f)));
  }
}

// C: the cache's element, c10::BFloat16, or int8_t / uint8_t (f8e4m3's bytes) with scales
// ks, vs read at slot * ss + head (ss: Hkv for int8's per-token scales, 0 for f8e4m3's per head).
template <typename C, typename I>
void prefill(const c10::BFloat16* q, int64_t q_sn, int64_t q_sh, const C* kc, const C* vc, const float* ks,
             const float* vs, int64_t ss, int64_t blk_stride, int64_t tok_stride, int64_t block_size, const I* table,
             int64_t n, int64_t ctx, int64_t hq, int64_t hkv, int64_t d, int64_t window, float scale,
             c10::BFloat16* out) {
  constexpr bool plain = std::is_same_v<C, c10::BFloat16>;
  const int64_t g = hq / hkv, p0 = ctx - n, tiles = (n + QT - 1) / QT, rows_max = QT * g;
  // Tiles in the order 0, T-1, 1, T-2, ...: the threads' contiguous shares then hold about
  // the same number of causal keys.
  std::vector<int64_t> order(tiles);
  for (int64_t i = 0, lo = 0, hi = tiles - 1; i < tiles; ++i) order[i] = (i % 2 == 0) ? lo++ : hi--;
  at::parallel_for(0, tiles * hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint32_t> kp(d / 2 * KB), vp(KB / 2 * d), qpair(rows_max * d / 2);
    std::vector<float> acc(rows_max * d), m(rows_max), l(rows_max);
    std::vector<int64_t> pos(rows_max);
    std::vector<uint16_t> krow(plain ? 0 : d), vrow(plain ? 0 : d);  // a quantized row as bf16
    alignas(64) float sc[RB][KB];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t tile = order[item / hkv], h = item % hkv;
      const int64_t i0 = tile * QT, nq = std::min<int64_t>(QT, n - i0), rows = nq * g;
      for (int64_t r = 0; r < rows; ++r) {  // row r: position i0 + r / g, query head h * g + r % g
        pos[r] = p0 + i0 + r / g;
        const c10::BFloat16* src = q + (i0 + r / g) * q_sn + (h * g + r % g) * q_sh;
        for (int64_t j = 0; j < d / 2; ++j) qpair[r * d / 2 + j] = u32_at(src + 2 * j);
      }
      std::fill(acc.begin(), acc.begin() + rows * d, 0.f);
      std::fill(m.begin(), m.begin() + rows, -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.begin() + rows, 0.f);
      const int64_t p_first = p0 + i0, p_last = p0 + i0 + nq - 1;
      const int64_t lo = window > 0 ? std::max<int64_t>(0, p_first - window + 1) : 0, hi = p_last + 1;
      for (int64_t kb = lo / KB * KB; kb < hi; kb += KB) {
        // Pack the block's keys and values (keys at or past hi are zeros: never-written slots
        // may hold NaN, and 0 * NaN would poison the sums).
        for (int64_t t = 0; t < KB; ++t) {
          const int64_t key = kb + t;
          if (key < hi) {
            const int64_t blk = static_cast<int64_t>(table[key / block_size]);
            const int64_t off = blk * blk_stride + (key % block_size) * tok_stride + h * d;
            const c10::BFloat16* kr;
            const c10::BFloat16* vr;
            if constexpr (plain) {
              kr = kc + off;
              vr = vc + off;
            } else {
              const int64_t si = (blk * block_size + key % block_size) * ss + h;
              scaled_row_bf16(kc + off, ks[si], krow.data(), d);
              scaled_row_bf16(vc + off, vs[si], vrow.data(), d);
              kr = reinterpret_cast<const c10::BFloat16*>(krow.data());
              vr = reinterpret_cast<const c10::BFloat16*>(vrow.data());
            }
            for (int64_t j = 0; j < d / 2; ++j) kp[j * KB + t] = u32_at(kr + 2 * j);
            uint16_t* vd = reinterpret_cast<uint16_t*>(vp.data()) + (t / 2) * d * 2 + (t % 2);
            for (int64_t c = 0; c < d; ++c) vd[2 * c] = vr[c].x;
          } else {
            for (int64_t j = 0; j < d / 2; ++j) kp[j * KB + t] = 0;
            uint16_t* vd = reinterpret_cast<uint16_t*>(vp.data()) + (t / 2) * d * 2 + (t % 2);
            for (int64_t c = 0; c < d; ++c) vd[2 * c] = 0;
          }
        }
        for (int64_t r0 = 0; r0 < rows; r0 += RB) {
          const int rb = static_cast<int>(std::min<int64_t>(RB, rows - r0));
          __m512 s[RB][NV];
          for (int r = 0; r < RB; ++r)
            for (int v = 0; v < NV; ++v) s[r][v] = _mm512_setzero_ps();
          for (int64_t j = 0; j < d / 2; ++j) {
            __m512bh kv[NV];
            for (int v = 0; v < NV; ++v) kv[v] = (__m512bh)_mm512_loadu_si512(kp.data() + j * KB + 16 * v);
            for (int r = 0; r < RB; ++r) {  // (rows past the tile's end: stale, unused)
              const __m512bh qb = (__m512bh)_mm512_set1_epi32(static_cast<int>(qpair[(r0 + r) * d / 2 + j]));
              for (int v = 0; v < NV; ++v) s[r][v] = _mm512_dpbf16_ps(s[r][v], qb, kv[v]);
            }
          }
          const __m512 sc_v = _mm512_set1_ps(scale);
          for (int r = 0; r < rb; ++r)
            for (int v = 0; v < NV; ++v) _mm512_store_ps(sc[r] + 16 * v, _mm512_mul_ps(s[r][v], sc_v));
          for (int r = 0; r < rb; ++r) {
            const int64_t row = r0 + r, p = pos[row];
            const int64_t first = window > 0 ? std::max<int64_t>(0, p - window + 1) : 0;
            const int64_t a = std::max(first, kb) - kb, b = std::min(p + 1, kb + KB) - kb;  // valid lanes [a, b)
            if (a >= b) continue;
            const uint64_t valid = (b == 64 ? ~0ull : ((1ull << b) - 1ull)) & ~((1ull << a) - 1ull);
            __m512 sv[NV];
            __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
            for (int v = 0; v < NV; ++v) {
              sv[v] = _mm512_mask_mov_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()),
                                         static_cast<__mmask16>(valid >> (16 * v)), _mm512_load_ps(sc[r] + 16 * v));
              mx = _mm512_max_ps(mx, sv[v]);
            }
            const float m_new = std::max(m[row], _mm512_reduce_max_ps(mx));
            const float corr = m_new == m[row] ? 1.f : std::exp(m[row] - m_new);  // 0 on the first block (m = -inf)
            const __m512 mv = _mm512_set1_ps(m_new);
            __m512 sum = _mm512_setzero_ps();
            alignas(64) uint32_t pp[KB / 2];
            for (int v = 0; v < NV; ++v) {
              const __m512 pr = _mm512_maskz_mov_ps(static_cast<__mmask16>(valid >> (16 * v)),
                                                    exp16(_mm512_sub_ps(sv[v], mv)));
              sum = _mm512_add_ps(sum, pr);
              _mm256_store_si256(reinterpret_cast<__m256i*>(pp + 8 * v), (__m256i)_mm512_cvtneps_pbh(pr));
            }
            l[row] = l[row] * corr + _mm512_reduce_add_ps(sum);
            m[row] = m_new;
            // Key pairs that hold a valid lane: the rest are zero probabilities.
            const int k_lo = static_cast<int>(a / 2), k_hi = static_cast<int>((b + 1) / 2);
            float* ar = acc.data() + row * d;
            const __m512 cv = _mm512_set1_ps(corr);
            for (int64_t c = 0; c < d; c += 16) {
              __m512 a0 = _mm512_mul_ps(_mm512_loadu_ps(ar + c), cv), a1 = _mm512_setzero_ps();
              int k2 = k_lo;
              for (; k2 + 1 < k_hi; k2 += 2) {  // two chains: the adds' latency, not their count, binds
                a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[k2])),
                                      (__m512bh)_mm512_loadu_si512(vp.data() + k2 * d + c));
                a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[k2 + 1])),
                                      (__m512bh)_mm512_loadu_si512(vp.data() + (k2 + 1) * d + c));
              }
              if (k2 < k_hi)
                a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[k2])),
                                      (__m512bh)_mm512_loadu_si512(vp.data() + k2 * d + c));
              _mm512_storeu_ps(ar + c, _mm512_add_ps(a0, a1));
            }
          }
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
        c10::BFloat16* o = out + ((i0 + r / g) * hq + h * g + r % g) * d;
        const float* ar = acc.data() + r * d;
        for (int64_t c = 0; c < d; c += 16)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + c),
                              (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(ar + c), _mm512_set1_ps(inv))));
      }
    }
  });
}
#endif  // PA_BF16

}  // namespace

// Whether paged_prefill runs here: AVX-512 BF16 at this object's level (isa.h) and on this CPU.
bool paged_prefill_available() {
#ifdef PA_BF16
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
  return ok;
#else
  return false;
#endif
}

// q [n, Hq, D] bf16 (last dim contiguous): the chunk's queries, at positions ctx - n .. ctx - 1;
// k_cache, v_cache [num_blocks, block_size, Hkv, D] contiguous, already holding the chunk's
// keys and values: bf16, or int8 / f8e4m3 with k_scale, v_scale (float32: int8's per (token,
// head) [num_blocks, block_size, Hkv], f8e4m3's per head [Hkv]; value = stored * scale);
// block_table [max_blocks] of this sequence (int32 or int64); window <= 0: none.
// Query at position p attends keys j <= p (and j > p - window). Returns [n, Hq, D] bf16.
at::Tensor paged_prefill(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& block_table, int64_t ctx, double scale, int64_t window,
                         const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale) {
  TORCH_CHECK(paged_prefill_available(), "paged_prefill needs AVX-512 BF16, which this CPU or build lacks");
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 3 && q.stride(2) == 1 && q.scalar_type() == at::kBFloat16,
              "q must be a CPU bfloat16 [n, Hq, D] tensor with a contiguous last dim");
  const auto ct = k_cache.scalar_type();
  const bool int8 = ct == at::kChar, fp8 = ct == at::kFloat8_e4m3fn;
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes() && v_cache.scalar_type() == ct &&
                  (ct == at::kBFloat16 || int8 || fp8),
              "k_cache and v_cache must be contiguous [num_blocks, block_size, Hkv, D] bfloat16, int8 or f8e4m3");
  TORCH_CHECK((int8 || fp8) == (k_scale.has_value() && v_scale.has_value()) &&
                  (int8 || fp8 || !(k_scale.has_value() || v_scale.has_value())),
              "paged_prefill: an int8 or f8e4m3 cache needs k_scale and v_scale, and only those caches take them");
  const int64_t n = q.size(0), hq = q.size(1), d = q.size(2), hkv = k_cache.size(2), bs = k_cache.size(1);
  if (int8 || fp8)
    for (const at::Tensor& sc : {*k_scale, *v_scale})
      TORCH_CHECK(sc.scalar_type() == at::kFloat && sc.is_contiguous() &&
                      (int8 ? sc.sizes() == k_cache.sizes().slice(0, 3) : sc.dim() == 1 && sc.size(0) == hkv),
                  "paged_prefill: k_scale and v_scale must be contiguous float32 ",
                  int8 ? "[num_blocks, block_size, Hkv] for an int8 cache" : "[Hkv] for an f8e4m3 cache");
  TORCH_CHECK(k_cache.size(3) == d && d % 32 == 0 && hq % hkv == 0,
              "head dims differ, are not a multiple of 32, or query heads are not a multiple of KV heads");
  TORCH_CHECK(n >= 1 && ctx >= n, "a chunk of ", n, " queries cannot end a context of ", ctx);
  TORCH_CHECK(block_table.dim() == 1 && block_table.is_contiguous() &&
                  (block_table.scalar_type() == at::kLong || block_table.scalar_type() == at::kInt),
              "block_table must be a contiguous int32 or int64 [max_blocks] tensor");
  const int64_t used = (ctx + bs - 1) / bs;
  TORCH_CHECK(used <= block_table.size(0), "a context of ", ctx, " tokens needs ", used, " blocks; the table holds ",
              block_table.size(0));
  auto tab = block_table.to(at::kLong);
  const int64_t* tp = tab.data_ptr<int64_t>();
  for (int64_t i = (window > 0 ? std::max<int64_t>(0, ctx - n - window + 1) / bs : 0); i < used; ++i)
    TORCH_CHECK(tp[i] >= 0 && tp[i] < k_cache.size(0), "paged_prefill: table position ", i, " names block ",
                tp[i], ", outside the pool of ", k_cache.size(0), " blocks");
  auto out = at::empty({n, hq, d}, q.options());
#ifdef PA_BF16
  auto run = [&](auto elem) {
    using C = decltype(elem);
    const float* ks = int8 || fp8 ? k_scale->data_ptr<float>() : nullptr;
    const float* vs = int8 || fp8 ? v_scale->data_ptr<float>() : nullptr;
    prefill<C, int64_t>(q.data_ptr<c10::BFloat16>(), q.stride(0), q.stride(1), static_cast<const C*>(k_cache.data_ptr()),
                        static_cast<const C*>(v_cache.data_ptr()), ks, vs, int8 ? hkv : 0, k_cache.stride(0),
                        k_cache.stride(1), bs, tp, n, ctx, hq, hkv, d, window, static_cast<float>(scale),
                        out.data_ptr<c10::BFloat16>());
  };
  if (int8) run(int8_t{});
  else if (fp8) run(uint8_t{});  // (f8e4m3 read as its bytes)
  else run(c10::BFloat16{});
#endif
  return out;
}

PAGEDLLM_REGISTER(prefill_attention) {
  m.def("paged_prefill_available() -> bool", &paged_prefill_available);
  m.def("paged_prefill(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, int ctx, float scale, "
        "int window=0, Tensor? k_scale=None, Tensor? v_scale=None) -> Tensor", &paged_prefill);
}

}  // namespace PAGEDLLM_ISA
