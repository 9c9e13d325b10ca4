// A decode step of a quantized Llama-family model, every decoder layer in one native call.
// Each layer is the same five calls the Python path makes (quant_linear for q|k|v with the
// input norm and bias, paged_decode_qkv for rope + cache write + attention, quant_linear for
// o_proj + residual, gate|up with the post-attention norm and silu(gate) * up, down_proj +
// residual), so the results are the same bits; what goes is the interpreter and dispatcher
// work around 150 small calls a token, a large share of a batch-1 step on a 135M model.
#include "isa.h"  // first: the library headers, and the level this object is compiled for

namespace PAGEDLLM_ISA {

at::Tensor quant_linear(const at::Tensor& x, at::TensorList ws, at::IntArrayRef types, int64_t k,
                        const c10::optional<at::Tensor>& norm_weight, double eps,
                        const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& residual,
                        int64_t act, int64_t isa);
at::Tensor paged_decode_qkv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                            at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slot_mapping,
                            const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t hq,
                            int64_t hkv, double scale, int64_t window);

// Per layer l, projection j (0 q|k|v, 1 o, 2 gate|up, 3 down): parts[4 l + j] weight parts in
// `weights` / `types` (in order), row length kdims[4 l + j], bias biases[4 l + j]; norms[2 l]
// and norms[2 l + 1] the input and post-attention RMSNorm weights.
at::Tensor quant_decode_layers(const at::Tensor& h0, at::TensorList weights, at::IntArrayRef types,
                               at::IntArrayRef parts, at::IntArrayRef kdims, at::TensorList norms, double eps,
                               const c10::List<c10::optional<at::Tensor>>& biases, at::TensorList k_caches,
                               at::TensorList v_caches, at::IntArrayRef windows, const at::Tensor& cos,
                               const at::Tensor& sin, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                               const at::Tensor& context_lens, int64_t hq, int64_t hkv, double scale, int64_t isa) {
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(layers > 0 && static_cast<int64_t>(v_caches.size()) == layers &&
                  static_cast<int64_t>(windows.size()) == layers && static_cast<int64_t>(parts.size()) == 4 * layers &&
                  static_cast<int64_t>(kdims.size()) == 4 * layers &&
                  static_cast<int64_t>(biases.size()) == 4 * layers &&
                  static_cast<int64_t>(norms.size()) == 2 * layers && weights.size() == types.size(),
              "quant_decode_layers: per-layer lists of inconsistent lengths");
  int64_t total = 0;
  for (int64_t p : parts) total += p;
  TORCH_CHECK(total == static_cast<int64_t>(weights.size()), "quant_decode_layers: parts do not cover the weights");
  at::Tensor h = h0;
  int64_t w0 = 0;
  auto proj = [&](int64_t j, const at::Tensor& x, const c10::optional<at::Tensor>& norm,
                  const c10::optional<at::Tensor>& residual, int64_t act) {
    const int64_t n = parts[j];
    at::Tensor y = quant_linear(x, weights.slice(w0, n), types.slice(w0, n), kdims[j], norm, eps,
                                biases.get(j), residual, act, isa);
    w0 += n;
    return y;
  };
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor qkv = proj(4 * l, h, norms[2 * l], c10::nullopt, 0);
    const at::Tensor o = paged_decode_qkv(qkv, cos, sin, k_caches[l], v_caches[l], slot_mapping, block_tables,
                                          context_lens, hq, hkv, scale, windows[l]);
    h = proj(4 * l + 1, o, c10::nullopt, h, 0);
    const at::Tensor g = proj(4 * l + 2, h, norms[2 * l + 1], c10::nullopt, 1);
    h = proj(4 * l + 3, g, c10::nullopt, h, 0);
  }
  return h;
}

PAGEDLLM_REGISTER(decode_stack) {
  m.def("quant_decode_layers(Tensor h, Tensor[] weights, int[] types, int[] parts, int[] kdims, Tensor[] norms, "
        "float eps, Tensor?[] biases, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, int[] windows, Tensor cos, "
        "Tensor sin, Tensor slot_mapping, Tensor block_tables, Tensor context_lens, int hq, int hkv, float scale, "
        "int isa) -> Tensor", &quant_decode_layers);
}

}  // namespace PAGEDLLM_ISA
