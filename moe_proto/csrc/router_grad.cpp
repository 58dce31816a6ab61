// The router's input gradient added to the dispatch's in one pass (see moe_proto/layer.py, _RouterLogits):
//   out[t] = grad_x[t] + sum_e grad_logits[t, e] * w[e]      (w is the router weight, [E, d] with E small)
// Autograd would write grad_logits @ w to a new [S, d] tensor and add the two: three passes over [S, d] more.
// With route_row/route_offsets, grad_x is the expert-major buffer's gradient and token t's term is the sum of its
// rows route_row[route_offsets[t]:route_offsets[t + 1]]: the dispatch's backward (a gather) in the same pass.
#include "ops.h"

#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// dst = sum of the rows src + rows[i] * d (none: 0) + sum_e coef[e] * w[e], one row of d columns.
inline void row_sum_plus_router(const float* __restrict src, const int64_t* rows, int64_t num_rows,
                                const float* __restrict coef, const float* __restrict wp, int64_t experts,
                                int64_t d, float* __restrict dst) {
  int64_t j0 = 0;
#if defined(__AVX512F__)
  // 64 columns at a time in four registers across the E terms (a whole-row pass per term re-read and re-wrote
  // the row E times, and GCC kept an array accumulator in memory: 0.60 and 0.72 against 0.52 ms for mm + add_).
  for (; j0 + 64 <= d; j0 += 64) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
    for (int64_t r = 0; r < num_rows; ++r) {
      const float* s = src + rows[r] * d + j0;
      a0 = _mm512_add_ps(a0, _mm512_loadu_ps(s));
      a1 = _mm512_add_ps(a1, _mm512_loadu_ps(s + 16));
      a2 = _mm512_add_ps(a2, _mm512_loadu_ps(s + 32));
      a3 = _mm512_add_ps(a3, _mm512_loadu_ps(s + 48));
    }
    for (int64_t e = 0; e < experts; ++e) {
      const __m512 c = _mm512_set1_ps(coef[e]);
      const float* we = wp + e * d + j0;
      a0 = _mm512_fmadd_ps(c, _mm512_loadu_ps(we), a0);
      a1 = _mm512_fmadd_ps(c, _mm512_loadu_ps(we + 16), a1);
      a2 = _mm512_fmadd_ps(c, _mm512_loadu_ps(we + 32), a2);
      a3 = _mm512_fmadd_ps(c, _mm512_loadu_ps(we + 48), a3);
    }
    _mm512_storeu_ps(dst + j0, a0);
    _mm512_storeu_ps(dst + j0 + 16, a1);
    _mm512_storeu_ps(dst + j0 + 32, a2);
    _mm512_storeu_ps(dst + j0 + 48, a3);
  }
#endif
#pragma omp simd
  for (int64_t j = j0; j < d; ++j) dst[j] = 0.0f;
  for (int64_t r = 0; r < num_rows; ++r) {
    const float* __restrict s = src + rows[r] * d;
#pragma omp simd
    for (int64_t j = j0; j < d; ++j) dst[j] += s[j];
  }
  for (int64_t e = 0; e < experts; ++e) {
    const float c = coef[e];
    const float* __restrict we = wp + e * d;
#pragma omp simd
    for (int64_t j = j0; j < d; ++j) dst[j] += c * we[j];
  }
}

}  // namespace

void add_router_input_grad(const at::Tensor& grad_x, const at::Tensor& grad_logits, const at::Tensor& w,
                           at::Tensor& out, const c10::optional<at::Tensor>& route_row,
                           const c10::optional<at::Tensor>& route_offsets) {
  for (const at::Tensor* t : {&grad_x, &grad_logits, &w, static_cast<const at::Tensor*>(&out)}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2,
                "moe_proto add_router_input_grad: every operand must be a contiguous 2-d float32 CPU tensor");
  }
  const int64_t tokens = out.size(0), d = out.size(1), experts = w.size(0);
  const bool gather = route_row.has_value();
  TORCH_CHECK(gather == route_offsets.has_value(),
              "moe_proto add_router_input_grad: route_row and route_offsets come together");
  TORCH_CHECK(w.size(1) == d && grad_x.size(1) == d && grad_logits.size(0) == tokens &&
                  grad_logits.size(1) == experts && (gather || grad_x.size(0) == tokens),
              "moe_proto add_router_input_grad: shapes do not match (grad_x [S, d] or [R, d], grad_logits [S, E], "
              "w [E, d], out [S, d])");
  const int64_t* rows = nullptr;
  const int64_t* offsets = nullptr;
  int64_t num_routes = 0;
  if (gather) {
    for (const at::Tensor* t : {&*route_row, &*route_offsets}) {
      TORCH_CHECK(t->is_cpu() && t->scalar_type() == at::kLong && t->is_contiguous() && t->dim() == 1,
                  "moe_proto add_router_input_grad: route_row and route_offsets must be contiguous 1-d int64");
    }
    num_routes = route_row->size(0);
    TORCH_CHECK(route_offsets->size(0) == tokens,
                "moe_proto add_router_input_grad: route_offsets must hold one start per token");
    rows = route_row->data_ptr<int64_t>();
    offsets = route_offsets->data_ptr<int64_t>();
    const int64_t buffer_rows = grad_x.size(0);
    for (int64_t i = 0; i < num_routes; ++i) {
      TORCH_CHECK(rows[i] >= 0 && rows[i] < buffer_rows, "moe_proto add_router_input_grad: route_row[", i, "] = ",
                  rows[i], " is outside the buffer's ", buffer_rows, " rows");
    }
    for (int64_t t = 0; t < tokens; ++t) {
      const int64_t end = t + 1 < tokens ? offsets[t + 1] : num_routes;
      TORCH_CHECK(offsets[t] >= 0 && offsets[t] <= end && end <= num_routes,
                  "moe_proto add_router_input_grad: route_offsets must be non-decreasing within [0, ", num_routes,
                  "] (token ", t, ")");
    }
  }
  const float* gx = grad_x.data_ptr<float>();
  const float* gl = grad_logits.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* o = out.data_ptr<float>();
  for (int64_t t = 0; t < tokens; ++t) {
    if (gather) {
      const int64_t start = offsets[t], end = t + 1 < tokens ? offsets[t + 1] : num_routes;
      row_sum_plus_router(gx, rows + start, end - start, gl + t * experts, wp, experts, d, o + t * d);
    } else {
      const int64_t self = t;
      row_sum_plus_router(gx, &self, 1, gl + t * experts, wp, experts, d, o + t * d);
    }
  }
}
