"""NVFP4 MoE in vLLM's CPU engine: the export of a tiny Qwen3-MoE loads and generates, the kernel report names the
experts' kernel, the same weights stream into one ``reload_weights`` call, and NVFP4 experts are refused before vLLM
starts where it has no NVFP4 MoE kernel (its CPU build)."""

import pytest
import torch

from triage_trl.nvfp4.config import NVFP4Config
from triage_trl.nvfp4.experts import check_sampler_nvfp4_experts, sampler_nvfp4_moe_support
from triage_trl.nvfp4.selection import select_nvfp4_layers

pytestmark = pytest.mark.skipif(sampler_nvfp4_moe_support()[0], reason="checks vLLM's CPU build (no NVFP4 MoE)")

BOTH_NVFP4 = dict(learner_precision="nvfp4", sampler_precision="nvfp4", nvfp4_emulation_dtype="fp32")
PROMPTS = ["What is 3 + 4? Let me think step by step.", "Compute 12 - 5.\nFirst, 12 - 5 = 7."]


@pytest.fixture(scope="module")
def moe_engine(tmp_path_factory, in_process_vllm):
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from triage_trl.nvfp4.calibration import calibrate_input_global_scales
    from triage_trl.nvfp4.checkpoint_tensors import save_nvfp4_checkpoint
    from triage_trl.nvfp4.learner import convert_to_nvfp4_learner, set_sampler_input_scales
    from triage_trl.sampler.vllm_engine import start_engine
    from triage_trl.testing import save_tiny_qwen3_moe

    root = tmp_path_factory.mktemp("nvfp4-moe-vllm")
    src = save_tiny_qwen3_moe(root / "src")
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    tok = AutoTokenizer.from_pretrained(src)
    with torch.no_grad():
        model.lm_head.weight.mul_(20)  # greedy log-probs far from uniform
    selection = convert_to_nvfp4_learner(model, NVFP4Config(**BOTH_NVFP4), native=False)
    scales = calibrate_input_global_scales(model, tok, PROMPTS)
    set_sampler_input_scales(model, scales)
    ckpt = save_nvfp4_checkpoint(model, tok, root / "nvfp4", scales)
    llm, report = start_engine(ckpt, "nvfp4", max_model_len=256, seed=0)
    yield SimpleNamespace(llm=llm, report=report, model=model, tok=tok, selection=selection, scales=scales)
    del llm


def _greedy(llm, n=6):
    from vllm import SamplingParams

    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=n, temperature=0.0, logprobs=0, seed=0), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], [
        [next(iter(lp.values())).logprob for lp in o.outputs[0].logprobs] for o in outs]


def test_auto_keeps_experts_bf16_in_both_engines_and_reports_it(moe_engine):
    summary = moe_engine.selection.summary()
    assert summary["nvfp4/params_nvfp4_experts"] == 0 and summary["nvfp4/params_bf16_experts"] == 196608
    assert moe_engine.report["moe_kernels"].startswith("UnquantizedFusedMoEMethod")  # bf16 experts
    assert moe_engine.report["moe_kernels"].endswith(" x2")
    assert "FastCpuNvFp4LinearKernel x4" in moe_engine.report["linear_kernels"]  # qkv and o of 2 blocks in NVFP4
    assert type(moe_engine.model.model.layers[0].mlp.experts).__name__ == "Qwen3MoeExperts"  # learner: bf16 too


def test_export_generates_and_matches_the_learner(moe_engine):
    import copy

    from triage_trl.runtime import engine_dtype

    tokens, logprobs = _greedy(moe_engine.llm)
    assert all(len(t) == 6 for t in tokens)
    model, tok = copy.deepcopy(moe_engine.model).to(engine_dtype()), moe_engine.tok
    # End to end the two engines agree only up to chaos: their GEMMs accumulate in different orders (vLLM's CPU
    # kernels differ by machine kind), and one ulp flips E2M1 roundings of the NVFP4 attention downstream, x20
    # logits here; measured 0.15-0.25 nats mean per completion on an AVX2 CPU. The layer-level agreement is
    # asserted in test_nvfp4_vllm.py; here the bound only separates a right export from a wrong expert layout
    # (random experts: several nats per token).
    for prompt, completion, sampler_lp in zip(PROMPTS, tokens, logprobs):
        ids = tok(prompt, return_tensors="pt")["input_ids"]
        full = torch.cat([ids, torch.tensor([completion])], dim=1)
        with torch.no_grad():
            logits = model(input_ids=full).logits[0, ids.shape[1] - 1:-1].float()
        learner_lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]
        gap = (learner_lp - torch.tensor(sampler_lp)).abs()
        print(f"\nvLLM NVFP4 (bf16 experts) vs NVFP4 learner: max |dlogp| {gap.max():.4f}, mean {gap.mean():.4f}")
        assert gap.mean() < 1.0


def test_one_reload_weights_call_streams_the_experts(moe_engine):
    from triage_trl.nvfp4.experts import repack_cpu_moe_after_reload
    from triage_trl.nvfp4.checkpoint_tensors import iter_checkpoint_weights

    llm, model = moe_engine.llm, moe_engine.model
    before, _ = _greedy(llm)

    def sync():  # what the sampler's _load_learner_weights does
        weights = iter_checkpoint_weights(model, selection=moe_engine.selection, input_global_scales=moe_engine.scales)
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
        assert llm.apply_model(repack_cpu_moe_after_reload) == [2]
        llm.reset_prefix_cache()

    sync()
    assert _greedy(llm)[0] == before  # an unchanged model reloads to the same engine

    experts = [m.mlp.experts for m in model.model.layers]
    saved = [(e.gate_up_proj.detach().clone(), e.down_proj.detach().clone()) for e in experts]
    try:
        with torch.no_grad():
            for e in experts:
                e.down_proj.mul_(-30.0)
        sync()
        changed, _ = _greedy(llm)
        assert changed != before
    finally:
        with torch.no_grad():
            for e, (w13, w2) in zip(experts, saved):
                e.gate_up_proj.copy_(w13)
                e.down_proj.copy_(w2)
        sync()
    assert _greedy(llm)[0] == before


def test_nvfp4_experts_refused_before_vllm_starts(tmp_path):
    from transformers import AutoModelForCausalLM

    from triage_trl.testing import save_tiny_qwen3_moe

    model = AutoModelForCausalLM.from_pretrained(save_tiny_qwen3_moe(tmp_path / "m"), dtype=torch.bfloat16)
    selection = select_nvfp4_layers(model, NVFP4Config(nvfp4_moe_experts="nvfp4", **BOTH_NVFP4))
    with pytest.raises(ValueError, match="vLLM's cpu build has no NVFP4 MoE kernel.*nvfp4_moe_experts='auto'"):
        check_sampler_nvfp4_experts(selection)
    check_sampler_nvfp4_experts(select_nvfp4_layers(model, NVFP4Config(**BOTH_NVFP4)))  # auto: accepted
