"""picasso custom ops: C++ and Triton kernels against the pure-torch reference, hash table, builder behaviour."""

import logging
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest
import torch

from picasso_ops import ops
from picasso_ops.embedding.sparse_optim import RowUpdate, create_optimizer
from picasso_ops.ops import OpsConfig, builder, reference
from sparse_core import jit_build

HYPER = {
    "sgd": {"lr": 0.1},
    "rowwise_adagrad": {"lr": 0.1, "eps": 1e-8},
    "adam": {"lr": 0.01, "beta1": 0.9, "beta2": 0.99, "eps": 1e-8},
}
TOL = dict(rtol=1e-6, atol=1e-6)
# the first test that needs the C++ ops JIT-builds them (1-3 min cold on a busy 2-core box; cached after)
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def cpp():
    """The C++ ops, built (or loaded from the cache) once; a missing compiler skips, a failed build fails."""
    if shutil.which(ops.current_config().cxx) is None:
        pytest.skip("no C++ compiler")
    assert builder.load_ops(), "the C++ ops failed to build (see the warning in the log)"
    return "cpp"


def make_case(seed, *, columns=7, batch=5, width=16, weighted=False, mean=False, with_row_offsets=True,
              index_dtype=torch.int64, rows_per_table=6):
    """A pack of tables (some looked up by two columns), column-major bags with empty and repeated ids.

    Output columns are permuted and the output has spare columns, as in a collection with other packs.
    """
    g = torch.Generator().manual_seed(seed)
    table_of_column = torch.tensor([0, 0, 1, 2, 2, 3, 4, 5, 5, 6, 7][:columns])
    num_tables = int(table_of_column.max()) + 1
    row_offsets = table_of_column * rows_per_table
    lengths = torch.randint(0, 5, (columns, batch), generator=g)
    lengths[:, 0] = 0  # an empty bag in every column
    offsets = torch.zeros(columns * batch + 1, dtype=torch.int64)
    torch.cumsum(lengths.reshape(-1), 0, out=offsets[1:])
    n = int(offsets[-1])
    ids = torch.randint(0, rows_per_table, (n,), generator=g)  # small tables: many repeats
    counts = lengths.sum(1)
    rows = ids + torch.repeat_interleave(row_offsets, counts)
    weight = torch.randn(num_tables * rows_per_table, width, generator=g)
    spare = 3
    slots = torch.randperm(columns + spare, generator=g)[:columns]
    case = dict(
        weight=weight,
        indices=(ids if with_row_offsets else rows).to(index_dtype),
        offsets=offsets.to(index_dtype),
        column_starts=slots * width,
        out_width=(columns + spare) * width,
        row_offsets=row_offsets if with_row_offsets else None,
        per_sample_weights=torch.rand(n, generator=g) + 0.5 if weighted else None,
        mean_columns=torch.rand(columns, generator=g) < 0.5 if mean else None,
        segments=None,
    )
    # one segment per table: bag boundaries where the table changes
    first = [0] + [c for c in range(1, columns) if table_of_column[c] != table_of_column[c - 1]] + [columns]
    case["segments"] = torch.tensor(first) * batch
    return case, g


def _lookup(case, out, backend):
    return ops.packed_lookup(
        case["weight"], case["indices"], case["offsets"], case["column_starts"], out,
        row_offsets=case["row_offsets"], per_sample_weights=case["per_sample_weights"],
        mean_columns=case["mean_columns"], backend=backend,
    )


