// See quant_common.h for the formats and the activation quantization.
#include "isa.h"  // first: the library headers, and the level this object is compiled for
#include "quant_common.h"
#include <numeric>  // std::iota (the MoE router's top k)

namespace PAGEDLLM_ISA {

namespace pq {
// The scalar reference: y[r, n] for weight rows n in [n0, n1) and all activation rows r, in plain
// C++ that every machine runs. The SIMD paths must agree with it (tests/test_quant_kernels.py).
template <bool SIGNED>
void gemv_rows(const Fmt& f, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1,
               const QAct& x, float* y, int64_t ldy) {
  const int64_t k = x.k, m = x.m;
  const int64_t nblk = k / f.vals;
  const int nch = f.vals / 32;
  alignas(64) uint8_t q[256];
  float sc[16], mn[16];
  std::vector<float> accs(m);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    std::fill(accs.begin(), accs.end(), 0.f);
    for (int64_t blk = 0; blk < nblk; ++blk) {
      const uint8_t* bp = row + blk * f.bytes;
      block_scales(f.type, bp, sc, mn);
      unpack_ref(f.type, bp, q);
      const int64_t c0 = blk * nch;  // first 32-chunk of this block
      for (int j = 0; j < nch; ++j) {
        for (int64_t r = 0; r < m; ++r) {
          const int64_t c = x.at(r, c0 + j);
          const int8_t* a = x.a.data() + c * 32;
          int32_t s0 = 0, s1 = 0;
          for (int l = 0; l < 16; ++l) {
            const int32_t w0 = SIGNED ? static_cast<int8_t>(q[32 * j + l]) : q[32 * j + l];
            const int32_t w1 = SIGNED ? static_cast<int8_t>(q[32 * j + 16 + l]) : q[32 * j + 16 + l];
            s0 += w0 * a[l];
            s1 += w1 * a[16 + l];
          }
          accs[r] += x.d[c] * (sc[2 * j] * static_cast<float>(s0) + sc[2 * j + 1] * static_cast<float>(s1) +
                               mn[2 * j] * static_cast<float>(x.s16[2 * c]) +
                               mn[2 * j + 1] * static_cast<float>(x.s16[2 * c + 1]));
        }
      }
    }
    for (int64_t r = 0; r < m; ++r) y[r * ldy + n] = accs[r];
  }
}

#ifdef PQ_X86
// The fast path: a weight row is unpacked once into q (values), sv (an 8-float scale vector per
// 32 values: lanes 0-3 the first 16's scale, 4-7 the second's) and mv (offsets per 16); then
// tiles of 2 weight rows x up to 4 activation rows run in registers, so each activation chunk
// loaded serves two weight rows and each unpacked weight chunk serves four activation rows.
template <int64_t TYPE>
inline void unpack_row(const uint8_t* row, int64_t k, uint8_t* q, float* sv, float* mv) {
  constexpr int VALS = (TYPE == Q2_K || TYPE == Q3_K || TYPE == Q4_K || TYPE == Q5_K || TYPE == Q6_K) ? 256 : 32;
  const Fmt f = fmt_of(TYPE);
  float sc[16], mn[16];
  for (int64_t blk = 0; blk < k / VALS; ++blk) {
    const uint8_t* b = row + blk * f.bytes;
    unpack_avx2(TYPE, b, q + blk * VALS);
    block_scales(TYPE, b, sc, mn);
    for (int j = 0; j < VALS / 32; ++j) {
      _mm256_store_ps(sv + (blk * (VALS / 32) + j) * 8,
                      _mm256_set_m128(_mm_set1_ps(sc[2 * j + 1]), _mm_set1_ps(sc[2 * j])));
      _mm256_store_ps(mv + (blk * (VALS / 32) + j) * 8,
                      _mm256_set_m128(_mm_set1_ps(mn[2 * j + 1]), _mm_set1_ps(mn[2 * j])));
    }
  }
}

template <int ISA, bool SIGNED, int NR, int MR>
inline void tile(uint8_t* const* q, float* const* sv, float* const* mv, const QAct& x, int64_t r0,
                 float* y, int64_t ldy, int64_t n) {
  const int64_t kc = x.k / 32;
  __m256 acc[NR][MR], macc[NR][MR];
  for (int i = 0; i < NR; ++i)
    for (int r = 0; r < MR; ++r) acc[i][r] = macc[i][r] = _mm256_setzero_ps();
  for (int64_t c = 0; c < kc; ++c) {
    __m256i w[NR];
    __m256 s[NR], mw[NR];
    for (int i = 0; i < NR; ++i) {
      w[i] = _mm256_load_si256(reinterpret_cast<const __m256i*>(q[i] + 32 * c));
      s[i] = _mm256_load_ps(sv[i] + 8 * c);
      if (!SIGNED) mw[i] = _mm256_load_ps(mv[i] + 8 * c);
    }
    for (int r = 0; r < MR; ++r) {
      const int64_t ci = x.at(r0 + r, c);
      const __m256i av = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.a.data() + ci * 32));
      const __m256 d = _mm256_broadcast_ss(x.d.data() + ci);
      const __m256 ms = SIGNED ? d : _mm256_loadu_ps(x.msv.data() + ci * 8);
      for (int i = 0; i < NR; ++i) {
        const __m256i p = dot_isa<ISA, SIGNED>(w[i], av);
        acc[i][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(s[i], d), acc[i][r]);
        if (!SIGNED) macc[i][r] = _mm256_fmadd_ps(mw[i], ms, macc[i][r]);
      }
    }
  }
  // hsum(dots) + hsum(offsets), the same expression as gemv_direct: a row's result does not
  // depend on how many rows share the call (batch invariance).
  for (int i = 0; i < NR; ++i)
    for (int r = 0; r < MR; ++r) y[(r0 + r) * ldy + n + i] = hsum(acc[i][r]) + hsum(macc[i][r]);
}

template <int ISA, bool SIGNED, int NR>
inline void tiles(uint8_t* const* q, float* const* sv, float* const* mv, const QAct& x, float* y,
                  int64_t ldy, int64_t n) {
  int64_t r0 = 0;
  for (; r0 + 4 <= x.m; r0 += 4) tile<ISA, SIGNED, NR, 4>(q, sv, mv, x, r0, y, ldy, n);
  if (x.m - r0 >= 2) { tile<ISA, SIGNED, NR, 2>(q, sv, mv, x, r0, y, ldy, n); r0 += 2; }
  if (x.m - r0 == 1) tile<ISA, SIGNED, NR, 1>(q, sv, mv, x, r0, y, ldy, n);
}

template <int ISA, int64_t TYPE>
void gemv_fast(const uint8_t* w, int64_t rb, int64_t n0, int64_t n1, const QAct& x, float* y, int64_t ldy) {
  constexpr bool SIGNED = TYPE == Q8_0;
  const int64_t k = x.k;
  thread_local std::vector<uint8_t> qbuf;
  thread_local std::vector<float> sbuf, mbuf;
  const int64_t qa = (k + 63) / 64 * 64, sa = (k / 32 * 8 + 15) / 16 * 16;
  if (static_cast<int64_t>(qbuf.size()) < 2 * qa + 64) qbuf.resize(2 * qa + 64);
  if (static_cast<int64_t>(sbuf.size()) < 2 * sa + 16) sbuf.resize(2 * sa + 16);
  if (static_cast<int64_t>(mbuf.size()) < 2 * sa + 16) mbuf.resize(2 * sa + 16);
  uint8_t* qb = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(qbuf.data()) + 63) & ~uintptr_t{63});
  float* sb = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(sbuf.data()) + 63) & ~uintptr_t{63});
  uint8_t* q[2] = {qb, qb + qa};
  float* sv[2] = {sb, sb + sa};
  float* mb = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(mbuf.data()) + 63) & ~uintptr_t{63});
  float* mv[2] = {mb, mb + sa};
  int64_t n = n0;
  for (; n + 2 <= n1; n += 2) {
    unpack_row<TYPE>(w + n * rb, k, q[0], sv[0], mv[0]);
    unpack_row<TYPE>(w + (n + 1) * rb, k, q[1], sv[1], mv[1]);
    tiles<ISA, SIGNED, 2>(q, sv, mv, x, y, ldy, n);
  }
  if (n < n1) {
    unpack_row<TYPE>(w + n * rb, k, q[0], sv[0], mv[0]);
    tiles<ISA, SIGNED, 1>(q, sv, mv, x, y, ldy, n);
  }
}

