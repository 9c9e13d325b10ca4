// The sampler's first look at each row of logits, in one pass after the max: the k largest
// logits with their ids, and the softmax denominator sum_j exp((x_j - max) / T). In torch this
// is a topk plus four full passes over the rows (subtract, divide, exp, sum); here each row
// is read twice, 8 lanes at a time, and the candidates are kept by a running threshold that
// rarely lets a value through once k good ones are known.
#include "isa.h"  // first: the library headers, and the level this object is compiled for
#include "quant_common.h"  // the x86 SIMD helpers (exp8, hsum)

namespace PAGEDLLM_ISA {

namespace {
#ifdef PQ_X86
using pq::exp8;
using pq::hsum;
#endif

using Cand = std::pair<float, int64_t>;

inline bool before(const Cand& a, const Cand& b) {  // larger value first, then smaller id
  return a.first > b.first || (a.first == b.first && a.second < b.second);
}

// A candidate as one integer that sorts like (value descending, id ascending): the value's
// bits made order-preserving in the high half, the id's complement in the low half. Sorting
// these runs several times faster than sorting (value, id) pairs with a tie-break.
inline uint64_t cand_key(float x, int64_t i) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  b = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
  return (static_cast<uint64_t>(b) << 32) | (0xFFFFFFFFu - static_cast<uint32_t>(i));
}
inline void key_cand(uint64_t key, float& x, int64_t& i) {
  uint32_t b = static_cast<uint32_t>(key >> 32);
  b = (b & 0x80000000u) ? (b & 0x7FFFFFFFu) : ~b;
  std::memcpy(&x, &b, 4);
  i = static_cast<int64_t>(0xFFFFFFFFu - static_cast<uint32_t>(key));
}

// Keys in descending order of their value half, stably (ties keep their order: the scan
// collects ids ascending, so ties come out by id, as cand_key orders them). An LSD radix sort
// over the value's 4 bytes: a few linear passes where std::sort on thousands of keys made the
// sampler's large levels slow; a byte every key shares is skipped.
void radix_desc(std::vector<uint64_t>& keys) {
  thread_local std::vector<uint64_t> tmp;
  const size_t n = keys.size();
  tmp.resize(n);
  uint64_t* src = keys.data();
  uint64_t* dst = tmp.data();
  for (int shift = 32; shift < 64; shift += 8) {
    size_t cnt[257] = {0};
    for (size_t j = 0; j < n; ++j) ++cnt[((~src[j]) >> shift & 0xFF) + 1];
    if (cnt[((~src[0]) >> shift & 0xFF) + 1] == n) continue;  // one bucket: already in order
    for (int b = 0; b < 256; ++b) cnt[b + 1] += cnt[b];
    for (size_t j = 0; j < n; ++j) dst[cnt[(~src[j]) >> shift & 0xFF]++] = src[j];
    std::swap(src, dst);
  }
  if (src != keys.data()) std::memcpy(keys.data(), src, n * sizeof(uint64_t));
}

// Many candidates and no sum (the sampler's later levels): a threshold estimated from every
// 8th value, then one pass keeps everything at or above it. Exact whenever at least k values
// pass (checked); false sends the row to the general path.
bool row_topk_sampled(const float* x, int64_t v, int64_t k, float* vals, int64_t* ids) {
  constexpr int64_t STRIDE = 8;
  const int64_t ns = v / STRIDE, want = std::min(ns, k / STRIDE + k / (2 * STRIDE) + 8);
  if (ns < 64 || want < 1) return false;
  float est = -std::numeric_limits<float>::infinity();
  if (4 * k < v) {  // else every value is a candidate anyway
    thread_local std::vector<float> sample;
    sample.resize(ns);
    for (int64_t j = 0; j < ns; ++j) sample[j] = x[j * STRIDE];
    std::nth_element(sample.begin(), sample.begin() + (want - 1), sample.end(), std::greater<float>());
    est = sample[want - 1];
  }
  thread_local std::vector<uint64_t> keys;
  keys.clear();
  int64_t i = 0;
#ifdef PQ_X86
  const __m256 ev = _mm256_set1_ps(est);
  for (; i + 8 <= v; i += 8) {
    int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), ev, _CMP_GE_OQ));
    while (mask) {
      const int b = __builtin_ctz(mask);
      mask &= mask - 1;
      keys.push_back(cand_key(x[i + b], i + b));
    }
  }
#endif
  for (; i < v; ++i)
    if (x[i] >= est) keys.push_back(cand_key(x[i], i));
  if (static_cast<int64_t>(keys.size()) < k) return false;  // (NaNs fail every comparison)
  radix_desc(keys);
  for (int64_t j = 0; j < k; ++j) key_cand(keys[j], vals[j], ids[j]);
  return true;
}