# ------------------------------------------------------------------ lookup
@pytest.mark.parametrize("width", [4, 16, 24, 64])
@pytest.mark.parametrize("weighted,mean", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("with_row_offsets", [True, False])
def test_lookup_matches_reference(cpp, width, weighted, mean, index_dtype, with_row_offsets):
    case, g = make_case(1, width=width, weighted=weighted, mean=mean, index_dtype=index_dtype,
                        with_row_offsets=with_row_offsets)
    base = torch.randn(5, case["out_width"], generator=g)  # spare columns must stay untouched
    want = _lookup(case, base.clone(), "reference")
    got = _lookup(case, base.clone(), cpp)
    torch.testing.assert_close(got, want, **TOL)


def test_lookup_empty_and_bad_ids(cpp):
    w = torch.randn(4, 8)
    out = torch.full((3, 8), 7.0)
    ops.packed_lookup(w, torch.zeros(0, dtype=torch.int64), torch.zeros(4, dtype=torch.int64), torch.tensor([0]), out)
    assert torch.equal(out, torch.zeros(3, 8))  # all bags empty: zeros, for sum and mean alike
    with pytest.raises(RuntimeError, match="outside the buffer"):
        ops.packed_lookup(w, torch.tensor([4]), torch.tensor([0, 1]), torch.tensor([0]), torch.empty(1, 8))
    with pytest.raises(RuntimeError, match="offsets must hold"):
        ops.packed_lookup(w, torch.tensor([1]), torch.tensor([0, 1]), torch.tensor([0]), torch.empty(2, 8))


@pytest.mark.parametrize("backend", ["cpp", "reference"])
@pytest.mark.parametrize("weighted", [False, True])
def test_lookup_column_rows_checks_each_table(cpp, backend, weighted):
    """``column_rows``: same output for valid ids; an id inside the buffer but past its own table raises."""
    case, g = make_case(2, width=16, weighted=weighted)
    C = case["column_starts"].numel()
    rows_per_table = 6
    base = torch.randn(5, case["out_width"], generator=g)
    want = _lookup(case, base.clone(), "reference")
    got = ops.packed_lookup(
        case["weight"], case["indices"], case["offsets"], case["column_starts"], base.clone(),
        row_offsets=case["row_offsets"], per_sample_weights=case["per_sample_weights"],
        column_rows=torch.full((C,), rows_per_table), backend=backend,
    )
    torch.testing.assert_close(got, want, **TOL)
    # column 0's table is followed by others in the buffer: id 6 is a valid buffer row, not a valid id
    bad = case["indices"].clone()
    bad[0] = rows_per_table
    args = (case["weight"], bad, case["offsets"], case["column_starts"], base.clone())
    ops.packed_lookup(*args, row_offsets=case["row_offsets"], backend=backend)  # no column_rows: accepted
    with pytest.raises(RuntimeError, match=r"index 0 \(id 6\) is outside its column's table"):
        ops.packed_lookup(*args, row_offsets=case["row_offsets"], column_rows=torch.full((C,), rows_per_table),
                          backend=backend)
    bad[0] = -1
    with pytest.raises(RuntimeError, match=r"index 0 \(id -1\)"):
        ops.packed_lookup(*args, row_offsets=case["row_offsets"], column_rows=torch.full((C,), rows_per_table),
                          backend=backend)


def test_advise_hugepages_leaves_values_intact(cpp):
    """Advising a large tensor is safe before or after writes; small or non-CPU tensors are not advised."""
    assert ops.advise_hugepages(torch.empty(16)) is False
    big = torch.empty(3 << 20)  # 12 MiB: at least one whole huge page inside on x86_64
    advised = ops.advise_hugepages(big)
    assert isinstance(advised, bool)
    thp = "/sys/kernel/mm/transparent_hugepage/enabled"
    if os.path.exists(thp) and "[never]" not in open(thp).read():
        assert advised
    big.fill_(3.0)
    ops.advise_hugepages(big)  # already touched: nothing changes
    assert torch.equal(big, torch.full_like(big, 3.0))


def test_pooled_empty_recycles_a_block_only_after_its_storage_dies(cpp):
    """A freed output's block comes back for the next same-size call; a live view keeps its block."""
    rows, cols = 1024, 2048  # 8 MiB
    ops.output_pool_stats(limit_bytes=1 << 30)
    a = ops.pooled_empty(rows, cols)
    assert a.shape == (rows, cols) and a.dtype == torch.float32
    a.fill_(1.5)
    ptr = a.data_ptr()
    view = a[3]  # keeps the storage alive after `a` goes
    del a
    before = ops.output_pool_stats()
    b = ops.pooled_empty(rows, cols)
    assert b.data_ptr() != ptr and torch.equal(view, torch.full((cols,), 1.5))  # the live block was not reused
    del view
    c = ops.pooled_empty(rows, cols)
    assert c.data_ptr() == ptr and ops.output_pool_stats()["hits"] == before["hits"] + 1
    del b, c
    assert ops.output_pool_stats()["cached_bytes"] >= 2 * rows * cols * 4
    assert ops.output_pool_stats(limit_bytes=0)["cached_bytes"] == 0  # a zero cap frees every block
    d = ops.pooled_empty(3, 5, dtype=torch.float64)  # small and other dtypes work; blocks are whole huge pages
    assert d.shape == (3, 5) and d.dtype == torch.float64
    del d
    assert ops.output_pool_stats()["cached_bytes"] == 0  # over the cap: freed, not cached
    ops.output_pool_stats(limit_bytes=1 << 30)


def test_collection_hugepage_output_same_values(cpp):
    """A collection output above the huge-page threshold is the same with and without ``hugepage_output``."""
    from picasso_ops.embedding import PackedEmbeddingCollection, TableSpec
    from picasso_ops.jagged import JaggedBatch

    specs = [TableSpec(f"t{i}", 50, 512, "mean" if i else "sum") for i in range(2)]
    torch.manual_seed(0)
    emb = PackedEmbeddingCollection(specs)
    assert emb.hugepage_output
    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(0, 4, (2, 2048), generator=g)  # out: 2048 x 1024 floats = 8 MiB
    batch = JaggedBatch(["t0", "t1"], torch.randint(0, 50, (int(lengths.sum()),), generator=g), lengths)
    with torch.no_grad():
        a = emb(batch).values.clone()
        emb.hugepage_output = False
        b = emb(batch).values
    assert torch.equal(a, b)


# --------------------------------------------------------- backward + optim
def _state(optimizer, weight):
    if optimizer == "rowwise_adagrad":
        return {"momentum1": torch.zeros(weight.shape[0])}
    if optimizer == "adam":
        return {"momentum1": torch.zeros_like(weight), "momentum2": torch.zeros_like(weight)}
    return {}


def _train(case, optimizer, backend, steps, seed, use_segments):
    """``steps`` fused backward+update steps on one case, new random output gradients each step."""
    weight = case["weight"].clone()
    state = _state(optimizer, weight)
    g = torch.Generator().manual_seed(seed)
    batch = (case["offsets"].numel() - 1) // case["column_starts"].numel()
    for step in range(1, steps + 1):
        grad = torch.randn(batch, case["out_width"], generator=g)
        ops.packed_backward_update(
            weight, state, case["indices"], case["offsets"], grad, case["column_starts"],
            optimizer=optimizer, hyperparams=HYPER[optimizer], step=step,
            row_offsets=case["row_offsets"], per_sample_weights=case["per_sample_weights"],
            mean_columns=case["mean_columns"], segments=case["segments"] if use_segments else None,
            backend=backend,
        )
    return weight, state


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adam"])
@pytest.mark.parametrize("weighted,mean", [(False, False), (True, True), (False, True)])
@pytest.mark.parametrize("width,index_dtype,use_segments", [(16, torch.int64, True), (24, torch.int32, False)])
def test_backward_update_matches_reference(cpp, optimizer, weighted, mean, width, index_dtype, use_segments):
    case, _ = make_case(2, width=width, weighted=weighted, mean=mean, index_dtype=index_dtype, batch=9)
    w_ref, s_ref = _train(case, optimizer, "reference", steps=5, seed=3, use_segments=use_segments)
    w_cpp, s_cpp = _train(case, optimizer, cpp, steps=5, seed=3, use_segments=use_segments)
    assert not torch.equal(w_ref, case["weight"])
    torch.testing.assert_close(w_cpp, w_ref, **TOL)
    for key in s_ref:
        torch.testing.assert_close(s_cpp[key], s_ref[key], **TOL)


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adam"])
def test_backward_update_sequence_rows(cpp, optimizer):
    """``offsets=None``: one gradient row per id (sequence features), repeated ids summed."""
    g = torch.Generator().manual_seed(4)
    weight = torch.randn(10, 8, generator=g)
    ids = torch.randint(0, 10, (40,), generator=g)
    results = []
    for backend in ("reference", cpp):
        w, state = weight.clone(), _state(optimizer, weight)
        for step in (1, 2, 3):
            grad = torch.randn(40, 8, generator=torch.Generator().manual_seed(step))
            ops.packed_backward_update(w, state, ids, None, grad, None, optimizer=optimizer,
                                       hyperparams=HYPER[optimizer], step=step, backend=backend)
        results.append((w, state))
    torch.testing.assert_close(results[1][0], results[0][0], **TOL)
    for key in results[0][1]:
        torch.testing.assert_close(results[1][1][key], results[0][1][key], **TOL)


def test_backward_update_bad_id_changes_nothing(cpp):
    w = torch.randn(4, 8)
    before = w.clone()
    with pytest.raises(RuntimeError, match="nothing was updated"):
        ops.packed_backward_update(w, {}, torch.tensor([1, 9]), torch.tensor([0, 2]), torch.ones(1, 8),
                                   torch.tensor([0]), optimizer="sgd", hyperparams={"lr": 1.0})
    assert torch.equal(w, before)


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adam"])
def test_reference_optimizer_is_sparse_optim(optimizer):
    """The reference formulas are those of embedding.sparse_optim, which packed.py uses."""
    g = torch.Generator().manual_seed(5)
    weight = torch.randn(6, 4, generator=g)
    rows = torch.tensor([0, 2, 5])
    opt = create_optimizer(optimizer, HYPER[optimizer])
    w_opt, s_opt = weight.clone(), opt.init_state(6, 4, num_logical_rows=6)
    w_ref, s_ref = weight.clone(), _state(optimizer, weight)
    for step in (1, 2, 3):
        grad = torch.randn(3, 4, generator=g)
        opt.update(w_opt, s_opt, RowUpdate.simple(rows, grad, step=step))
        reference.apply_optimizer(w_ref, s_ref, rows, grad, optimizer, HYPER[optimizer], step)
    torch.testing.assert_close(w_ref, w_opt, rtol=0, atol=0)
    for key in s_ref:
        torch.testing.assert_close(s_ref[key], s_opt[key], rtol=0, atol=0)


def test_ops_release_the_gil(cpp):
    """A Python thread keeps running while one lookup call runs: the op does not hold the GIL."""
    import threading

    case, _ = make_case(6, columns=7, batch=40000, width=64)
    out = torch.empty(40000, case["out_width"])
    _lookup(case, out, cpp)  # first touch of out's pages happens here, not in the timed call
    ticks, done = [], threading.Event()

    def spin():
        while not done.is_set():
            ticks.append(time.perf_counter())

    thread = threading.Thread(target=spin)
    thread.start()
    time.sleep(0.01)
    try:
        start = time.perf_counter()
        _lookup(case, out, cpp)
        end = time.perf_counter()
    finally:
        done.set()
        thread.join()
    margin = 0.2 * (end - start)  # ignore the Python around the kernel
    inside = [t for t in ticks if start + margin < t < end - margin]
    assert len(inside) > 0, f"no Python ran during a {1e3 * (end - start):.1f} ms op call"


# --------------------------------------------------------------- hash table
def _hash_pair(num_slots):
    return ops.HashTable(num_slots, backend="reference"), ops.HashTable(num_slots, backend="cpp")


def test_hash_table_against_dict(cpp):
    g = torch.Generator().manual_seed(7)
    ref, fast = _hash_pair(64)
    model: dict[int, int] = {}
    free = list(range(63, -1, -1))
    for _ in range(40):
        op = int(torch.randint(0, 3, (1,), generator=g))
        keys = torch.randint(-100, 100, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g) * 7919
        if op == 0:  # insert (with in-batch duplicates)
            want = []
            for k in keys.tolist():
                if k not in model and free:
                    model[k] = free.pop()
                want.append(model.get(k, -1))
            for t in (ref, fast):
                assert t.insert(keys).tolist() == want
        elif op == 1:
            want = [model.get(k, -1) for k in keys.tolist()]
            for t in (ref, fast):
                assert t.find(keys).tolist() == want
        else:
            want = []
            for k in keys.tolist():
                slot = model.pop(k, -1)
                if slot >= 0:
                    free.append(slot)
                want.append(slot)
            for t in (ref, fast):
                assert t.erase(keys).tolist() == want
        assert len(ref) == len(fast) == len(model)
        for name, tensor in ref.state_dict().items():  # same state: the two are interchangeable
            assert torch.equal(tensor, fast.state_dict()[name]), name


def test_hash_table_full_and_churn(cpp):
    for table in _hash_pair(8):
        slots = table.insert(torch.arange(10))
        assert slots[:8].tolist() == list(range(8)) and slots[8:].tolist() == [-1, -1]  # full: reported
        assert table.find(torch.tensor([8, 9])).tolist() == [-1, -1] and len(table) == 8
        for round_ in range(50):  # erase/insert churn builds tombstones and forces rebuilds
            erased = table.erase(torch.arange(8) + 100 * round_)
            assert sorted(erased.tolist()) == list(range(8))
            table.insert(torch.arange(8) + 100 * (round_ + 1))
        assert sorted(table.find(torch.arange(8) + 5000).tolist()) == list(range(8))
        assert int(table.meta[2]) <= table.capacity // 4
    with pytest.raises(RuntimeError, match="reserved"):
        ops.HashTable(4, backend="cpp").insert(torch.tensor([reference.EMPTY_KEY]))


def test_hash_table_state_round_trip(cpp):
    ref, fast = _hash_pair(32)
    ref.insert(torch.arange(20) * 3)
    fast.load_state_dict(ref.state_dict())
    assert fast.find(torch.arange(20) * 3).tolist() == list(range(20))
    assert fast.insert(torch.tensor([-5])).tolist() == ref.insert(torch.tensor([-5])).tolist() == [20]


# ------------------------------------------------------------------ builder
@pytest.fixture
def bind_config():
    """``bind_config(OpsConfig(...))`` binds a config for one test; the one before is bound again after it."""
    previous = ops.configure(ops.current_config())

    def bind(config):
        ops.configure(config)

    yield bind
    ops.configure(previous)


def _old(path, seconds):
    t = time.time() - seconds
    os.utime(path, (t, t))


def test_stale_lock_is_cleared_or_named(tmp_path, caplog):
    lock = tmp_path / "lock"
    lock.touch()
    _old(lock, 3600)
    with pytest.raises(builder.StaleLockError) as err:
        builder.check_lock(tmp_path, stale_after_s=60, clear_stale=False)
    assert str(lock) in str(err.value) and f"rm {lock}" in str(err.value)
    assert lock.exists()
    with caplog.at_level(logging.WARNING, logger="picasso_ops.ops.builder"):
        builder.check_lock(tmp_path, stale_after_s=60)
    assert not lock.exists()
    assert any(str(lock) in r.getMessage() and "stale" in r.getMessage() for r in caplog.records)


def test_lock_of_dead_builder_is_stale_at_once(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock = tmp_path / "lock"
    lock.touch()  # fresh, but its builder is gone
    (tmp_path / f"builder.{socket.gethostname()}.{dead.pid}").touch()
    builder.check_lock(tmp_path, stale_after_s=3600)
    assert not lock.exists() and not list(tmp_path.glob("builder.*"))


def test_lock_of_live_builder_is_kept(tmp_path):
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock = tmp_path / "lock"
        lock.touch()
        _old(lock, 3600)  # old, but its builder is still running: a slow build, not a dead one
        (tmp_path / f"builder.{socket.gethostname()}.{live.pid}").touch()
        builder.check_lock(tmp_path, stale_after_s=60, wait=False)
        assert lock.exists()
        young = tmp_path / "young"
        young.mkdir()
        (young / "lock").touch()  # young and no marker: maybe a build that just started; wait, do not delete
        builder.check_lock(young, stale_after_s=60, wait=False)
        assert (young / "lock").exists()
    finally:
        live.kill()
        live.wait()


def test_build_clears_stale_lock_before_torch_waits_on_it(tmp_path, monkeypatch, bind_config):
    """The real build path: a stale lock in the extensions dir is gone before cpp_extension.load runs."""
    bind_config(OpsConfig(extensions_dir=str(tmp_path)))
    directory = builder.build_directory()
    assert directory == tmp_path / f"{builder.EXTENSION_NAME}-{builder.build_key()}"
    directory.mkdir(parents=True)
    lock = directory / "lock"
    lock.touch()
    _old(lock, 3600)
    seen = {}

    def fake_load(**kwargs):
        seen["lock_exists"] = lock.exists()
        seen["markers"] = [p.name for p in directory.glob("builder.*")]
        seen["build_directory"] = kwargs["build_directory"]

    import torch.utils.cpp_extension as cpp_extension

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    jit_build.build(builder.LIBRARY, stale_after_s=60, clear_stale=True)
    assert seen["lock_exists"] is False and seen["build_directory"] == str(directory)
    assert seen["markers"] == [f"builder.{socket.gethostname()}.{os.getpid()}"]
    assert not list(directory.glob("builder.*"))  # marker removed after the build


_CPU_AVX512 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx2 avx512f avx512bw\n"
_CPU_AVX2 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx2\n"


def test_native_builds_are_cached_per_cpu_kind(tmp_path):
    """-march=native: a CPU with other ISA flags gets its own build folder; a portable -march shares one."""
    native = OpsConfig(extensions_dir=str(tmp_path), march="native")
    avx512 = builder.build_directory(native, cpuinfo=_CPU_AVX512)
    avx2 = builder.build_directory(native, cpuinfo=_CPU_AVX2)
    assert avx512 != avx2 and avx512.parent == avx2.parent == tmp_path
    assert avx512.name.startswith(f"{builder.EXTENSION_NAME}-native-")
    reordered = _CPU_AVX512.replace("avx2 avx512f avx512bw", "avx512bw avx2 avx512f")
    assert builder.build_directory(native, cpuinfo=reordered) == avx512  # flag order is not a CPU kind
    portable = OpsConfig(extensions_dir=str(tmp_path), march="x86-64-v2")
    assert builder.build_directory(portable, cpuinfo=_CPU_AVX512) == builder.build_directory(portable,
                                                                                          cpuinfo=_CPU_AVX2)
    assert builder.build_directory(portable).name == f"{builder.EXTENSION_NAME}-x86-64-v2"
    assert builder.cpu_isa_flags("Features\t: fp asimd sve\n") == ("asimd", "fp", "sve")  # ARM's spelling


def test_build_goes_to_this_cpus_folder(tmp_path, monkeypatch, bind_config):
    """The real build path compiles into the folder keyed by this CPU's flags, not a shared one."""
    bind_config(OpsConfig(extensions_dir=str(tmp_path), march="native"))
    monkeypatch.setattr(jit_build, "cpu_isa_flags", lambda cpuinfo=None: ("fpu", "sse2", "avx2"))
    seen = {}
    import torch.utils.cpp_extension as cpp_extension

    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: seen.update(kwargs))
    jit_build.build(builder.LIBRARY, stale_after_s=60, clear_stale=True)
    first = seen["build_directory"]
    monkeypatch.setattr(jit_build, "cpu_isa_flags", lambda cpuinfo=None: ("fpu", "sse2", "avx2", "avx512f"))
    jit_build.build(builder.LIBRARY, stale_after_s=60, clear_stale=True)
    assert seen["build_directory"] != first and "-march=native" in seen["extra_cflags"]


def test_no_compiler_falls_back_with_one_warning(monkeypatch, caplog):
    monkeypatch.setitem(builder._state, "module", None)
    monkeypatch.setitem(builder._state, "failed", None)

    def broken_build(*args, **kwargs):
        raise RuntimeError("simulated: error: command 'c++' failed: No such file or directory")

    monkeypatch.setattr(jit_build, "build", broken_build)
    case, _ = make_case(8, weighted=True, mean=True)
    want = _lookup(case, torch.zeros(5, case["out_width"]), "reference")
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            got = _lookup(case, torch.zeros(5, case["out_width"]), None)
            torch.testing.assert_close(got, want)
            ops.HashTable(4).insert(torch.tensor([1]))
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "reference" in r.getMessage()]
    assert len(warnings) == 1
    assert "simulated" in warnings[0].getMessage()
    assert "python -m sparse_scale.prebuild" in warnings[0].getMessage()
    assert ops.select_backend(torch.device("cpu")) == "reference"
    with pytest.raises(RuntimeError, match="could not be built"):
        ops.select_backend(torch.device("cpu"), backend="cpp")


