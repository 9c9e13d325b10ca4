// Weights repacked at load so that one SIMD lane is one output row (llama.cpp's CPU repack
// has the same idea). In the file's layout a weight row is a run of blocks, so a matrix
// product needs a horizontal sum per row and per chunk, and each activation chunk is used by
// one row at a time. Here 16 rows are interleaved: for each 32-value block, the 4-byte
// groups of the 16 rows sit side by side, so
//   - one 64-byte load holds 16 rows x 4 values (two such groups when 4-bit: low and high
//     nibbles), and one `vpdpbusd` against 4 activation bytes broadcast advances all 16 rows;
//   - the block's 16 scales are one vector, so the scale is applied once per block and row
//     tile, not once per row and chunk, and nothing is summed horizontally at the end;
//   - the weight vectors decoded for a block serve every activation row of the tile (up to 8).
// The repack is lossless and about the file's size: values keep their bits (4-bit nibbles,
// the 5th bit as a bit plane, Q8_0 as bytes), fp16 scales stay fp16, and the K-quants keep
// their fp16 super-block scale with the 6-bit sub-block scales as bytes (d * sc is exact in fp32).
//
// Packed formats: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K (whose scales cover 16
// values: two per block, the first for values 0-15, the second for 16-31). Q2_K and Q3_K keep
// the file's layout.
//
// Layout of a packed weight [N, K]: N / 16 groups, each a run of units (32 values, or 256 for
// the K-quants), so the tensor is uint8 [N / 16, K / vals * unit_bytes]:
//   unit  = [Q4_K/Q5_K: d fp16 x16, dmin fp16 x16 | Q6_K: d fp16 x16] + vals / 32 blocks
//   block = values + [5-bit: high-bit plane, 64 B | 6-bit: 2-bit plane, 128 B] + scales
//   values, 4/5-bit: 4 chunks of 64 B; byte 4r+i of chunk c holds value 4c+i of row r in its
//           low nibble and value 16+4c+i in its high nibble;
//   values, Q8_0: 8 chunks of 64 B; byte 4r+i of chunk t is value 4t+i of row r, plus 128;
//   high bits: 8 bytes per 4-value step t, bit 4r+i = bit 4 of value 4t+i of row r;
//   2-bit plane (Q6_K): 2 chunks of 64 B; bits 2s..2s+1 of byte 4r+i of chunk h are bits 4-5
//           of value 4t+i of row r, t = 4h + s;
//   scales: legacy d fp16 x16 [+ m fp16 x16]; Q4_K/Q5_K sc u8 x16, m u8 x16; Q6_K sc i8 x16
//           for values 0-15 and x16 for 16-31.
#include "isa.h"  // first: the library headers, and the level this object is compiled for
#include "quant_common.h"