void row_topk(const float* x, int64_t v, int64_t k, float temp, float* vals, int64_t* ids, float* total) {
  if (total == nullptr && k >= 256 && row_topk_sampled(x, v, k, vals, ids)) return;
  constexpr float NEG = -std::numeric_limits<float>::infinity();
  float m = NEG;
  int64_t i = 0;
  const bool with_total = total != nullptr;  // else the candidates only: one pass, no exp
#ifdef PQ_X86
  if (with_total) {
  __m256 mv = _mm256_set1_ps(NEG);
  for (; i + 8 <= v; i += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(x + i));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mv);
  for (float l : lanes) m = std::max(m, l);
  }
#endif
  if (with_total)
    for (; i < v; ++i) m = std::max(m, x[i]);
  const float it = 1.f / temp;
  thread_local std::vector<Cand> cand;
  cand.clear();
  cand.reserve(4 * k + 8);
  float thr = NEG;  // once k candidates are known, only values above the k-th can enter
  auto shrink = [&] {
    std::nth_element(cand.begin(), cand.begin() + (k - 1), cand.end(), before);
    cand.resize(k);
    thr = cand[k - 1].first;
    for (const Cand& c : cand) thr = std::min(thr, c.first);
  };
  float sum = 0.f;
  i = 0;
#ifdef PQ_X86
  __m256 acc = _mm256_setzero_ps();
  double dsum = 0.;  // float lanes sum 2048 values at a time; the chunks add up in double
  const __m256 mm = _mm256_set1_ps(m), itv = _mm256_set1_ps(it);
  for (; i + 8 <= v; i += 8) {
    const __m256 xv = _mm256_loadu_ps(x + i);
    if (with_total) acc = _mm256_add_ps(acc, exp8(_mm256_mul_ps(_mm256_sub_ps(xv, mm), itv)));
    if (with_total && (i & 2047) == 2040) {
      dsum += hsum(acc);
      acc = _mm256_setzero_ps();
    }
    int mask = _mm256_movemask_ps(_mm256_cmp_ps(xv, _mm256_set1_ps(thr), _CMP_GT_OQ));
    while (mask) {
      const int b = __builtin_ctz(mask);
      mask &= mask - 1;
      cand.emplace_back(x[i + b], i + b);
    }
    if (static_cast<int64_t>(cand.size()) >= 4 * k) shrink();
  }
  sum = static_cast<float>(dsum + hsum(acc));
#endif
  for (; i < v; ++i) {
    if (with_total) sum += std::exp((x[i] - m) * it);
    if (x[i] > thr) cand.emplace_back(x[i], i);
    if (static_cast<int64_t>(cand.size()) >= 4 * k) shrink();
  }
  if (static_cast<int64_t>(cand.size()) < k) {  // fewer than k values above -inf (a masked row)
    std::vector<char> taken(v, 0);
    for (const Cand& c : cand) taken[c.second] = 1;
    for (int64_t j = 0; j < v && static_cast<int64_t>(cand.size()) < k; ++j)
      if (!taken[j]) cand.emplace_back(x[j], j);
  }
  std::partial_sort(cand.begin(), cand.begin() + k, cand.end(), before);
  for (int64_t j = 0; j < k; ++j) {
    vals[j] = cand[j].first;
    ids[j] = cand[j].second;
  }
  if (with_total) *total = sum;
}

}  // namespace

// logits [N, v] float32, temps [n] float32, rows [n] (which rows of logits; all when None)
// -> (the k largest logits per row, descending [n, k]; their ids [n, k] int64;
// sum_j exp((x_j - max_j x) / T) [n], or [0] when with_total is false).
std::tuple<at::Tensor, at::Tensor, at::Tensor> sample_topk(const at::Tensor& logits, const at::Tensor& temps, int64_t k,
                                                           const c10::optional<at::Tensor>& rows, bool with_total) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat && logits.dim() == 2,
              "sample_topk: logits must be a CPU float32 [rows, vocab] tensor");
  const int64_t v = logits.size(1);
  at::Tensor rc;
  const int64_t* rp = nullptr;
  int64_t n = logits.size(0);
  if (rows.has_value()) {
    rc = rows->to(at::kLong).contiguous();
    rp = rc.data_ptr<int64_t>();
    n = rc.numel();
    for (int64_t i = 0; i < n; ++i)
      TORCH_CHECK(rp[i] >= 0 && rp[i] < logits.size(0), "sample_topk: row ", rp[i], " out of range");
  }
  TORCH_CHECK(k >= 1 && k <= v, "sample_topk: k = ", k, " must be in [1, ", v, "]");
  TORCH_CHECK(temps.numel() == n && temps.scalar_type() == at::kFloat, "sample_topk: one float32 temperature per row");
  const auto lc = logits.contiguous();
  const auto tc = temps.contiguous();
  auto vals = at::empty({n, k}, logits.options());
  auto ids = at::empty({n, k}, logits.options().dtype(at::kLong));
  auto total = at::empty({with_total ? n : 0}, logits.options());
  const float* xp = lc.data_ptr<float>();
  const float* tp = tc.data_ptr<float>();
  float* vp = vals.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  float* sp = total.data_ptr<float>();
  at::parallel_for(0, n, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r)
      row_topk(xp + (rp ? rp[r] : r) * v, v, k, tp[r], vp + r * k, ip + r * k, with_total ? sp + r : nullptr);
  });
  return {vals, ids, total};
}


