// The backward pass of moe_proto's combine (out[t] = sum of gate[r] * y[r] over the buffer rows r of token t),
// both gradients in one pass over the buffer rows (see moe_proto/dispatch.py, _Combine):
//   grad_y[r] = gate[r] * grad_out[token[r]]      grad_gate[r] = dot(grad_out[token[r]], y[r])
// Each row of grad_out is read once for both, where embedding_bag and its per-sample-weight backward read it twice
// and the latter returns the gate gradient in route order, to be permuted into buffer order afterwards.
#include "ops.h"

#include <cstdint>

void combine_backward(const at::Tensor& grad_out, const at::Tensor& y, const at::Tensor& gate,
                      const at::Tensor& token_index, c10::optional<at::Tensor> grad_y,
                      c10::optional<at::Tensor> grad_gate) {
  for (const at::Tensor* t : {&grad_out, &y, &gate}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->is_contiguous(),
                "moe_proto combine_backward: grad_out, y and gate must be contiguous float32 CPU tensors");
  }
  TORCH_CHECK(token_index.scalar_type() == at::kLong && token_index.is_contiguous() && token_index.dim() == 1,
              "moe_proto combine_backward: token_index must be a contiguous 1-d int64 tensor");
  const int64_t rows = y.size(0), d = y.size(1), tokens = grad_out.size(0);
  TORCH_CHECK(grad_out.dim() == 2 && grad_out.size(1) == d && gate.numel() == rows && token_index.numel() == rows,
              "moe_proto combine_backward: shapes do not match (grad_out [S, d], y [R, d], gate [R], token_index [R])");
  const float* g = grad_out.data_ptr<float>();
  const float* yp = y.data_ptr<float>();
  const float* gp = gate.data_ptr<float>();
  const int64_t* tok = token_index.data_ptr<int64_t>();
  float* gy = nullptr;
  float* gg = nullptr;
  if (grad_y) {
    TORCH_CHECK(grad_y->scalar_type() == at::kFloat && grad_y->is_contiguous() && grad_y->numel() == rows * d,
                "moe_proto combine_backward: grad_y must be a contiguous float32 [R, d] tensor");
    gy = grad_y->data_ptr<float>();
  }
  if (grad_gate) {
    TORCH_CHECK(grad_gate->scalar_type() == at::kFloat && grad_gate->is_contiguous() && grad_gate->numel() == rows,
                "moe_proto combine_backward: grad_gate must be a contiguous float32 [R] tensor");
    gg = grad_gate->data_ptr<float>();
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = tok[r];
    TORCH_CHECK(t >= 0 && t < tokens, "moe_proto combine_backward: buffer row ", r, " names token ", t,
                " outside [0, ", tokens, ")");
    const float* __restrict gr = g + t * d;
    if (gy) {
      float* __restrict out = gy + r * d;
      const float w = gp[r];
#pragma omp simd
      for (int64_t j = 0; j < d; ++j) out[j] = w * gr[j];
    }
    if (gg) {
      const float* __restrict yr = yp + r * d;
      float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
      for (int64_t j = 0; j < d; ++j) acc += gr[j] * yr[j];
      gg[r] = acc;
    }
  }
}
