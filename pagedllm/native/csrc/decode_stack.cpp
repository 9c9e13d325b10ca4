// A decode step of a quantized Llama-family model, every decoder layer in one native call.
// Each layer is the same five calls the Python path makes (quant_linear for q|k|v with the
// input norm and bias, paged_decode_qkv for rope + cache write + attention, quant_linear for
// o_proj + residual, gate|up with the post-attention norm and silu(gate) * up, down_proj +
// residual), so the results are the same bits; what goes is the interpreter and dispatcher
// work around 150 small calls a token, a large share of a batch-1 step on a 135M model.
//
// LoRA adapters (pagedllm/lora): a step whose rows use adapters passes, per projection and
// slot, A [r', in] and B^T in panels of 32 output columns (each panel's nonzero rows one after
// another, with an index of panel offsets and entry ranks: lora.layers.LinearLoRA), and the
// step's row groups (a slot and its rows, or every row). Each projection with an adapter in a
// used slot adds, per group, (x[rows] A^T) B^T to the float32 product of its normed input,
// before the bias, the activation and the residual: where the Python path's LinearLoRA.add
// puts it.
#include "isa.h"  // first: the library headers, and the level this object is compiled for
#include "quant_common.h"

// cpu_kernels.cpp's attention, from the object dispatch.cpp registers beside this one: this
// level's, or at avxvnni (where cpu_kernels is not compiled) the AVX2 one (isa.h).
namespace PAGEDLLM_ISA_CPU_KERNELS {
at::Tensor paged_decode_qkv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                            at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slot_mapping,
                            const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t hq,
                            int64_t hkv, double scale, int64_t window,
                            const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale);
}  // namespace PAGEDLLM_ISA_CPU_KERNELS