namespace {
inline uint32_t mix32(uint32_t x) {  // lowbias32, as sampling/sampler.py's mix32
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  return x ^ (x >> 16);
}
}  // namespace

// One candidate level of the sampler for n rows, in one call: the k best candidates' logits
// (descending) and ids, each row's temperature, softmax denominator, filters and hash key.
// Per row, as sampler.py's _filter and _gumbel do in torch: probabilities p_j = exp((x_j -
// x_0) / T) / total, kept while j < top_k, the mass before j is at most top_p (cumulative
// sums in double, as torch's cumsum), and p_j >= min_p p_0; the row is decided when the
// level provably holds every kept token (complete, top_k <= k, the mass passed top_p, or the
// last candidate dropped). A decided row draws argmax_j log p_j + G_j over its kept tokens,
// G_j = -log(-log u) with u from hash(token_hash[id_j] ^ key). Returns (tokens [n], -1 where
// undecided; need [n]: for an undecided row a lower bound on the candidates it needs, 0 if
// unknown).
std::tuple<at::Tensor, at::Tensor> sample_candidates(const at::Tensor& vals, const at::Tensor& ids,
                                                     const at::Tensor& temps, const at::Tensor& total,
                                                     const at::Tensor& top_k, const at::Tensor& top_p,
                                                     const at::Tensor& min_p, const at::Tensor& keys,
                                                     const at::Tensor& token_hash, bool complete) {
  TORCH_CHECK(vals.dim() == 2 && vals.scalar_type() == at::kFloat && vals.device().is_cpu(),
              "sample_candidates: vals must be a CPU float32 [n, k] tensor");
  const int64_t n = vals.size(0), k = vals.size(1);
  TORCH_CHECK(ids.sizes() == vals.sizes() && ids.scalar_type() == at::kLong, "sample_candidates: ids must be int64 [n, k]");
  for (const at::Tensor* t : {&temps, &total, &top_p, &min_p})
    TORCH_CHECK(t->numel() == n && t->scalar_type() == at::kFloat, "sample_candidates: one float32 value per row");
  TORCH_CHECK(top_k.numel() == n && top_k.scalar_type() == at::kLong && keys.numel() == n &&
                  keys.scalar_type() == at::kLong, "sample_candidates: top_k and keys must be int64 [n]");
  TORCH_CHECK(token_hash.dim() == 1 && token_hash.scalar_type() == at::kLong, "sample_candidates: token_hash must be int64 [v]");
  const int64_t v = token_hash.numel();
  const auto vc = vals.contiguous(), ic = ids.contiguous(), tc = temps.contiguous(), zc = total.contiguous();
  const auto kc = top_k.contiguous(), pc = top_p.contiguous(), mc = min_p.contiguous(), hc = keys.contiguous();
  const auto th = token_hash.contiguous();
  const float* vp = vc.data_ptr<float>();
  const int64_t* ip = ic.data_ptr<int64_t>();
  const int64_t* hp = th.data_ptr<int64_t>();
  for (int64_t j = 0; j < n * k; ++j)
    TORCH_CHECK(ip[j] >= 0 && ip[j] < v, "sample_candidates: token id ", ip[j], " outside the vocabulary of ", v);
  auto tokens = at::full({n}, -1, ids.options());
  auto need = at::zeros({n}, vals.options());
  int64_t* op = tokens.data_ptr<int64_t>();
  float* np = need.data_ptr<float>();
  at::parallel_for(0, n, 1, [&](int64_t b, int64_t e) {
    std::vector<float> p(k);
    std::vector<char> keep(k);
    for (int64_t r = b; r < e; ++r) {
      const float* x = vp + r * k;
      const float t = tc.data_ptr<float>()[r], z = zc.data_ptr<float>()[r];
      const float tp = pc.data_ptr<float>()[r], mp = mc.data_ptr<float>()[r];
      const int64_t tk = kc.data_ptr<int64_t>()[r];
      double cum = 0.;
      float cum_f = 0.f;
      for (int64_t j = 0; j < k; ++j) {
        p[j] = std::exp((x[j] - x[0]) / t) / z;
        cum += p[j];
        cum_f = static_cast<float>(cum);
        keep[j] = j < tk && cum_f - p[j] <= tp && p[j] >= mp * p[0];
      }
      const bool done = complete || tk <= k || cum_f > tp || !keep[k - 1];
      if (!done) {
        // Every later token is at most p[k-1]: the mass still missing needs this many more.
        const float bound = std::min(static_cast<float>(tk), k + (tp - cum_f) / p[k - 1]);
        np[r] = mp > 0.f || std::isnan(bound) ? 0.f : bound;  // min_p can end a row anywhere
        continue;
      }
      const uint32_t key = static_cast<uint32_t>(hc.data_ptr<int64_t>()[r]);
      float best = -std::numeric_limits<float>::infinity();
      int64_t arg = 0;
      for (int64_t j = 0; j < k; ++j) {
        if (!keep[j]) continue;
        const uint32_t h = mix32(static_cast<uint32_t>(hp[ip[r * k + j]]) ^ key);
        const float u = (static_cast<float>(h >> 8) + 0.5f) * (1.0f / 16777216.0f);
        const float score = std::log(p[j]) - std::log(-std::log(u));
        if (score > best) {
          best = score;
          arg = j;
        }
      }
      op[r] = ip[r * k + arg];
    }
  });
  return {tokens, need};
}

