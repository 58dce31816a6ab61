// picasso::hash_find / hash_insert / hash_erase: an int64 key -> int64 slot table, open addressing.
//
// State lives in caller-owned tensors so it can be checkpointed and moved like any buffer:
//   keys  [cap] int64, cap a power of two >= 2 * num_slots; kEmpty / kTombstone mark free buckets
//   slots [cap] int64, the slot of the key in the same bucket
//   free  [num_slots] int64, a stack of unused slots; free[0 : meta[1]] are available
//   meta  [3] int64: live keys, free slots, tombstones
// Linear probing from a Fibonacci hash. A full table (no free slot) returns -1 for the keys it
// could not insert and changes nothing else; buckets are rebuilt when tombstones pass cap / 4, so
// at least a quarter of the buckets stay empty and every probe ends.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kEmpty = std::numeric_limits<int64_t>::min();
constexpr int64_t kTombstone = std::numeric_limits<int64_t>::min() + 1;

struct Table {
  int64_t* keys;
  int64_t* slots;
  int64_t* free;
  int64_t* meta;
  int64_t cap;
  int bits;
  uint64_t mask;

  int64_t home(int64_t key) const {
    return static_cast<int64_t>((static_cast<uint64_t>(key) * 0x9E3779B97F4A7C15ULL) >> (64 - bits));
  }
  int64_t find(int64_t key) const {
    for (int64_t h = home(key);; h = (h + 1) & mask) {
      const int64_t k = keys[h];
      if (k == key) return slots[h];
      if (k == kEmpty) return -1;
    }
  }
};

Table open_table(at::Tensor& keys, at::Tensor& slots, at::Tensor& free, at::Tensor& meta) {
  for (const at::Tensor* t : {&keys, &slots, &free, &meta}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kLong && t->dim() == 1 && t->is_contiguous(),
                "hash table: state tensors must be contiguous 1-d int64 CPU tensors");
  }
  const int64_t cap = keys.numel();
  TORCH_CHECK(cap >= 2 && (cap & (cap - 1)) == 0 && slots.numel() == cap,
              "hash table: keys and slots must have the same power-of-two size >= 2");
  TORCH_CHECK(2 * free.numel() <= cap, "hash table: needs at least 2 buckets per slot");
  TORCH_CHECK(meta.numel() == 3, "hash table: meta must hold [size, free, tombstones]");
  int bits = 0;
  while ((int64_t{1} << bits) < cap) ++bits;
  return {keys.data_ptr<int64_t>(), slots.data_ptr<int64_t>(), free.data_ptr<int64_t>(), meta.data_ptr<int64_t>(),
          cap, bits, static_cast<uint64_t>(cap - 1)};
}

void check_keys(const at::Tensor& keys) {
  TORCH_CHECK(keys.scalar_type() == at::kLong && keys.device().is_cpu(), "hash table: keys must be int64 CPU");
}

// drop tombstones: reinsert live keys in bucket order (deterministic)
void rebuild(Table& t) {
  std::vector<std::pair<int64_t, int64_t>> live;
  live.reserve(t.meta[0]);
  for (int64_t h = 0; h < t.cap; ++h) {
    if (t.keys[h] != kEmpty && t.keys[h] != kTombstone) live.emplace_back(t.keys[h], t.slots[h]);
    t.keys[h] = kEmpty;
    t.slots[h] = -1;
  }
  for (const auto& kv : live) {
    int64_t h = t.home(kv.first);
    while (t.keys[h] != kEmpty) h = (h + 1) & t.mask;
    t.keys[h] = kv.first;
    t.slots[h] = kv.second;
  }
  t.meta[2] = 0;
}

at::Tensor hash_find(const at::Tensor& keys, const at::Tensor& slots, const at::Tensor& query) {
  at::Tensor k = keys, s = slots, f = at::empty({0}, keys.options()), m = at::zeros({3}, keys.options());
  const Table t = open_table(k, s, f, m);
  check_keys(query);
  auto q = query.contiguous();
  auto out = at::empty_like(q);
  const int64_t* qp = q.data_ptr<int64_t>();
  int64_t* op = out.data_ptr<int64_t>();
  // read-only probes: safe to split across threads
  at::parallel_for(0, q.numel(), 4096, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) op[i] = t.find(qp[i]);
  });
  return out;
}

at::Tensor hash_insert(at::Tensor& keys, at::Tensor& slots, at::Tensor& free, at::Tensor& meta,
                       const at::Tensor& query) {
  Table t = open_table(keys, slots, free, meta);
  check_keys(query);
  auto q = query.contiguous();
  const int64_t* qp = q.data_ptr<int64_t>();
  const int64_t n = q.numel();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(qp[i] != kEmpty && qp[i] != kTombstone, "hash_insert: keys ", kEmpty, " and ", kTombstone,
                " are reserved");
  }
  if (t.meta[2] > t.cap / 4) rebuild(t);
  auto out = at::empty_like(q);
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t key = qp[i];
    int64_t h = t.home(key), tomb = -1, found = -1;
    for (;; h = (h + 1) & t.mask) {
      const int64_t k = t.keys[h];
      if (k == key) {
        found = t.slots[h];
        break;
      }
      if (k == kEmpty) break;
      if (k == kTombstone && tomb < 0) tomb = h;
    }
    if (found >= 0) {
      op[i] = found;
      continue;
    }
    if (t.meta[1] == 0) {  // full: report, change nothing
      op[i] = -1;
      continue;
    }
    const int64_t b = tomb >= 0 ? tomb : h;
    const int64_t slot = t.free[--t.meta[1]];
    t.keys[b] = key;
    t.slots[b] = slot;
    t.meta[0] += 1;
    if (tomb >= 0) t.meta[2] -= 1;
    op[i] = slot;
  }
  return out;
}

at::Tensor hash_erase(at::Tensor& keys, at::Tensor& slots, at::Tensor& free, at::Tensor& meta,
                      const at::Tensor& query) {
  Table t = open_table(keys, slots, free, meta);
  check_keys(query);
  auto q = query.contiguous();
  const int64_t* qp = q.data_ptr<int64_t>();
  const int64_t n = q.numel();
  auto out = at::empty_like(q);
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t key = qp[i];
    op[i] = -1;
    if (key == kEmpty || key == kTombstone) continue;
    for (int64_t h = t.home(key);; h = (h + 1) & t.mask) {
      const int64_t k = t.keys[h];
      if (k == kEmpty) break;
      if (k == key) {
        op[i] = t.slots[h];
        t.free[t.meta[1]++] = t.slots[h];
        t.keys[h] = kTombstone;
        t.slots[h] = -1;
        t.meta[0] -= 1;
        t.meta[2] += 1;
        break;
      }
    }
  }
  if (t.meta[2] > t.cap / 4) rebuild(t);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(picasso, m) {
  m.def("hash_find(Tensor keys, Tensor slots, Tensor query) -> Tensor");
  m.def("hash_insert(Tensor(a!) keys, Tensor(b!) slots, Tensor(c!) free, Tensor(d!) meta, Tensor query) -> Tensor");
  m.def("hash_erase(Tensor(a!) keys, Tensor(b!) slots, Tensor(c!) free, Tensor(d!) meta, Tensor query) -> Tensor");
}

TORCH_LIBRARY_IMPL(picasso, CPU, m) {
  m.impl("hash_find", &hash_find);
  m.impl("hash_insert", &hash_insert);
  m.impl("hash_erase", &hash_erase);
}
