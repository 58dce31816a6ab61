// Routing decisions that are integer bookkeeping over S*K routes (see moe_proto/routing.py): the top-1 choice per
// group and the capacity slots. One pass each, where the torch expressions take 4 and 10-15 dispatched ops.
// Both give up (return ok=false) rather than guess where torch's order is the specification: tied or NaN scores
// (torch.topk's tie order) and NaN priorities (argsort's NaN order); the caller then runs the torch expression.
#include "ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

std::tuple<at::Tensor, bool> select_top1(const at::Tensor& scores) {
  TORCH_CHECK(scores.device().is_cpu() && scores.scalar_type() == at::kFloat && scores.is_contiguous() &&
                  scores.dim() == 3,
              "moe_proto select_top1: scores must be a contiguous [S, P, G] float32 CPU tensor");
  const int64_t groups = scores.size(0) * scores.size(1), width = scores.size(2);
  auto index = at::empty({scores.size(0), scores.size(1), 1}, scores.options().dtype(at::kLong));
  const float* s = scores.data_ptr<float>();
  int64_t* out = index.data_ptr<int64_t>();
  for (int64_t g = 0; g < groups; ++g) {
    // Branch-free passes over the group (a running argmax mispredicted on random scores: 163 against 56 us at
    // [4096, 1, 16]): the maximum, how many scores equal it or are NaN, and the first index holding it.
    const float* __restrict row = s + g * width;
    float best = row[0];
    for (int64_t j = 1; j < width; ++j) best = row[j] > best ? row[j] : best;
    int64_t equal = 0, nan = 0, first = width;
    for (int64_t j = 0; j < width; ++j) {
      equal += row[j] == best;
      nan += row[j] != row[j];
    }
    for (int64_t j = width - 1; j >= 0; --j) first = row[j] == best ? j : first;
    if (equal != 1 || nan) return {index, false};
    out[g] = first;
  }
  return {index, true};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, bool> assign_slots(
    const at::Tensor& expert_index, const c10::optional<at::Tensor>& eligible, int64_t num_experts,
    int64_t capacity, const c10::optional<at::Tensor>& priority) {
  TORCH_CHECK(expert_index.scalar_type() == at::kLong && expert_index.is_contiguous() && expert_index.is_cpu(),
              "moe_proto assign_slots: expert_index must be a contiguous int64 CPU tensor");
  const int64_t n = expert_index.numel();
  const int64_t* ei = expert_index.data_ptr<int64_t>();
  const bool* ok_route = nullptr;
  if (eligible) {
    TORCH_CHECK(eligible->scalar_type() == at::kBool && eligible->is_contiguous() && eligible->numel() == n,
                "moe_proto assign_slots: eligible must be a contiguous bool tensor with one entry per route");
    ok_route = eligible->data_ptr<bool>();
  }
  const float* prio = nullptr;
  if (priority) {
    TORCH_CHECK(priority->scalar_type() == at::kFloat && priority->is_contiguous() && priority->numel() == n,
                "moe_proto assign_slots: priority must be a contiguous float32 tensor with one entry per route");
    prio = priority->data_ptr<float>();
  }
  auto keep = at::empty_like(expert_index, expert_index.options().dtype(at::kBool));
  auto slot = at::empty_like(expert_index);
  auto routed = at::zeros({num_experts}, expert_index.options());
  bool* kp = keep.data_ptr<bool>();
  int64_t* sp = slot.data_ptr<int64_t>();
  int64_t* count = routed.data_ptr<int64_t>();
  // Rank of every eligible route among its expert's routes in route (token-major) order.
  for (int64_t i = 0; i < n; ++i) {
    const int64_t e = ei[i];
    TORCH_CHECK(e >= 0 && e < num_experts, "moe_proto assign_slots: route ", i, " names expert ", e, " outside [0, ",
                num_experts, ")");
    if (ok_route && !ok_route[i]) {
      kp[i] = false;
      sp[i] = -1;
    } else {
      kp[i] = true;
      sp[i] = count[e]++;
    }
  }
  const int64_t most = num_experts ? *std::max_element(count, count + num_experts) : 0;
  if (capacity < 0 || most <= capacity) return {keep, slot, routed, routed.clone(), true};
  auto kept = routed.clamp_max(capacity);
  if (!prio) {  // position policy: the first `capacity` routes in token order keep their ranks as slots
    for (int64_t i = 0; i < n; ++i) {
      if (kp[i] && sp[i] >= capacity) {
        kp[i] = false;
        sp[i] = -1;
      }
    }
    return {keep, slot, routed, kept, true};
  }
  // Over-capacity experts only: their routes compete by priority (higher first, ties to the lower route index).
  std::vector<std::vector<int64_t>> candidates(num_experts);
  for (int64_t i = 0; i < n; ++i) {
    if (kp[i] && count[ei[i]] > capacity) {
      if (std::isnan(prio[i])) return {keep, slot, routed, kept, false};
      candidates[ei[i]].push_back(i);
    }
  }
  std::vector<int64_t> order;
  for (int64_t e = 0; e < num_experts; ++e) {
    auto& routes = candidates[e];
    if (routes.empty()) continue;
    order = routes;
    std::stable_sort(order.begin(), order.end(), [prio](int64_t a, int64_t b) { return prio[a] > prio[b]; });
    for (size_t r = capacity; r < order.size(); ++r) {
      kp[order[r]] = false;
      sp[order[r]] = -1;
    }
    int64_t next = 0;  // survivors take the expert's rows in token order
    for (int64_t i : routes) {
      if (kp[i]) sp[i] = next++;
    }
  }
  return {keep, slot, routed, kept, true};
}
