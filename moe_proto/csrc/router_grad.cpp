// The router's input gradient added to the dispatch's in one pass (see moe_proto/layer.py, _RouterLogits):
//   out[t] = grad_x[t] + sum_e grad_logits[t, e] * w[e]      (w is the router weight, [E, d] with E small)
// Autograd would write grad_logits @ w to a new [S, d] tensor and add the two: three passes over [S, d] more.
#include "ops.h"

#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

void add_router_input_grad(const at::Tensor& grad_x, const at::Tensor& grad_logits, const at::Tensor& w,
                           at::Tensor& out) {
  for (const at::Tensor* t : {&grad_x, &grad_logits, &w, static_cast<const at::Tensor*>(&out)}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2,
                "moe_proto add_router_input_grad: every operand must be a contiguous 2-d float32 CPU tensor");
  }
  const int64_t tokens = grad_x.size(0), d = grad_x.size(1), experts = w.size(0);
  TORCH_CHECK(w.size(1) == d && grad_logits.size(0) == tokens && grad_logits.size(1) == experts &&
                  out.size(0) == tokens && out.size(1) == d,
              "moe_proto add_router_input_grad: shapes do not match (grad_x [S, d], grad_logits [S, E], w [E, d])");
  const float* gx = grad_x.data_ptr<float>();
  const float* gl = grad_logits.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* o = out.data_ptr<float>();
  for (int64_t t = 0; t < tokens; ++t) {
    const float* __restrict src = gx + t * d;
    const float* __restrict coef = gl + t * experts;
    float* __restrict dst = o + t * d;
    int64_t j0 = 0;
#if defined(__AVX512F__)
    // 64 columns at a time in four registers across the E terms (a whole-row pass per term re-read and re-wrote
    // the row E times, and GCC kept an array accumulator in memory: 0.60 and 0.72 against 0.52 ms for mm + add_).
    for (; j0 + 64 <= d; j0 += 64) {
      __m512 a0 = _mm512_loadu_ps(src + j0), a1 = _mm512_loadu_ps(src + j0 + 16);
      __m512 a2 = _mm512_loadu_ps(src + j0 + 32), a3 = _mm512_loadu_ps(src + j0 + 48);
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
    for (int64_t j = j0; j < d; ++j) dst[j] = src[j];
    for (int64_t e = 0; e < experts; ++e) {
      const float c = coef[e];
      const float* __restrict we = wp + e * d;
#pragma omp simd
      for (int64_t j = j0; j < d; ++j) dst[j] += c * we[j];
    }
  }
}
