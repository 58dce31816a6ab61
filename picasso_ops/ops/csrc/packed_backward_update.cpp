// picasso::packed_backward_update: a pack's backward with the sparse optimizer fused in, in place.
//
// Work items are (segment, partition) pairs: a segment is a group of columns whose rows no other
// segment touches (a table), and a partition is a slice of the segment's rows by hash, used when
// there are fewer segments than threads so one big table still spreads over all threads. Each item
// walks its ids once in order, dedups rows with a small open-addressing map, sums each row's
// gradient into a scratch row that stays in cache, then applies SGD, row-wise Adagrad or lazy Adam
// to its unique rows and their state. Items own disjoint rows, so they run in parallel with no
// locks, and a dense gradient is never built. Per row, gradients are summed in id order, as the
// reference's stable sort does.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

namespace {

enum class Optim { kSgd, kRowwiseAdagrad, kAdam };

constexpr int64_t kPrefetch = 8;   // unique rows ahead: hides the weight/state miss of the next updates
constexpr int64_t kGradAhead = 8;  // bags ahead whose gradient row is prefetched

struct BwdArgs {
  int64_t num_rows;
  int64_t width;
  int64_t batch;  // pooled: samples per column; 0: every id is its own bag (sequence features)
  int64_t ld;     // grad row stride
  const int64_t* column_starts;
  const int64_t* row_offsets;
  const float* weights;
  const bool* mean_columns;
  const float* grad;
};

struct OptimArgs {
  Optim kind;
  float lr, eps, beta1, beta2, bias1, bias2;  // bias*: 1 - beta**step
  float* weight;
  float* m1;
  float* m2;
};

// every 64-byte line of a row of W floats; rw = 1 when the row will be written
inline void prefetch_row(const float* p, int64_t W, int rw) {
  for (int64_t k = 0; k < W; k += 16) {
    if (rw) {
      __builtin_prefetch(p + k, 1);
    } else {
      __builtin_prefetch(p + k, 0);
    }
  }
}

inline uint64_t mix(int64_t r) { return static_cast<uint64_t>(r) * 0x9E3779B97F4A7C15ULL; }

// per-thread scratch, reused across the items a thread runs
struct Scratch {
  std::vector<int64_t> keys;
  std::vector<int32_t> slot;
  std::vector<int64_t> rows;
  std::vector<float> acc;
  int bits = 0;