// Chunk j (32 values) of a block, straight into a register: the few-rows path needs no buffer.
template <int64_t TYPE>
PQ_AVX2 __m256i unpack_chunk(const uint8_t* b, int j) {
  const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(3);
  if constexpr (TYPE == Q4_0 || TYPE == Q4_1) {
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + (TYPE == Q4_0 ? 2 : 4)));
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(x, 4), x), m4);
  } else if constexpr (TYPE == Q5_0 || TYPE == Q5_1) {
    constexpr int off = TYPE == Q5_0 ? 2 : 4;
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + off + 4));
    const __m256i lo = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(x, 4), x), m4);
    return _mm256_or_si256(lo, bits_to_bytes(u32(b + off), 0x10));
  } else if constexpr (TYPE == Q8_0) {
    return ld(b + 2);
  } else if constexpr (TYPE == Q2_K) {
    const __m256i x = ld(b + 16 + 32 * (j / 4));
    return _mm256_and_si256(_mm256_srli_epi16(x, 2 * (j % 4)), m3);
  } else if constexpr (TYPE == Q3_K) {
    const __m256i x = ld(b + 32 + 32 * (j / 4));
    const __m256i lo = _mm256_and_si256(_mm256_srli_epi16(x, 2 * (j % 4)), m3);
    return _mm256_or_si256(lo, test_bit(ld(b), static_cast<uint8_t>(1u << j), 4));
  } else if constexpr (TYPE == Q4_K) {
    const __m256i x = ld(b + 16 + 32 * (j / 2));
    return j % 2 ? nib_hi(x) : nib_lo(x);
  } else if constexpr (TYPE == Q5_K) {
    const __m256i x = ld(b + 48 + 32 * (j / 2));
    return _mm256_or_si256(j % 2 ? nib_hi(x) : nib_lo(x), test_bit(ld(b + 16), static_cast<uint8_t>(1u << j), 0x10));
  } else {  // Q6_K
    const int n = j / 4, jj = j % 4;
    const __m256i l = ld(b + 64 * n + 32 * (jj % 2));
    const __m256i lo = jj / 2 ? nib_hi(l) : nib_lo(l);
    const __m256i h = _mm256_and_si256(_mm256_srli_epi16(ld(b + 128 + 32 * n), 2 * jj), m3);
    return _mm256_or_si256(lo, _mm256_slli_epi16(h, 4));
  }
}

// Up to 4 activation rows (decode at small batch): every weight chunk is unpacked in a register
// and used at once by each row; scales are read per block.
template <int ISA, int64_t TYPE, int MR>
void gemv_direct(const uint8_t* w, int64_t rb, int64_t n0, int64_t n1, const QAct& x, float* y, int64_t ldy) {
  constexpr bool SIGNED = TYPE == Q8_0;
  constexpr bool K = TYPE == Q2_K || TYPE == Q3_K || TYPE == Q4_K || TYPE == Q5_K || TYPE == Q6_K;
  constexpr int VALS = K ? 256 : 32, NCH = VALS / 32;
  const Fmt f = fmt_of(TYPE);
  const int64_t nblk = x.k / VALS;
  float sc[16], mn[16];
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * rb;
    __m256 acc[MR], macc[MR];
    for (int r = 0; r < MR; ++r) acc[r] = macc[r] = _mm256_setzero_ps();
    for (int64_t blk = 0; blk < nblk; ++blk) {
      const uint8_t* b = row + blk * f.bytes;
      block_scales(TYPE, b, sc, mn);
      for (int j = 0; j < NCH; ++j) {
        const __m256i wv = unpack_chunk<TYPE>(b, j);
        const __m256 sv = K ? _mm256_set_m128(_mm_set1_ps(sc[2 * j + 1]), _mm_set1_ps(sc[2 * j])) : _mm256_set1_ps(sc[0]);
        const __m256 mw = K ? _mm256_set_m128(_mm_set1_ps(mn[2 * j + 1]), _mm_set1_ps(mn[2 * j])) : _mm256_set1_ps(mn[0]);
        const int64_t c0 = blk * NCH + j;
        for (int r = 0; r < MR; ++r) {
          const int64_t c = x.at(r, c0);
          const __m256i av = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.a.data() + c * 32));
          const __m256i p = dot_isa<ISA, SIGNED>(wv, av);
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(sv, _mm256_set1_ps(x.d[c])), acc[r]);
          if (!SIGNED) macc[r] = _mm256_fmadd_ps(mw, _mm256_loadu_ps(x.msv.data() + c * 8), macc[r]);
        }
      }
    }
    for (int r = 0; r < MR; ++r) y[r * ldy + n] = hsum(acc[r]) + hsum(macc[r]);
  }
}

template <int ISA, int64_t TYPE>
void gemv_dispatch(const uint8_t* w, int64_t rb, int64_t n0, int64_t n1, const QAct& x, float* y, int64_t ldy) {
  switch (x.m) {
    case 1: gemv_direct<ISA, TYPE, 1>(w, rb, n0, n1, x, y, ldy); return;
    case 2: gemv_direct<ISA, TYPE, 2>(w, rb, n0, n1, x, y, ldy); return;
    case 3: gemv_direct<ISA, TYPE, 3>(w, rb, n0, n1, x, y, ldy); return;
    case 4: gemv_direct<ISA, TYPE, 4>(w, rb, n0, n1, x, y, ldy); return;
    default: gemv_fast<ISA, TYPE>(w, rb, n0, n1, x, y, ldy);
  }
}

template <int ISA>
void gemv_fast_any(int64_t type, const uint8_t* w, int64_t rb, int64_t n0, int64_t n1, const QAct& x, float* y,
                   int64_t ldy) {
  switch (type) {
    case Q4_0: gemv_dispatch<ISA, Q4_0>(w, rb, n0, n1, x, y, ldy); break;
    case Q4_1: gemv_dispatch<ISA, Q4_1>(w, rb, n0, n1, x, y, ldy); break;
    case Q5_0: gemv_dispatch<ISA, Q5_0>(w, rb, n0, n1, x, y, ldy); break;
    case Q5_1: gemv_dispatch<ISA, Q5_1>(w, rb, n0, n1, x, y, ldy); break;
    case Q8_0: gemv_dispatch<ISA, Q8_0>(w, rb, n0, n1, x, y, ldy); break;
    case Q2_K: gemv_dispatch<ISA, Q2_K>(w, rb, n0, n1, x, y, ldy); break;
    case Q3_K: gemv_dispatch<ISA, Q3_K>(w, rb, n0, n1, x, y, ldy); break;
    case Q4_K: gemv_dispatch<ISA, Q4_K>(w, rb, n0, n1, x, y, ldy); break;
    case Q5_K: gemv_dispatch<ISA, Q5_K>(w, rb, n0, n1, x, y, ldy); break;
    case Q6_K: gemv_dispatch<ISA, Q6_K>(w, rb, n0, n1, x, y, ldy); break;
  }
}
#endif  // PQ_X86

}  // namespace pq

using namespace pq;

namespace {
// Rows [r0, r1) of one weight part against every row of qa, into y's columns [r0, r1) (row i
// of qa at y + i * ldy): the kernel of the part's format, packed or not, at path `isa`.
void part_rows(const Fmt& f, bool packed, const at::Tensor& w, int64_t isa, int64_t r0, int64_t r1,
               const QAct& qa, float* y, int64_t ldy) {
  const uint8_t* wp = w.data_ptr<uint8_t>();
  if (packed) { packed_matmul(f.type, isa, wp, w.size(1), r0 / 16, r1 / 16, qa, y, ldy); return; }
  const int64_t rb = w.stride(0);
#ifdef PQ_X86
#ifdef PQ_HAS_VNNI
  if (isa == AVX512VNNI) { gemv_fast_any<AVX512VNNI>(f.type, wp, rb, r0, r1, qa, y, ldy); return; }
#endif
#ifdef PQ_AVXVNNI
  if (isa == AVXVNNI) { gemv_fast_any<AVXVNNI>(f.type, wp, rb, r0, r1, qa, y, ldy); return; }
#endif
  if (isa == AVX2) { gemv_fast_any<AVX2>(f.type, wp, rb, r0, r1, qa, y, ldy); return; }
#endif
  f.is_signed ? gemv_rows<true>(f, wp, rb, r0, r1, qa, y, ldy) : gemv_rows<false>(f, wp, rb, r0, r1, qa, y, ldy);
}
}  // namespace