namespace PAGEDLLM_ISA {

namespace pq {

constexpr int GR = 16;  // rows per group
constexpr int TILE_PAD = 32;  // transposed tiles' rows are padded: a 4 KiB stride aliases in L1

struct PLayout {
  int64_t type;
  int vals, nbits;
  bool kq, has_min, split;  // split: two scales per block (Q6_K's 16-value groups)
  int iofs;  // the symmetric formats' zero point, folded into the integer dot: w = d * (q + iofs)
  int vbytes, hbytes, sbytes, blk, hdr, unit;
};

// Software prefetch of the weights `ahead` bytes before the block being read (past a group's end
// it reaches the next group, which follows in memory). With several rows a block takes long
// enough that the hardware prefetcher fell behind: tiles of 8+ rows ran far slower streaming
// from DRAM than from cache, and even 1-4 rows gained a little. The distance is
// pagedllm::weight_prefetch_bytes(rows): nearer while the weights come from DRAM, farther while
// they fit the cache, at least 2 KiB for tiles of 4+ rows (weight_memory.h and .cpp, where it
// was measured).

constexpr bool packable(int64_t t) {
  return t == Q4_0 || t == Q4_1 || t == Q5_0 || t == Q5_1 || t == Q8_0 || t == Q4_K || t == Q5_K || t == Q6_K;
}

constexpr PLayout playout(int64_t t) {
  const bool kq = t == Q4_K || t == Q5_K || t == Q6_K, split = t == Q6_K;
  const int nbits = t == Q8_0 ? 8 : t == Q6_K ? 6 : (t == Q5_0 || t == Q5_1 || t == Q5_K) ? 5 : 4;
  const bool has_min = t == Q4_1 || t == Q5_1 || t == Q4_K || t == Q5_K;
  const int vb = nbits == 8 ? 512 : 256, hb = nbits == 5 ? 64 : nbits == 6 ? 128 : 0;
  const int sb = (has_min && !kq) ? 64 : 32;
  const int blk = vb + hb + sb, hdr = split ? 32 : kq ? 64 : 0, vals = kq ? 256 : 32;
  return {t, vals, nbits, kq, has_min, split,
          t == Q4_0 ? -8 : t == Q5_0 ? -16 : t == Q8_0 ? -128 : t == Q6_K ? -32 : 0,
          vb, hb, sb, blk, hdr, hdr + vals / 32 * blk};
}

int64_t packed_group_bytes(int64_t type, int64_t k) {
  const PLayout L = playout(type);
  return k / L.vals * L.unit;
}

// Value i (0..31) of lane r in a block, as the unsigned q of w = s * q + m.
#ifdef PQ_X86
template <typename Layout>
inline void prefetch_ahead(const Layout& L, const uint8_t* B, int ahead) {
  if (ahead <= 0) return;  // (none: the hardware prefetcher alone)
  for (int off = 0; off < L.blk; off += 64) _mm_prefetch(reinterpret_cast<const char*>(B + ahead + off), _MM_HINT_T0);
}
#endif

inline int packed_value(const PLayout& L, const uint8_t* b, int r, int i) {
  const int t = i / 4, pos = 4 * r + i % 4;
  if (L.nbits == 8) return b[64 * t + pos];
  const int c = t % 4;
  int v = (b[64 * c + pos] >> (t >= 4 ? 4 : 0)) & 0xF;
  if (L.nbits == 5) v |= ((b[256 + 8 * t + pos / 8] >> (pos % 8)) & 1) << 4;
  if (L.nbits == 6) v |= ((b[256 + 64 * (t / 4) + pos] >> (2 * (t % 4))) & 3) << 4;
  return v;
}

// Scale and offset of lane r in block j of unit u, for values 0-15 (half 0) or 16-31: w = s * q + m.
inline void packed_scale(const PLayout& L, const uint8_t* u, int j, int r, int hi, float& s, float& m) {
  const uint8_t* sp = u + L.hdr + j * L.blk + L.vbytes + L.hbytes;
  if (L.split) {
    s = half(u + 2 * r) * static_cast<float>(static_cast<int8_t>(sp[16 * hi + r]));
    m = static_cast<float>(L.iofs) * s;
  } else if (L.kq) {
    s = half(u + 2 * r) * static_cast<float>(sp[r]);
    m = -half(u + 32 + 2 * r) * static_cast<float>(sp[16 + r]);
  } else {
    s = half(sp + 2 * r);
    m = L.has_min ? half(sp + 32 + 2 * r) : static_cast<float>(L.iofs) * s;
  }
}

// ---------------------------------------------------------------------------------------------
// Packing (once, at load).

// NB: the layout's bits per value, a template argument so that the per-value scatter below is
// compiled without its branches on the width (packing runs once per weight at load).
template <int NB>
void pack_group(const PLayout& L, const Fmt& f, const uint8_t* src, int64_t rb, int64_t k, uint8_t* dst) {
  alignas(64) uint8_t q[GR][256];
  for (int64_t u = 0; u < k / L.vals; ++u) {
    uint8_t* U = dst + u * L.unit;
    std::memset(U, 0, L.unit);
    for (int r = 0; r < GR; ++r) {
      const uint8_t* b = src + r * rb + u * f.bytes;
      unpack_ref(L.type, b, q[r]);
      if (L.split) {
        std::memcpy(U + 2 * r, b + 208, 2);
      } else if (L.kq) {
        std::memcpy(U + 2 * r, b, 2);
        std::memcpy(U + 32 + 2 * r, b + 2, 2);
      }
    }
    for (int j = 0; j < L.vals / 32; ++j) {
      uint8_t* B = U + L.hdr + j * L.blk;
      for (int r = 0; r < GR; ++r) {
        for (int i = 0; i < 32; ++i) {
          const int v = NB == 8 ? (q[r][32 * j + i] ^ 0x80) : q[r][32 * j + i];
          const int t = i / 4, pos = 4 * r + i % 4;
          if constexpr (NB == 8) {
            B[64 * t + pos] = static_cast<uint8_t>(v);
          } else {
            B[64 * (t % 4) + pos] |= static_cast<uint8_t>((v & 0xF) << (t >= 4 ? 4 : 0));
            if constexpr (NB == 5) {
              if (v & 0x10) B[256 + 8 * t + pos / 8] |= static_cast<uint8_t>(1u << (pos % 8));
            }
            if constexpr (NB == 6) B[256 + 64 * (t / 4) + pos] |= static_cast<uint8_t>((v >> 4) << (2 * (t % 4)));
          }
        }
        const uint8_t* b = src + r * rb + u * f.bytes;
        uint8_t* S = B + L.vbytes + L.hbytes;
        if (L.split) {
          S[r] = b[192 + 2 * j];
          S[16 + r] = b[192 + 2 * j + 1];
        } else if (L.kq) {
          int sc, m;
          scale_min_k4(j, b + 4, sc, m);
          S[r] = static_cast<uint8_t>(sc);
          S[16 + r] = static_cast<uint8_t>(m);
        } else {
          std::memcpy(S + 2 * r, b, 2);
          if (L.has_min) std::memcpy(S + 32 + 2 * r, b + 2, 2);
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The scalar reference: every machine runs it; the SIMD paths are tested against gguf and it.

void pgemm_scalar(const PLayout& L, const uint8_t* w, int64_t gb, int64_t g0, int64_t g1, const QAct& x, float* y,
                  int64_t ldy) {
  std::vector<float> acc(x.m), macc(x.m);
  for (int64_t g = g0; g < g1; ++g) {
    for (int r = 0; r < GR; ++r) {
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(macc.begin(), macc.end(), 0.f);
      for (int64_t u = 0; u < x.k / L.vals; ++u) {
        const uint8_t* U = w + g * gb + u * L.unit;
        for (int j = 0; j < L.vals / 32; ++j) {
          const uint8_t* B = U + L.hdr + j * L.blk;
          float s, m;
          packed_scale(L, U, j, r, 0, s, m);
          int q[32];
          for (int i = 0; i < 32; ++i) q[i] = packed_value(L, B, r, i);
          const int64_t c = u * (L.vals / 32) + j;
          for (int64_t row = 0; row < x.m; ++row) {
            const int64_t ci = x.at(row, c);
            const int8_t* a = x.a.data() + ci * 32;
            int32_t dot = 0, dot_hi = 0;
            for (int i = 0; i < 16; ++i) dot += q[i] * a[i];
            for (int i = 16; i < 32; ++i) dot_hi += q[i] * a[i];
            if (L.split) {  // two scales: values 0-15 and 16-31
              float s1, m1;
              packed_scale(L, U, j, r, 1, s1, m1);
              acc[row] += static_cast<float>(dot + L.iofs * x.s16[2 * ci]) * (s * x.d[ci]);
              acc[row] += static_cast<float>(dot_hi + L.iofs * x.s16[2 * ci + 1]) * (s1 * x.d[ci]);
              continue;
            }
            dot += dot_hi;
            if (L.has_min) {
              acc[row] += static_cast<float>(dot) * (s * x.d[ci]);
              macc[row] += m * x.ds32[ci];
            } else {  // m = iofs * s: folded into the integer dot as the SIMD paths do
              acc[row] += static_cast<float>(dot + L.iofs * x.s32[ci]) * (s * x.d[ci]);
            }
          }
        }
      }
      for (int64_t row = 0; row < x.m; ++row) y[row * ldy + g * GR + r] = acc[row] + macc[row];
    }
  }
}

#ifdef PQ_X86
// ---------------------------------------------------------------------------------------------
// AVX2: 8 lanes, so a group is two halves of 8 rows; maddubs (u8 x s8 -> i16 pairs) + madd.

// Bits 4-5 of the 6-bit values of step s (0-3) from a 2-bit plane chunk.
inline __m256i hi2_avx2(__m256i hb, int s) {
  const __m256i v = s == 0 ? _mm256_slli_epi16(hb, 4) : s == 1 ? _mm256_slli_epi16(hb, 2) : s == 2 ? hb : _mm256_srli_epi16(hb, 2);
  return _mm256_and_si256(v, _mm256_set1_epi8(0x30));
}

template <int64_t TYPE>
inline void scales_avx2(const uint8_t* B, int h, __m256 dv, __m256 mv, __m256& s, __m256& s_hi, __m256& mw);

// Half h (rows 8h..8h+7) of a block: its 8 steps' values as bytes (unsigned; Q8_0 as value + 128)
// and its scales: s (values 0-15, or all), s_hi (Q6_K's 16-31) and the offsets mw.
template <int64_t TYPE>
inline void decode_avx2(const uint8_t* B, int h, __m256 dv, __m256 mv, __m256i* W, __m256& s, __m256& s_hi,
                        __m256& mw) {
  constexpr PLayout L = playout(TYPE);
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  if constexpr (L.nbits == 8) {
    for (int t = 0; t < 8; ++t) W[t] = ld(B + 64 * t + 32 * h);
  } else {
    for (int c = 0; c < 4; ++c) {
      const __m256i v = ld(B + 64 * c + 32 * h);
      W[c] = _mm256_and_si256(v, m4);
      W[c + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    }
    if constexpr (L.nbits == 5)
      for (int t = 0; t < 8; ++t) W[t] = _mm256_or_si256(W[t], bits_to_bytes(u32(B + 256 + 8 * t + 4 * h), 0x10));
    if constexpr (L.nbits == 6)
      for (int t = 0; t < 8; ++t) W[t] = _mm256_or_si256(W[t], hi2_avx2(ld(B + 256 + 64 * (t / 4) + 32 * h), t % 4));
  }
  scales_avx2<TYPE>(B, h, dv, mv, s, s_hi, mw);
}

// The scales of half h of block B (decode_avx2's s, s_hi and mw).
template <int64_t TYPE>
inline void scales_avx2(const uint8_t* B, int h, __m256 dv, __m256 mv, __m256& s, __m256& s_hi, __m256& mw) {
  constexpr PLayout L = playout(TYPE);
  const uint8_t* S = B + L.vbytes + L.hbytes;
  if constexpr (L.split) {
    s = _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(S + 8 * h)))));
    s_hi = _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(S + 16 + 8 * h)))));
  } else if constexpr (L.kq) {
    const __m128i sc = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(S + 8 * h));
    const __m128i mn = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(S + 16 + 8 * h));
    s = _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sc)));
    mw = _mm256_mul_ps(mv, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(mn)));
  } else {
    s = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(S + 16 * h)));
    if constexpr (L.has_min) mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(S + 32 + 16 * h)));
  }
}

// A packed group as a [K, 16] slice of a transposed tile (row stride ld): for each value
// position, the 16 rows' weights side by side, 8 at a time.
template <int64_t TYPE, typename T>
void tile_avx2(const uint8_t* gp, int64_t k, T* out, int64_t ld) {
  constexpr PLayout L = playout(TYPE);
  for (int64_t u = 0; u < k / L.vals; ++u) {
    const uint8_t* U = gp + u * L.unit;
    for (int h = 0; h < 2; ++h) {
      __m256 dv, mv;
      if constexpr (L.kq) dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(U + 16 * h)));
      if constexpr (L.kq && L.has_min) mv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(U + 32 + 16 * h)));
      for (int j = 0; j < L.vals / 32; ++j) {
        __m256i W[8];
        __m256 s, s_hi, mw;
        decode_avx2<TYPE>(U + L.hdr + j * L.blk, h, dv, mv, W, s, s_hi, mw);
        T* o = out + (u * L.vals + 32 * j) * ld + 8 * h;
        for (int t = 0; t < 8; ++t) {
          const __m256 st = L.split && t >= 4 ? s_hi : s;
          const __m256 m = L.kq && L.has_min ? _mm256_sub_ps(_mm256_setzero_ps(), mw)
                         : L.has_min ? mw : _mm256_mul_ps(_mm256_set1_ps(static_cast<float>(L.iofs)), st);
          for (int i = 0; i < 4; ++i) {
            const __m256i q = _mm256_and_si256(_mm256_srli_epi32(W[t], 8 * i), _mm256_set1_epi32(0xFF));
            store8(o + (4 * t + i) * ld, _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), st, m));
          }
        }
      }
    }
  }
}