namespace PAGEDLLM_ISA {

using PAGEDLLM_ISA_CPU_KERNELS::paged_decode_qkv;

std::tuple<at::Tensor, at::Tensor> quant_moe_block(const at::Tensor& x, const at::Tensor& norm_weight, double eps,
                                                   const at::Tensor& router, int64_t top_k, bool renormalize,
                                                   bool round_weights, at::TensorList gate_up,
                                                   at::IntArrayRef gu_types, at::IntArrayRef gu_parts,
                                                   at::TensorList down, at::IntArrayRef down_types, int64_t isa,
                                                   int64_t x2);

void qk_norm(at::Tensor qkv, const at::Tensor& wq, const at::Tensor& wk, int64_t hq, int64_t hkv, double eps,
             double clip);

namespace {

// One adapter's rows of a step: which rows of x / y (all when `rows` is null), its weights.
struct LoRAGroup {
  const int64_t* rows;
  int64_t nrows;
  const at::Tensor* a;      // [r, K] in the model's dtype
  const void* panels;       // [entries, 32] in A's dtype: panel p's entries are [off[p], off[p + 1])
  const int64_t* off;       // [panels + 1]
  const int64_t* rank;      // [entries]: the B^T row each entry holds
};
constexpr int64_t PANEL = 32;  // as lora.layers.PANEL

template <typename T>
inline float as_float(T v) { return static_cast<float>(v); }
// bfloat16 is float32's top half: a shift, which the compiler vectorizes (c10's conversion it does not).
template <>
inline float as_float(c10::BFloat16 v) {
  const uint32_t u = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

#ifdef PQ_X86
// t[i, j + q] = x[i] . A[j + q] for R rows and Q ranks: each load of A serves R rows and each
// load of x Q ranks, all R * Q sums in registers.
template <typename T, int R, int Q>
inline void shrink_block(const float* const* x, const T* a, int64_t K, float* t, int64_t r, int64_t j) {
  __m256 acc[R][Q];
  for (int i = 0; i < R; ++i)
    for (int q = 0; q < Q; ++q) acc[i][q] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 w[Q];
    for (int q = 0; q < Q; ++q) w[q] = pq::load8(a + (j + q) * K + k);
    for (int i = 0; i < R; ++i) {
      const __m256 xv = _mm256_loadu_ps(x[i] + k);
      for (int q = 0; q < Q; ++q) acc[i][q] = _mm256_fmadd_ps(xv, w[q], acc[i][q]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int q = 0; q < Q; ++q) {
      float s = pq::hsum(acc[i][q]);
      for (int64_t kk = k; kk < K; ++kk) s += x[i][kk] * as_float(a[(j + q) * K + kk]);
      t[i * r + j + q] = s;
    }
}

template <typename T, int R, int Q>
void shrink_rows(const float* const* x, const T* a, int64_t K, float* t, int64_t r, int64_t j0, int64_t j1) {
  int64_t j = j0;
  for (; j + Q <= j1; j += Q) shrink_block<T, R, Q>(x, a, K, t, r, j);
  for (; j < j1; ++j) shrink_block<T, R, 1>(x, a, K, t, r, j);
}

// t[i, j] = x[row i] . A[j] for one group, rows i in [0, nrows), ranks j in [j0, j1): four rows
// and two ranks a block (each A load, a bfloat16 conversion, serves four rows), then two rows
// and four ranks, then one (R * Q sums, R + Q loads: within AVX2's 16 registers).
template <typename T>
void lora_shrink(const float* x, int64_t K, const LoRAGroup& g, float* t, int64_t j0, int64_t j1) {
  const T* a = g.a->data_ptr<T>();
  const int64_t r = g.a->size(0);
  auto row = [&](int64_t i) { return x + (g.rows ? g.rows[i] : i) * K; };
  int64_t i = 0;
  for (; i + 4 <= g.nrows; i += 4) {
    const float* xr[4] = {row(i), row(i + 1), row(i + 2), row(i + 3)};
    shrink_rows<T, 4, 2>(xr, a, K, t + i * r, r, j0, j1);
  }
  for (; i + 2 <= g.nrows; i += 2) {
    const float* xr[2] = {row(i), row(i + 1)};
    shrink_rows<T, 2, 4>(xr, a, K, t + i * r, r, j0, j1);
  }
  if (i < g.nrows) {
    const float* xr[1] = {row(i)};
    shrink_rows<T, 1, 4>(xr, a, K, t + i * r, r, j0, j1);
  }
}

// y[i, c0 : c1] += sum over panel p's entries e of t[i, rank[e]] * panel_e for R rows, the
// columns [c0, c1) inside panel p: each load of a panel row serves R rows, the sums stay in
// registers until y is touched once, and the panels are read in order, one run of memory.
template <typename T, int R, int V>
inline void expand_panel(const float* const* ti, float* const* yi, const T* data, const int64_t* off,
                         const int64_t* rank, int64_t p, int64_t c0, int64_t c1) {
  const int64_t base = p * PANEL, e0 = off[p], e1 = off[p + 1];
  if (c0 == base && c1 == base + PANEL) {
    for (int64_t cc = 0; cc < PANEL; cc += 8 * V) {  // V vectors of the panel's row a pass
      __m256 acc[R][V];
      for (int i = 0; i < R; ++i)
        for (int v = 0; v < V; ++v) acc[i][v] = _mm256_setzero_ps();
      for (int64_t e = e0; e < e1; ++e) {
        __m256 b[V];
        for (int v = 0; v < V; ++v) b[v] = pq::load8(data + e * PANEL + cc + 8 * v);
        for (int i = 0; i < R; ++i) {
          const __m256 tv = _mm256_broadcast_ss(ti[i] + rank[e]);
          for (int v = 0; v < V; ++v) acc[i][v] = _mm256_fmadd_ps(tv, b[v], acc[i][v]);
        }
      }
      for (int i = 0; i < R; ++i)
        for (int v = 0; v < V; ++v) {
          float* yo = yi[i] + c0 + cc + 8 * v;
          _mm256_storeu_ps(yo, _mm256_add_ps(_mm256_loadu_ps(yo), acc[i][v]));
        }
    }
    return;
  }
  // Part of a panel: the edge of a thread's columns, or the last panel of an odd width.
  int64_t c = c0;
  for (; c + 8 <= c1; c += 8) {
    __m256 acc[R];
    for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t e = e0; e < e1; ++e) {
      const __m256 b = pq::load8(data + e * PANEL + (c - base));
      for (int i = 0; i < R; ++i) acc[i] = _mm256_fmadd_ps(_mm256_broadcast_ss(ti[i] + rank[e]), b, acc[i]);
    }
    for (int i = 0; i < R; ++i) _mm256_storeu_ps(yi[i] + c, _mm256_add_ps(_mm256_loadu_ps(yi[i] + c), acc[i]));
  }
  for (; c < c1; ++c)
    for (int64_t e = e0; e < e1; ++e)
      for (int i = 0; i < R; ++i) yi[i][c] += ti[i][rank[e]] * as_float(data[e * PANEL + (c - base)]);
}

template <typename T, int R, int V>
void expand_rows(const float* const* ti, float* const* yi, const LoRAGroup& g, int64_t o0, int64_t o1) {
  const T* data = static_cast<const T*>(g.panels);
  for (int64_t c = o0; c < o1;) {
    const int64_t p = c / PANEL, ce = std::min(o1, (p + 1) * PANEL);
    expand_panel<T, R, V>(ti, yi, data, g.off, g.rank, p, c, ce);
    c = ce;
  }
}

// y[row i, o] += sum_j t[i, j] B^T[j, o] for output columns o in [o0, o1): four rows and two
// vectors of a panel's row a block (each panel load, a bfloat16 conversion, serves four rows),
// then two rows and four vectors, then one.
template <typename T>
void lora_expand(const float* t, float* y, int64_t N, const LoRAGroup& g, int64_t o0, int64_t o1) {
  const int64_t r = g.a->size(0);
  auto out = [&](int64_t i) { return y + (g.rows ? g.rows[i] : i) * N; };
  int64_t i = 0;
  for (; i + 4 <= g.nrows; i += 4) {
    const float* ti[4] = {t + i * r, t + (i + 1) * r, t + (i + 2) * r, t + (i + 3) * r};
    float* yi[4] = {out(i), out(i + 1), out(i + 2), out(i + 3)};
    expand_rows<T, 4, 2>(ti, yi, g, o0, o1);
  }
  for (; i + 2 <= g.nrows; i += 2) {
    const float* ti[2] = {t + i * r, t + (i + 1) * r};
    float* yi[2] = {out(i), out(i + 1)};
    expand_rows<T, 2, 4>(ti, yi, g, o0, o1);
  }
  if (i < g.nrows) {
    const float* ti[1] = {t + i * r};
    float* yi[1] = {out(i)};
    expand_rows<T, 1, 4>(ti, yi, g, o0, o1);
  }
}
#else
// t[i, j] = x[row i] . A[j] for one group, rows i in [0, nrows), ranks j in [j0, j1). Four rows
// at a time: each load of A serves four dot products, in four independent accumulators.
template <typename T>
void lora_shrink(const float* x, int64_t K, const LoRAGroup& g, float* t, int64_t j0, int64_t j1) {
  const T* a = g.a->data_ptr<T>();
  const int64_t r = g.a->size(0);
  auto row = [&](int64_t i) { return x + (g.rows ? g.rows[i] : i) * K; };
  for (int64_t j = j0; j < j1; ++j) {
    const T* aj = a + j * K;
    int64_t i = 0;
    for (; i + 4 <= g.nrows; i += 4) {
      const float *x0 = row(i), *x1 = row(i + 1), *x2 = row(i + 2), *x3 = row(i + 3);
      float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
      for (int64_t k = 0; k < K; ++k) {
        const float w = as_float(aj[k]);
        s0 += x0[k] * w;
        s1 += x1[k] * w;
        s2 += x2[k] * w;
        s3 += x3[k] * w;
      }
      t[i * r + j] = s0;
      t[(i + 1) * r + j] = s1;
      t[(i + 2) * r + j] = s2;
      t[(i + 3) * r + j] = s3;
    }
    for (; i < g.nrows; ++i) {
      const float* xi = row(i);
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t k = 0; k < K; ++k) s += xi[k] * as_float(aj[k]);
      t[i * r + j] = s;
    }
  }
}

// y[row i, o] += sum_j t[i, j] B^T[j, o] for output columns o in [o0, o1), from the panels.
template <typename T>
void lora_expand(const float* t, float* y, int64_t N, const LoRAGroup& g, int64_t o0, int64_t o1) {
  const T* data = static_cast<const T*>(g.panels);
  const int64_t r = g.a->size(0);
  for (int64_t i = 0; i < g.nrows; ++i) {
    float* yi = y + (g.rows ? g.rows[i] : i) * N;
    const float* ti = t + i * r;
    for (int64_t o = o0; o < o1; ++o) {
      const int64_t p = o / PANEL;
      float acc = 0.f;
      for (int64_t e = g.off[p]; e < g.off[p + 1]; ++e) acc += ti[g.rank[e]] * as_float(data[e * PANEL + o % PANEL]);
      yi[o] += acc;
    }
  }
}
#endif  // PQ_X86

// What the deltas of a call's projections reuse: the shrink's products, a float32 copy of an
// input that is not float32, and each projection's layout of both.
struct LoRAScratch {
  std::vector<float> t, x;
  std::vector<int64_t> t0;  // each group's offset in t
  std::vector<std::pair<size_t, int64_t>> units;  // (group, first of four ranks): the shrink's blocks
};

template <typename U>
void rows_to_float(const U* src, int64_t n, float* dst) {
  int64_t i = 0;
#ifdef PQ_X86
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, pq::load8(src + i));
#endif
  for (; i < n; ++i) dst[i] = as_float(src[i]);
}

// One projection's deltas for the step's groups, inside the product's parallel region: before
// its share of the product each thread runs a share of the shrink's blocks of four ranks
// (t = x A^T per group) in proportion to its share of the columns, so the threads' shares meet
// exactly and each reads one run of A; on the columns it has finished it waits until every
// block is done, then adds y += t B^T there. So the threads are woken once per projection.
template <typename T>
struct LoRADeltas {
  const std::vector<LoRAGroup>& groups;
  LoRAScratch& s;
  const int64_t n_out;
  const float* x = nullptr;
  int64_t K = 0;
  std::atomic<int64_t> done{0};

