"""TriageVLLMGeneration on the vLLM CPU build: start, one-call sync, probe scoring.

Probe gap = mean |learner - sampler| log-prob over the probe's scored tokens (nats), learner in bf16 (transformers).
Measured on this CPU (tiny Qwen3, see the ``triage_samplers`` fixture):

* bf16 sampler (lm_head x8, T=1): 0.011 at start, 0.013 after syncing perturbed weights (bound 0.03: bf16
  rounding of logits of magnitude ~10 in two GEMM orders);
* NVFP4 sampler (lm_head x2, T=0.7): 0.19 at start, 0.18 after a sync (bound 0.3: the W4A4 quantisation error
  against a bf16 learner, not a sync error);
* a skipped sync after perturbing every linear by 0.5 std: 1.42 (bf16) and 0.55 (NVFP4) nats; the test asks
  for >= 2x the synced gap and >= synced + 0.2 nats.
"""

import logging

import pytest
import torch

pytest.importorskip("vllm")

from triage_trl.sampler.vllm_generation import TriageVLLMGeneration  # noqa: E402

PROBE = "Question: what is 12 + 30?\nLet me think step by step.\n12 + 30 = 42.\nThe quick brown fox jumps over."
GAP_BOUND = {"bf16": 0.03, "nvfp4": 0.3}


