// picasso::packed_lookup: one pack's pooled embedding-bag lookup, written straight into [B, sum D].
//
// Bags are column-major (bag g = column c * B + sample b, the batch's field-major order), so the
// ids are read sequentially; bag (c, b) is written to out[b, column_starts[c] : column_starts[c] + W].
// Each bag writes its own output block, so bags run in parallel with no synchronisation.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#if defined(__AVX__)
#include <immintrin.h>
#endif
#include <cstdint>
#include <fstream>
#include <limits>
#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace {

// ids ahead whose rows are prefetched: hides the row miss of Zipf tails. 16 measured 10-25% faster
// than 8 at B=2048, F=200-1000, D=16-64 (one thread, Sapphire Rapids VM); 32 no better than 16.
#ifndef PICASSO_LOOKUP_PREFETCH
#define PICASSO_LOOKUP_PREFETCH 16
#endif
constexpr int64_t kPrefetch = PICASSO_LOOKUP_PREFETCH;

struct LookupArgs {
  const float* weight;
  int64_t num_rows;
  int64_t width;
  int64_t batch;
  int64_t ld;  // output row stride
  const int64_t* column_starts;
  const int64_t* row_offsets;  // nullptr: indices are buffer rows already
  const int64_t* column_rows;  // nullptr: any id inside the buffer is valid; else id < column_rows[c]
  const float* weights;        // nullptr: unweighted
  const bool* mean_columns;    // nullptr: every column sums
  float* out;
};

// The output is written once and read by the next layer much later: streaming stores skip the
// read-for-ownership of each output line, a sixth of the lookup's memory traffic at D=64.
#ifndef PICASSO_LOOKUP_STREAM
#define PICASSO_LOOKUP_STREAM 1
#endif
inline void store_row(float* o, const float* acc, int64_t n, float scale) {
#if defined(__AVX__) && PICASSO_LOOKUP_STREAM
  if ((reinterpret_cast<uintptr_t>(o) & 31) == 0 && (n & 7) == 0) {
    const __m256 s = _mm256_set1_ps(scale);
    for (int64_t j = 0; j < n; j += 8) _mm256_stream_ps(o + j, _mm256_mul_ps(_mm256_loadu_ps(acc + j), s));
    return;
  }
#endif
  for (int64_t j = 0; j < n; ++j) o[j] = acc[j] * scale;
}

// Bags b0..b1 of column c. Everything per column (row offset, valid id range, mean flag, output
// column) is hoisted out of the bag loop. kW > 0: width known at compile time (unrolled,
// vectorised, accumulator in registers); 0: any width, in tiles of 64.
template <typename index_t, int kW, bool kWeighted>
void lookup_column(const LookupArgs& a, const index_t* indices, const index_t* offsets, int64_t c, int64_t b0,
                   int64_t b1, int64_t id_end, std::atomic<int64_t>& bad) {
  const int64_t W = kW > 0 ? kW : a.width;
  constexpr int kTile = kW > 0 ? kW : 64;
  const int64_t roff = a.row_offsets ? a.row_offsets[c] : 0;
  // valid ids: id + roff inside the buffer and, with column_rows, 0 <= id < column_rows[c]
  int64_t lo = -roff, hi = a.num_rows - roff;
  if (a.column_rows) {
    lo = std::max<int64_t>(lo, 0);
    hi = std::min<int64_t>(hi, a.column_rows[c]);
  }
  const uint64_t span = hi > lo ? static_cast<uint64_t>(hi - lo) : 0;
  const uint64_t num_rows = static_cast<uint64_t>(a.num_rows);
  const bool mean = a.mean_columns && a.mean_columns[c];
  float* out_c = a.out + a.column_starts[c];
  const index_t* off = offsets + c * a.batch;
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t s = static_cast<int64_t>(off[b]);
    const int64_t e = static_cast<int64_t>(off[b + 1]);
    const float scale = (mean && e > s) ? 1.0f / static_cast<float>(e - s) : 1.0f;
    float* o = out_c + b * a.ld;
    for (int64_t j0 = 0; j0 < W; j0 += kTile) {
      const int64_t n = kW > 0 ? kW : std::min<int64_t>(kTile, W - j0);
      float acc[kTile];
      for (int64_t j = 0; j < n; ++j) acc[j] = 0.0f;
      for (int64_t p = s; p < e; ++p) {
        if (p + kPrefetch < id_end) {
          // a later id may belong to the next column (other row offset): a wrong prefetch only costs a line
          const int64_t q = static_cast<int64_t>(indices[p + kPrefetch]) + roff;
          if (static_cast<uint64_t>(q) < num_rows) {
            const float* ahead = a.weight + q * a.width + j0;
            for (int64_t k = 0; k < n; k += 16) __builtin_prefetch(ahead + k);  // every 64-byte line of the row
          }
        }
        const int64_t id = static_cast<int64_t>(indices[p]);
        if (static_cast<uint64_t>(id - lo) >= span) {
          bad.store(p, std::memory_order_relaxed);
          continue;
        }
        const float* row = a.weight + (id + roff) * a.width + j0;
        if (kWeighted) {
          const float w = a.weights[p];
          for (int64_t j = 0; j < n; ++j) acc[j] += w * row[j];
        } else {
          for (int64_t j = 0; j < n; ++j) acc[j] += row[j];
        }
      }
      store_row(o + j0, acc, n, scale);
    }
  }
}