def test_missing_compiler_detected_without_building(monkeypatch, caplog, bind_config):
    monkeypatch.setitem(builder._state, "module", None)
    monkeypatch.setitem(builder._state, "failed", None)
    bind_config(OpsConfig(cxx="no-such-compiler-xyz"))
    monkeypatch.setattr(jit_build, "build", lambda *a, **k: pytest.fail("must not try to build without a compiler"))
    with caplog.at_level(logging.WARNING):
        assert builder.load_ops() is False
        assert builder.load_ops() is False
    assert sum("no-such-compiler-xyz" in r.getMessage() for r in caplog.records) == 1


def test_cuda_tensors_choose_triton_when_importable(monkeypatch, caplog, bind_config):
    """The choice itself needs no GPU: CUDA float32 -> triton, else the reference with one warning."""
    cuda = torch.device("cuda")
    bind_config(OpsConfig())
    monkeypatch.setattr(ops, "triton_available", lambda: True)
    assert ops.select_backend(cuda) == "triton"
    assert ops.select_backend(cuda, torch.float16) == "reference"
    bind_config(OpsConfig(use_triton=False))
    assert ops.select_backend(cuda) == "reference"
    assert ops.select_backend(cuda, backend="triton") == "triton"  # forcing one still works
    bind_config(OpsConfig())
    monkeypatch.setattr(ops, "triton_available", lambda: False)
    monkeypatch.setattr(ops, "_warned", set())  # the warning is once per process
    with caplog.at_level(logging.WARNING):
        assert ops.select_backend(cuda) == "reference"
    assert any("Triton is not importable" in r.getMessage() for r in caplog.records)