  void prepare(const at::Tensor& in) {
    K = in.size(1);  // (contiguous: LinearHook's contract)
    switch (in.scalar_type()) {
      case at::kFloat: x = in.data_ptr<float>(); break;
      case at::kBFloat16: to_float(in.data_ptr<c10::BFloat16>(), in.numel()); break;
      case at::kHalf: to_float(in.data_ptr<c10::Half>(), in.numel()); break;
      default: TORCH_CHECK(false, "quant_decode_layers: inputs must be float32, bfloat16 or float16");
    }
    s.t0.assign(1, 0);
    s.units.clear();
    for (size_t gi = 0; gi < groups.size(); ++gi) {
      s.t0.push_back(s.t0.back() + groups[gi].nrows * groups[gi].a->size(0));
      for (int64_t j = 0; j < groups[gi].a->size(0); j += 4) s.units.emplace_back(gi, j);
    }
    if (static_cast<int64_t>(s.t.size()) < s.t0.back()) s.t.resize(s.t0.back());
  }

  template <typename U>
  void to_float(const U* src, int64_t n) {
    if (static_cast<int64_t>(s.x.size()) < n) s.x.resize(n);
    rows_to_float(src, n, s.x.data());
    x = s.x.data();
  }

  void lead(int64_t lo, int64_t hi) {
    const int64_t nu = static_cast<int64_t>(s.units.size()), u0 = nu * lo / n_out, u1 = nu * hi / n_out;
#ifdef PQ_X86
    // This thread's run of A and its panels of B^T asked for at once, into L2 (a 32-row step
    // over four adapters asks for some 300 KB): the shrink then finds A on its way, and the
    // panels arrive while the product streams the base weights (a batch-1 step with an adapter
    // ran faster than without the prefetch: docs/benchmarks/lora.md).
    for (int64_t u = u0; u < u1; ++u) {
      const auto [gi, j] = s.units[u];
      const T* a = groups[gi].a->template data_ptr<T>();
      prefetch_run<_MM_HINT_T1>(a + j * K, a + std::min(j + 4, groups[gi].a->size(0)) * K);
    }
    for (const auto& g : groups) {
      const T* p = static_cast<const T*>(g.panels);
      prefetch_run<_MM_HINT_T1>(p + g.off[lo / PANEL] * PANEL, p + g.off[(hi + PANEL - 1) / PANEL] * PANEL);
    }
#endif
    for (int64_t u = u0; u < u1; ++u) {
      const auto [gi, j] = s.units[u];
      lora_shrink<T>(x, K, groups[gi], s.t.data() + s.t0[gi], j, std::min(j + 4, groups[gi].a->size(0)));
    }
    done.fetch_add(u1 - u0, std::memory_order_release);
  }