// A 4-bit half block's int16 sums p (all 8 steps: 8 x 2 x 15 x 127 fits) for the row of block
// index ci, into fa: the one sequence of float operations every tile and pass applies, so a
// row's result does not depend on which kernel below took it (integer sums are exact in any order).
// finish_avx2 takes the half block's int32 sums ia (OFS: with the zero point iofs still to fold in).
template <int64_t TYPE, bool OFS>
__attribute__((always_inline)) inline void finish_avx2(__m256i ia, __m256 s, __m256 mw, const QAct& x, int64_t ci,
                                                       __m256& fa) {
  constexpr PLayout L = playout(TYPE);
  if constexpr (OFS && L.iofs != 0) ia = _mm256_add_epi32(ia, _mm256_set1_epi32(L.iofs * x.s32[ci]));
  fa = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia), _mm256_mul_ps(s, _mm256_set1_ps(x.d[ci])), fa);
  if constexpr (L.kq) fa = _mm256_fnmadd_ps(mw, _mm256_set1_ps(x.ds32[ci]), fa);
  else if constexpr (L.has_min) fa = _mm256_fmadd_ps(mw, _mm256_set1_ps(x.ds32[ci]), fa);
}
template <int64_t TYPE>
__attribute__((always_inline)) inline void finish4_avx2(__m256i p, __m256 s, __m256 mw, const QAct& x, int64_t ci,
                                                        __m256& fa) {
  finish_avx2<TYPE, true>(_mm256_madd_epi16(p, _mm256_set1_epi16(1)), s, mw, x, ci, fa);
}

// One activation row (block index ci) against half a block's decoded weights: fa += the 8 rows'
// products, the weights' offsets folded into the same accumulator (as the VNNI path does), so a
// row's sums are the same operations in the same order whatever the tile or pass it is in.
template <int64_t TYPE>
__attribute__((always_inline)) inline void row_avx2(const __m256i* W, __m256 s, __m256 mw, const QAct& x, int64_t ci,
                                                    __m256& fa) {
  constexpr PLayout L = playout(TYPE);
  static_assert(!L.split, "Q6_K takes group_avx2_q6");
  const __m256i ones = _mm256_set1_epi16(1);
  const uint8_t* a = reinterpret_cast<const uint8_t*>(x.a.data() + ci * 32);
  auto act = [&](int t) { return _mm256_set1_epi32(static_cast<int>(u32(a + 4 * t))); };
  __m256i ia;
  if constexpr (L.nbits == 8) {  // |w| x sign-moved a: maddubs of 8-bit values would saturate
    ia = _mm256_setzero_si256();
    for (int t = 0; t < 8; ++t) {
      const __m256i av = _mm256_sign_epi8(act(t), W[t]);
      ia = _mm256_add_epi32(ia, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(W[t], W[t]), av), ones));
    }
  } else if constexpr (L.nbits == 4) {  // all 8 steps of 4-bit products fit in int16 (8 x 2 x 15 x 127)
    __m256i p0 = _mm256_maddubs_epi16(W[0], act(0)), p1 = _mm256_maddubs_epi16(W[4], act(4));
    for (int t = 1; t < 4; ++t) {
      p0 = _mm256_add_epi16(p0, _mm256_maddubs_epi16(W[t], act(t)));
      p1 = _mm256_add_epi16(p1, _mm256_maddubs_epi16(W[t + 4], act(t + 4)));
    }
    return finish4_avx2<TYPE>(_mm256_add_epi16(p0, p1), s, mw, x, ci, fa);
  } else {  // 4 steps of 5-bit products fit in int16 before widening
    __m256i p0 = _mm256_maddubs_epi16(W[0], act(0)), p1 = _mm256_maddubs_epi16(W[4], act(4));
    for (int t = 1; t < 4; ++t) {
      p0 = _mm256_add_epi16(p0, _mm256_maddubs_epi16(W[t], act(t)));
      p1 = _mm256_add_epi16(p1, _mm256_maddubs_epi16(W[t + 4], act(t + 4)));
    }
    ia = _mm256_add_epi32(_mm256_madd_epi16(p0, ones), _mm256_madd_epi16(p1, ones));
  }
  finish_avx2<TYPE, L.nbits != 8>(ia, s, mw, x, ci, fa);  // (8-bit: the sign move took the offset out)
}

#ifdef PQ_AVXVNNI
// row_avx2 at the avxvnni level: each step one vpdpbusd into int32 (no int16 sums to keep in
// range, so every width takes the same two chains, and Q8_0 its unsigned value + 128 with the
// offset folded in after, as the AVX-512 VNNI path does). The int32 sums equal row_avx2's, and
// the float operations after them are finish_avx2's: the same results bit for bit.
template <int64_t TYPE>
__attribute__((always_inline)) inline void row_avxvnni(const __m256i* W, __m256 s, __m256 mw, const QAct& x, int64_t ci,
                                                       __m256& fa) {
  const uint8_t* a = reinterpret_cast<const uint8_t*>(x.a.data() + ci * 32);
  auto act = [&](int t) { return _mm256_set1_epi32(static_cast<int>(u32(a + 4 * t))); };
  __m256i p0 = PQ_DPBUSD256(_mm256_setzero_si256(), W[0], act(0));
  __m256i p1 = PQ_DPBUSD256(_mm256_setzero_si256(), W[4], act(4));
  for (int t = 1; t < 4; ++t) {
    p0 = PQ_DPBUSD256(p0, W[t], act(t));
    p1 = PQ_DPBUSD256(p1, W[t + 4], act(t + 4));
  }
  finish_avx2<TYPE, true>(_mm256_add_epi32(p0, p1), s, mw, x, ci, fa);
}
#endif

// The blocks of group gp in order, for the tile of activation rows from r0: f(U, B, ci, a), U the
// block's unit, B its bytes, ci the block index of the tile's first row (the tile's rows follow
// it: block-major) and a that row's int8 activations; the weights `ahead` bytes on prefetched.
template <int64_t TYPE, typename F>
__attribute__((always_inline)) inline void tile_blocks(const uint8_t* gp, const QAct& x, int64_t r0, int ahead, F&& f) {
  constexpr PLayout L = playout(TYPE);
  for (int64_t u = 0; u < x.k / L.vals; ++u) {
    const uint8_t* U = gp + u * L.unit;
    for (int j = 0; j < L.vals / 32; ++j) {
      const uint8_t* B = U + L.hdr + j * L.blk;
      prefetch_ahead(L, B, ahead);
      const int64_t ci = x.at(r0, u * (L.vals / 32) + j);
      f(U, B, ci, reinterpret_cast<const uint8_t*>(x.a.data() + ci * 32));
    }
  }
}

