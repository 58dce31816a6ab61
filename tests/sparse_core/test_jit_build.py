"""sparse_core.jit_build's declared op libraries: registration, flags, cache folders, the one loader's fallback."""
import logging
from pathlib import Path

import pytest

from sparse_core import jit_build
from sparse_core.jit_build import BuildSettings, OpLibrary


def _library(name: str = "jit_build_test_cpu", **kwargs) -> OpLibrary:
    kwargs.setdefault("sources", (Path("/nonexistent/a.cpp"),))
    return OpLibrary(name=name, package="jit_build_test", **kwargs)


def test_flags_put_march_where_the_library_says():
    assert _library(cflags=("-O3", "-fopenmp")).flags(BuildSettings(march="native")) == \
        ["-O3", "-fopenmp", "-march=native"]
    assert _library(cflags=("-O3", "-fx"), march_index=1).flags(BuildSettings(march="x86-64-v2")) == \
        ["-O3", "-march=x86-64-v2", "-fx"]
    assert _library(cflags=("-O3",)).flags(BuildSettings(march="")) == ["-O3"]


def test_directory_is_keyed_by_march_and_cpu_kind(tmp_path):
    library = _library()
    avx2 = library.directory(BuildSettings(root=tmp_path), cpuinfo="flags : sse2 avx2\n")
    avx512 = library.directory(BuildSettings(root=tmp_path), cpuinfo="flags : sse2 avx2 avx512f\n")
    assert avx2 != avx512 and avx2.parent == tmp_path and avx2.name.startswith("jit_build_test_cpu-native-")
    assert library.directory(BuildSettings(root=tmp_path, march="x86-64-v2")) == tmp_path / "jit_build_test_cpu-x86-64-v2"


def test_bad_declarations_are_refused():
    with pytest.raises(ValueError, match="identifier"):
        _library(name="has-dash")
    with pytest.raises(ValueError, match="sources is empty"):
        _library(sources=())
    first = jit_build.register(_library(name="jit_build_test_twice"), declared_by="tests.one")
    assert jit_build.register(_library(name="jit_build_test_twice"), declared_by="tests.one") is not None
    with pytest.raises(ValueError, match="declared twice"):
        jit_build.register(_library(name="jit_build_test_twice", cflags=("-O2",)), declared_by="tests.two")
    assert first in jit_build.registered()


def test_the_packages_declare_their_libraries_once():
    from moe_proto import ops as moe_ops
    from picasso_ops.ops import builder

    names = [library.name for library in jit_build.registered()]
    assert "picasso_ops_cpu" in names and "moe_proto_cpu" in names
    assert builder.LIBRARY is jit_build.registered()[names.index("picasso_ops_cpu")]
    assert moe_ops.LIBRARY.flags() == ["-O3", "-march=native", "-fopenmp-simd", "-mprefer-vector-width=512"]


def test_a_library_that_cannot_load_warns_once_and_returns_none(monkeypatch, caplog):
    disabled = jit_build.register(_library(name="jit_build_test_off", settings=lambda: BuildSettings(
        disabled="turned off by the test")), declared_by="tests.jit_off")
    missing = jit_build.register(_library(name="jit_build_test_nocxx", settings=lambda: BuildSettings(
        cxx="no-such-compiler-xyz")), declared_by="tests.jit_nocxx")
    monkeypatch.setattr(jit_build, "build", lambda *a, **k: pytest.fail("must not build"))
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            assert jit_build.load(disabled) is None and jit_build.load(missing) is None
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2
    assert warnings[0].name == "tests.jit_off" and "turned off by the test" in warnings[0].getMessage()
    assert "no-such-compiler-xyz" in warnings[1].getMessage()
    assert all("python -m sparse_scale.prebuild" in w.getMessage() for w in warnings)
    assert not jit_build.loaded(disabled)


def test_a_failed_build_falls_back_and_forget_failure_retries(monkeypatch, caplog):
    library = jit_build.register(_library(name="jit_build_test_retry", settings=lambda: BuildSettings(cxx="sh")),
                                 declared_by="tests.jit_retry")
    calls = []

    def build(lib, **kwargs):
        calls.append(lib.name)
        if len(calls) == 1:
            raise RuntimeError("simulated compile error")
        return "/built/lib.so"

    monkeypatch.setattr(jit_build, "build", build)
    with caplog.at_level(logging.WARNING):
        assert jit_build.load(library) is None and jit_build.load(library) is None
    assert calls == ["jit_build_test_retry"] and "simulated compile error" in caplog.text
    jit_build.forget_failure(library)
    assert jit_build.load(library) == "/built/lib.so" and jit_build.loaded(library)
    assert jit_build.load(library) == "/built/lib.so" and len(calls) == 2  # once per process


def test_a_stale_lock_error_is_raised_not_swallowed(monkeypatch):
    library = jit_build.register(_library(name="jit_build_test_lock", settings=lambda: BuildSettings(cxx="sh")),
                                 declared_by="tests.jit_lock")

    def build(lib, **kwargs):
        raise jit_build.StaleLockError(Path("/x/lock"), 700.0, lib.name)

    monkeypatch.setattr(jit_build, "build", build)
    with pytest.raises(jit_build.StaleLockError, match="rm /x/lock"):
        jit_build.load(library, clear_stale=False)
    assert jit_build.load_state(library)["failed"] is None  # the user deletes the lock and retries