def test_disabled_cpp_never_builds(monkeypatch, caplog, bind_config):
    monkeypatch.setitem(builder._state, "module", None)
    monkeypatch.setitem(builder._state, "failed", None)
    bind_config(OpsConfig(use_cpp=False))
    monkeypatch.setattr(jit_build, "build", lambda *a, **k: pytest.fail("use_cpp=False must not build"))
    with caplog.at_level(logging.WARNING):
        assert builder.load_ops() is False
    assert ops.select_backend(torch.device("cpu")) == "reference"
    assert sum("use_cpp" in r.getMessage() for r in caplog.records) == 1


def test_flags_and_lock_age_come_from_the_bound_config(tmp_path, bind_config):
    assert builder.LIBRARY.flags(builder.build_settings(OpsConfig())) == ["-O3", "-fopenmp", "-march=native"]
    assert builder.LIBRARY.flags(builder.build_settings(OpsConfig(march=""))) == ["-O3", "-fopenmp"]
    lock = tmp_path / "lock"
    lock.touch()
    _old(lock, 120)
    bind_config(OpsConfig(stale_lock_s=3600))
    builder.check_lock(tmp_path, wait=False)  # 2 min old, stale after 1 h: kept
    assert lock.exists()
    bind_config(OpsConfig(stale_lock_s=60))
    builder.check_lock(tmp_path, wait=False)  # stale after 1 min: removed
    assert not lock.exists()