// 4-bit formats, tiles of 3-4 rows (prefill, many sequences): each activation broadcast feeds both
// halves of the group (16 weight rows, not 8), and the weights are decoded a step at a time, so
// the registers hold the rows' int16 sums instead of a half block's 8 decoded steps. A
// broadcast costs a vector slot like a product does (AMD Zen 4), so sharing it is most of the
// gain. The empty asm statements keep each step's sums in order: without them GCC reassociated
// the int16 adds into trees, kept every product alive at once and spilled them to the stack.
// VNNI (the avxvnni level): the same with vpdpbusd into int32 sums (the same sums).
template <int64_t TYPE, int MR, bool VNNI = false>
void group_avx2_wide(const uint8_t* gp, const QAct& x, int64_t r0, float* y, int64_t ldy) {
  constexpr PLayout L = playout(TYPE);
  static_assert(L.nbits == 4, "the wide AVX2 kernel sums 4-bit products in int16");
  // p += w x a for 4 steps of u8 x s8: int16 pairs (maddubs) or, VNNI, int32 (vpdpbusd). ([&]:
  // GCC emits a captureless lambda's conversion to a function pointer without the level's target.)
  auto dot = [&](__m256i p, __m256i w, __m256i a, bool first) {
#ifdef PQ_AVXVNNI
    if constexpr (VNNI) return PQ_DPBUSD256(first ? _mm256_setzero_si256() : p, w, a);
#endif
    const __m256i q = _mm256_maddubs_epi16(w, a);
    return first ? q : _mm256_add_epi16(p, q);
  };
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  __m256 fa[2][MR];
  for (int h = 0; h < 2; ++h)
    for (int r = 0; r < MR; ++r) fa[h][r] = _mm256_setzero_ps();
  tile_blocks<TYPE>(gp, x, r0, pagedllm::weight_prefetch_bytes(MR), [&](const uint8_t* U, const uint8_t* B, int64_t ci,
                                                                     const uint8_t* a) {
      __m256i p[2][MR];
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        const __m256i v0 = ld(B + 64 * c), v1 = ld(B + 64 * c + 32);
        const __m256i l0 = _mm256_and_si256(v0, m4), l1 = _mm256_and_si256(v1, m4);
        for (int r = 0; r < MR; ++r) {
          const __m256i av = _mm256_set1_epi32(static_cast<int>(u32(a + 32 * r + 4 * c)));
          p[0][r] = dot(p[0][r], l0, av, c == 0);
          p[1][r] = dot(p[1][r], l1, av, c == 0);
        }
        for (int r = 0; r < MR; ++r) asm volatile("" : "+x"(p[0][r]), "+x"(p[1][r]));
        const __m256i h0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), m4), h1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), m4);
        for (int r = 0; r < MR; ++r) {
          const __m256i av = _mm256_set1_epi32(static_cast<int>(u32(a + 32 * r + 16 + 4 * c)));
          p[0][r] = dot(p[0][r], h0, av, false);
          p[1][r] = dot(p[1][r], h1, av, false);
        }
        for (int r = 0; r < MR; ++r) asm volatile("" : "+x"(p[0][r]), "+x"(p[1][r]));
      }
      for (int h = 0; h < 2; ++h) {
        __m256 dv = _mm256_setzero_ps(), mv = _mm256_setzero_ps(), s, s_hi, mw;
        if constexpr (L.kq) dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(U + 16 * h)));
        if constexpr (L.kq && L.has_min) mv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(U + 32 + 16 * h)));
        scales_avx2<TYPE>(B, h, dv, mv, s, s_hi, mw);
        for (int r = 0; r < MR; ++r) {
          if constexpr (VNNI) finish_avx2<TYPE, true>(p[h][r], s, mw, x, ci + r, fa[h][r]);
          else finish4_avx2<TYPE>(p[h][r], s, mw, x, ci + r, fa[h][r]);
        }
      }
  });
  for (int h = 0; h < 2; ++h)
    for (int r = 0; r < MR; ++r) _mm256_storeu_ps(y + (r0 + r) * ldy + 8 * h, fa[h][r]);
}

// Q6_K, tiles of 1-4 rows: as group_avx2_wide, each activation broadcast feeds both halves of the
// group. Products of 6-bit values (0-63) fill int16 in two steps, so a 16-value sum (4 steps)
// keeps in int16 only centred: the activations' off6 (QAct) taken from it once leaves the sums
// of (q - 32) a, within +-32512. The madd that widens them multiplies by the rows' int16 scales,
// so a block's two 16-value groups sum exactly in int32 and take one float product (d x the
// activations' scale) a row, where summing pairs of steps took four madds and two.
// VNNI (the avxvnni level): vpdpbusd sums a 16-value group in int32, so the offset of 32 comes
// off as 32 x the activations' 16-value sum (no off6 needed), and the rows' int32 scales multiply
// it (vpmulld): the same int32 sums as the madd's, so the same results bit for bit.
template <int64_t TYPE, int MR, bool VNNI = false>
void group_avx2_q6(const uint8_t* gp, const QAct& x, int64_t r0, float* y, int64_t ldy) {
  constexpr PLayout L = playout(TYPE);
  static_assert(L.nbits == 6 && L.split, "the 6-bit AVX2 kernel is Q6_K's");
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  __m256 fa[2][MR];
  for (int h = 0; h < 2; ++h)
    for (int r = 0; r < MR; ++r) fa[h][r] = _mm256_setzero_ps();
  // Step t's values of half h: low nibbles (t < 4) or high nibbles of chunk t % 4, with bits 4-5
  // from the 2-bit plane.
  auto step = [&](const uint8_t* B, int t, int h) {
    const __m256i v = ld(B + 64 * (t % 4) + 32 * h);
    const __m256i nib = t < 4 ? _mm256_and_si256(v, m4) : _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    return _mm256_or_si256(nib, hi2_avx2(ld(B + 256 + 64 * (t / 4) + 32 * h), t % 4));
  };
  tile_blocks<TYPE>(gp, x, r0, pagedllm::weight_prefetch_bytes(MR), [&](const uint8_t* U, const uint8_t* B, int64_t ci,
                                                                     const uint8_t* a) {
    const uint8_t* S = B + L.vbytes + L.hbytes;
    const int32_t* off = VNNI ? x.s16.data() + 2 * ci : x.off6.data() + 2 * ci;
    __m256i ia[2][MR];
#pragma GCC unroll 2
    for (int g = 0; g < 2; ++g) {  // values 0-15 (steps 0-3), then 16-31 (steps 4-7)
      __m256i p[2][MR];
#pragma GCC unroll 4  // (whole: each step's shifts are constants)
      for (int st = 0; st < 4; ++st) {
        const int t = 4 * g + st;
        const __m256i w0 = step(B, t, 0), w1 = step(B, t, 1);
        for (int r = 0; r < MR; ++r) {
          const __m256i av = _mm256_set1_epi32(static_cast<int>(u32(a + 32 * r + 4 * t)));
#ifdef PQ_AVXVNNI
          if constexpr (VNNI) {
            p[0][r] = PQ_DPBUSD256(st == 0 ? _mm256_setzero_si256() : p[0][r], w0, av);
            p[1][r] = PQ_DPBUSD256(st == 0 ? _mm256_setzero_si256() : p[1][r], w1, av);
            continue;
          }
#endif
          const __m256i q0 = _mm256_maddubs_epi16(w0, av), q1 = _mm256_maddubs_epi16(w1, av);
          p[0][r] = st == 0 ? q0 : _mm256_add_epi16(p[0][r], q0);
          p[1][r] = st == 0 ? q1 : _mm256_add_epi16(p[1][r], q1);
        }
        for (int r = 0; r < MR; ++r) asm volatile("" : "+x"(p[0][r]), "+x"(p[1][r]));
      }
      if constexpr (VNNI) {  // (q a - 32 a) x the row's scale, in int32
        const __m256i sc32[2] = {
            _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(S + 16 * g))),
            _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(S + 16 * g + 8)))};
        for (int r = 0; r < MR; ++r) {
          const __m256i c = _mm256_set1_epi32(32 * off[2 * r + g]);
          for (int h = 0; h < 2; ++h) {
            const __m256i q = _mm256_mullo_epi32(_mm256_sub_epi32(p[h][r], c), sc32[h]);
            ia[h][r] = g == 0 ? q : _mm256_add_epi32(ia[h][r], q);
          }
        }
        continue;
      }
      // The group's 16 scales as int16, each twice (both int16 of its row's lane): rows 0-7, 8-15.
      const __m256i sc = _mm256_permute4x64_epi64(
          _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(S + 16 * g))), 0xD8);
      const __m256i sch[2] = {_mm256_unpacklo_epi16(sc, sc), _mm256_unpackhi_epi16(sc, sc)};
      for (int r = 0; r < MR; ++r) {
        const __m256i c = _mm256_set1_epi32(off[2 * r + g]);
        for (int h = 0; h < 2; ++h) {
          const __m256i q = _mm256_madd_epi16(_mm256_sub_epi16(p[h][r], c), sch[h]);
          ia[h][r] = g == 0 ? q : _mm256_add_epi32(ia[h][r], q);
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(U + 16 * h)));
      for (int r = 0; r < MR; ++r)
        fa[h][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[h][r]), _mm256_mul_ps(dv, _mm256_set1_ps(x.d[ci + r])), fa[h][r]);
    }
  });
  for (int h = 0; h < 2; ++h)
    for (int r = 0; r < MR; ++r) _mm256_storeu_ps(y + (r0 + r) * ldy + 8 * h, fa[h][r]);
}

