// picasso::pooled_empty: large CPU outputs from a recycling pool of already-faulted huge-page blocks.
//
// A fresh [B, sum D] output of 100+ MB (F=1000, D=16, B=2048) is page-faulted by the lookup's first
// stores; on this VM those faults cost from a third of the lookup to more than all of it, depending
// on the host (benchmarks/RESULTS.md). Training allocates the same shape every step, so a block freed
// by the previous step is handed back as is: no mmap, no faults. A block returns to the pool only when
// its storage dies (every view gone), as in PyTorch's CUDA caching allocator; the pool keeps at most
// `limit` bytes of free blocks and releases the rest to the OS.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <iterator>
#include <map>
#include <mutex>
#include <vector>
#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace {

constexpr size_t kAlign = size_t(2) << 20;  // a huge page: blocks are whole huge pages

struct Pool {
  std::mutex mu;
  std::multimap<size_t, void*> free_blocks;  // bytes -> block
  size_t cached = 0;                         // bytes in free_blocks
  size_t limit = size_t(1) << 30;
  int64_t hits = 0;
  int64_t misses = 0;
};

Pool& pool() {
  static Pool* p = new Pool();  // never destroyed: storages freed at interpreter exit still return here
  return *p;
}

void give_back(void* block, size_t bytes) {
  Pool& p = pool();
  {
    std::lock_guard<std::mutex> g(p.mu);
    if (p.cached + bytes <= p.limit) {
      p.free_blocks.emplace(bytes, block);
      p.cached += bytes;
      return;
    }
  }
  std::free(block);
}

void* take(size_t bytes) {
  Pool& p = pool();
  {
    std::lock_guard<std::mutex> g(p.mu);
    auto it = p.free_blocks.find(bytes);  // exact size: a training step asks for the same shape every time
    if (it != p.free_blocks.end()) {
      void* block = it->second;
      p.free_blocks.erase(it);
      p.cached -= bytes;
      ++p.hits;
      return block;
    }
    ++p.misses;
  }
  void* block = std::aligned_alloc(kAlign, bytes);
  TORCH_CHECK(block != nullptr, "pooled_empty: out of memory allocating ", bytes, " bytes");
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  madvise(block, bytes, MADV_HUGEPAGE);  // best effort: 512x fewer faults on first use where THP is on
#endif
  return block;
}

at::Tensor pooled_empty(int64_t rows, int64_t cols, at::ScalarType dtype) {
  TORCH_CHECK(rows >= 0 && cols >= 0, "pooled_empty: negative shape [", rows, ", ", cols, "]");
  const size_t need = size_t(rows) * size_t(cols) * at::elementSize(dtype);
  const size_t bytes = std::max(kAlign, (need + kAlign - 1) / kAlign * kAlign);
  void* block = take(bytes);
  return at::from_blob(block, {rows, cols}, [bytes](void* b) { give_back(b, bytes); },
                       at::TensorOptions().dtype(dtype).device(at::kCPU));
}

// (cached bytes, hits, misses) so far; `limit` >= 0 sets the cap on cached bytes and frees what exceeds it.
std::vector<int64_t> output_pool_stats(int64_t limit) {
  Pool& p = pool();
  std::vector<void*> release;
  std::vector<int64_t> out;
  {
    std::lock_guard<std::mutex> g(p.mu);
    if (limit >= 0) {
      p.limit = size_t(limit);
      while (p.cached > p.limit && !p.free_blocks.empty()) {
        auto it = std::prev(p.free_blocks.end());  // largest first
        p.cached -= it->first;
        release.push_back(it->second);
        p.free_blocks.erase(it);
      }
    }
    out = {int64_t(p.cached), p.hits, p.misses};
  }
  for (void* b : release) std::free(b);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(picasso, m) {
  // no tensor arguments, so no dispatch key: catch-all kernels
  m.def("pooled_empty(int rows, int cols, ScalarType dtype) -> Tensor", &pooled_empty);
  m.def("output_pool_stats(int limit=-1) -> int[]", &output_pool_stats);
}