def test_ops_config_from_env_is_the_only_reader_of_the_variables():
    env = {"PICASSO_OPS_DISABLE_TRITON": "1", "PICASSO_OPS_DISABLE_CPP": "yes", "PICASSO_OPS_MARCH": "x86-64-v2",
           "PICASSO_OPS_STALE_LOCK_S": "42", "CXX": "clang++", "TORCH_EXTENSIONS_DIR": "/tmp/ext"}
    assert OpsConfig.from_env(env) == OpsConfig(use_triton=False, use_cpp=False, march="x86-64-v2",
                                                stale_lock_s=42.0, cxx="clang++", extensions_dir="/tmp/ext")
    assert OpsConfig.from_env({}) == OpsConfig()
    assert OpsConfig.from_env({"PICASSO_OPS_DISABLE_CPP": "0", "PICASSO_OPS_DISABLE_TRITON": ""}) == OpsConfig()
    with pytest.raises(ValueError, match="PICASSO_OPS_STALE_LOCK_S"):
        OpsConfig.from_env({"PICASSO_OPS_STALE_LOCK_S": "ten"})
    with pytest.raises(TypeError, match="OpsConfig"):
        ops.configure({"use_cpp": False})


_IMPORT_WITH_ENV_SET = """
import os, torch
from picasso_ops import ops
from picasso_ops.ops import OpsConfig, builder
assert ops.current_config() == OpsConfig(), ops.current_config()
assert builder.DEFAULT_STALE_AFTER_S == 600.0
assert builder.build_directory() != builder.build_directory(OpsConfig(extensions_dir="/tmp/elsewhere"))
ops.triton_available = lambda: True
assert ops.select_backend(torch.device("cuda")) == "triton"
ops.configure(OpsConfig.from_env(os.environ))
assert ops.select_backend(torch.device("cuda")) == "reference"
assert not builder.load_ops() and ops.select_backend(torch.device("cpu")) == "reference"
assert str(builder.build_directory()).startswith("/tmp/elsewhere/picasso_ops_cpu-"), builder.build_directory()
print("ok")
"""