// Q6_K takes group_avx2_q6 at every tile size, the 4-bit formats group_avx2_wide at 3-4 rows. Here
// up to 2 rows (batch 1, in one or two levels) take each block's two halves in one pass over the
// group: every 64-byte line of the weights is read once, and the unit's scales once. More rows
// take the halves one after the other, as their accumulators and one half's weights fill the
// 16 registers.
// VNNI: the avxvnni level's kernels (row_avxvnni and the VNNI forms of the two above).
template <int64_t TYPE, int MR, bool VNNI = false>
void group_avx2(const uint8_t* gp, const QAct& x, int64_t r0, float* y, int64_t ldy) {
  constexpr PLayout L = playout(TYPE);
  if constexpr (L.split) {
    group_avx2_q6<TYPE, MR, VNNI>(gp, x, r0, y, ldy);
  } else if constexpr (L.nbits == 4 && MR >= 3 && MR <= 4) {
    group_avx2_wide<TYPE, MR, VNNI>(gp, x, r0, y, ldy);
  } else {
    const int ahead = pagedllm::weight_prefetch_bytes(MR);
    constexpr bool FUSED = MR <= 2;
    constexpr int NH = FUSED ? 2 : 1;
    for (int h0 = 0; h0 < 2; h0 += NH) {
      __m256 fa[NH][MR];
      for (int h = 0; h < NH; ++h)
        for (int r = 0; r < MR; ++r) fa[h][r] = _mm256_setzero_ps();
      for (int64_t u = 0; u < x.k / L.vals; ++u) {
        const uint8_t* U = gp + u * L.unit;
        for (int j = 0; j < L.vals / 32; ++j) {
          const uint8_t* B = U + L.hdr + j * L.blk;
          if (h0 == 0) prefetch_ahead(L, B, ahead);  // (a second pass reads the group from cache)
          const int64_t c = u * (L.vals / 32) + j;
          for (int hh = 0; hh < NH; ++hh) {
            const int h = h0 + hh;
            __m256 dv, mv;
            if constexpr (L.kq) dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(U + 16 * h)));
            if constexpr (L.kq && L.has_min) mv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(U + 32 + 16 * h)));
            __m256i W[8];
            __m256 s, mw, s_hi;
            decode_avx2<TYPE>(B, h, dv, mv, W, s, s_hi, mw);
#ifdef PQ_AVXVNNI
            if constexpr (VNNI) {
              for (int r = 0; r < MR; ++r) row_avxvnni<TYPE>(W, s, mw, x, x.at(r0 + r, c), fa[hh][r]);
              continue;
            }
#endif
            if constexpr (L.nbits == 8)
              for (int t = 0; t < 8; ++t) W[t] = _mm256_xor_si256(W[t], _mm256_set1_epi8(-128));  // back to int8
            for (int r = 0; r < MR; ++r) row_avx2<TYPE>(W, s, mw, x, x.at(r0 + r, c), fa[hh][r]);
          }
        }
      }
      for (int hh = 0; hh < NH; ++hh)
        for (int r = 0; r < MR; ++r) _mm256_storeu_ps(y + (r0 + r) * ldy + 8 * (h0 + hh), fa[hh][r]);
    }
  }
}
#endif  // PQ_X86

#ifdef PQ_HAS_VNNI
// ---------------------------------------------------------------------------------------------
// AVX-512 VNNI: 16 lanes = the whole group; vpdpbusd (u8 x s8, 4 products per lane).

// Block B of a group (its unit's d and dmin as dv, mv for the K-quants): its 8 steps' values
// as unsigned bytes W[t] (values 4t..4t+3 of the 16 rows; Q8_0 as value + 128) and its
// scales: s (values 0-15, or all), s_hi (Q6_K's 16-31) and the offsets' mw.
template <int64_t TYPE>
__attribute__((always_inline)) inline void decode_vnni(const uint8_t* B, __m512 dv, __m512 mv, __m512i* W, __m512& s, __m512& mw, __m512& s_hi) {
  constexpr PLayout L = playout(TYPE);
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  if constexpr (L.nbits == 8) {
    for (int t = 0; t < 8; ++t) W[t] = _mm512_loadu_si512(B + 64 * t);
  } else {
    for (int c = 0; c < 4; ++c) {
      const __m512i v = _mm512_loadu_si512(B + 64 * c);
      W[c] = _mm512_and_si512(v, m4);
      W[c + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
    }
    if constexpr (L.nbits == 5) {
      const __m512i b4 = _mm512_set1_epi8(0x10);
      for (int t = 0; t < 8; ++t) {
        uint64_t bits;
        std::memcpy(&bits, B + 256 + 8 * t, 8);
        W[t] = _mm512_or_si512(W[t], _mm512_maskz_mov_epi8(_cvtu64_mask64(bits), b4));
      }
    }
    if constexpr (L.nbits == 6) {
      const __m512i m30 = _mm512_set1_epi8(0x30);
      for (int h = 0; h < 2; ++h) {
        const __m512i hb = _mm512_loadu_si512(B + 256 + 64 * h);
        W[4 * h] = _mm512_or_si512(W[4 * h], _mm512_and_si512(_mm512_slli_epi16(hb, 4), m30));
        W[4 * h + 1] = _mm512_or_si512(W[4 * h + 1], _mm512_and_si512(_mm512_slli_epi16(hb, 2), m30));
        W[4 * h + 2] = _mm512_or_si512(W[4 * h + 2], _mm512_and_si512(hb, m30));
        W[4 * h + 3] = _mm512_or_si512(W[4 * h + 3], _mm512_and_si512(_mm512_srli_epi16(hb, 2), m30));
      }
    }
  }
  const uint8_t* S = B + L.vbytes + L.hbytes;
  if constexpr (L.split) {
    s = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(S)))));
    s_hi = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(S + 16)))));
  } else if constexpr (L.kq) {
    s = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(S)))));
    mw = _mm512_mul_ps(mv, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(S + 16)))));
  } else {
    s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(S)));
    if constexpr (L.has_min) mw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(S + 32)));
  }
}

// Q consecutive activation rows (from index ci: a block's rows are adjacent) against one decoded
// block: fa[q] += the block's products for row q. Two sums a row (values 0-15 and 16-31): Q6_K's
// halves have scales of their own, and two chains halve a row's dependent chain. The weights'
// offset (iofs * the activations' sum) is where the sums start, not an add after them.
template <int64_t TYPE, int Q>
__attribute__((always_inline)) inline void rows_vnni(const __m512i* W, __m512 s, __m512 mw, __m512 s_hi, const QAct& x,
                                                     int64_t ci, __m512* fa) {
  constexpr PLayout L = playout(TYPE);
  __m512i i0[Q], i1[Q];
  const uint8_t* a = reinterpret_cast<const uint8_t*>(x.a.data() + ci * 32);
#pragma GCC unroll 4
  for (int q = 0; q < Q; ++q) {
    if constexpr (L.split) {
      i0[q] = _mm512_set1_epi32(L.iofs * x.s16[2 * (ci + q)]);
      i1[q] = _mm512_set1_epi32(L.iofs * x.s16[2 * (ci + q) + 1]);
    } else {
      i0[q] = L.iofs != 0 ? _mm512_set1_epi32(L.iofs * x.s32[ci + q]) : _mm512_setzero_si512();
      i1[q] = _mm512_setzero_si512();
    }
  }
#pragma GCC unroll 4
  for (int t = 0; t < 4; ++t)
#pragma GCC unroll 4
    for (int q = 0; q < Q; ++q) {
      i0[q] = _mm512_dpbusd_epi32(i0[q], W[t], _mm512_set1_epi32(static_cast<int>(u32(a + 32 * q + 4 * t))));
      i1[q] = _mm512_dpbusd_epi32(i1[q], W[t + 4], _mm512_set1_epi32(static_cast<int>(u32(a + 32 * q + 16 + 4 * t))));
    }
  // The rows' activation scales read before any accumulator is touched: a float load after a
  // store to fa may alias it, which kept every accumulator in memory.
  __m512 d[Q], ds[Q];
#pragma GCC unroll 4
  for (int q = 0; q < Q; ++q) {
    d[q] = _mm512_set1_ps(x.d[ci + q]);
    if constexpr (!L.split && (L.kq || L.has_min)) ds[q] = _mm512_set1_ps(x.ds32[ci + q]);
  }
#pragma GCC unroll 4
  for (int q = 0; q < Q; ++q) {
    if constexpr (L.split) {
      fa[q] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0[q]), _mm512_mul_ps(s, d[q]), fa[q]);
      fa[q] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i1[q]), _mm512_mul_ps(s_hi, d[q]), fa[q]);
    } else {
      fa[q] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(i0[q], i1[q])), _mm512_mul_ps(s, d[q]), fa[q]);
      if constexpr (L.kq) fa[q] = _mm512_fnmadd_ps(mw, ds[q], fa[q]);
      else if constexpr (L.has_min) fa[q] = _mm512_fmadd_ps(mw, ds[q], fa[q]);
    }
  }
}

