// The adapters a decode step's rows use, for quant_decode_layers (decode_stack.cpp): made once
// in Python (torch.classes.pagedllm.LoRAStack) whenever an adapter comes or goes or the step's
// slots change, and then handed to every step as one object. Passed as three lists of tensors
// instead, each step paid a conversion per element, hundreds of them on a 30-layer model.
//
// Included by isa.h before its target pragmas (so its inline code keeps the baseline target in
// every object), and by dispatch.cpp, which registers the class.
#pragma once

#include <ATen/ATen.h>
#include <torch/custom_class.h>

#include <cstdint>
#include <vector>

namespace pagedllm {

struct LoRAStack : torch::CustomClassHolder {
  // Projection j's slot s (the step's s-th used slot) is entry j * slots + s: A [r, in], B^T's
  // panels [entries, 32] and their index [panels + 1 offsets, then each entry's rank]; all
  // undefined where that slot leaves the projection alone.
  struct Entry {
    at::Tensor a, panels, index;
  };
  std::vector<Entry> entries;
  int64_t slots;

  LoRAStack(const c10::List<c10::optional<at::Tensor>>& a, const c10::List<c10::optional<at::Tensor>>& panels,
            const c10::List<c10::optional<at::Tensor>>& index, int64_t slots_)
      : slots(slots_) {
    TORCH_CHECK(slots > 0 && a.size() % slots == 0 && panels.size() == a.size() && index.size() == a.size(),
                "LoRAStack: A, panels and index need one entry per projection and slot");
    entries.reserve(a.size());
    for (size_t i = 0; i < a.size(); ++i) {
      const c10::optional<at::Tensor> ai = a.get(i), pi = panels.get(i), ii = index.get(i);
      TORCH_CHECK(ai.has_value() == pi.has_value() && ai.has_value() == ii.has_value(),
                  "LoRAStack: entry ", i, " has some of A, panels and index but not all");
      entries.push_back(ai.has_value() ? Entry{*ai, *pi, *ii} : Entry{});
    }
  }
};

}  // namespace pagedllm