def learner_logps(model, ids: list[int], temperature: float) -> torch.Tensor:
    """TRL's learner log-probs: log_softmax(logits / T) of tokens 1..L-1, float32."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def probe_gap(s, ids) -> float:
    sampler = torch.tensor(s.gen.score_logps([ids])[0])
    return float((learner_logps(s.model, ids, s.temperature) - sampler).abs().mean())


def _linear_or_head(name: str) -> bool:
    return name.endswith("proj.weight") or name == "lm_head.weight"


@torch.no_grad()
def perturb(model, seed: int, scale: float = 0.5, chosen=_linear_or_head) -> dict[str, torch.Tensor]:
    """Add ``scale * std(W) * noise`` to every parameter ``chosen(name)`` picks (default: every decoder linear and
    lm_head weight); returns the deltas."""
    g = torch.Generator().manual_seed(seed)
    deltas = {}
    for name, p in model.named_parameters():
        if chosen(name):
            d = (torch.randn(p.shape, generator=g) * p.float().std() * scale).to(p.dtype)
            p.add_(d)
            deltas[name] = d
    return deltas


@torch.no_grad()
def restore(model, deltas):
    for name, p in model.named_parameters():
        if name in deltas:
            p.sub_(deltas[name])


def assert_sync_catches_up(s, ids, precision: str, deltas: dict[str, torch.Tensor], label: str) -> None:
    """The learner has moved by ``deltas``: the probe sees the stale sampler, a sync brings it within the bound;
    then the weights are restored and synced back."""
    try:
        stale_gap = probe_gap(s, ids)  # the learner moved, the sampler did not
        s.gen.sync_weights()
        synced_gap = probe_gap(s, ids)
        print(f"{label}: stale {stale_gap:.4f} synced {synced_gap:.4f} nats")
        assert synced_gap <= GAP_BOUND[precision]
        assert stale_gap >= 2 * synced_gap and stale_gap >= synced_gap + 0.2
    finally:
        restore(s.model, deltas)
        s.gen.sync_weights()
    assert probe_gap(s, ids) <= GAP_BOUND[precision]


def model_runner(gen):
    """The in-process vLLM model runner of a sampler (tests look inside the engine)."""
    return gen.llm.llm_engine.model_executor.driver_worker.model_runner


# ---------------------------------------------------------------- fast: settings refused before any engine starts


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"sampler_precision": "fp8", "checkpoint_dir": "x"}, "sampler_precision"),
        ({"sampler_precision": "bf16", "checkpoint_dir": "x", "mode": "server"}, "colocate"),
        ({"sampler_precision": "nvfp4", "checkpoint_dir": "x"}, "calibration_prompts"),
        ({"sampler_precision": "bf16"}, "checkpoint_dir"),
    ],
)
def test_constructor_errors_name_the_fix(tmp_path, kwargs, match):
    from accelerate import Accelerator

    with pytest.raises(ValueError, match=match):
        TriageVLLMGeneration(torch.nn.Linear(2, 2), Accelerator(cpu=True), None, **kwargs)


# ---------------------------------------------------------------- slow: real engines (one per precision per session)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "nvfp4"])
def test_engine_starts_and_reports_its_kernels(triage_samplers, precision):
    s = triage_samplers(precision)
    report = s.gen.kernel_report
    assert report["platform"] == "cpu"
    assert report["sampler_precision"] == precision
    from triage_trl.runtime import engine_dtype

    assert report["dtype"] == str(engine_dtype()).removeprefix("torch.")  # float32 on CPUs without bf16 instructions
    if precision == "nvfp4":
        assert report["linear_kernels"] == "CompressedTensorsW4A4Fp4/FastCpuNvFp4LinearKernel x8"
        assert report["activations"].startswith("nvfp4")
        assert report["gemm"] in ("onednn_mm (float32)", "onednn_mm (bfloat16)", "torch.matmul", "torch.matmul (float32)")
    else:
        assert report["linear_kernels"] == "UnquantizedLinearMethod x8"
    assert s.gen.llm.llm_engine.model_config.logprobs_mode == "processed_logprobs"
    cache = s.gen.llm.llm_engine.vllm_config.cache_config  # prefix caching can share a short prompt's blocks
    assert cache.block_size == 32 and cache.enable_prefix_caching
    assert cache.kv_cache_memory_bytes == 2**27  # tests/conftest.py's TEST_KV_CACHE_GIB, not vLLM's whole GiB
    assert torch.set_num_threads is torch._C.set_num_threads  # vLLM's no-op replacement undone
    ids = s.tokenizer("What is 3 + 4?")["input_ids"]
    prompt_ids, completion_ids, logprobs, _ = s.gen.generate([ids, ids], None, 1)
    assert prompt_ids == [ids, ids]
    assert [len(c) for c in completion_ids] == [8, 8] or all(1 <= len(c) <= 8 for c in completion_ids)
    assert all(len(lp) == len(c) and all(x[0] <= 0 for x in lp) for lp, c in zip(logprobs, completion_ids))


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "nvfp4"])
def test_sync_matches_learner_and_skipped_sync_is_caught(triage_samplers, precision):
    s = triage_samplers(precision)
    ids = s.tokenizer(PROBE)["input_ids"]
    start_gap = probe_gap(s, ids)
    assert start_gap <= GAP_BOUND[precision]
    assert_sync_catches_up(s, ids, precision, perturb(s.model, seed=1), f"{precision} (start {start_gap:.4f})")


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "nvfp4"])
def test_tied_lm_head_serves_the_synced_embedding(triage_samplers, precision):
    """A tied ``lm_head`` receives no tensor of its own in a reload; on CPUs where vLLM packs its weight for oneDNN
    (AVX512-BF16, AMX) it served the dummy start weights until ``cpu_reload.refresh_cpu_lm_heads`` (measured on an
    AVX512-BF16 EPYC without it: SmolLM2 probe gap 8.4 nats). The start and every sync load through a reload."""
    from triage_trl.sampler.cpu_reload import refresh_cpu_lm_heads

    s = triage_samplers(precision, tied=True)
    assert s.model.lm_head.weight is s.model.model.embed_tokens.weight
    ids = s.tokenizer(PROBE)["input_ids"]
    assert probe_gap(s, ids) <= GAP_BOUND[precision]
    deltas = perturb(s.model, seed=3, chosen=lambda name: name == "model.embed_tokens.weight")
    assert list(deltas) == ["model.embed_tokens.weight"]
    assert_sync_catches_up(s, ids, precision, deltas, f"{precision} tied")
    assert s.gen.llm.apply_model(refresh_cpu_lm_heads) == [1]
    assert triage_samplers(precision).gen.llm.apply_model(refresh_cpu_lm_heads) == [0]  # untied: the reload's own


@pytest.mark.slow
def test_reload_without_the_head_refresh_serves_a_stale_tied_head(triage_samplers):
    """The vLLM 0.31 CPU defect ``refresh_cpu_lm_heads`` works around, reproduced: after a plain ``reload_weights``
    a tied ``lm_head`` still multiplies by its oneDNN-packed old weight (float32 engines pack it on every x86 CPU:
    the float32 engine of AVX2-only CPUs was first thought broken after reloads for this), and the refresh puts it
    right."""
    from triage_trl.sampler.cpu_reload import refresh_cpu_lm_heads

    s = triage_samplers("bf16", tied=True)
    ids = s.tokenizer(PROBE)["input_ids"]
    deltas = perturb(s.model, seed=5, chosen=lambda name: name == "model.embed_tokens.weight")
    try:
        s.gen.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": s.gen._iter_sampler_weights(),
                                                           "is_checkpoint_format": True})
        s.gen.llm.reset_prefix_cache()
        stale = probe_gap(s, ids)
        assert s.gen.llm.apply_model(refresh_cpu_lm_heads) == [1]
        s.gen.llm.reset_prefix_cache()
        refreshed = probe_gap(s, ids)
        print(f"tied head after reload: {stale:.4f} without the refresh, {refreshed:.4f} with it")
        assert refreshed <= GAP_BOUND["bf16"]
        assert stale >= 2 * refreshed and stale >= refreshed + 0.2
    finally:
        restore(s.model, deltas)
        s.gen.sync_weights()
    assert probe_gap(s, ids) <= GAP_BOUND["bf16"]


@pytest.mark.slow
@pytest.mark.parametrize("precision,tied", [("bf16", True), ("nvfp4", True), ("nvfp4", False)])
def test_sync_leaves_out_frozen_unchanged_vocabulary_matrices(triage_samplers, precision, tied):
    """``frozen_vocab.FrozenVocabSkip``: once the engine holds a frozen embedding (and an untied frozen head), later
    syncs leave them out, and a tied head is not re-packed; the sampler still follows the decoder's moves, and an
    in-place change of the frozen embedding is sent again."""
    s = triage_samplers(precision, tied=tied)
    ids = s.tokenizer(PROBE)["input_ids"]
    matrices = {"model.embed_tokens.weight": s.model.model.embed_tokens.weight}
    if not tied:
        matrices["lm_head.weight"] = s.model.lm_head.weight
    refreshed, warned = [], []
    from triage_trl.sampler import cpu_reload

    class Warned(logging.Handler):  # vLLM's warnings about the vocabulary layers a reload did not receive
        def emit(self, record):
            if any(word in record.getMessage() for word in ("not loaded", "VocabParallel", "ParallelLMHead")):
                warned.append(record.getMessage())

    handler, vllm_logger = Warned(logging.WARNING), logging.getLogger("vllm")
    level = vllm_logger.level
    vllm_logger.addHandler(handler)
    vllm_logger.setLevel(logging.WARNING)  # the project's default is ERROR; a user may lower it
    real_refresh = cpu_reload.refresh_cpu_lm_heads
    try:
        cpu_reload.refresh_cpu_lm_heads = lambda model: refreshed.append(1) or real_refresh(model)
        for p in matrices.values():
            p.requires_grad_(False)
        s.gen.sync_weights()  # the engine receives them once as frozen
        assert s.gen.frozen_vocab.skipped == []
        refreshed.clear()
        warned.clear()
        decoder = perturb(s.model, seed=7, scale=1.0, chosen=lambda name: name.endswith("proj.weight"))
        assert_sync_catches_up(s, ids, precision, decoder, f"{precision} tied={tied}, vocabulary left out")
        assert sorted(s.gen.frozen_vocab.skipped) == sorted(matrices)
        assert s.gen.direct_write.missed == []  # left out on purpose: no warning about them
        assert refreshed == []  # nothing re-packed: the embedding was not sent
        assert warned == []  # no warning about what the syncs left out
        embedding = perturb(s.model, seed=8, scale=2.0, chosen=lambda name: name == "model.embed_tokens.weight")
        assert_sync_catches_up(s, ids, precision, embedding, f"{precision} tied={tied}, frozen embedding changed")
        assert "model.embed_tokens.weight" not in s.gen.frozen_vocab.skipped  # restored in place: sent again
        assert refreshed == [1, 1]  # the change's sync and the restore's
    finally:
        vllm_logger.removeHandler(handler)
        vllm_logger.setLevel(level)
        cpu_reload.refresh_cpu_lm_heads = real_refresh
        for p in matrices.values():
            p.requires_grad_(True)
        s.gen.sync_weights()
    assert s.gen.frozen_vocab.skipped == []
    assert probe_gap(s, ids) <= GAP_BOUND[precision]


@pytest.mark.slow
def test_nvfp4_sync_without_a_weight_change_changes_nothing(triage_samplers):
    """Static activation scales (calibrated once, at start): re-syncing the same weights reproduces the sampler
    bit for bit, so held-out evaluations before and after a sync compare the policy, not a recalibration."""
    from vllm import SamplingParams

    s = triage_samplers("nvfp4")
    ids = s.tokenizer(PROBE)["input_ids"]
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0)

    def greedy():
        out = s.gen.llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0]
        return list(out.token_ids), [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)]

    scales = dict(s.gen.input_global_scales)
    before = greedy()
    s.gen.sync_weights()
    assert s.gen.input_global_scales.keys() == scales.keys()
    assert all(torch.equal(s.gen.input_global_scales[k], v) for k, v in scales.items())
    assert greedy() == before


@pytest.mark.slow
def test_bf16_sync_is_exact_and_one_reload_call(triage_samplers, monkeypatch):
    s = triage_samplers("bf16")
    monkeypatch.setattr(s.gen, "direct_write_ok", (False, "this test checks the reload path"))
    runner = model_runner(s.gen)
    calls = []
    original = runner.reload_weights

    def counting(weights_iterator=None, **kw):
        weights = list(weights_iterator)
        calls.append(({n for n, _ in weights}, kw))
        return original(weights_iterator=iter(weights), **kw)

    monkeypatch.setattr(runner, "reload_weights", counting)
    ids = s.tokenizer(PROBE)["input_ids"]
    deltas = perturb(s.model, seed=2)
    try:
        s.gen.sync_weights()
        gap = probe_gap(s, ids)
    finally:
        restore(s.model, deltas)
        s.gen.sync_weights()
    assert len(calls) == 2 and all(kw == {"is_checkpoint_format": True} for _, kw in calls)  # one call per sync
    names, _ = calls[0]
    assert names == {n for n, _ in s.model.named_parameters()}
    assert gap <= GAP_BOUND["bf16"]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).contiguous().view(torch.uint8)


def engine_state(gen) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Copies of every parameter and buffer of the engine's model, and of the NVFP4 kernel's dequantised weights."""
    def read(model):
        tensors = {n: t.detach().clone() for n, t in model.state_dict().items()}
        caches = {n: m.nvfp4_dequantised.weight.clone() for n, m in model.named_modules()
                  if hasattr(m, "nvfp4_dequantised")}
        return tensors, caches

    return gen.llm.apply_model(read)[0]