// y [M, N] float32 = x [M, K] @ dequant(w)^T, where w is the row-wise concatenation of the
// parts ws (each in its own format, e.g. q/k in Q4_K and v in Q6_K): one call per fused
// projection, the activation quantized once, the threads spread over all parts' rows.
namespace {
// quant_matmul; `hook` (if any) has its `lead` run by each thread of the product's region first
// and its `columns` on each thread's output columns once they are done.
at::Tensor matmul_tailed(const at::Tensor& x, at::TensorList ws, at::IntArrayRef types, int64_t k, int64_t isa,
                         const LinearHook* hook, at::ScalarType model_dtype) {
  TORCH_CHECK(!ws.empty() && ws.size() == types.size(), "quant_matmul: one format per weight part");
  std::vector<Fmt> fmts;
  std::vector<bool> packed;
  std::vector<int64_t> row0{0};
  for (size_t p = 0; p < ws.size(); ++p) {
    packed.push_back(types[p] >= PACKED);
    fmts.push_back(fmt_of(packed.back() ? types[p] - PACKED : types[p]));
    if (packed.back()) check_packed(ws[p], fmts.back().type, k); else check_weight(ws[p], fmts.back(), k);
    row0.push_back(row0.back() + ws[p].size(0) * (packed.back() ? 16 : 1));
  }
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.size(1) == k, "x must be a CPU [M, ", k, "] tensor");
  const int levels = (isa & ACT_X2) ? 2 : 1;
  isa &= ~ACT_X2;
  if (isa == AUTO) isa = best_isa();
  TORCH_CHECK(isa_supported(isa), "instruction set path ", isa, " is not available on this CPU");
  const auto xc = x.contiguous();
  const int64_t m = x.size(0), n = row0.back();
  // A bfloat16 model's step of many rows over packed weights, on a CPU with AMX: the tile
  // product of bfloat16 weights and activations (quant_packed.cpp), not int8 activations.
  const bool all_packed = std::all_of(packed.begin(), packed.end(), [](bool p) { return p; });
  const int64_t amx_min = isa == AVX512VNNI && hook == nullptr && all_packed && model_dtype == at::kBFloat16 ? amx_rows() : 0;
  if (amx_min > 0 && m >= amx_min) {
    const int64_t mp = (m + 15) / 16 * 16;  // tiles of 16 rows: the last one padded with zeros
    at::Tensor xb = xc;
    if (xc.scalar_type() != at::kBFloat16 || mp != m) {
      xb = at::zeros({mp, k}, xc.options().dtype(at::kBFloat16));
      xb.narrow(0, 0, m).copy_(xc);
    }
    auto y = at::empty({m, n}, x.options().dtype(at::kFloat));
    float* yp = y.data_ptr<float>();
    const c10::BFloat16* xp = xb.data_ptr<c10::BFloat16>();
    at::parallel_for(0, n / 16, std::max<int64_t>(1, grain_for(n) / 16), [&](int64_t b, int64_t e) {
      for (size_t p = 0; p < fmts.size(); ++p) {
        const int64_t lo = std::max(b * 16, row0[p]), hi = std::min(e * 16, row0[p + 1]);
        if (lo < hi)
          amx_packed_matmul(fmts[p].type, ws[p].data_ptr<uint8_t>(), ws[p].size(1), (lo - row0[p]) / 16,
                            (hi - row0[p]) / 16, xp, m, k, yp + row0[p], n);
      }
    });
    return y;
  }
  QAct qa;
  const bool off6 = needs_off6(isa, types);
  switch (xc.scalar_type()) {
    case at::kFloat: quantize_rows(xc.data_ptr<float>(), m, k, qa, levels, off6, !all_packed); break;
    case at::kBFloat16: quantize_rows(xc.data_ptr<c10::BFloat16>(), m, k, qa, levels, off6, !all_packed); break;
    case at::kHalf: quantize_rows(xc.data_ptr<c10::Half>(), m, k, qa, levels, off6, !all_packed); break;
    default: TORCH_CHECK(false, "quant_matmul: x must be float32, bfloat16 or float16");
  }
  // Threads split the output in units of 16 rows (a packed group) where every part allows it.
  bool whole = true;
  for (size_t p = 0; p < ws.size(); ++p) whole = whole && (row0[p + 1] - row0[p]) % 16 == 0;
  const bool any_packed = std::find(packed.begin(), packed.end(), true) != packed.end();
  TORCH_CHECK(whole || !any_packed, "quant_matmul: packed parts need every part's rows in groups of 16");
  const int64_t unit = whole ? 16 : 1;
  auto y = at::empty({m * levels, n}, x.options().dtype(at::kFloat));
  float* yp = y.data_ptr<float>();
  // Two levels: rows 2i and 2i + 1 of y are the halves of output row i, summed into `out` by
  // each thread on its own columns.
  auto out = levels == 1 ? y : at::empty({m, n}, y.options());
  float* op = out.data_ptr<float>();
  // Bytes read per unit of each part: the threads' shares are cut where those are even.
  std::vector<int64_t> ends;
  std::vector<double> unit_bytes;
  for (size_t p = 0; p < ws.size(); ++p) {
    ends.push_back(row0[p + 1] / unit);
    unit_bytes.push_back(static_cast<double>(packed[p] ? ws[p].size(1) : ws[p].stride(0) * unit));
  }
  parallel_by_cost(ends, unit_bytes, std::max<int64_t>(1, grain_for(n) / unit), [&](int64_t b, int64_t e) {
    b *= unit;
    e *= unit;
    if (hook != nullptr) hook->lead(b, e);
    for (size_t p = 0; p < fmts.size(); ++p) {
      const int64_t lo = std::max(b, row0[p]), hi = std::min(e, row0[p + 1]);
      if (lo >= hi) continue;
      // The part's rows [lo, hi) land in y's columns [lo, hi).
      part_rows(fmts[p], packed[p], ws[p], isa, lo - row0[p], hi - row0[p], qa, yp + row0[p], n);
    }
    if (levels == 2)
      for (int64_t i = 0; i < m; ++i) {
        const float* l0 = yp + 2 * i * n;
        const float* l1 = l0 + n;
        float* o = op + i * n;
        for (int64_t j = b; j < e; ++j) o[j] = l0[j] + l1[j];
      }
    if (hook != nullptr) hook->columns(op, n, b, e);
  });
  return out;
}
}  // namespace

at::Tensor quant_matmul(const at::Tensor& x, at::TensorList ws, at::IntArrayRef types, int64_t k, int64_t isa) {
  return matmul_tailed(x, ws, types, k, isa, nullptr, x.scalar_type());
}

