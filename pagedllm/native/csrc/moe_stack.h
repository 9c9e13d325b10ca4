// The sparse MoE blocks of a model, for quant_decode_layers (decode_stack.cpp): made once in
// Python (torch.classes.pagedllm.MoeStack, models/moe.py) when the all-layer decode's plan is
// made, and handed to every step as one object. An MoE layer holds 100-200 expert tensors;
// passed as lists they would cost a conversion per element every step.
//
// Included by isa.h before its target pragmas (so its inline code keeps the baseline target in
// every object), and by dispatch.cpp, which registers the class.
#pragma once

#include <ATen/ATen.h>
#include <torch/custom_class.h>

#include <cstdint>
#include <vector>

namespace pagedllm {

struct MoeStack : torch::CustomClassHolder {
  // One entry per decoder layer; `router` undefined: that layer's MLP is dense.
  struct Layer {
    at::Tensor router;  // float32 [experts, hidden]
    std::vector<at::Tensor> gate_up, down;
    std::vector<int64_t> gate_up_types, gate_up_parts, down_types;
    int64_t top_k = 0;
    bool renormalize = false, round_weights = false;
    at::Tensor last_ids;  // [rows, top_k] of the last step that ran this layer here (trace)
  };
  std::vector<Layer> layers;

  MoeStack() = default;

  void add_dense() { layers.emplace_back(); }

  void add_sparse(at::Tensor router, std::vector<at::Tensor> gate_up, std::vector<int64_t> gate_up_types,
                  std::vector<int64_t> gate_up_parts, std::vector<at::Tensor> down, std::vector<int64_t> down_types,
                  int64_t top_k, bool renormalize, bool round_weights) {
    TORCH_CHECK(router.defined() && router.scalar_type() == at::kFloat && router.dim() == 2 && router.is_contiguous() &&
                    router.size(0) == static_cast<int64_t>(down.size()),
                "MoeStack: the router must be a contiguous float32 [experts, hidden], one row per expert");
    TORCH_CHECK(gate_up_types.size() == gate_up.size() && gate_up_parts.size() == down.size() &&
                    down_types.size() == down.size(),
                "MoeStack: one type per weight part and one gate|up part count per expert");
    TORCH_CHECK(top_k >= 1 && top_k <= router.size(0), "MoeStack: top_k ", top_k, " of ", router.size(0), " experts");
    layers.push_back(Layer{std::move(router), std::move(gate_up), std::move(down), std::move(gate_up_types),
                           std::move(gate_up_parts), std::move(down_types), top_k, renormalize, round_weights, {}});
  }

  int64_t size() const { return static_cast<int64_t>(layers.size()); }

  // Layer l's expert ids from the last step that ran it in the all-layer call (undefined: none).
  c10::optional<at::Tensor> last_ids(int64_t l) const {
    TORCH_CHECK(l >= 0 && l < size(), "MoeStack: layer ", l, " out of range");
    const at::Tensor& t = layers[l].last_ids;
    return t.defined() ? c10::optional<at::Tensor>(t) : c10::nullopt;
  }
};

}  // namespace pagedllm