@pytest.mark.slow
@pytest.mark.parametrize("precision,tied,architecture", [("bf16", False, "Qwen3"), ("nvfp4", False, "Qwen3"),
                                                       ("nvfp4", True, "Qwen3"), ("nvfp4", True, "Llama")])
def test_direct_write_leaves_the_engine_as_the_reload_does(triage_samplers, monkeypatch, precision, tied,
                                                           architecture):
    """After the first load a sync writes the engine's layers directly (``sampler.direct_write``), without vLLM's
    layerwise reload: every parameter and buffer, the NVFP4 kernel's dequantised weights and the log-probs of the
    probe equal, bit for bit, what ``reload_weights`` makes of the same learner weights; no reload call runs, and
    no NVFP4 weight is decoded (the kernel takes the values the export's quantisation computed)."""
    from triage_trl.sampler import cpu_kernel

    s = triage_samplers(precision, tied=tied, architecture=architecture)
    assert s.gen.direct_write_ok == (True, "") and s.gen.kernel_report["weight_sync"].startswith("direct write")
    ids = s.tokenizer(PROBE)["input_ids"]
    runner = model_runner(s.gen)
    calls, decodes = [], []
    original = runner.reload_weights
    monkeypatch.setattr(runner, "reload_weights", lambda **kw: calls.append(1) or original(**kw))
    decode = cpu_kernel.nvfp4_dequantize_packed
    monkeypatch.setattr(cpu_kernel, "nvfp4_dequantize_packed", lambda *a, **k: decodes.append(1) or decode(*a, **k))
    before = s.gen.score_logps([ids])[0]
    deltas = perturb(s.model, seed=11, chosen=lambda n: n.endswith("weight"))  # linears, norms, vocabulary
    try:
        s.gen.sync_weights()
        assert calls == [] and s.gen.direct_write.passed_on == [] and decodes == []
        followed = probe_gap(s, ids)  # the sampler follows the learner's move (not two stale engines alike)
        assert s.gen.direct_write.missed == []
        written = s.gen.direct_write.written
        assert any(n.endswith("qkv_proj") for n in written) and any(n.endswith("gate_up_proj") for n in written)
        assert any(n.endswith("layernorm") for n in written) and "model.embed_tokens" in written
        direct_state, direct_logps = engine_state(s.gen), s.gen.score_logps([ids])[0]
        monkeypatch.setattr(s.gen, "direct_write_ok", (False, "the reference"))
        s.gen.sync_weights()
        assert calls == [1] and len(decodes) == len(direct_state[1])  # the reload decodes every NVFP4 layer
        reload_state, reload_logps = engine_state(s.gen), s.gen.score_logps([ids])[0]
        monkeypatch.undo()
    finally:
        restore(s.model, deltas)
        s.gen.sync_weights()
    for direct, reloaded in zip(direct_state, reload_state):
        assert direct.keys() == reloaded.keys()
        for name in direct:
            assert direct[name].dtype == reloaded[name].dtype, name
            assert torch.equal(_bits(direct[name]), _bits(reloaded[name])), name
    assert len(direct_state[0]) > 0 and (len(direct_state[1]) > 0) == (precision == "nvfp4")
    assert direct_logps == reload_logps and direct_logps != before
    assert followed <= GAP_BOUND[precision] and probe_gap(s, ids) <= GAP_BOUND[precision]