  void reset(int64_t expected) {
    bits = 4;
    while ((int64_t{1} << bits) < 2 * expected) ++bits;
    keys.assign(int64_t{1} << bits, -1);
    slot.resize(int64_t{1} << bits);
    rows.clear();
    acc.clear();
  }
  void grow() {  // keep the map at most half full
    const int64_t cap = int64_t{1} << ++bits;
    keys.assign(cap, -1);
    slot.resize(cap);
    for (int64_t u = 0; u < static_cast<int64_t>(rows.size()); ++u) {
      uint64_t h = mix(rows[u]) >> (64 - bits);
      while (keys[h] != -1) h = (h + 1) & (cap - 1);
      keys[h] = rows[u];
      slot[h] = static_cast<int32_t>(u);
    }
  }
  // index of row r among this item's unique rows, adding it (with a zero gradient) when new
  int64_t find_or_add(int64_t r, int64_t width) {
    const uint64_t mask = (uint64_t{1} << bits) - 1;
    uint64_t h = mix(r) >> (64 - bits);
    while (keys[h] != -1 && keys[h] != r) h = (h + 1) & mask;
    if (keys[h] == r) return slot[h];
    const int64_t u = static_cast<int64_t>(rows.size());
    keys[h] = r;
    slot[h] = static_cast<int32_t>(u);
    rows.push_back(r);
    acc.resize(acc.size() + width, 0.0f);
    if (2 * (u + 1) > (int64_t{1} << bits)) grow();
    return u;
  }
};

template <int kW>
inline void apply_row(const OptimArgs& o, int64_t width, int64_t row, const float* acc) {
  const int64_t W = kW > 0 ? kW : width;
  float* w = o.weight + row * W;
  switch (o.kind) {
    case Optim::kSgd: {
      for (int64_t j = 0; j < W; ++j) w[j] += acc[j] * -o.lr;
      break;
    }
    case Optim::kRowwiseAdagrad: {
      float sq = 0.0f;
      for (int64_t j = 0; j < W; ++j) sq += acc[j] * acc[j];
      const float m = o.m1[row] + sq / static_cast<float>(W);
      o.m1[row] = m;
      const float mult = (1.0f / (std::sqrt(m) + o.eps)) * -o.lr;
      for (int64_t j = 0; j < W; ++j) w[j] += acc[j] * mult;
      break;
    }
    case Optim::kAdam: {
      float* m1 = o.m1 + row * W;
      float* m2 = o.m2 + row * W;
      for (int64_t j = 0; j < W; ++j) {
        const float g = acc[j];
        const float a1 = m1[j] * o.beta1 + g * (1.0f - o.beta1);
        const float a2 = m2[j] * o.beta2 + g * g * (1.0f - o.beta2);
        m1[j] = a1;
        m2[j] = a2;
        w[j] += ((a1 / o.bias1) / (std::sqrt(a2 / o.bias2) + o.eps)) * -o.lr;
      }
      break;
    }
  }
}

// one item: ids of bags [g0, g1) whose row falls in partition `part` of `parts`
template <typename index_t, int kW>
void run_item(const BwdArgs& a, const OptimArgs& o, const index_t* indices, const index_t* offsets, int64_t g0,
              int64_t g1, int64_t part, int64_t parts, Scratch& sc, std::atomic<int64_t>& bad) {
  const int64_t W = kW > 0 ? kW : a.width;
  const int64_t p0 = offsets ? static_cast<int64_t>(offsets[g0]) : g0;
  const int64_t p1 = offsets ? static_cast<int64_t>(offsets[g1]) : g1;
  if (p1 == p0) return;
  sc.reset(std::min<int64_t>((p1 - p0) / parts + 8, a.num_rows));
  auto add = [&](int64_t p, int64_t r, const float* g, float coef) {
    if (r < 0 || r >= a.num_rows) {
      bad.store(p, std::memory_order_relaxed);
      return;
    }
    if (parts > 1 && static_cast<int64_t>(((mix(r) >> 32) * static_cast<uint64_t>(parts)) >> 32) != part) return;
    const int64_t u = sc.find_or_add(r, W);  // may grow acc: take its address only after
    float* acc = sc.acc.data() + u * W;
    for (int64_t j = 0; j < W; ++j) acc[j] += g[j] * coef;
  };
  if (!offsets) {
    for (int64_t p = p0; p < p1; ++p) {
      add(p, static_cast<int64_t>(indices[p]), a.grad + p * a.ld, a.weights ? a.weights[p] : 1.0f);
    }
  } else {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t c = g / a.batch;
      const int64_t b = g - c * a.batch;
      const int64_t s = offsets[g], e = offsets[g + 1];
      const float* grow = a.grad + b * a.ld + a.column_starts[c];
      // grad rows are a page apart (stride sum D): fetch a few bags ahead to overlap the TLB and cache miss
      if (b + kGradAhead < a.batch) prefetch_row(grow + kGradAhead * a.ld, W, 0);
      const int64_t roff = a.row_offsets ? a.row_offsets[c] : 0;
      const float scale =
          (a.mean_columns && a.mean_columns[c] && e > s) ? 1.0f / static_cast<float>(e - s) : 1.0f;
      for (int64_t p = s; p < e; ++p) {
        add(p, static_cast<int64_t>(indices[p]) + roff, grow, a.weights ? a.weights[p] * scale : scale);
      }
    }
  }
  if (bad.load(std::memory_order_relaxed) >= 0) return;  // the caller raises; keep the buffers unchanged
  const int64_t U = static_cast<int64_t>(sc.rows.size());
  for (int64_t u = 0; u < U; ++u) {
    if (u + kPrefetch < U) {
      const int64_t q = sc.rows[u + kPrefetch];
      prefetch_row(o.weight + q * W, W, 1);
      if (o.kind == Optim::kRowwiseAdagrad) __builtin_prefetch(o.m1 + q, 1);
      if (o.kind == Optim::kAdam) {
        prefetch_row(o.m1 + q * W, W, 1);
        prefetch_row(o.m2 + q * W, W, 1);
      }
    }
    apply_row<kW>(o, W, sc.rows[u], sc.acc.data() + u * W);
  }
}