// bags g0..g1 (column-major: g = c * B + b), walked column by column
template <typename index_t, int kW, bool kWeighted>
void lookup_bags(const LookupArgs& a, const index_t* indices, const index_t* offsets, int64_t g0, int64_t g1,
                 std::atomic<int64_t>& bad) {
  const int64_t id_end = static_cast<int64_t>(offsets[g1]);
  for (int64_t c = g0 / a.batch; c * a.batch < g1; ++c) {
    const int64_t b0 = std::max<int64_t>(g0 - c * a.batch, 0);
    const int64_t b1 = std::min<int64_t>(g1 - c * a.batch, a.batch);
    lookup_column<index_t, kW, kWeighted>(a, indices, offsets, c, b0, b1, id_end, bad);
  }
}

template <typename index_t, bool kWeighted>
void lookup_width(const LookupArgs& a, const index_t* indices, const index_t* offsets, int64_t g0, int64_t g1,
                  std::atomic<int64_t>& bad) {
  switch (a.width) {
    case 4: lookup_bags<index_t, 4, kWeighted>(a, indices, offsets, g0, g1, bad); break;
    case 8: lookup_bags<index_t, 8, kWeighted>(a, indices, offsets, g0, g1, bad); break;
    case 16: lookup_bags<index_t, 16, kWeighted>(a, indices, offsets, g0, g1, bad); break;
    case 32: lookup_bags<index_t, 32, kWeighted>(a, indices, offsets, g0, g1, bad); break;
    case 64: lookup_bags<index_t, 64, kWeighted>(a, indices, offsets, g0, g1, bad); break;
    case 128: lookup_bags<index_t, 128, kWeighted>(a, indices, offsets, g0, g1, bad); break;
    default: lookup_bags<index_t, 0, kWeighted>(a, indices, offsets, g0, g1, bad); break;
  }
}

template <typename index_t>
void lookup_dispatch(const LookupArgs& a, const index_t* indices, const index_t* offsets, int64_t num_bags,
                     std::atomic<int64_t>& bad) {
  // ~3 ids a bag: chunks of 2048 bags amortise the thread hand-off
  at::parallel_for(0, num_bags, 2048, [&](int64_t g0, int64_t g1) {
    if (a.weights) {
      lookup_width<index_t, true>(a, indices, offsets, g0, g1, bad);
    } else {
      lookup_width<index_t, false>(a, indices, offsets, g0, g1, bad);
    }
#if defined(__AVX__)
    _mm_sfence();  // on each worker thread: its streaming stores are visible before the op returns
#endif
  });
}