@pytest.mark.slow
def test_direct_write_passes_what_it_does_not_know_to_one_reload(triage_samplers, monkeypatch, caplog):
    """Layers the direct write does not handle go, whole, through one ``reload_weights`` call in the same sync
    (here: the norms and the NVFP4 gate/up layers, by pretending it does not know them); vLLM's warnings about the
    layers written directly are dropped (its "RotaryEmbedding: Failed to load weights", logged at every reload, full
    ones too, stays), the export's dequantised values of the layers passed on are not held through the reload, and
    the sampler equals a full reload's."""
    import triage_trl.sampler.direct_write as dw

    s = triage_samplers("nvfp4")
    held = []
    write = s.gen.direct_write.write
    monkeypatch.setattr(s.gen.direct_write, "write", lambda *a: (write(*a), held.append(dict(a[3])))[0])
    ids = s.tokenizer(PROBE)["input_ids"]
    runner = model_runner(s.gen)
    names = []
    original = runner.reload_weights

    def recording(weights_iterator=None, **kw):
        weights = list(weights_iterator)
        names.append([n for n, _ in weights])
        return original(weights_iterator=iter(weights), **kw)

    monkeypatch.setattr(runner, "reload_weights", recording)
    known = dw._kind
    passed_on = ("Norm", "MergedColumnParallelLinear")
    monkeypatch.setattr(dw, "_kind", lambda module, leaf, base: None if type(module).__name__.endswith(passed_on)
                        else known(module, leaf, base))
    deltas = perturb(s.model, seed=12, chosen=lambda n: n.endswith("weight"))
    try:
        with caplog.at_level(logging.WARNING, logger="vllm"):
            s.gen.sync_weights()
        passed = s.gen.direct_write.passed_on
        assert names == [passed] and passed and all("norm" in n or "gate_proj" in n or "up_proj" in n for n in passed)
        assert any("up_proj.weight_packed" in n for n in passed) and held == [{}]
        written = ("ParallelLinear", "RowParallel", "VocabParallel", "ParallelLMHead", "not loaded")
        assert not [r for r in caplog.records if any(w in r.getMessage() for w in written)]
        hybrid = s.gen.score_logps([ids])[0]
        monkeypatch.setattr(s.gen, "direct_write_ok", (False, "the reference"))
        s.gen.sync_weights()
        assert s.gen.score_logps([ids])[0] == hybrid
    finally:
        monkeypatch.undo()
        restore(s.model, deltas)
        s.gen.sync_weights()