namespace {
// The (weight, row) units of several products, flattened so the threads split all of them at
// once: product i has units [first[i], first[i + 1]).
struct Units {
  std::vector<int64_t> first{0};
  void add(int64_t n) { first.push_back(first.back() + n); }
  int64_t total() const { return first.back(); }
  // Calls f(i, u0, u1) for each product i overlapping [b, e), with its own unit range.
  template <typename F>
  void each(int64_t b, int64_t e, F&& f) const {
    const int64_t np = static_cast<int64_t>(first.size()) - 1;
    int64_t i = std::upper_bound(first.begin(), first.end(), b) - first.begin() - 1;
    for (; i < np && first[i] < e; ++i) {
      const int64_t u0 = std::max(b, first[i]) - first[i], u1 = std::min(e, first[i + 1]) - first[i];
      if (u0 < u1) f(i, u0, u1);
    }
  }
};

// One MoE layer's routed experts for a step's few rows (T <= INT_ROWS), in one call. The
// (row, slot) pairs are grouped by expert id; each active expert's rows run its gate|up (one
// or more parts), silu(gate) * up rounded to x's dtype, and its down projection, on the
// integer kernels, its inputs rounded in two levels where x2 says (bit 0: gate|up's, bit 1:
// down's; the step's width decides, as for a dense layer's projections); the threads split
// each phase over all active experts' output rows at once. out[t] (float32) = sum over t's slots, experts in ascending order, of
// weight * expert(x[t]): the Python grouped path's loop over active experts, without it.
// x: the rows as float values (each representable in T: the Python path's activations), ids
// and weights [n_tok, topk].
template <typename T>
at::Tensor moe_experts(const float* xp, int64_t n_tok, int64_t hidden, const int64_t* idp, const float* wp,
                       int64_t topk, at::TensorList gate_up, at::IntArrayRef gu_types, at::IntArrayRef gu_parts,
                       at::TensorList down, at::IntArrayRef down_types, int64_t isa, int64_t x2) {
  const int64_t n_exp = static_cast<int64_t>(down.size());
  TORCH_CHECK(static_cast<int64_t>(gu_parts.size()) == n_exp && down_types.size() == down.size() &&
              gu_types.size() == gate_up.size(), "quant_moe_experts: one gate|up part count and one down per expert");
  // Each expert's parts and their formats; every expert the same widths.
  std::vector<int64_t> part0{0};
  for (int64_t e = 0; e < n_exp; ++e) part0.push_back(part0.back() + gu_parts[e]);
  TORCH_CHECK(part0.back() == static_cast<int64_t>(gate_up.size()), "quant_moe_experts: gate|up part counts do not add up");
  auto fmt_packed = [](int64_t type) { return std::make_pair(fmt_of(type >= PACKED ? type - PACKED : type), type >= PACKED); };
  auto rows_of = [](const at::Tensor& w, bool packed) { return w.size(0) * (packed ? 16 : 1); };
  // Group the (row, slot) pairs by expert, rows in order.
  std::vector<std::vector<std::pair<int64_t, float>>> rows(n_exp);
  for (int64_t t = 0; t < n_tok; ++t)
    for (int64_t s = 0; s < topk; ++s) {
      const int64_t e = idp[t * topk + s];
      TORCH_CHECK(e >= 0 && e < n_exp, "quant_moe_experts: expert id ", e, " out of range [0, ", n_exp, ")");
      rows[e].emplace_back(t, wp[t * topk + s]);
    }
  std::vector<int64_t> active;
  for (int64_t e = 0; e < n_exp; ++e)
    if (!rows[e].empty()) active.push_back(e);
  if (active.empty()) return at::zeros({n_tok, hidden}, at::TensorOptions().dtype(at::kFloat));  // (no rows)
  // Only the active experts' weights are checked: a step reads only those (at batch 1, a few of
  // OLMoE's 64), and checking all of them every layer cost a visible share of the block.
  int64_t inter2 = -1;
  std::vector<std::vector<int64_t>> gu_row0(n_exp);
  for (int64_t e : active) {
    gu_row0[e].push_back(0);
    for (int64_t p = part0[e]; p < part0[e + 1]; ++p) {
      const auto [f, packed] = fmt_packed(gu_types[p]);
      if (packed) check_packed(gate_up[p], f.type, hidden); else check_weight(gate_up[p], f, hidden);
      gu_row0[e].push_back(gu_row0[e].back() + rows_of(gate_up[p], packed));
    }
    TORCH_CHECK(inter2 < 0 || gu_row0[e].back() == inter2, "quant_moe_experts: expert ", e, " has ",
                gu_row0[e].back(), " gate|up rows, expert ", active[0], " ", inter2);
    inter2 = gu_row0[e].back();
  }
  const int64_t inter = inter2 / 2;
  TORCH_CHECK(inter2 % 2 == 0 && inter % 32 == 0, "quant_moe_experts: gate|up rows must be 2 x a multiple of 32");
  for (int64_t e : active) {
    const auto [f, packed] = fmt_packed(down_types[e]);
    if (packed) check_packed(down[e], f.type, inter); else check_weight(down[e], f, inter);
    TORCH_CHECK(rows_of(down[e], packed) == hidden, "quant_moe_experts: expert ", e, "'s down projection has ",
                rows_of(down[e], packed), " rows, not ", hidden);
  }
  isa &= ~ACT_X2;
  if (isa == AUTO) isa = best_isa();
  TORCH_CHECK(isa_supported(isa), "instruction set path ", isa, " is not available on this CPU");
  const int64_t na = static_cast<int64_t>(active.size());
  const int lg = (x2 & 1) ? 2 : 1, ld = (x2 & 2) ? 2 : 1;  // levels of the gate|up and down inputs
  const bool off6 = needs_off6(isa, gu_types) || needs_off6(isa, down_types);
  // Each active expert's rows of x, quantized.
  std::vector<QAct> qx(na), qh(na);
  at::parallel_for(0, na, 1, [&](int64_t b, int64_t e) {
    std::vector<float> gathered;
    for (int64_t a = b; a < e; ++a) {
      const auto& r = rows[active[a]];
      gathered.resize(r.size() * hidden);
      for (size_t i = 0; i < r.size(); ++i) std::copy_n(xp + r[i].first * hidden, hidden, gathered.data() + i * hidden);
      quantize_rows(gathered.data(), static_cast<int64_t>(r.size()), hidden, qx[a], lg, off6);
    }
  });
  // gate|up of every active expert: [rows x levels, 2I] each.
  auto unit_of = [](int64_t n, const std::vector<int64_t>& row0) {
    for (size_t p = 0; p + 1 < row0.size(); ++p)
      if ((row0[p + 1] - row0[p]) % 16 != 0) return int64_t{1};
    return n % 16 == 0 ? int64_t{16} : int64_t{1};
  };
  std::vector<std::vector<float>> g(na), d(na);
  std::vector<int64_t> gu_unit(na);
  Units ua, ud;
  for (int64_t a = 0; a < na; ++a) {
    const int64_t e = active[a];
    g[a].resize(rows[e].size() * lg * inter2);
    gu_unit[a] = unit_of(inter2, gu_row0[e]);
    for (int64_t p = part0[e]; p < part0[e + 1]; ++p)
      TORCH_CHECK(gu_unit[a] == 16 || gu_types[p] < PACKED, "quant_moe_experts: packed parts need rows in groups of 16");
    ua.add(inter2 / gu_unit[a]);
  }
  at::parallel_for(0, ua.total(), std::max<int64_t>(1, grain_for(inter2) / 16), [&](int64_t b, int64_t e) {
    ua.each(b, e, [&](int64_t a, int64_t u0, int64_t u1) {
      const int64_t ex = active[a], lo = u0 * gu_unit[a], hi = u1 * gu_unit[a];
      const auto& row0 = gu_row0[ex];
      for (int64_t p = part0[ex]; p < part0[ex + 1]; ++p) {
        const int64_t j = p - part0[ex], plo = std::max(lo, row0[j]), phi = std::min(hi, row0[j + 1]);
        if (plo >= phi) continue;
        const auto [f, packed] = fmt_packed(gu_types[p]);
        part_rows(f, packed, gate_up[p], isa, plo - row0[j], phi - row0[j], qx[a], g[a].data() + row0[j], inter2);
      }
    });
  });
  // silu(gate) * up, rounded to T as the Python path's `.to(dtype)`, quantized for the downs.
  at::parallel_for(0, na, 1, [&](int64_t b, int64_t e) {
    std::vector<T> act;
    for (int64_t a = b; a < e; ++a) {
      const int64_t n = static_cast<int64_t>(rows[active[a]].size());
      act.resize(n * inter);
      for (int64_t i = 0; i < n; ++i) {
        const float* g0 = g[a].data() + i * lg * inter2;
        const float* g1 = lg == 2 ? g0 + inter2 : nullptr;
        for (int64_t j = 0; j < inter; ++j) {
          const float gate = g1 ? g0[j] + g1[j] : g0[j], up = g1 ? g0[inter + j] + g1[inter + j] : g0[inter + j];
          act[i * inter + j] = static_cast<T>(gate / (1.f + std::exp(-gate)) * up);
        }
      }
      quantize_rows(act.data(), n, inter, qh[a], ld, off6);
    }
  });
  for (int64_t a = 0; a < na; ++a) {
    d[a].resize(rows[active[a]].size() * ld * hidden);
    ud.add(hidden % 16 == 0 ? hidden / 16 : hidden);
  }
  const int64_t d_unit = hidden % 16 == 0 ? 16 : 1;
  at::parallel_for(0, ud.total(), std::max<int64_t>(1, grain_for(hidden) / d_unit), [&](int64_t b, int64_t e) {
    ud.each(b, e, [&](int64_t a, int64_t u0, int64_t u1) {
      const int64_t ex = active[a];
      const auto [f, packed] = fmt_packed(down_types[ex]);
      part_rows(f, packed, down[ex], isa, u0 * d_unit, u1 * d_unit, qh[a], d[a].data(), hidden);
    });
  });
  // The weighted sum, experts in ascending order; threads split the columns.
  auto out = at::zeros({n_tok, hidden}, at::TensorOptions().dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  at::parallel_for(0, hidden, 256, [&](int64_t c0, int64_t c1) {
    for (int64_t a = 0; a < na; ++a) {
      const auto& r = rows[active[a]];
      for (size_t i = 0; i < r.size(); ++i) {
        const float* d0 = d[a].data() + i * ld * hidden;
        const float* d1 = ld == 2 ? d0 + hidden : nullptr;
        float* o = op + r[i].first * hidden;
        const float w = r[i].second;
        for (int64_t c = c0; c < c1; ++c) o[c] += w * (d1 ? d0[c] + d1[c] : d0[c]);
      }
    }
  });
  return out;
}
}  // namespace

at::Tensor quant_moe_experts(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights,
                             at::TensorList gate_up, at::IntArrayRef gu_types, at::IntArrayRef gu_parts,
                             at::TensorList down, at::IntArrayRef down_types, int64_t isa, int64_t x2) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.size(1) % 32 == 0,
              "quant_moe_experts: x must be a CPU [T, H] tensor, H a multiple of 32");
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == x.size(0) && weights.sizes() == ids.sizes(),
              "quant_moe_experts: ids and weights must be [", x.size(0), ", k]");
  const auto xf = x.to(at::kFloat).contiguous();
  const auto idc = ids.to(at::kLong).contiguous();
  const auto wc = weights.to(at::kFloat).contiguous();
  auto run = [&](auto tag) {
    using T = decltype(tag);
    return moe_experts<T>(xf.data_ptr<float>(), x.size(0), x.size(1), idc.data_ptr<int64_t>(), wc.data_ptr<float>(),
                          ids.size(1), gate_up, gu_types, gu_parts, down, down_types, isa, x2);
  };
  switch (x.scalar_type()) {
    case at::kFloat: return run(float{});
    case at::kBFloat16: return run(c10::BFloat16{});
    case at::kHalf: return run(c10::Half{});
    default: TORCH_CHECK(false, "quant_moe_experts: x must be float32, bfloat16 or float16");
  }
}