  void expand(float* y, int64_t n, int64_t lo, int64_t hi) {
    // Every block is some thread's, and no thread waits before finishing its own blocks.
    const int64_t nu = static_cast<int64_t>(s.units.size());
    while (done.load(std::memory_order_acquire) < nu) pause();
    for (size_t gi = 0; gi < groups.size(); ++gi) lora_expand<T>(s.t.data() + s.t0[gi], y, n, groups[gi], lo, hi);
  }

#ifdef PQ_X86
  template <_mm_hint H>
  static void prefetch_run(const T* b, const T* e) {
    for (const char* p = reinterpret_cast<const char*>(b); p < reinterpret_cast<const char*>(e); p += 64)
      _mm_prefetch(p, H);
  }
#endif

  static void pause() {
#ifdef PQ_X86
    _mm_pause();
#else
    std::this_thread::yield();
#endif
  }
};

template <typename T>
at::Tensor linear_with_deltas(const std::vector<LoRAGroup>& groups, LoRAScratch& s, int64_t n_out, const at::Tensor& x,
                              at::TensorList ws, at::IntArrayRef ts, int64_t k,
                              const c10::optional<at::Tensor>& norm, double eps,
                              const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& residual,
                              int64_t act, int64_t isa) {
  LoRADeltas<T> d{groups, s, n_out};
  const LinearHook hook{[&](const at::Tensor& xin) { d.prepare(xin); },
                        [&](int64_t lo, int64_t hi) { d.lead(lo, hi); },
                        [&](float* y, int64_t n, int64_t lo, int64_t hi) { d.expand(y, n, lo, hi); }};
  return quant_linear_hooked(x, ws, ts, k, norm, eps, bias, residual, act, isa, &hook);
}

// A projection's output width: its parts' rows (a packed part's row is a group of 16).
int64_t out_features(at::TensorList ws, at::IntArrayRef ts) {
  int64_t n = 0;
  for (size_t p = 0; p < ws.size(); ++p) n += ws[p].size(0) * (ts[p] >= pq::PACKED ? 16 : 1);
  return n;
}

}  // namespace