@pytest.mark.slow
def test_direct_write_names_a_layer_the_export_missed(triage_samplers, monkeypatch, caplog):
    """A layer the export has no tensor for keeps its previous values, as under the reload, and the sync says so
    (a warning naming it), instead of passing silently because no reload ran to warn."""
    s = triage_samplers("bf16")
    gone = "model.layers.1.self_attn.o_proj.weight"
    export = s.gen._iter_sampler_weights
    monkeypatch.setattr(s.gen, "_iter_sampler_weights", lambda *a: ((n, t) for n, t in export(*a) if n != gone))
    with caplog.at_level(logging.WARNING, logger="triage_trl"):
        s.gen.sync_weights()
    assert s.gen.direct_write.missed == ["model.layers.1.self_attn.o_proj"]
    assert [r for r in caplog.records if "model.layers.1.self_attn.o_proj" in r.getMessage()]
    monkeypatch.undo()
    s.gen.sync_weights()
    assert s.gen.direct_write.missed == []


@pytest.mark.slow
def test_nvfp4_reload_refreshes_fast_kernel_cache(triage_samplers):
    """vLLM 0.31's layerwise reload re-runs process_weights_after_loading on the same modules: the fast kernel's
    dequantised weights follow the new packed weights, and its output equals the emulation kernel's on them."""
    from vllm.model_executor.kernels.linear import EmulationNvFp4LinearKernel
    from vllm.model_executor.kernels.linear.nvfp4.base import NvFp4LinearLayerConfig
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import dequantize_to_dtype

    from triage_trl.sampler.cpu_kernel import FastCpuNvFp4LinearKernel

    s = triage_samplers("nvfp4")
    layers = [m for m in model_runner(s.gen).model.modules() if hasattr(m, "nvfp4_dequantised")]
    assert len(layers) == 8
    before = [layer.nvfp4_dequantised.weight.clone() for layer in layers]
    count = FastCpuNvFp4LinearKernel.dequantisations
    deltas = perturb(s.model, seed=3)
    try:
        s.gen.sync_weights()
        assert FastCpuNvFp4LinearKernel.dequantisations - count == len(layers)  # once per layer per load
        emu = EmulationNvFp4LinearKernel(NvFp4LinearLayerConfig())
        for layer, old in zip(layers, before):
            cached = layer.nvfp4_dequantised.weight
            packed = layer.weight.data.view(torch.uint8)
            fresh = dequantize_to_dtype(packed, layer.weight_scale.data, layer.weight_global_scale.data,
                                        cached.dtype, 16, swizzle=False)  # the engine's dtype (runtime.engine_dtype)
            assert torch.equal(cached, fresh) and not torch.equal(cached, old)
            x = torch.randn(5, cached.shape[1]).to(cached.dtype)
            out, ref = layer.scheme.kernel.apply_weights(layer, x), emu.apply_weights(layer, x)
            assert bool(((out.float() - ref.float()).abs() <= 2**-7 * ref.float().abs() + 1e-3).all())
    finally:
        restore(s.model, deltas)
        s.gen.sync_weights()


