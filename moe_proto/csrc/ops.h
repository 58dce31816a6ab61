// The functions of moe_proto's C++ CPU op library (bound to Python in bindings.cpp; see moe_proto/ops.py).
#pragma once

#include <torch/extension.h>

#include <vector>

// expert_ffn.cpp: the expert FFN loop, the activation's derivative kept from the forward pass.
void expert_ffn_forward(const at::Tensor& x, const std::vector<int64_t>& counts, int64_t act_code,
                        const at::Tensor& w1, const c10::optional<at::Tensor>& b1, const at::Tensor& w2,
                        const c10::optional<at::Tensor>& b2, at::Tensor& deriv, at::Tensor& act, at::Tensor& y);
void expert_ffn_backward(const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& deriv,
                         const at::Tensor& act, const at::Tensor& w1, const at::Tensor& w2,
                         const std::vector<int64_t>& counts, c10::optional<at::Tensor> dx,
                         c10::optional<at::Tensor> dw1, c10::optional<at::Tensor> db1,
                         c10::optional<at::Tensor> dw2, c10::optional<at::Tensor> db2, at::Tensor& d_buf);
std::vector<at::Tensor> activation_with_derivative(const at::Tensor& v, int64_t act_code);

// combine_grad.cpp: both gradients of the gate-weighted combine in one pass over the buffer rows.
void combine_backward(const at::Tensor& grad_out, const at::Tensor& y, const at::Tensor& gate,
                      const at::Tensor& token_index, c10::optional<at::Tensor> grad_y,
                      c10::optional<at::Tensor> grad_gate);

// router_grad.cpp: out = grad_x + grad_logits @ w, one pass over the rows; with route_row/route_offsets grad_x is
// the dispatch buffer's gradient, gathered and summed per token in the same pass.
void add_router_input_grad(const at::Tensor& grad_x, const at::Tensor& grad_logits, const at::Tensor& w,
                           at::Tensor& out, const c10::optional<at::Tensor>& route_row,
                           const c10::optional<at::Tensor>& route_offsets);

// route_slots.cpp: routing decisions; ok=false where torch's tie or NaN order decides (the caller falls back).
std::tuple<at::Tensor, bool> select_top1(const at::Tensor& scores);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, bool> assign_slots(
    const at::Tensor& expert_index, const c10::optional<at::Tensor>& eligible, int64_t num_experts,
    int64_t capacity, const c10::optional<at::Tensor>& priority);