void packed_lookup(const at::Tensor& weight, const at::Tensor& indices, const at::Tensor& offsets,
                   const at::Tensor& column_starts, const std::optional<at::Tensor>& row_offsets,
                   const std::optional<at::Tensor>& per_sample_weights,
                   const std::optional<at::Tensor>& mean_columns, at::Tensor& out,
                   const std::optional<at::Tensor>& column_rows) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kFloat && weight.dim() == 2 &&
                  weight.is_contiguous(),
              "packed_lookup: weight must be a contiguous float32 CPU [rows, width] tensor");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.stride(1) == 1,
              "packed_lookup: out must be a float32 [B, sum D] tensor with unit column stride");
  TORCH_CHECK(indices.dim() == 1 && offsets.dim() == 1, "packed_lookup: indices and offsets must be 1-d");
  TORCH_CHECK(indices.scalar_type() == at::kInt || indices.scalar_type() == at::kLong,
              "packed_lookup: indices must be int32 or int64");
  const int64_t C = column_starts.numel();
  const int64_t B = out.size(0);
  const int64_t W = weight.size(1);
  TORCH_CHECK(offsets.numel() == C * B + 1, "packed_lookup: offsets must hold columns * batch + 1 = ", C * B + 1,
              " entries, got ", offsets.numel());
  auto idx = indices.contiguous();
  auto off = offsets.to(indices.scalar_type()).contiguous();
  auto cs = column_starts.to(at::kLong).contiguous();
  TORCH_CHECK(C == 0 || (cs.min().item<int64_t>() >= 0 && cs.max().item<int64_t>() + W <= out.size(1)),
              "packed_lookup: a column start puts its ", W, " values outside out's ", out.size(1), " columns");
  std::optional<at::Tensor> ro, psw, mc;
  if (row_offsets) {
    ro = row_offsets->to(at::kLong).contiguous();
    TORCH_CHECK(ro->numel() == C, "packed_lookup: row_offsets needs one entry per column");
  }
  if (per_sample_weights) {
    psw = per_sample_weights->to(at::kFloat).contiguous();
    TORCH_CHECK(psw->numel() == idx.numel(), "packed_lookup: per_sample_weights needs one weight per index");
  }
  if (mean_columns) {
    mc = mean_columns->to(at::kBool).contiguous();
    TORCH_CHECK(mc->numel() == C, "packed_lookup: mean_columns needs one flag per column");
  }
  std::optional<at::Tensor> cr;
  if (column_rows) {
    cr = column_rows->to(at::kLong).contiguous();
    TORCH_CHECK(cr->numel() == C, "packed_lookup: column_rows needs one entry per column");
  }
  if (C * B == 0) return;
  TORCH_CHECK(off[0].item<int64_t>() == 0 && off[C * B].item<int64_t>() == idx.numel(),
              "packed_lookup: offsets must start at 0 and end at the number of indices");
  LookupArgs a{weight.data_ptr<float>(),
               weight.size(0),
               W,
               B,
               out.stride(0),
               cs.data_ptr<int64_t>(),
               ro ? ro->data_ptr<int64_t>() : nullptr,
               cr ? cr->data_ptr<int64_t>() : nullptr,
               psw ? psw->data_ptr<float>() : nullptr,
               mc ? mc->data_ptr<bool>() : nullptr,
               out.data_ptr<float>()};
  std::atomic<int64_t> bad{-1};
  AT_DISPATCH_INDEX_TYPES(idx.scalar_type(), "packed_lookup", [&] {
    lookup_dispatch<index_t>(a, idx.data_ptr<index_t>(), off.data_ptr<index_t>(), C * B, bad);
  });

  const int64_t p = bad.load();
  TORCH_CHECK(p < 0 || cr, "packed_lookup: index ", p, " points at a row outside the buffer of ", weight.size(0),
              " rows");
  TORCH_CHECK(p < 0, "packed_lookup: index ", p, " (id ", idx[p].item<int64_t>(),
              ") is outside its column's table (column_rows) or the buffer of ", weight.size(0), " rows");
}

// Transparent huge pages for a large, not yet touched CPU tensor (madvise MADV_HUGEPAGE on the whole huge
// pages inside its storage); true when advised. A fresh [B, sum D] output of tens of MB is otherwise
// faulted in 4 KiB page by page by the lookup's first stores, and those faults cost more than the
// lookup itself (measured: 105 MB output, 72 of 98 ms). Pages already touched are left as they are.
bool advise_hugepages(const at::Tensor& t) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  static const uintptr_t huge = [] {
    uintptr_t size = 0;
    std::ifstream f("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size");
    if (!(f >> size)) size = 0;  // no THP support: advise nothing
    return size;
  }();
  if (huge == 0 || !t.device().is_cpu() || !t.has_storage()) return false;
  const uintptr_t p = reinterpret_cast<uintptr_t>(t.storage().data());
  const uintptr_t start = (p + huge - 1) & ~(huge - 1);
  const uintptr_t end = (p + t.storage().nbytes()) & ~(huge - 1);
  if (end <= start) return false;
  return madvise(reinterpret_cast<void*>(start), end - start, MADV_HUGEPAGE) == 0;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(picasso, m) {
  m.def("advise_hugepages(Tensor t) -> bool");
  m.def(
      "packed_lookup(Tensor weight, Tensor indices, Tensor offsets, Tensor column_starts, Tensor? row_offsets, "
      "Tensor? per_sample_weights, Tensor? mean_columns, Tensor(a!) out, Tensor? column_rows=None) -> ()");
}

TORCH_LIBRARY_IMPL(picasso, CPU, m) {
  m.impl("packed_lookup", &packed_lookup);
  m.impl("advise_hugepages", &advise_hugepages);
}