@pytest.mark.slow
def test_probe_scoring_rescales_to_any_temperature(triage_samplers):
    s = triage_samplers("bf16")
    ids = s.tokenizer(PROBE)["input_ids"]
    for temperature in (1.0, 0.6, 1.5):
        sampler = torch.tensor(s.gen.score_logps([ids, ids[:10]], temperature=temperature)[0])
        learner = learner_logps(s.model, ids, temperature)
        assert sampler.shape == learner.shape == (len(ids) - 1,)
        assert float((sampler - learner).abs().mean()) <= GAP_BOUND["bf16"]
    with pytest.raises(ValueError, match="at least 2 tokens"):
        s.gen.score_logps([[5]])


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_probe_scoring_draws_no_random_number(triage_samplers, temperature):
    # The in-process engine samples rollouts from torch's global generator: a probe that drew from it (its one
    # generated token sampled at temperature 1, as before) shifted every later rollout, so the probe schedule
    # changed training.
    s = triage_samplers("bf16")
    ids = s.tokenizer(PROBE)["input_ids"]
    state = torch.random.get_rng_state()
    s.gen.score_logps([ids], temperature=temperature)
    assert torch.equal(torch.random.get_rng_state(), state)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "nvfp4"])
def test_peft_sync_sends_merged_weights(triage_samplers, precision):
    from peft import LoraConfig, get_peft_model

    s = triage_samplers(precision)
    base = s.model
    ids = s.tokenizer(PROBE)["input_ids"]
    # gate and up both adapted: the export merges and quantises that fused group in one buffer, which the direct
    # write takes without concatenating; q/k/v partly adapted: member by member
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj",
                                                                                    "up_proj", "down_proj"]))
    with torch.no_grad():
        g = torch.Generator().manual_seed(4)
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:  # gate/up's smaller: the gap bound is about q/v/down's large moves
                scale = 0.05 if ".gate_proj." in name or ".up_proj." in name else 0.5
                p.copy_(torch.randn(p.shape, generator=g).to(p.dtype) * scale)
    # The random adapters move activations far past the start's calibration: recalibrate for this sync, so the
    # check is about the merged weights, not about clipping at stale static scales.
    s.gen.recalibrate_every_sync = True
    try:
        s.gen.model = peft_model
        s.gen.sync_weights()
        with torch.no_grad():
            logits = peft_model(input_ids=torch.tensor([ids])).logits[0, :-1].float() / s.temperature
        learner = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
        sampler = torch.tensor(s.gen.score_logps([ids])[0])
        assert float((learner - sampler).abs().mean()) <= GAP_BOUND[precision]
        exported = list(s.gen._iter_sampler_weights())
        assert not any("lora" in n for n, _ in exported)
        if precision == "nvfp4":  # gate/up came from one buffer
            assert [n for n, t in exported if n.endswith("up_proj.weight_packed") and t._base is not None]
        direct = engine_state(s.gen)  # the direct write of the merged weights is the reload's, bit for bit
        s.gen.direct_write_ok = (False, "the reference")
        try:
            s.gen.sync_weights()
        finally:
            s.gen.direct_write_ok = (True, "")
        for ours, reloaded in zip(direct, engine_state(s.gen)):
            assert ours.keys() == reloaded.keys() and all(torch.equal(_bits(ours[n]), _bits(reloaded[n])) for n in ours)
    finally:
        s.gen.model = peft_model.unload()
        s.model = s.gen.model
        s.gen.sync_weights()
        s.gen.recalibrate_every_sync = False
    assert probe_gap(s, ids) <= GAP_BOUND[precision]


