"""The compile cache's key for multi-process CPU programs (``jaxdist.cluster.cache_key``): where
it cannot be shared, one line says so and JAX's own key stays. The shared key itself is checked
end to end in tests/test_distributed.py (a resumed run's rank 1 takes process 0's step)."""

from __future__ import annotations

from jax._src import cache_key

from jaxdist.cluster import cache_key as shared


def test_a_jax_without_the_hashing_function_keeps_its_own_key_and_says_so(monkeypatch, capsys):
    monkeypatch.setattr(shared, "_INSTALLED", False)
    monkeypatch.delattr(cache_key, "_hash_accelerator_config")
    assert shared.share_cpu_cache_keys() is False
    assert capsys.readouterr().err.splitlines() == [
        "jaxdist: each process keys its CPU programs in the compile cache on its own "
        "(this JAX has no jax._src.cache_key._hash_accelerator_config): a restarted rank compiles again"
    ]
    assert not hasattr(cache_key, "_hash_accelerator_config")  # nothing put in its place


def test_the_host_signature_follows_the_cpu_flags(monkeypatch, tmp_path):
    """Two hosts whose CPUs differ in one flag get two signatures (XLA:CPU compiles for the flags);
    the order the flags are listed in does not matter; no flags line, no signature."""
    cpuinfo = tmp_path / "cpuinfo"
    real_path = shared.Path

    def read(flags: str | None) -> bytes | None:
        cpuinfo.write_text("processor\t: 0\n" + (f"flags\t\t: {flags}\n" if flags is not None else "model name\t: x\n"))
        monkeypatch.setattr(shared, "Path", lambda p: cpuinfo if p == "/proc/cpuinfo" else real_path(p))
        return shared.host_cpu_signature()

    assert read("sse avx2 fma") == read("fma avx2 sse") != read("sse avx2 fma avx512f")
    assert read(None) is None