namespace pq {
// RMSNorm of each row into a float buffer, each value rounded through T as F.rms_norm's output
// in T would be, so the fused path quantizes the same activations as the unfused one.
template <typename T>
void rms_norm_row(const T* xr, const T* w, int64_t k, double eps, float* out) {
  int64_t i = 0;
  float ss = 0.f;
#ifdef PQ_X86
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= k; i += 8) {
    const __m256 v = load8(xr + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  ss = hsum(acc);
#endif
  for (; i < k; ++i) {
    const float v = static_cast<float>(xr[i]);
    ss += v * v;
  }
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(k) + static_cast<float>(eps));
  i = 0;
#ifdef PQ_X86
  for (; i + 8 <= k; i += 8)
    _mm256_storeu_ps(out + i, round8<T>(_mm256_mul_ps(_mm256_mul_ps(load8(xr + i), _mm256_set1_ps(inv)), load8(w + i))));
#endif
  for (; i < k; ++i)
    out[i] = static_cast<float>(static_cast<T>(static_cast<float>(xr[i]) * inv * static_cast<float>(w[i])));
}

template <typename T>
void rms_norm_rows(const T* x, const T* w, int64_t m, int64_t k, double eps, float* out) {
  at::parallel_for(0, m, 16, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) rms_norm_row(x + r * k, w, k, eps, out + r * k);
  });
}

// The q and k RMSNorms of q|k|v projection rows [M, (hq + 2 hkv) d], in place: over each head
// where the weights are d long (Qwen3, Gemma 3), over the whole q and k parts where they are
// hq d and hkv d long (OLMoE); each value rounded through T as rms_norm_rows rounds it.
template <typename T>
void qk_norm_rows(T* x, const T* wq, const T* wk, int64_t m, int64_t hq, int64_t hkv, int64_t d, bool per_head,
                  double eps) {
  const int64_t width = (hq + 2 * hkv) * d, nq = per_head ? hq : 1, nk = per_head ? hkv : 1;
  const int64_t lq = per_head ? d : hq * d, lk = per_head ? d : hkv * d, per_row = nq + nk;
  at::parallel_for(0, m * per_row, 4, [&](int64_t b, int64_t e) {
    std::vector<float> buf(std::max(lq, lk));
    for (int64_t u = b; u < e; ++u) {
      const int64_t r = u / per_row, j = u % per_row;
      const bool is_q = j < nq;
      const int64_t len = is_q ? lq : lk;
      T* xr = x + r * width + (is_q ? j * lq : hq * d + (j - nq) * lk);
      rms_norm_row(xr, is_q ? wq : wk, len, eps, buf.data());
      for (int64_t i = 0; i < len; ++i) xr[i] = static_cast<T>(buf[i]);
    }
  });
}

template <typename T>
at::Tensor epilogue(const at::Tensor& y, const c10::optional<at::Tensor>& bias,
                    const c10::optional<at::Tensor>& residual, int64_t act, const at::TensorOptions& opts) {
  const int64_t m = y.size(0), n = y.size(1), no = act == 1 ? n / 2 : n;
  auto out = at::empty({m, no}, opts);
  const float* yp = y.data_ptr<float>();
  at::Tensor bc, rc;
  const T* bp = nullptr;
  const T* rp = nullptr;
  if (bias.has_value()) { bc = bias->contiguous(); bp = bc.data_ptr<T>(); }
  if (residual.has_value()) { rc = residual->contiguous(); rp = rc.data_ptr<T>(); }
  T* op = out.data_ptr<T>();
  at::parallel_for(0, m, 8, [&](int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    int64_t j = 0;
#ifdef PQ_X86
    // The same steps 8 lanes at a time (exp by polynomial, within an ulp or so of std::exp).
    auto val8 = [&](int64_t c) {
      __m256 v = round8<T>(_mm256_loadu_ps(yp + r * n + c));
      if (bp) v = round8<T>(_mm256_add_ps(v, load8(bp + c)));
      return v;
    };
    for (; j + 8 <= no; j += 8) {
      __m256 v;
      if (act == 1) {
        const __m256 g = val8(j), u = val8(j + no);
        const __m256 sg = round8<T>(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), g)))));
        v = round8<T>(_mm256_mul_ps(sg, u));
      } else {
        v = val8(j);
      }
      if (rp) v = _mm256_add_ps(load8(rp + r * no + j), v);
      store8(op + r * no + j, v);
    }
#endif
    for (; j < no; ++j) {
      // Each step rounds to T where the unfused ops would: the projection's output, + bias,
      // silu(gate) * up, + residual.
      auto val = [&](int64_t c) {
        T v = static_cast<T>(yp[r * n + c]);
        if (bp) v = static_cast<T>(static_cast<float>(v) + static_cast<float>(bp[c]));
        return static_cast<float>(v);
      };
      float v;
      if (act == 1) {
        const float g = val(j), u = val(j + no);
        const T sg = static_cast<T>(g / (1.f + std::exp(-g)));
        v = static_cast<float>(static_cast<T>(static_cast<float>(sg) * u));
      } else {
        v = val(j);
      }
      if (rp) v = static_cast<float>(rp[r * no + j]) + v;
      op[r * no + j] = static_cast<T>(v);
    }
  }
  });
  return out;
}
}  // namespace pq