template <int64_t TYPE, int MR>
void group_vnni(const uint8_t* gp, const QAct& x, int64_t r0, float* y, int64_t ldy) {
  constexpr PLayout L = playout(TYPE);
  const int ahead = pagedllm::weight_prefetch_bytes(MR);
  // One accumulator a row (the weights' offsets fold into it): 16 rows fit the registers.
  __m512 fa[MR];
  for (int r = 0; r < MR; ++r) fa[r] = _mm512_setzero_ps();
  for (int64_t u = 0; u < x.k / L.vals; ++u) {
    const uint8_t* U = gp + u * L.unit;
    __m512 dv, mv;
    if constexpr (L.kq) dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(U)));
    if constexpr (L.kq && L.has_min) mv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(U + 32)));
    for (int j = 0; j < L.vals / 32; ++j) {
      const uint8_t* B = U + L.hdr + j * L.blk;
      prefetch_ahead(L, B, ahead);
      __m512i W[8];
      __m512 s, mw, s_hi;
      decode_vnni<TYPE>(B, dv, mv, W, s, mw, s_hi);
      const int64_t c = u * (L.vals / 32) + j;
      // Rows in quads (then a pair, then one), each quad's dot products interleaved, and the
      // loop unrolled so that every row's accumulator stays in a register.
      int r = 0;
#pragma GCC unroll 4
      for (; r + 4 <= MR; r += 4) rows_vnni<TYPE, 4>(W, s, mw, s_hi, x, x.at(r0 + r, c), fa + r);
      if constexpr (MR % 4 >= 2) { rows_vnni<TYPE, 2>(W, s, mw, s_hi, x, x.at(r0 + r, c), fa + r); r += 2; }
      if constexpr (MR % 2 == 1) rows_vnni<TYPE, 1>(W, s, mw, s_hi, x, x.at(r0 + r, c), fa + r);
    }
  }
  for (int r = 0; r < MR; ++r) _mm512_storeu_ps(y + (r0 + r) * ldy, fa[r]);
}

#if defined(__linux__)
// ---------------------------------------------------------------------------------------------
// AMX-BF16 (Sapphire Rapids and later), for steps of many rows. An integer tile product does
// not fit these formats: every 32-value block has its own scales, so each block's 16 x 16 dots
// would have to leave the tile to be scaled (a tile store each: slower than vpdpbusd). Here each block is decoded to bfloat16 weights, scales applied (s * q + m,
// rounded to nearest even: the values the dequantize + GEMM route multiplies), as one
// [16 pairs of values, 16 rows] tile; TDPBF16PS multiplies it with 16 activation rows and sums
// in float32 inside the tile over the whole row, and the sums leave the tile once per group.
#define PQ_AMX 1

struct TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// The CPU has AMX-TILE, AMX-BF16 and AVX512-BF16 (the weights' conversion) and Linux grants
// this process the tile state (5.16+).
bool amx_hardware() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 22)) || !(d & (1u << 24))) return false;
  if (!__builtin_cpu_supports("avx512bf16")) return false;
  constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

int64_t amx_rows() {
  static const bool hw = amx_hardware();
  return hw ? pagedllm::tuned_amx_rows.load(std::memory_order_relaxed) : 0;
}

// Tiles 0, 1: sums [16 rows, 16 floats]; 2, 3: activations [16 rows, 32 bf16]; 4: weights
// [16 pairs, 16 rows x 2 bf16]. Configured per call and released after: other libraries
// (oneDNN's AMX kernels) configure and release the tiles on the same threads.
__attribute__((target("amx-tile"))) void amx_begin() {
  TileConfig cfg;
  for (int t = 0; t < 5; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  // GCC 12 does not see that ldtilecfg reads the 64 bytes, and drops the stores above.
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

__attribute__((target("amx-tile"))) void amx_end() { _tile_release(); }

// Block B's weights as a bfloat16 tile: row 2t + h holds values 4t + 2h and 4t + 2h + 1 of
// the 16 weight rows, side by side per row.
template <int64_t TYPE>
__attribute__((target("avx512bf16"), always_inline)) inline void bf16_block(const uint8_t* B, __m512 dv, __m512 mv,
                                                                             uint8_t* out) {
  constexpr PLayout L = playout(TYPE);
  __m512i W[8];
  __m512 s, mw, s_hi;
  decode_vnni<TYPE>(B, dv, mv, W, s, mw, s_hi);
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i byte = _mm512_set1_epi32(0xFF);
  for (int t = 0; t < 8; ++t) {
    const __m512 st = L.split && t >= 4 ? s_hi : s;
    const __m512 m = L.kq && L.has_min ? _mm512_sub_ps(_mm512_setzero_ps(), mw)
                   : L.has_min ? mw : _mm512_mul_ps(_mm512_set1_ps(static_cast<float>(L.iofs)), st);
    __m512 f[4];
    for (int i = 0; i < 4; ++i)
      f[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(W[t], 8 * i), byte)), st, m);
    for (int h = 0; h < 2; ++h) {
      const __m512bh b = _mm512_cvtne2ps_pbh(f[2 * h + 1], f[2 * h]);
      _mm512_store_si512(out + 64 * (2 * t + h), _mm512_permutexvar_epi16(pairs, reinterpret_cast<const __m512i&>(b)));
    }
  }
}

template <int64_t TYPE>
__attribute__((target("avx512bf16,amx-tile,amx-bf16"))) void amx_groups(const uint8_t* w, int64_t gb, int64_t g0,
                                                                         int64_t g1, const c10::BFloat16* xb,
                                                                         int64_t m, int64_t k, float* y, int64_t ldy) {
  constexpr PLayout L = playout(TYPE);
  alignas(64) uint8_t wt[2][1024];
  alignas(64) float part[256];
  const int64_t ldx = k * 2;  // bytes between activation rows
  const uint8_t* xp = reinterpret_cast<const uint8_t*>(xb);
  const int ahead = pagedllm::weight_prefetch_bytes(16);
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* gp = w + g * gb;
    for (int64_t r0 = 0; r0 < m; r0 += 32) {
      const bool two = r0 + 16 < m;
      _tile_zero(0);
      _tile_zero(1);
      int64_t c = 0;
      for (int64_t u = 0; u < k / L.vals; ++u) {
        const uint8_t* U = gp + u * L.unit;
        __m512 dv = _mm512_setzero_ps(), mv = _mm512_setzero_ps();
        if constexpr (L.kq) dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(U)));
        if constexpr (L.kq && L.has_min) mv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(U + 32)));
        for (int j = 0; j < L.vals / 32; ++j, ++c) {
          const uint8_t* B = U + L.hdr + j * L.blk;
          if (r0 == 0) prefetch_ahead(L, B, ahead);
          uint8_t* wb = wt[c & 1];  // two buffers: a block's stores never wait on the last tile load
          bf16_block<TYPE>(B, dv, mv, wb);
          _tile_loadd(4, wb, 64);
          _tile_loadd(2, xp + r0 * ldx + c * 64, ldx);
          _tile_dpbf16ps(0, 2, 4);
          if (two) {
            _tile_loadd(3, xp + (r0 + 16) * ldx + c * 64, ldx);
            _tile_dpbf16ps(1, 3, 4);
          }
        }
      }
      for (int h = 0; h < (two ? 2 : 1); ++h) {
        const int64_t rb = r0 + 16 * h, rows = std::min<int64_t>(16, m - rb);
        if (h == 0) _tile_stored(0, part, 64); else _tile_stored(1, part, 64);
        for (int64_t r = 0; r < rows; ++r) _mm512_storeu_ps(y + (rb + r) * ldy + g * GR, _mm512_load_ps(part + 16 * r));
      }
    }
  }
}
#endif  // __linux__
#endif  // PQ_HAS_VNNI