template <typename index_t, int kW>
void run_all(const BwdArgs& a, const OptimArgs& o, const index_t* indices, const index_t* offsets,
             const std::vector<int64_t>& bounds, std::atomic<int64_t>& bad) {
  const int64_t S = static_cast<int64_t>(bounds.size()) - 1;
  const int64_t threads = at::get_num_threads();
  // partitions per segment: enough items to balance threads (every partition re-reads its segment's ids)
  const int64_t parts = (threads <= 1 || S >= 4 * threads) ? 1 : (4 * threads + S - 1) / S;
  std::vector<std::array<int64_t, 3>> items;  // (segment, partition, partitions)
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t q = 0; q < parts; ++q) items.push_back({s, q, parts});
  }
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t i0, int64_t i1) {
    Scratch sc;
    for (int64_t i = i0; i < i1; ++i) {
      const auto& it = items[i];
      run_item<index_t, kW>(a, o, indices, offsets, bounds[it[0]], bounds[it[0] + 1], it[1], it[2], sc, bad);
    }
  });
}

void packed_backward_update(at::Tensor& weight, at::Tensor& momentum1, at::Tensor& momentum2,
                            const at::Tensor& indices, const std::optional<at::Tensor>& offsets,
                            const at::Tensor& grad, const std::optional<at::Tensor>& column_starts,
                            const std::optional<at::Tensor>& row_offsets,
                            const std::optional<at::Tensor>& per_sample_weights,
                            const std::optional<at::Tensor>& mean_columns, const std::optional<at::Tensor>& segments,
                            c10::string_view optimizer, double lr, double eps, double beta1, double beta2,
                            double step) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kFloat && weight.dim() == 2 &&
                  weight.is_contiguous(),
              "packed_backward_update: weight must be a contiguous float32 CPU [rows, width] tensor");
  TORCH_CHECK(grad.scalar_type() == at::kFloat && grad.dim() == 2 && grad.stride(1) == 1,
              "packed_backward_update: grad must be float32 2-d with unit column stride");
  TORCH_CHECK(indices.scalar_type() == at::kInt || indices.scalar_type() == at::kLong,
              "packed_backward_update: indices must be int32 or int64");
  const int64_t R = weight.size(0), W = weight.size(1), N = indices.numel();
  Optim kind;
  const std::string name(optimizer.data(), optimizer.size());
  if (name == "sgd") {
    kind = Optim::kSgd;
  } else if (name == "rowwise_adagrad") {
    kind = Optim::kRowwiseAdagrad;
    TORCH_CHECK(momentum1.scalar_type() == at::kFloat && momentum1.is_contiguous() && momentum1.numel() == R,
                "packed_backward_update: rowwise_adagrad needs a contiguous float32 momentum1 of ", R, " rows");
  } else if (name == "adam") {
    kind = Optim::kAdam;
    for (const at::Tensor* m : {&momentum1, &momentum2}) {
      TORCH_CHECK(m->scalar_type() == at::kFloat && m->is_contiguous() && m->sizes() == weight.sizes(),
                  "packed_backward_update: adam needs contiguous float32 momentum1/momentum2 shaped like weight");
    }
    TORCH_CHECK(step >= 1, "packed_backward_update: adam needs step >= 1, got ", step);
  } else {
    TORCH_CHECK(false, "packed_backward_update: unknown optimizer '", name, "' (sgd, rowwise_adagrad, adam)");
  }
  auto idx = indices.contiguous();
  at::Tensor off, cs, ro, psw, mc, sg;
  int64_t num_bags, batch = 0;
  if (offsets) {
    TORCH_CHECK(column_starts, "packed_backward_update: pooled lookups (offsets given) need column_starts");
    off = offsets->to(idx.scalar_type()).contiguous();
    cs = column_starts->to(at::kLong).contiguous();
    const int64_t C = cs.numel();
    batch = grad.size(0);
    num_bags = C * batch;
    TORCH_CHECK(off.numel() == num_bags + 1, "packed_backward_update: offsets must hold columns * batch + 1 = ",
                num_bags + 1, " entries, got ", off.numel());
    TORCH_CHECK(C == 0 || (cs.min().item<int64_t>() >= 0 && cs.max().item<int64_t>() + W <= grad.size(1)),
                "packed_backward_update: a column start lies outside grad's ", grad.size(1), " columns");
    if (num_bags > 0) {
      TORCH_CHECK(off[0].item<int64_t>() == 0 && off[num_bags].item<int64_t>() == N,
                  "packed_backward_update: offsets must start at 0 and end at the number of indices");
    }
    if (mean_columns) {
      mc = mean_columns->to(at::kBool).contiguous();
      TORCH_CHECK(mc.numel() == C, "packed_backward_update: mean_columns needs one flag per column");
    }
    if (row_offsets) {
      ro = row_offsets->to(at::kLong).contiguous();
      TORCH_CHECK(ro.numel() == C, "packed_backward_update: row_offsets needs one entry per column");
    }
  } else {
    TORCH_CHECK(grad.size(0) == N && grad.size(1) == W,
                "packed_backward_update: without offsets grad must be [num indices, width]");
    TORCH_CHECK(!row_offsets && !mean_columns && !per_sample_weights,
                "packed_backward_update: row_offsets, mean_columns and per_sample_weights need offsets");
    num_bags = N;
  }
  if (per_sample_weights) {
    psw = per_sample_weights->to(at::kFloat).contiguous();
    TORCH_CHECK(psw.numel() == N, "packed_backward_update: per_sample_weights needs one weight per index");
  }
  std::vector<int64_t> bounds;
  if (segments) {
    sg = segments->to(at::kLong).contiguous();
    const int64_t* s = sg.data_ptr<int64_t>();
    bounds.assign(s, s + sg.numel());
    TORCH_CHECK(bounds.size() >= 2 && bounds.front() == 0 && bounds.back() == num_bags &&
                    std::is_sorted(bounds.begin(), bounds.end()),
                "packed_backward_update: segments must be ascending bag boundaries from 0 to ", num_bags);
  } else {
    bounds = {0, num_bags};
  }
  if (N == 0) return;
  BwdArgs a{R,
            W,
            batch,
            grad.stride(0),
            offsets ? cs.data_ptr<int64_t>() : nullptr,
            ro.defined() ? ro.data_ptr<int64_t>() : nullptr,
            psw.defined() ? psw.data_ptr<float>() : nullptr,
            mc.defined() ? mc.data_ptr<bool>() : nullptr,
            grad.data_ptr<float>()};
  OptimArgs o{kind,
              static_cast<float>(lr),
              static_cast<float>(eps),
              static_cast<float>(beta1),
              static_cast<float>(beta2),
              static_cast<float>(1.0 - std::pow(beta1, step)),
              static_cast<float>(1.0 - std::pow(beta2, step)),
              weight.data_ptr<float>(),
              kind == Optim::kSgd ? nullptr : momentum1.data_ptr<float>(),
              kind == Optim::kAdam ? momentum2.data_ptr<float>() : nullptr};
  std::atomic<int64_t> bad{-1};
  AT_DISPATCH_INDEX_TYPES(idx.scalar_type(), "packed_backward_update", [&] {
    const index_t* ip = idx.data_ptr<index_t>();
    const index_t* op = offsets ? off.data_ptr<index_t>() : nullptr;
    // bounds first, in one cheap pass: items update as they go, so a bad id must stop all of them
    at::parallel_for(0, num_bags, 4096, [&](int64_t g0, int64_t g1) {
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t roff = (op && a.row_offsets) ? a.row_offsets[g / batch] : 0;
        const int64_t s = op ? static_cast<int64_t>(op[g]) : g, e = op ? static_cast<int64_t>(op[g + 1]) : g + 1;
        for (int64_t p = s; p < e; ++p) {
          const int64_t r = static_cast<int64_t>(ip[p]) + roff;
          if (r < 0 || r >= R) bad.store(p, std::memory_order_relaxed);
        }
      }
    });
    const int64_t p = bad.load();
    TORCH_CHECK(p < 0, "packed_backward_update: index ", p, " points at a row outside the buffer of ", R,
                " rows; nothing was updated");
    switch (W) {
      case 4: run_all<index_t, 4>(a, o, ip, op, bounds, bad); break;
      case 8: run_all<index_t, 8>(a, o, ip, op, bounds, bad); break;
      case 16: run_all<index_t, 16>(a, o, ip, op, bounds, bad); break;
      case 32: run_all<index_t, 32>(a, o, ip, op, bounds, bad); break;
      case 64: run_all<index_t, 64>(a, o, ip, op, bounds, bad); break;
      case 128: run_all<index_t, 128>(a, o, ip, op, bounds, bad); break;
      default: run_all<index_t, 0>(a, o, ip, op, bounds, bad); break;
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(picasso, m) {
  m.def(
      "packed_backward_update(Tensor(a!) weight, Tensor(b!) momentum1, Tensor(c!) momentum2, Tensor indices, "
      "Tensor? offsets, Tensor grad, Tensor? column_starts, Tensor? row_offsets, Tensor? per_sample_weights, "
      "Tensor? mean_columns, Tensor? segments, str optimizer, float lr, float eps, float beta1, float beta2, "
      "float step) -> ()");
}

TORCH_LIBRARY_IMPL(picasso, CPU, m) { m.impl("packed_backward_update", &packed_backward_update); }