@pytest.mark.slow
def test_the_other_compute_dtype_path_agrees_within_the_same_bounds(tmp_path, monkeypatch, in_process_vllm):
    """The learner-sampler agreement on the compute dtype this CPU does not choose by itself (a patched ISA probe:
    bf16 engines on an AVX2-only CPU, float32 on one with AVX512-BF16 or AMX): an NVFP4 sampler and its learner in
    that dtype start within the NVFP4 bound, and a sync catches a moved learner up."""
    from types import SimpleNamespace

    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from triage_trl import runtime
    from triage_trl.testing import save_tiny_qwen3

    other = not runtime.native_bf16_gemm("cpu")
    monkeypatch.setattr(runtime, "native_bf16_gemm", lambda device_type="cpu": other)
    dtype = runtime.engine_dtype()
    src = save_tiny_qwen3(tmp_path / "src")
    model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(src)
    with torch.no_grad():
        model.lm_head.weight.mul_(2)
    gen = TriageVLLMGeneration(model, Accelerator(cpu=True), tokenizer, sampler_precision="nvfp4",
                               calibration_prompts=["What is 3 + 4? Let me think step by step."],
                               checkpoint_dir=str(tmp_path / "ckpt"), max_model_length=256, max_num_seqs=8,
                               max_completion_length=8, temperature=0.7)
    try:
        assert gen.kernel_report["dtype"] == str(dtype).removeprefix("torch.")
        s = SimpleNamespace(gen=gen, model=model, tokenizer=tokenizer, temperature=0.7)
        ids = tokenizer(PROBE)["input_ids"]
        start_gap = probe_gap(s, ids)
        assert start_gap <= GAP_BOUND["nvfp4"]
        assert_sync_catches_up(s, ids, "nvfp4", perturb(model, seed=1), f"nvfp4 {dtype} (start {start_gap:.4f})")
    finally:
        gen.close()