// Per layer l, projection j (0 q|k|v, 1 o, 2 gate|up, 3 down): parts[4 l + j] weight parts in
// `weights` / `types` (in order), row length kdims[4 l + j], bias biases[4 l + j]; norms[2 l]
// and norms[2 l + 1] the input and post-attention RMSNorm weights. LoRA: `lora` holds slot s
// of projection j (lora_stack.h; undefined: no adapter there);
// group g of the step uses slot group_slots[g] on the rows group_rows[g] (None: every row).
// A quantized cache (int8, f8e4m3): k_scales[l], v_scales[l] are layer l's scales, as paged_decode_qkv
// takes them (empty: a plain cache). q/k norms: qk_norms[2 l], qk_norms[2 l + 1] are layer l's
// RMSNorm weights, applied before rope by the call the per-layer path makes (qk_norm: over each
// q and each k head where they are head_dim long, as Qwen3's; over the whole q and k
// projections where they are that long, as OLMoE's; then q, k and v clamped to +-qkv_clip
// where it is positive, OLMoE's clip_qkv); empty: no q/k norm.
// MoE: where `moe` (moe_stack.h) has a sparse entry for layer l, its MLP half is that entry's
// whole block from the post-attention norm to the residual add (quant_moe_block, at path
// moe_isa with its x2 bits moe_x2), and parts[4 l + 2], parts[4 l + 3] are 0.
at::Tensor quant_decode_layers(const at::Tensor& h0, at::TensorList weights, at::IntArrayRef types,
                               at::IntArrayRef parts, at::IntArrayRef kdims, at::TensorList norms, double eps,
                               const c10::List<c10::optional<at::Tensor>>& biases, at::TensorList k_caches,
                               at::TensorList v_caches, at::IntArrayRef windows, const at::Tensor& cos,
                               const at::Tensor& sin, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                               const at::Tensor& context_lens, int64_t hq, int64_t hkv, double scale,
                               const c10::optional<c10::intrusive_ptr<pagedllm::LoRAStack>>& lora_stack,
                               at::IntArrayRef group_slots, const c10::List<c10::optional<at::Tensor>>& group_rows,
                               int64_t isa, at::TensorList k_scales, at::TensorList v_scales,
                               at::TensorList qk_norms,
                               const c10::optional<c10::intrusive_ptr<pagedllm::MoeStack>>& moe_stack,
                               int64_t moe_isa, int64_t moe_x2, double qkv_clip) {
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(layers > 0 && static_cast<int64_t>(v_caches.size()) == layers &&
                  static_cast<int64_t>(windows.size()) == layers && static_cast<int64_t>(parts.size()) == 4 * layers &&
                  static_cast<int64_t>(kdims.size()) == 4 * layers &&
                  static_cast<int64_t>(biases.size()) == 4 * layers &&
                  static_cast<int64_t>(norms.size()) == 2 * layers && weights.size() == types.size(),
              "quant_decode_layers: per-layer lists of inconsistent lengths");
  const bool scaled = !k_scales.empty();
  TORCH_CHECK(k_scales.size() == v_scales.size() && (!scaled || static_cast<int64_t>(k_scales.size()) == layers),
              "quant_decode_layers: k_scales and v_scales must name every layer's scales, or none");
  const bool with_qk_norm = !qk_norms.empty();
  TORCH_CHECK(!with_qk_norm || static_cast<int64_t>(qk_norms.size()) == 2 * layers,
              "quant_decode_layers: qk_norms must hold a q and a k norm weight for every layer, or nothing");
  pagedllm::MoeStack* moe = moe_stack.has_value() ? moe_stack->get() : nullptr;
  TORCH_CHECK(moe == nullptr || moe->size() == layers, "quant_decode_layers: the MoE stack has ",
              moe == nullptr ? 0 : moe->size(), " layers, the model ", layers);
  TORCH_CHECK(moe == nullptr || group_slots.empty(), "quant_decode_layers: LoRA adapters on MoE layers are not stacked");
  int64_t total = 0;
  for (int64_t p : parts) total += p;
  TORCH_CHECK(total == static_cast<int64_t>(weights.size()), "quant_decode_layers: parts do not cover the weights");
  const pagedllm::LoRAStack* stack = lora_stack.has_value() ? lora_stack->get() : nullptr;
  const int64_t S = stack != nullptr ? stack->slots : 0;
  const bool lora = S > 0 && !group_slots.empty();
  TORCH_CHECK(!lora || (static_cast<int64_t>(stack->entries.size()) == 4 * layers * S &&
                        group_rows.size() == group_slots.size()),
              "quant_decode_layers: LoRA lists of inconsistent lengths");
  const int64_t M = h0.size(0);
  // The step's rows per group, checked once.
  std::vector<at::Tensor> rows(group_slots.size());
  for (size_t g = 0; g < group_slots.size(); ++g) {
    TORCH_CHECK(group_slots[g] >= 0 && group_slots[g] < S, "quant_decode_layers: LoRA slot out of range");
    const c10::optional<at::Tensor> r = group_rows.get(g);
    if (r.has_value()) {
      rows[g] = r->to(at::kLong).contiguous();
      TORCH_CHECK(rows[g].numel() == 0 || (rows[g].min().item<int64_t>() >= 0 && rows[g].max().item<int64_t>() < M),
                  "quant_decode_layers: LoRA rows out of range");
    }
  }
  at::Tensor h = h0;
  int64_t w0 = 0;
  LoRAScratch scratch;
  auto proj = [&](int64_t j, const at::Tensor& x, const c10::optional<at::Tensor>& norm,
                  const c10::optional<at::Tensor>& residual, int64_t act) {
    const int64_t n = parts[j], isa_j = pq::isa_of_projection(isa, j % 4);
    at::TensorList ws = weights.slice(w0, n);
    at::IntArrayRef ts = types.slice(w0, n);
    w0 += n;
    std::vector<LoRAGroup> groups;
    const int64_t n_out = out_features(ws, ts), npan = (n_out + PANEL - 1) / PANEL;
    if (lora) {
      for (size_t g = 0; g < group_slots.size(); ++g) {
        const pagedllm::LoRAStack::Entry& e = stack->entries[j * S + group_slots[g]];
        if (!e.a.defined()) continue;
        const at::Tensor &A = e.a, &PN = e.panels, &IX = e.index;
        TORCH_CHECK(A.dim() == 2 && A.size(1) == kdims[j] && A.is_contiguous() && PN.dim() == 2 &&
                        PN.size(1) == PANEL && PN.is_contiguous() && PN.scalar_type() == A.scalar_type() &&
                        IX.scalar_type() == at::kLong && IX.is_contiguous() && IX.numel() == npan + 1 + PN.size(0),
                    "quant_decode_layers: LoRA weights of projection ", j, " are not A [r, ", kdims[j],
                    "] and B^T's panels of ", PANEL, " of ", n_out, " outputs with their index");
        const int64_t* ix = IX.data_ptr<int64_t>();
        TORCH_CHECK(ix[0] == 0 && ix[npan] == PN.size(0), "quant_decode_layers: LoRA panel index of projection ", j,
                    " does not cover its panels");
        const bool all = !rows[g].defined();
        groups.push_back({all ? nullptr : rows[g].data_ptr<int64_t>(), all ? M : rows[g].numel(), &A, PN.data_ptr(),
                          ix, ix + npan + 1});
      }
    }
    if (groups.empty())
      return quant_linear_hooked(x, ws, ts, kdims[j], norm, eps, biases.get(j), residual, act, isa_j, nullptr);
    switch (groups[0].a->scalar_type()) {
      case at::kFloat: return linear_with_deltas<float>(groups, scratch, n_out, x, ws, ts, kdims[j], norm, eps, biases.get(j), residual, act, isa_j);
      case at::kBFloat16: return linear_with_deltas<c10::BFloat16>(groups, scratch, n_out, x, ws, ts, kdims[j], norm, eps, biases.get(j), residual, act, isa_j);
      case at::kHalf: return linear_with_deltas<c10::Half>(groups, scratch, n_out, x, ws, ts, kdims[j], norm, eps, biases.get(j), residual, act, isa_j);
      default: break;
    }
    TORCH_CHECK(false, "quant_decode_layers: LoRA weights must be float32, bfloat16 or float16");
    return at::Tensor();
  };
  for (int64_t l = 0; l < layers; ++l) {
    at::Tensor qkv = proj(4 * l, h, norms[2 * l], c10::nullopt, 0);
    if (with_qk_norm) qk_norm(qkv, qk_norms[2 * l], qk_norms[2 * l + 1], hq, hkv, eps, qkv_clip);
    const at::Tensor o = paged_decode_qkv(qkv, cos, sin, k_caches[l], v_caches[l], slot_mapping, block_tables,
                                          context_lens, hq, hkv, scale, windows[l],
                                          scaled ? c10::optional<at::Tensor>(k_scales[l]) : c10::nullopt,
                                          scaled ? c10::optional<at::Tensor>(v_scales[l]) : c10::nullopt);
    h = proj(4 * l + 1, o, c10::nullopt, h, 0);
    pagedllm::MoeStack::Layer* sparse = moe != nullptr && moe->layers[l].router.defined() ? &moe->layers[l] : nullptr;
    if (sparse != nullptr) {
      TORCH_CHECK(parts[4 * l + 2] == 0 && parts[4 * l + 3] == 0, "quant_decode_layers: layer ", l,
                  " is sparse but has dense MLP weights");
      auto [out, ids] = quant_moe_block(h, norms[2 * l + 1], eps, sparse->router, sparse->top_k, sparse->renormalize,
                                        sparse->round_weights, sparse->gate_up, sparse->gate_up_types,
                                        sparse->gate_up_parts, sparse->down, sparse->down_types, moe_isa, moe_x2);
      sparse->last_ids = ids;
      h = out;
      continue;
    }
    const at::Tensor g = proj(4 * l + 2, h, norms[2 * l + 1], c10::nullopt, 1);
    h = proj(4 * l + 3, g, c10::nullopt, h, 0);
  }
  return h;
}

PAGEDLLM_REGISTER(decode_stack) {
  m.def("quant_decode_layers(Tensor h, Tensor[] weights, int[] types, int[] parts, int[] kdims, Tensor[] norms, "
        "float eps, Tensor?[] biases, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, int[] windows, Tensor cos, "
        "Tensor sin, Tensor slot_mapping, Tensor block_tables, Tensor context_lens, int hq, int hkv, float scale, "
        "__torch__.torch.classes.pagedllm.LoRAStack? lora, int[] group_slots, "
        "Tensor?[] group_rows, int isa, Tensor(c!)[] k_scales, Tensor(d!)[] v_scales, Tensor[] qk_norms, "
        "__torch__.torch.classes.pagedllm.MoeStack? moe=None, int moe_isa=0, int moe_x2=0, float qkv_clip=0.) -> Tensor",
        &quant_decode_layers);
}

}  // namespace PAGEDLLM_ISA