// quant_matmul with what surrounds a projection in a decoder layer folded in: an RMSNorm of x
// before it, a bias, silu(gate) * up over the two halves (act = 1), and a residual added after.
// Output in x's dtype: [M, N], or [M, N / 2] with act = 1.
// `hook` (decode_stack.cpp's LoRA deltas) sees the normed input as float32 and adds to the
// float32 product before the epilogue, where the Python path adds a layer's deltas.
// A whole MoE block for a step of few rows, from the layer's residual stream: x + the routed
// experts of RMSNorm(x), in x's dtype, and the expert ids [T, k]. As the Python block does it:
// the norm's output rounded to T, float32 router logits, a softmax, the top k (largest first,
// the lower id first on a tie), renormalized to sum to one where asked, rounded to T where
// asked (Qwen, OLMoE: round_weights; Mixtral scales in float32), then quant_moe_experts, its
// float32 sum rounded to T and added to x. The router's product is a float32 dot per (row,
// expert), not BLAS's order: a near-tie between two experts may go the other way.
namespace {
template <typename T>
std::tuple<at::Tensor, at::Tensor> moe_block(const at::Tensor& x, const at::Tensor& norm_weight, double eps,
                                             const at::Tensor& router, int64_t top_k, bool renormalize,
                                             bool round_weights, at::TensorList gate_up, at::IntArrayRef gu_types,
                                             at::IntArrayRef gu_parts, at::TensorList down,
                                             at::IntArrayRef down_types, int64_t isa, int64_t x2) {
  const int64_t n_tok = x.size(0), hidden = x.size(1), n_exp = router.size(0);
  const auto xc = x.contiguous();
  const auto wn = norm_weight.contiguous();
  std::vector<float> h(n_tok * hidden);
  rms_norm_rows(xc.data_ptr<T>(), wn.data_ptr<T>(), n_tok, hidden, eps, h.data());
  // Router logits, softmax, top k, per row.
  const float* rp = router.data_ptr<float>();
  std::vector<float> logits(n_tok * n_exp);
  at::parallel_for(0, n_tok * n_exp, 16, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const float* hr = h.data() + (i / n_exp) * hidden;
      const float* wr = rp + (i % n_exp) * hidden;
      float acc = 0.f;
#pragma omp simd reduction(+ : acc)
      for (int64_t j = 0; j < hidden; ++j) acc += hr[j] * wr[j];
      logits[i] = acc;
    }
  });
  auto ids = at::empty({n_tok, top_k}, at::TensorOptions().dtype(at::kLong));
  int64_t* idp = ids.data_ptr<int64_t>();
  std::vector<float> weights(n_tok * top_k);
  std::vector<int64_t> order(n_exp);
  std::vector<float> p(n_exp);
  for (int64_t t = 0; t < n_tok; ++t) {
    const float* l = logits.data() + t * n_exp;
    const float mx = *std::max_element(l, l + n_exp);
    float sum = 0.f;
    for (int64_t e = 0; e < n_exp; ++e) sum += (p[e] = std::exp(l[e] - mx));
    for (int64_t e = 0; e < n_exp; ++e) p[e] /= sum;
    std::iota(order.begin(), order.end(), int64_t{0});
    std::partial_sort(order.begin(), order.begin() + top_k, order.end(),
                      [&](int64_t a, int64_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
    float kept = 0.f;
    for (int64_t s = 0; s < top_k; ++s) kept += p[order[s]];
    for (int64_t s = 0; s < top_k; ++s) {
      float w = p[order[s]];
      if (renormalize) w /= kept;
      if (round_weights) w = static_cast<float>(static_cast<T>(w));
      idp[t * top_k + s] = order[s];
      weights[t * top_k + s] = w;
    }
  }
  const at::Tensor sum = moe_experts<T>(h.data(), n_tok, hidden, idp, weights.data(), top_k, gate_up, gu_types, gu_parts,
                                  down, down_types, isa, x2);
  auto out = at::empty_like(xc);
  const float* sp = sum.data_ptr<float>();
  const T* xp = xc.data_ptr<T>();
  T* op = out.data_ptr<T>();
  for (int64_t i = 0; i < n_tok * hidden; ++i)
    op[i] = static_cast<T>(static_cast<float>(xp[i]) + static_cast<float>(static_cast<T>(sp[i])));
  return {out, ids};
}
}  // namespace

std::tuple<at::Tensor, at::Tensor> quant_moe_block(const at::Tensor& x, const at::Tensor& norm_weight, double eps,
                                                   const at::Tensor& router, int64_t top_k, bool renormalize,
                                                   bool round_weights, at::TensorList gate_up,
                                                   at::IntArrayRef gu_types, at::IntArrayRef gu_parts,
                                                   at::TensorList down, at::IntArrayRef down_types, int64_t isa,
                                                   int64_t x2) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.size(1) % 32 == 0,
              "quant_moe_block: x must be a CPU [T, H] tensor, H a multiple of 32");
  TORCH_CHECK(norm_weight.scalar_type() == x.scalar_type() && norm_weight.numel() == x.size(1),
              "quant_moe_block: the norm's weight must be [H] in x's dtype");
  TORCH_CHECK(router.scalar_type() == at::kFloat && router.is_contiguous() && router.dim() == 2 &&
              router.size(1) == x.size(1) && router.size(0) == static_cast<int64_t>(down.size()),
              "quant_moe_block: the router must be a contiguous float32 [experts, H]");
  TORCH_CHECK(top_k >= 1 && top_k <= router.size(0), "quant_moe_block: top_k ", top_k, " of ", router.size(0),
              " experts");
  switch (x.scalar_type()) {
    case at::kFloat:
      return moe_block<float>(x, norm_weight, eps, router, top_k, renormalize, round_weights, gate_up, gu_types,
                              gu_parts, down, down_types, isa, x2);
    case at::kBFloat16:
      return moe_block<c10::BFloat16>(x, norm_weight, eps, router, top_k, renormalize, round_weights, gate_up,
                                      gu_types, gu_parts, down, down_types, isa, x2);
    case at::kHalf:
      return moe_block<c10::Half>(x, norm_weight, eps, router, top_k, renormalize, round_weights, gate_up, gu_types,
                                  gu_parts, down, down_types, isa, x2);
    default: TORCH_CHECK(false, "quant_moe_block: x must be float32, bfloat16 or float16");
  }
}

// q|k|v rows [M, (hq + 2 hkv) d] with their q and k RMSNorms applied in place (qk_norm_rows),
// then every value clamped to +-clip where clip > 0 (OLMoE's clip_qkv). The quantized decode
// path's q/k norms, per layer (models/llama.py) and in the all-layer decode alike: ATen's
// rms_norm on CPU is a chain of small ops, a fixed cost per layer that dominates at batch 1.
void qk_norm(at::Tensor qkv, const at::Tensor& wq, const at::Tensor& wk, int64_t hq, int64_t hkv, double eps,
             double clip) {
  TORCH_CHECK(qkv.device().is_cpu() && qkv.dim() == 2 && qkv.is_contiguous() && hq > 0 && hkv > 0 &&
                  qkv.size(1) % (hq + 2 * hkv) == 0,
              "qk_norm: qkv must be a contiguous CPU [M, (hq + 2 hkv) * head_dim] tensor");
  const int64_t d = qkv.size(1) / (hq + 2 * hkv);
  const bool per_head = wq.numel() == d && wk.numel() == d;
  TORCH_CHECK(per_head || (wq.numel() == hq * d && wk.numel() == hkv * d),
              "qk_norm: the q/k norm weights are neither of the head dim ", d, " nor of the q and k widths");
  TORCH_CHECK(wq.scalar_type() == qkv.scalar_type() && wk.scalar_type() == qkv.scalar_type() && wq.is_contiguous() &&
                  wk.is_contiguous(), "qk_norm: the norm weights must be contiguous, in qkv's dtype");
  switch (qkv.scalar_type()) {
    case at::kFloat: qk_norm_rows(qkv.data_ptr<float>(), wq.data_ptr<float>(), wk.data_ptr<float>(), qkv.size(0), hq, hkv, d, per_head, eps); break;
    case at::kBFloat16: qk_norm_rows(qkv.data_ptr<c10::BFloat16>(), wq.data_ptr<c10::BFloat16>(), wk.data_ptr<c10::BFloat16>(), qkv.size(0), hq, hkv, d, per_head, eps); break;
    case at::kHalf: qk_norm_rows(qkv.data_ptr<c10::Half>(), wq.data_ptr<c10::Half>(), wk.data_ptr<c10::Half>(), qkv.size(0), hq, hkv, d, per_head, eps); break;
    default: TORCH_CHECK(false, "qk_norm: qkv must be float32, bfloat16 or float16");
  }
  if (clip > 0) qkv.clamp_(-clip, clip);
}