#ifdef PQ_X86
template <int64_t TYPE, int MR>
inline void group_vnni_or(const uint8_t* gp, const QAct& x, int64_t r0, float* y, int64_t ldy) {
#ifdef PQ_HAS_VNNI
  group_vnni<TYPE, MR>(gp, x, r0, y, ldy);
#else
  group_avx2<TYPE, MR>(gp, x, r0, y, ldy);  // never dispatched: isa_supported() says no
#endif
}

// Groups [g0, g1) for every activation row, in row tiles of up to MAXR (each tile's results
// are computed the same way whatever the tile, so a row's output does not depend on the batch).
template <int ISA, int64_t TYPE>
void pgemm_simd(const uint8_t* w, int64_t gb, int64_t g0, int64_t g1, const QAct& x, float* y, int64_t ldy) {
  constexpr int MAXR = ISA == AVX512VNNI ? 16 : 4;
  auto run = [&](const uint8_t* gp, int64_t r0, int mr, float* yg) {
#define PQ_TILE(R)                                                   \
  case R:                                                            \
    if constexpr (R <= MAXR) {                                       \
      if constexpr (ISA == AVX512VNNI) group_vnni_or<TYPE, R>(gp, x, r0, yg, ldy); \
      else group_avx2<TYPE, R, ISA == AVXVNNI>(gp, x, r0, yg, ldy);  \
    }                                                                \
    break;
    switch (mr) {
      PQ_TILE(1) PQ_TILE(2) PQ_TILE(3) PQ_TILE(4) PQ_TILE(5) PQ_TILE(6) PQ_TILE(7) PQ_TILE(8)
      PQ_TILE(9) PQ_TILE(10) PQ_TILE(11) PQ_TILE(12) PQ_TILE(13) PQ_TILE(14) PQ_TILE(15) PQ_TILE(16)
    }
#undef PQ_TILE
  };
  for (int64_t g = g0; g < g1; ++g)
    for (int64_t r0 = 0; r0 < x.m; r0 += MAXR) run(w + g * gb, r0, static_cast<int>(std::min<int64_t>(MAXR, x.m - r0)), y + g * GR);
}
#endif

// ---------------------------------------------------------------------------------------------
// Dequantization of packed weights: rows (embedding lookups) and transposed tiles (prefill).

template <typename T>
void packed_row(const PLayout& L, const uint8_t* w, int64_t gb, int64_t row, int64_t k, T* out) {
  const int64_t g = row / GR;
  const int r = static_cast<int>(row % GR);
  for (int64_t u = 0; u < k / L.vals; ++u) {
    const uint8_t* U = w + g * gb + u * L.unit;
    for (int j = 0; j < L.vals / 32; ++j) {
      float s[2], m[2];
      packed_scale(L, U, j, r, 0, s[0], m[0]);
      packed_scale(L, U, j, r, 1, s[1], m[1]);
      const uint8_t* B = U + L.hdr + j * L.blk;
      T* o = out + u * L.vals + 32 * j;
      for (int i = 0; i < 32; ++i)
        o[i] = static_cast<T>(s[i / 16] * static_cast<float>(packed_value(L, B, r, i)) + m[i / 16]);
    }
  }
}

// Groups [g0, g1) as out[kk, (g - g0) * 16 + r] = w[16 g + r, kk]: a [K, rows] tile whose rows
// are the 16 lanes side by side, so every store is a run of lanes.
template <typename T>
void packed_tile_t(const PLayout& L, const uint8_t* w, int64_t gb, int64_t g0, int64_t g1, int64_t k, T* out,
                   int64_t ld) {
#ifdef PQ_X86
  if (isa_supported(AVX2)) {
    at::parallel_for(g0, g1, 1, [&](int64_t b, int64_t e) {
      for (int64_t g = b; g < e; ++g) {
        const uint8_t* gp = w + g * gb;
        T* o = out + (g - g0) * GR;
        switch (L.type) {
          case Q4_0: tile_avx2<Q4_0>(gp, k, o, ld); break;
          case Q4_1: tile_avx2<Q4_1>(gp, k, o, ld); break;
          case Q5_0: tile_avx2<Q5_0>(gp, k, o, ld); break;
          case Q5_1: tile_avx2<Q5_1>(gp, k, o, ld); break;
          case Q8_0: tile_avx2<Q8_0>(gp, k, o, ld); break;
          case Q4_K: tile_avx2<Q4_K>(gp, k, o, ld); break;
          case Q5_K: tile_avx2<Q5_K>(gp, k, o, ld); break;
          case Q6_K: tile_avx2<Q6_K>(gp, k, o, ld); break;
        }
      }
    });
    return;
  }
#endif
  at::parallel_for(g0, g1, 1, [&](int64_t b, int64_t e) {
    for (int64_t g = b; g < e; ++g)
      for (int64_t u = 0; u < k / L.vals; ++u) {
        const uint8_t* U = w + g * gb + u * L.unit;
        for (int j = 0; j < L.vals / 32; ++j) {
          float s[2][GR], m[2][GR];
          for (int r = 0; r < GR; ++r)
            for (int h = 0; h < 2; ++h) packed_scale(L, U, j, r, h, s[h][r], m[h][r]);
          const uint8_t* B = U + L.hdr + j * L.blk;
          T* o = out + (u * L.vals + 32 * j) * ld + (g - g0) * GR;
          for (int i = 0; i < 32; ++i)
            for (int r = 0; r < GR; ++r)
              o[i * ld + r] = static_cast<T>(s[i / 16][r] * static_cast<float>(packed_value(L, B, r, i)) + m[i / 16][r]);
        }
      }
  });
}

template <int64_t TYPE>
void pmatmul(int64_t isa, const uint8_t* w, int64_t gb, int64_t g0, int64_t g1, const QAct& x, float* y, int64_t ldy) {
#ifdef PQ_X86
  if constexpr (playout(TYPE).split)
    TORCH_CHECK(isa != AVX2 || static_cast<int64_t>(x.off6.size()) == x.m * (x.k / 16),
                "the AVX2 Q6_K kernel needs the activations quantized with their offsets (needs_off6)");
#ifdef PQ_HAS_VNNI
  if (isa == AVX512VNNI) return pgemm_simd<AVX512VNNI, TYPE>(w, gb, g0, g1, x, y, ldy);
#endif
#ifdef PQ_AVXVNNI
  if (isa == AVXVNNI) return pgemm_simd<AVXVNNI, TYPE>(w, gb, g0, g1, x, y, ldy);
#endif
  if (isa == AVX2) return pgemm_simd<AVX2, TYPE>(w, gb, g0, g1, x, y, ldy);
#endif
  pgemm_scalar(playout(TYPE), w, gb, g0, g1, x, y, ldy);
}

