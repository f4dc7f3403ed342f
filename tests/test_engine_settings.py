"""The KV cache size an in-process vLLM engine gets (``runtime.vllm_process_settings``, ``start_engine``)."""

import os

import pytest

from triage_trl.runtime import CPU_KV_CACHE_BYTES_ENV, vllm_process_settings


def _kv_env():
    return os.environ.get("VLLM_CPU_KVCACHE_SPACE"), os.environ.get(CPU_KV_CACHE_BYTES_ENV)


def test_whole_and_fractional_gib_and_a_nested_block(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.delenv(CPU_KV_CACHE_BYTES_ENV, raising=False)
    with vllm_process_settings():
        assert _kv_env() == ("1", str(2**30))  # the default
    with vllm_process_settings(cpu_kv_cache_gib=2):
        assert _kv_env() == ("2", str(2**31))
    with vllm_process_settings(cpu_kv_cache_gib=0.125):
        assert _kv_env() == (None, str(2**27))  # vLLM's variable takes whole GiB only: left unset
        with vllm_process_settings():
            assert _kv_env() == (None, str(2**27))  # an inner block keeps the outer size
        from triage_trl.runtime import child_process_env

        assert CPU_KV_CACHE_BYTES_ENV not in child_process_env()  # a child's own settings choose its size
    assert _kv_env() == (None, None)  # restored
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
    with vllm_process_settings():
        assert _kv_env() == ("3", str(3 * 2**30))
    with vllm_process_settings(env={"VLLM_CPU_KVCACHE_SPACE": "4"}):
        assert _kv_env() == ("4", str(4 * 2**30))  # the variable given to the block chooses the size
    with vllm_process_settings(env={"VLLM_CPU_KVCACHE_SPACE": None}):
        assert _kv_env() == (None, str(2**30))  # unset by the block: the default size, not the environment's 3
    monkeypatch.setenv(CPU_KV_CACHE_BYTES_ENV, str(2**27))  # inherited by a child started without child_process_env
    with vllm_process_settings():
        assert _kv_env() == ("3", str(3 * 2**30))  # the child's own variable wins


@pytest.mark.parametrize("bad", [0, -1, 2**-11, "x", float("nan"), float("inf")])
def test_a_size_that_is_not_a_positive_number_is_refused(bad):
    with pytest.raises(ValueError, match="at least 1 MiB"):
        with vllm_process_settings(cpu_kv_cache_gib=bad):
            pass


class _Built(Exception):
    pass


@pytest.fixture
def engine_start(tmp_path, monkeypatch):
    """``engine_start(**kwargs)``: ``start_engine`` up to ``vllm.LLM``, which records what the engine would get (its
    ``kv_cache_memory_bytes`` and the ``VLLM_CPU_KVCACHE_SPACE`` it would read) instead of starting."""
    import vllm
    from vllm.platforms import current_platform

    from triage_trl.sampler.vllm_engine import start_engine

    if not current_platform.is_cpu():
        pytest.skip("vLLM's CPU platform only; the CPU runs this test everywhere else")
    seen = {}

    def fake_llm(**kwargs):
        seen.update(bytes=kwargs.get("kv_cache_memory_bytes"), variable=os.environ.get("VLLM_CPU_KVCACHE_SPACE"))
        raise _Built

    monkeypatch.setattr(vllm, "LLM", fake_llm)

    def start(**kwargs):
        with pytest.raises(_Built):
            start_engine(tmp_path, "bf16", **kwargs)
        return dict(seen)

    return start


@pytest.mark.parametrize("gib, given, expected", [(0.125, None, 2**27), (2, None, 2**31), (2, 3 * 2**20, 3 * 2**20)])
def test_start_engine_passes_the_size_and_hides_the_whole_gib_variable(engine_start, gib, given, expected):
    """vLLM's CPU platform lets ``VLLM_CPU_KVCACHE_SPACE`` override ``kv_cache_memory_bytes``: the engine is built
    without it, with the exact size chosen (or the one the caller passed)."""
    extra = {} if given is None else {"kv_cache_memory_bytes": given}
    with vllm_process_settings(cpu_kv_cache_gib=gib):
        seen = engine_start(**extra)
        assert _kv_env()[0] == (str(gib) if isinstance(gib, int) else None)  # put back after the start
    assert seen == {"bytes": expected, "variable": None}


@pytest.mark.parametrize("gib, variable", [(1, "4"), (1.5, "1")])
def test_a_variable_set_inside_the_block_wins(engine_start, monkeypatch, gib, variable):
    with vllm_process_settings(cpu_kv_cache_gib=gib):
        monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", variable)
        seen = engine_start()
    assert seen == {"bytes": None, "variable": variable}  # vLLM reads the variable, as it would without triage-trl