// RMSNorm of the rows of x [M, K] in x's dtype, as the fused projections' norms compute it
// (within a few float32 ulps of F.rms_norm, whose sum runs in another order): the model's final
// norm. ATen's rms_norm on CPU is a chain of small ops, slow right after a decode step's weights
// have streamed through the caches.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && w.dim() == 1 && w.numel() == x.size(1) &&
                  w.scalar_type() == x.scalar_type(),
              "rms_norm: x must be a CPU [M, K] tensor and the weight [K] in its dtype");
  const auto xc = x.contiguous(), wc = w.contiguous();
  auto out = at::empty_like(xc);
  const int64_t m = xc.size(0), k = xc.size(1);
  auto run = [&](auto* xp, auto* wp, auto* op) {
    at::parallel_for(0, m, 16, [&](int64_t b, int64_t e) {
      std::vector<float> buf(k);
      for (int64_t r = b; r < e; ++r) {
        rms_norm_row(xp + r * k, wp, k, eps, buf.data());
        for (int64_t i = 0; i < k; ++i) op[r * k + i] = static_cast<std::remove_pointer_t<decltype(op)>>(buf[i]);
      }
    });
  };
  switch (xc.scalar_type()) {
    case at::kFloat: run(xc.data_ptr<float>(), wc.data_ptr<float>(), out.data_ptr<float>()); break;
    case at::kBFloat16: run(xc.data_ptr<c10::BFloat16>(), wc.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>()); break;
    case at::kHalf: run(xc.data_ptr<c10::Half>(), wc.data_ptr<c10::Half>(), out.data_ptr<c10::Half>()); break;
    default: TORCH_CHECK(false, "rms_norm: x must be float32, bfloat16 or float16");
  }
  return out;
}

at::Tensor quant_linear_hooked(const at::Tensor& x, at::TensorList ws, at::IntArrayRef types, int64_t k,
                               const c10::optional<at::Tensor>& norm_weight, double eps,
                               const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& residual,
                               int64_t act, int64_t isa, const LinearHook* hook) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k, "x must be [M, ", k, "]");
  TORCH_CHECK(act == 0 || act == 1, "act must be 0 (none) or 1 (silu(gate) * up)");
  at::Tensor xin = x;
  if (norm_weight.has_value()) {
    TORCH_CHECK(norm_weight->numel() == k && norm_weight->scalar_type() == x.scalar_type(),
                "norm_weight must be [", k, "] in x's dtype");
    const auto xc = x.contiguous();
    const auto wc = norm_weight->contiguous();
    xin = at::empty({x.size(0), k}, x.options().dtype(at::kFloat));
    switch (x.scalar_type()) {
      case at::kFloat: rms_norm_rows(xc.data_ptr<float>(), wc.data_ptr<float>(), x.size(0), k, eps, xin.data_ptr<float>()); break;
      case at::kBFloat16: rms_norm_rows(xc.data_ptr<c10::BFloat16>(), wc.data_ptr<c10::BFloat16>(), x.size(0), k, eps, xin.data_ptr<float>()); break;
      case at::kHalf: rms_norm_rows(xc.data_ptr<c10::Half>(), wc.data_ptr<c10::Half>(), x.size(0), k, eps, xin.data_ptr<float>()); break;
      default: TORCH_CHECK(false, "quant_linear: x must be float32, bfloat16 or float16");
    }
  }
  if (!xin.is_contiguous()) xin = xin.contiguous();  // (the hook may keep a pointer into it)
  if (hook != nullptr) hook->prepare(xin);
  auto y = matmul_tailed(xin, ws, types, k, isa, hook, x.scalar_type());
  const int64_t n = y.size(1);
  TORCH_CHECK(act == 0 || n % 2 == 0, "silu(gate) * up needs an even width");
  if (bias.has_value()) TORCH_CHECK(bias->numel() == n && bias->scalar_type() == x.scalar_type(), "bias must be [", n, "] in x's dtype");
  if (residual.has_value())
    TORCH_CHECK(residual->dim() == 2 && residual->size(0) == x.size(0) && residual->size(1) == (act == 1 ? n / 2 : n) &&
                    residual->scalar_type() == x.scalar_type(), "residual must be [M, N] in x's dtype");
  switch (x.scalar_type()) {
    case at::kFloat: return epilogue<float>(y, bias, residual, act, x.options());
    case at::kBFloat16: return epilogue<c10::BFloat16>(y, bias, residual, act, x.options());
    case at::kHalf: return epilogue<c10::Half>(y, bias, residual, act, x.options());
    default: TORCH_CHECK(false, "quant_linear: x must be float32, bfloat16 or float16");
  }
}

at::Tensor quant_linear(const at::Tensor& x, at::TensorList ws, at::IntArrayRef types, int64_t k,
                        const c10::optional<at::Tensor>& norm_weight, double eps,
                        const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& residual,
                        int64_t act, int64_t isa) {
  return quant_linear_hooked(x, ws, types, k, norm_weight, eps, bias, residual, act, isa, nullptr);
}

namespace pq {
template <typename T>
void dequant_row(const Fmt& f, const uint8_t* row, int64_t k, T* out, bool fast) {
  alignas(64) uint8_t q[256];
  float sc[16], mn[16];
  for (int64_t blk = 0; blk < k / f.vals; ++blk) {
    const uint8_t* bp = row + blk * f.bytes;
    block_scales(f.type, bp, sc, mn);
#ifdef PQ_X86
    if (fast) unpack_avx2(f.type, bp, q); else
#endif
    unpack_ref(f.type, bp, q);
    T* o = out + blk * f.vals;
    for (int g = 0; g < f.vals / 16; ++g) {
      const float s = sc[g], m = mn[g];
      for (int l = 0; l < 16; ++l) {
        const float qv = f.is_signed ? static_cast<float>(static_cast<int8_t>(q[16 * g + l])) : static_cast<float>(q[16 * g + l]);
        o[16 * g + l] = static_cast<T>(s * qv + m);
      }
    }
  }
}

template <typename T>
void dequant_rows_impl(const Fmt& f, const uint8_t* w, int64_t rb, const int64_t* ids, int64_t rows,
                       int64_t k, T* out, bool fast) {
  at::parallel_for(0, rows, grain_for(rows), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) dequant_row(f, w + (ids ? ids[i] : i) * rb, k, out + i * k, fast);
  });
}
}  // namespace pq

// The float values w stands for, as `dtype`: rows [start, start + count) of w, or the rows
// `ids` names (an embedding lookup) when ids is given.
at::Tensor quant_dequant(const at::Tensor& w, int64_t type, int64_t k, const c10::optional<at::Tensor>& ids,
                         int64_t start, int64_t count, at::ScalarType dtype, int64_t isa,
                         const c10::optional<at::Tensor>& scratch) {
  const Fmt f = fmt_of(type);
  check_weight(w, f, k);
  if (isa == AUTO) isa = best_isa();
  TORCH_CHECK(isa_supported(isa), "instruction set path ", isa, " is not available on this CPU");
  const bool fast = isa != SCALAR;
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t rb = w.stride(0);
  at::Tensor idx;
  int64_t rows;
  const int64_t* ip = nullptr;
  if (ids.has_value()) {
    idx = ids->to(at::kLong).contiguous();
    rows = idx.numel();
    ip = idx.data_ptr<int64_t>();
    for (int64_t i = 0; i < rows; ++i)
      TORCH_CHECK(ip[i] >= 0 && ip[i] < w.size(0), "row id ", ip[i], " is out of range [0, ", w.size(0), ")");
  } else {
    if (count < 0) count = w.size(0) - start;
    TORCH_CHECK(start >= 0 && start + count <= w.size(0), "rows [", start, ", ", start + count, ") out of range");
    rows = count;
    wp += start * rb;
  }
  auto out = scratch_view(scratch, {rows, k}, w.options().dtype(dtype));
  switch (dtype) {
    case at::kFloat: dequant_rows_impl(f, wp, rb, ip, rows, k, out.data_ptr<float>(), fast); break;
    case at::kBFloat16: dequant_rows_impl(f, wp, rb, ip, rows, k, out.data_ptr<c10::BFloat16>(), fast); break;
    case at::kHalf: dequant_rows_impl(f, wp, rb, ip, rows, k, out.data_ptr<c10::Half>(), fast); break;
    default: TORCH_CHECK(false, "quant_dequant: dtype must be float32, bfloat16 or float16");
  }
  return out;
}