void packed_matmul(int64_t type, int64_t isa, const uint8_t* w, int64_t gb, int64_t g0, int64_t g1, const QAct& x,
                   float* y, int64_t ldy) {
  switch (type) {
    case Q4_0: return pmatmul<Q4_0>(isa, w, gb, g0, g1, x, y, ldy);
    case Q4_1: return pmatmul<Q4_1>(isa, w, gb, g0, g1, x, y, ldy);
    case Q5_0: return pmatmul<Q5_0>(isa, w, gb, g0, g1, x, y, ldy);
    case Q5_1: return pmatmul<Q5_1>(isa, w, gb, g0, g1, x, y, ldy);
    case Q8_0: return pmatmul<Q8_0>(isa, w, gb, g0, g1, x, y, ldy);
    case Q4_K: return pmatmul<Q4_K>(isa, w, gb, g0, g1, x, y, ldy);
    case Q5_K: return pmatmul<Q5_K>(isa, w, gb, g0, g1, x, y, ldy);
    case Q6_K: return pmatmul<Q6_K>(isa, w, gb, g0, g1, x, y, ldy);
  }
  TORCH_CHECK(false, "no packed layout for ggml type ", type);
}

#ifdef PQ_AMX
void amx_packed_matmul(int64_t type, const uint8_t* w, int64_t gb, int64_t g0, int64_t g1, const c10::BFloat16* xb,
                       int64_t m, int64_t k, float* y, int64_t ldy) {
  amx_begin();
  switch (type) {
    case Q4_0: amx_groups<Q4_0>(w, gb, g0, g1, xb, m, k, y, ldy); break;
    case Q4_1: amx_groups<Q4_1>(w, gb, g0, g1, xb, m, k, y, ldy); break;
    case Q5_0: amx_groups<Q5_0>(w, gb, g0, g1, xb, m, k, y, ldy); break;
    case Q5_1: amx_groups<Q5_1>(w, gb, g0, g1, xb, m, k, y, ldy); break;
    case Q8_0: amx_groups<Q8_0>(w, gb, g0, g1, xb, m, k, y, ldy); break;
    case Q4_K: amx_groups<Q4_K>(w, gb, g0, g1, xb, m, k, y, ldy); break;
    case Q5_K: amx_groups<Q5_K>(w, gb, g0, g1, xb, m, k, y, ldy); break;
    case Q6_K: amx_groups<Q6_K>(w, gb, g0, g1, xb, m, k, y, ldy); break;
  }
  amx_end();
}
#else
int64_t amx_rows() { return 0; }
void amx_packed_matmul(int64_t, const uint8_t*, int64_t, int64_t, int64_t, const c10::BFloat16*, int64_t, int64_t,
                       float*, int64_t) {
  TORCH_CHECK(false, "no AMX path in this build level");
}
#endif

void check_packed(const at::Tensor& w, int64_t type, int64_t k) {
  TORCH_CHECK(packable(type), "ggml type ", type, " has no packed layout");
  const PLayout L = playout(type);
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(),
              "a packed weight must be a contiguous CPU uint8 [rows / 16, group_bytes] tensor");
  TORCH_CHECK(k > 0 && k % L.vals == 0, "row length ", k, " is not a multiple of the format's block of ", L.vals);
  TORCH_CHECK(w.size(1) == packed_group_bytes(type, k), "packed groups hold ", w.size(1), " bytes, expected ",
              packed_group_bytes(type, k), " for rows of ", k, " values");
}

}  // namespace pq

using namespace pq;

// The file's layout [N, row_bytes] -> the packed layout [N / 16, group_bytes].
at::Tensor quant_pack(const at::Tensor& w, int64_t type, int64_t k) {
  const Fmt f = fmt_of(type);
  check_weight(w, f, k);
  TORCH_CHECK(packable(type), "ggml type ", type, " has no packed layout");
  TORCH_CHECK(w.size(0) % GR == 0, "packing needs a multiple of ", GR, " rows, got ", w.size(0));
  const PLayout L = playout(type);
  const int64_t groups = w.size(0) / GR, gb = packed_group_bytes(type, k), rb = w.stride(0);
  auto out = pagedllm::weight_buffer(groups * gb).view({groups, gb});  // huge pages (weight_memory.cpp)
  const uint8_t* src = w.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  auto pack = L.nbits == 8 ? pack_group<8> : L.nbits == 6 ? pack_group<6> : L.nbits == 5 ? pack_group<5> : pack_group<4>;
  TORCH_CHECK(L.nbits == 4 || L.nbits == 5 || L.nbits == 6 || L.nbits == 8, "no packing for ", L.nbits, "-bit values");
  at::parallel_for(0, groups, 16, [&](int64_t b, int64_t e) {
    for (int64_t g = b; g < e; ++g) pack(L, f, src + g * GR * rb, rb, k, dst + g * gb);
  });
  return out;
}

// Rows of a packed weight as `dtype`: the rows `ids` names (an embedding lookup), or, with
// transposed = true, groups [start / 16, (start + count) / 16) as a [K, count] tile (prefill's GEMM).
at::Tensor quant_dequant_packed(const at::Tensor& w, int64_t type, int64_t k, const c10::optional<at::Tensor>& ids,
                                int64_t start, int64_t count, at::ScalarType dtype, bool transposed,
                                const c10::optional<at::Tensor>& scratch) {
  check_packed(w, type, k);
  const PLayout L = playout(type);
  const int64_t gb = w.size(1), rows_all = w.size(0) * GR;
  const uint8_t* wp = w.data_ptr<uint8_t>();
  if (transposed) {
    if (count < 0) count = rows_all - start;
    TORCH_CHECK(start % GR == 0 && count % GR == 0 && start >= 0 && start + count <= rows_all,
                "packed tiles cover whole groups of ", GR, " rows within [0, ", rows_all, ")");
    const int64_t ld = count + TILE_PAD;
    auto out = scratch_view(scratch, {k, ld}, w.options().dtype(dtype));
    const int64_t g0 = start / GR, g1 = (start + count) / GR;
    switch (dtype) {
      case at::kFloat: packed_tile_t(L, wp, gb, g0, g1, k, out.data_ptr<float>(), ld); break;
      case at::kBFloat16: packed_tile_t(L, wp, gb, g0, g1, k, out.data_ptr<c10::BFloat16>(), ld); break;
      case at::kHalf: packed_tile_t(L, wp, gb, g0, g1, k, out.data_ptr<c10::Half>(), ld); break;
      default: TORCH_CHECK(false, "dtype must be float32, bfloat16 or float16");
    }
    return out.narrow(1, 0, count);
  }
  at::Tensor idx;
  std::vector<int64_t> range;
  const int64_t* ip;
  int64_t rows;
  if (ids.has_value()) {
    idx = ids->to(at::kLong).contiguous();
    rows = idx.numel();
    ip = idx.data_ptr<int64_t>();
    for (int64_t i = 0; i < rows; ++i)
      TORCH_CHECK(ip[i] >= 0 && ip[i] < rows_all, "row id ", ip[i], " is out of range [0, ", rows_all, ")");
  } else {
    if (count < 0) count = rows_all - start;
    TORCH_CHECK(start >= 0 && start + count <= rows_all, "rows [", start, ", ", start + count, ") out of range");
    rows = count;
    for (int64_t i = 0; i < rows; ++i) range.push_back(start + i);
    ip = range.data();
  }
  auto out = scratch_view(scratch, {rows, k}, w.options().dtype(dtype));
  at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      switch (dtype) {
        case at::kFloat: packed_row(L, wp, gb, ip[i], k, out.data_ptr<float>() + i * k); break;
        case at::kBFloat16: packed_row(L, wp, gb, ip[i], k, out.data_ptr<c10::BFloat16>() + i * k); break;
        case at::kHalf: packed_row(L, wp, gb, ip[i], k, out.data_ptr<c10::Half>() + i * k); break;
        default: break;
      }
    }
  });
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, "dtype must be float32, bfloat16 or float16");
  return out;
}

PAGEDLLM_REGISTER(quant_packed) {
  m.def("quant_pack(Tensor w, int type, int k) -> Tensor", &quant_pack);
  m.def("quant_dequant_packed(Tensor w, int type, int k, Tensor? ids=None, int start=0, int count=-1, "
        "ScalarType dtype=float, bool transposed=False, Tensor? scratch=None) -> Tensor", &quant_dequant_packed);
  m.def("quant_amx_rows() -> int", &amx_rows);
}

}  // namespace PAGEDLLM_ISA