def test_importing_the_ops_with_the_variables_set_changes_nothing_until_configured():
    """A fresh process with every variable set: defaults until the edge calls configure(OpsConfig.from_env(...))."""
    env = {**os.environ, "PICASSO_OPS_DISABLE_TRITON": "1", "PICASSO_OPS_DISABLE_CPP": "1",
           "PICASSO_OPS_MARCH": "no-such-arch", "PICASSO_OPS_STALE_LOCK_S": "5", "TORCH_EXTENSIONS_DIR": "/tmp/elsewhere"}
    done = subprocess.run([sys.executable, "-c", _IMPORT_WITH_ENV_SET], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_float64_weights_use_reference():
    assert ops.select_backend(torch.device("cpu"), torch.float64) == "reference"
    w = torch.randn(5, 4, dtype=torch.float64)
    out = torch.zeros(1, 4, dtype=torch.float64)
    ops.packed_lookup(w, torch.tensor([1, 1]), torch.tensor([0, 2]), torch.tensor([0]), out)
    torch.testing.assert_close(out[0], 2 * w[1])


# ------------------------------------------------------------------- triton
@pytest.fixture(scope="module")
def triton_backend():
    if not ops.triton_available():
        pytest.skip("triton is not installed")
    if not torch.cuda.is_available():
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("triton was imported before TRITON_INTERPRET=1 could be set; run this file on its own")
        # read when triton's own and our kernels are decorated, i.e. before the first triton import
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from picasso_ops.ops import triton_kernels  # noqa: F401

    return "triton"


@pytest.mark.parametrize("width", [8, 24])
@pytest.mark.parametrize("weighted,mean,with_row_offsets", [(False, False, True), (True, True, False)])
def test_triton_lookup_matches_reference(triton_backend, width, weighted, mean, with_row_offsets):
    case, g = make_case(9, columns=4, batch=4, width=width, weighted=weighted, mean=mean,
                        with_row_offsets=with_row_offsets)
    base = torch.randn(4, case["out_width"], generator=g)
    want = _lookup(case, base.clone(), "reference")
    got = _lookup(case, base.clone(), triton_backend)
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adam"])
def test_triton_backward_update_matches_reference(triton_backend, optimizer):
    case, _ = make_case(10, columns=4, batch=4, width=8, weighted=True, mean=True)
    w_ref, s_ref = _train(case, optimizer, "reference", steps=3, seed=11, use_segments=False)
    w_tri, s_tri = _train(case, optimizer, triton_backend, steps=3, seed=11, use_segments=False)
    torch.testing.assert_close(w_tri, w_ref, **TOL)
    for key in s_ref:
        torch.testing.assert_close(s_tri[key], s_ref[key], **TOL)


# ------------------------------------------------- PackedEmbeddingCollection
@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adam"])
@pytest.mark.parametrize("across_dims", [False, True])
def test_collection_with_custom_ops_matches_torch_path(cpp, optimizer, across_dims):
    """``custom_ops=True`` trains to the same weights and state as the torch path (packs with sub-rows keep it)."""
    from picasso_ops.embedding import PackedEmbeddingCollection, TableSpec
    from picasso_ops.jagged import JaggedBatch

    specs = [
        TableSpec("t_sum8", 11, 8, "sum", optimizer, HYPER[optimizer], feature_names=("f_a", "f_b")),
        TableSpec("t_mean8", 7, 8, "mean", optimizer, HYPER[optimizer]),
        TableSpec("t_sum16", 13, 16, "sum", optimizer, HYPER[optimizer]),
        TableSpec("t_seq8", 9, 8, "none", optimizer, HYPER[optimizer]),
    ]
    keys = ["t_sum16", "f_b", "t_seq8", "f_a", "t_mean8"]
    rows = {"f_a": 11, "f_b": 11, "t_mean8": 7, "t_sum16": 13, "t_seq8": 9}
    torch.manual_seed(0)
    ours = PackedEmbeddingCollection(specs, across_dims=across_dims, custom_ops=True)
    torch.manual_seed(0)
    base = PackedEmbeddingCollection(specs, across_dims=across_dims, custom_ops=False)
    assert any(k._op_backend() == "cpp" for k in ours.kernels)
    g = torch.Generator().manual_seed(12)
    for step in range(4):
        lengths = torch.randint(0, 4, (len(keys), 6), generator=g)
        bound = torch.repeat_interleave(torch.tensor([rows[k] for k in keys]), lengths.sum(1))
        values = (torch.rand(bound.numel(), generator=g) * bound).long()
        batch = JaggedBatch(keys, values, lengths, torch.rand(values.numel(), generator=g) + 0.5)
        target = torch.randn(6, 40, generator=g)
        for emb in (ours, base):
            out = emb(batch)
            ((out.values * target).sum() + out["t_seq8"].square().sum()).backward()
        torch.testing.assert_close(ours(batch).values, base(batch).values, **TOL)
    for key, value in base.state_dict().items():
        torch.testing.assert_close(ours.state_dict()[key], value, **TOL, msg=key)


def test_collection_custom_ops_deferred_updates_fall_back_to_torch_path(cpp):
    """Deferred updates (gradient accumulation) run the torch path on the op's raw-id plans: same result."""
    from picasso_ops.embedding import PackedEmbeddingCollection, TableSpec
    from picasso_ops.jagged import JaggedBatch

    specs = [TableSpec(f"t{i}", 10 + i, 8, "mean" if i % 2 else "sum", "adam", HYPER["adam"]) for i in range(3)]
    keys = [s.name for s in specs]
    torch.manual_seed(0)
    ours = PackedEmbeddingCollection(specs, custom_ops=True)
    torch.manual_seed(0)
    base = PackedEmbeddingCollection(specs, custom_ops=False)
    g = torch.Generator().manual_seed(13)
    for emb in (ours, base):
        emb.defer_updates = True
    for _ in range(2):
        lengths = torch.randint(0, 4, (3, 5), generator=g)
        bound = torch.repeat_interleave(torch.tensor([10, 11, 12]), lengths.sum(1))
        batch = JaggedBatch(keys, (torch.rand(bound.numel(), generator=g) * bound).long(), lengths)
        target = torch.randn(5, 24, generator=g)
        for emb in (ours, base):
            (emb(batch).values * target).sum().backward()
    for emb in (ours, base):
        emb.step()
    for key, value in base.state_dict().items():
        torch.testing.assert_close(ours.state_dict()[key], value, **TOL, msg=key)