// How many blocks of w have a non-finite (NaN or inf) fp16 scale or min.
int64_t quant_bad_scales(const at::Tensor& w, int64_t type, int64_t k) {
  const Fmt f = fmt_of(type);
  check_weight(w, f, k);
  int offs[2] = {-1, -1};
  switch (type) {
    case Q4_0: case Q5_0: case Q8_0: offs[0] = 0; break;
    case Q4_1: case Q5_1: case Q4_K: case Q5_K: offs[0] = 0; offs[1] = 2; break;
    case Q2_K: offs[0] = 80; offs[1] = 82; break;
    case Q3_K: offs[0] = 108; break;
    case Q6_K: offs[0] = 208; break;
  }
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t rb = w.stride(0), nb = k / f.vals, rows = w.size(0);
  int64_t bad = 0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* p = wp + r * rb + b * f.bytes;
      for (int o : offs)
        if (o >= 0 && !half_finite(p + o)) { ++bad; break; }
    }
  return bad;
}

// The CPU's int8 dot-product peak, as the quantized kernels issue their products: vpdpbusd on
// 512-bit registers (AVX-512 VNNI: 64 products an instruction) or vpmaddubsw on 256-bit ones
// (AVX2: 32, summed in int16 as group_avx2 sums them), ten independent chains a thread, no
// memory touched. A decode step of many rows is bound by these (not by the bytes it reads), so
// `pagedllm bench compare` sets its rate against this figure as it sets batch 1's against the
// read bandwidth. `iters` passes of ten instructions on each of torch's threads; the caller times it.
namespace {
#ifdef PQ_HAS_VNNI
int64_t peak_chains_vnni(int64_t iters) {
  __m512i acc[10];
  for (auto& a : acc) a = _mm512_setzero_si512();
  __m512i w = _mm512_set1_epi8(3), x = _mm512_set1_epi8(5);
  for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 10
    for (auto& a : acc) a = _mm512_dpbusd_epi32(a, w, x);
    asm volatile("" : "+v"(w), "+v"(x));  // (the operands are not constants to fold)
  }
  __m512i r = acc[0];
  for (int c = 1; c < 10; ++c) r = _mm512_add_epi32(r, acc[c]);
  return _mm512_reduce_add_epi32(r);
}
#endif
#ifdef PQ_AVXVNNI
int64_t peak_chains_avxvnni(int64_t iters) {  // (peak_chains_vnni's loop on 256-bit registers)
  __m256i acc[10];
  for (auto& a : acc) a = _mm256_setzero_si256();
  __m256i w = _mm256_set1_epi8(3), x = _mm256_set1_epi8(5);
  for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 10
    for (auto& a : acc) a = PQ_DPBUSD256(a, w, x);
    asm volatile("" : "+x"(w), "+x"(x));
  }
  __m256i r = acc[0];
  for (int c = 1; c < 10; ++c) r = _mm256_add_epi32(r, acc[c]);
  return _mm256_extract_epi32(r, 0);
}
#endif
#ifdef PQ_X86
int64_t peak_chains_avx2(int64_t iters) {
  // Each chain its own weights: with one operand pair the compiler computes the product once
  // for all chains (it did: the "peak" read 1.3x VNNI's on a Zen 4).
  __m256i acc[5], w[5];
  for (int c = 0; c < 5; ++c) acc[c] = _mm256_setzero_si256(), w[c] = _mm256_set1_epi8(static_cast<char>(3 + c));
  __m256i x = _mm256_set1_epi8(5);
  for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {  // (ten products a pass, as the VNNI loop's ten)
#pragma GCC unroll 5
      for (int c = 0; c < 5; ++c) acc[c] = _mm256_add_epi16(acc[c], _mm256_maddubs_epi16(w[c], x));
      asm volatile("" : "+x"(w[0]), "+x"(w[1]), "+x"(w[2]), "+x"(w[3]), "+x"(w[4]), "+x"(x));
    }
  }
  __m256i r = acc[0];
  for (int c = 1; c < 5; ++c) r = _mm256_add_epi16(r, acc[c]);
  return _mm256_extract_epi16(r, 0);
}
#endif
}  // namespace

// Multiply-accumulates a pass of peak_chains runs per thread (0: no int8 SIMD on this path).
int64_t int8_peak_macs_per_pass(int64_t isa) {
  if (isa == AUTO) isa = best_isa();
  return isa == AVX512VNNI ? 10 * 64 : (isa == AVX2 || isa == AVXVNNI) ? 10 * 32 : 0;
}

// Runs `iters` passes on every thread of torch's pool; returns a checksum (the caller times it).
int64_t int8_peak_run(int64_t isa, int64_t iters) {
  if (isa == AUTO) isa = best_isa();
  TORCH_CHECK(isa_supported(isa), "instruction set path ", isa, " is not available on this CPU");
  TORCH_CHECK(iters >= 0, "iters must be >= 0, got ", iters);
  const int64_t threads = at::get_num_threads();
  std::vector<int64_t> sums(threads, 0);
  at::parallel_for(0, threads, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
#ifdef PQ_HAS_VNNI
      if (isa == AVX512VNNI) { sums[t] = peak_chains_vnni(iters); continue; }
#endif
#ifdef PQ_AVXVNNI
      if (isa == AVXVNNI) { sums[t] = peak_chains_avxvnni(iters); continue; }
#endif
#ifdef PQ_X86
      if (isa == AVX2) { sums[t] = peak_chains_avx2(iters); continue; }
#endif
      sums[t] = 0;
    }
  });
  return std::accumulate(sums.begin(), sums.end(), int64_t{0});
}

// Bit 0: scalar (always), 1: AVX2, 2: AVX-512 VNNI, 3: AVX-VNNI; which paths this object holds
// and this CPU can run.
int64_t quant_isas() {
  int64_t mask = 0;
  for (int64_t i = SCALAR; i <= AVXVNNI; ++i)
    if (isa_supported(i)) mask |= int64_t{1} << (i - 1);
  return mask;
}

PAGEDLLM_REGISTER(quant_kernels) {
  m.def("qk_norm(Tensor(a!) qkv, Tensor wq, Tensor wk, int hq, int hkv, float eps, float clip=0.) -> ()", &qk_norm);
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor", &rms_norm);
  m.def("quant_matmul(Tensor x, Tensor[] ws, int[] types, int k, int isa=0) -> Tensor", &quant_matmul);
  m.def("quant_moe_experts(Tensor x, Tensor ids, Tensor weights, Tensor[] gate_up, int[] gate_up_types, "
        "int[] gate_up_parts, Tensor[] down, int[] down_types, int isa=0, int x2=0) -> Tensor",
        &quant_moe_experts);
  m.def("quant_moe_block(Tensor x, Tensor norm_weight, float eps, Tensor router, int top_k, bool renormalize, "
        "bool round_weights, Tensor[] gate_up, int[] gate_up_types, int[] gate_up_parts, Tensor[] down, "
        "int[] down_types, int isa=0, int x2=0) -> (Tensor, Tensor)", &quant_moe_block);
  m.def("quant_dequant(Tensor w, int type, int k, Tensor? ids=None, int start=0, int count=-1, "
        "ScalarType dtype=float, int isa=0, Tensor? scratch=None) -> Tensor", &quant_dequant);
  m.def("quant_linear(Tensor x, Tensor[] ws, int[] types, int k, Tensor? norm_weight=None, float eps=0., "
        "Tensor? bias=None, Tensor? residual=None, int act=0, int isa=0) -> Tensor", &quant_linear);
  m.def("quant_bad_scales(Tensor w, int type, int k) -> int", &quant_bad_scales);
  m.def("quant_isas() -> int", &quant_isas);
  m.def("int8_peak_macs_per_pass(int isa=0) -> int", &int8_peak_macs_per_pass);
  m.def("int8_peak_run(int isa, int iters) -> int", &int8_peak_run);
}

}  // namespace PAGEDLLM_ISA