_DENSE_THEN_MOE = """
import sys, tempfile
from pathlib import Path
from triage_trl.runtime import vllm_process_settings
from triage_trl.sampler.vllm_engine import start_engine
from triage_trl.testing import save_tiny_qwen3, save_tiny_qwen3_moe
from vllm.triton_utils import dispatcher
registrations = []
register = dispatcher.register_kernels
dispatcher.register_kernels = lambda overrides: (registrations.append(len(overrides)), register(overrides))[1]
with tempfile.TemporaryDirectory() as d, vllm_process_settings(cpu_kv_cache_gib=0.125):
    dense, _ = start_engine(save_tiny_qwen3(Path(d) / "dense"), "bf16", max_model_len=128, seed=0)
    moe, report = start_engine(save_tiny_qwen3_moe(Path(d) / "moe"), "bf16", max_model_len=128, seed=0)
    print("moe_kernels=" + report["moe_kernels"])
    from vllm.v1.sample import rejection_sampler
    overridden = isinstance(rejection_sampler.expand_kernel, dispatcher.KernelOverride)  # the C++ fallback runs
    print(f"registrations={registrations} overridden={overridden}")
"""


@pytest.mark.slow
def test_a_moe_engine_starts_next_to_a_live_dense_one():
    """vLLM 0.31 creates its expert-parallel group only when a process's first engine is MoE; start_engine adds it
    (a process of its own: the engines' parallel groups are process globals). The second start leaves vLLM's CPU
    Triton-kernel overrides as the first registered them."""
    import os
    import re
    import subprocess
    import sys

    from triage_trl.runtime import child_process_env

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = child_process_env(PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    run = subprocess.run([sys.executable, "-c", _DENSE_THEN_MOE], cwd=root, env=env, capture_output=True, text=True,
                         timeout=600, check=False)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert "moe_kernels=UnquantizedFusedMoEMethod" in run.stdout
    # vLLM's CPU Triton-kernel overrides: registered by the first engine only (start_engine skips the rescan after)
    assert re.search(r"^registrations=\[\d+\] overridden=True$", run.stdout, re.M), run.stdout[-2000:]