// Greedy tokens: for each row of logits [B, V] float32, the id of its largest value (the first
// of equal ones, as torch.argmax), and -1 where `check_finite` and the row holds a NaN or an
// infinity (the sampler's failed-row mark). One pass for the max and the check, one to find
// its first place, where torch took four ops and as many passes (sum, isfinite, argmax,
// masked_fill) over every row.
namespace {
void greedy_row(const float* x, int64_t v, bool check_finite, int64_t* out) {
  float m = -std::numeric_limits<float>::infinity();
  bool bad = false;
  int64_t j = 0;
#ifdef PQ_X86
  __m256 mv = _mm256_set1_ps(m), badv = _mm256_setzero_ps();
  for (; j + 8 <= v; j += 8) {
    const __m256 xv = _mm256_loadu_ps(x + j);
    mv = _mm256_max_ps(mv, xv);
    // x - x is 0 for a finite x, NaN for an infinity or a NaN: unordered against 0.
    badv = _mm256_or_ps(badv, _mm256_cmp_ps(_mm256_sub_ps(xv, xv), _mm256_setzero_ps(), _CMP_UNORD_Q));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mv);
  for (float l : lanes) m = std::max(m, l);
  bad = _mm256_movemask_ps(badv) != 0;
#endif
  for (; j < v; ++j) {
    m = std::max(m, x[j]);
    bad = bad || !std::isfinite(x[j]);
  }
  if (check_finite && bad) {
    *out = -1;
    return;
  }
  int64_t arg = 0;  // (a NaN row, not checked: any id will do, it is in range)
  for (int64_t i = 0; i < v; ++i)
    if (x[i] == m) {
      arg = i;
      break;
    }
  *out = arg;
}
}  // namespace

at::Tensor greedy_tokens(const at::Tensor& logits, bool check_finite) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.scalar_type() == at::kFloat,
              "greedy_tokens: logits must be a CPU float32 [B, V] tensor");
  TORCH_CHECK(logits.size(1) > 0, "greedy_tokens: rows of no logits");
  const auto lc = logits.stride(1) == 1 ? logits : logits.contiguous();
  const int64_t b = lc.size(0), v = lc.size(1), ld = lc.stride(0);
  auto ids = at::empty({b}, logits.options().dtype(at::kLong));
  const float* lp = lc.data_ptr<float>();
  int64_t* op = ids.data_ptr<int64_t>();
  at::parallel_for(0, b, 2, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) greedy_row(lp + r * ld, v, check_finite, op + r);
  });
  return ids;
}

PAGEDLLM_REGISTER(sample_kernels) {
  m.def("greedy_tokens(Tensor logits, bool check_finite=True) -> Tensor", &greedy_tokens);
  m.def("sample_topk(Tensor logits, Tensor temps, int k, Tensor? rows=None, bool with_total=True) -> "
        "(Tensor, Tensor, Tensor)",
        &sample_topk);
  m.def("sample_candidates(Tensor vals, Tensor ids, Tensor temps, Tensor total, Tensor top_k, Tensor top_p, "
        "Tensor min_p, Tensor keys, Tensor token_hash, bool complete) -> (Tensor, Tensor)",
        &sample_candidates);
}

}  // namespace PAGEDLLM_ISA
