"""Two-process worker of ``tests/test_distributed_sharded.py``: the vLLM sampler on an FSDP2-sharded or
ZeRO-3-partitioned learner, 3 optimizer steps, on CPU with gloo. Not a test module; run under torchrun:

    torchrun --nproc_per_node 2 tests/sharded_worker.py MODEL OUT RUN [RUN ...]

Each RUN is ``{fsdp2|zero3}:{bf16|dynamic|sampler}:{bf16|nvfp4}``: the sharding, the learner (``bf16``: not
converted, or the NVFP4 learner with ``dynamic`` or ``sampler`` scales; with ``sampler`` the sampler's activation
scales are pushed to the learner after every sync, as the trainer does) and the sampler precision. The runs go one
after another in the same two processes (one launch: the interpreter start and imports, about 16 s on both cores,
paid once), each with its own model, optimizer and vLLM engine; every engine is kept until the processes end, since
closing a process's last engine tears down torch.distributed's default group (vLLM's teardown), which the next run
still needs. Each run writes ``OUT/<sharding>-<learner>-<precision>/rank<i>.json``.

Why not the trainer: accelerate 1.15 enables FSDP and DeepSpeed only on accelerators (with ``cpu=True`` it drops
them), so ``TriageGRPOTrainer`` cannot be launched with either on CPU. This worker builds what accelerate's FSDP2
plugin (``fully_shard`` per decoder layer, then the root) and DeepSpeed ZeRO-3 (``zero.Init`` + ``initialize``)
build, after the trainer's own steps (load, NVFP4 conversion), and drives the real ``TriageVLLMGeneration`` the way
TRL does (a sync before each generation).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import sys

import torch
import torch.distributed as dist

PROMPTS = ["What is 3 + 4? Let me think step by step.", "Compute 12 - 5.\nFirst, 12 - 5 = 7."]
PROBE = "Question: what is 12 + 30?\nLet me think step by step.\n12 + 30 = 42.\nThe quick brown fox jumps over."
ZERO3 = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
         "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}


def _full(param) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor):
        return param.full_tensor()
    if hasattr(param, "ds_id"):
        import deepspeed

        with deepspeed.zero.GatheredParameters([param]):
            return param.detach().clone()
    return param.detach()


def _load_full_weights(reference, model) -> None:
    """Copy the (gathered) current weights of the sharded ``model`` into the plain ``reference`` (its NVFP4 weight
    caches invalidated: it re-quantises at its next forward)."""
    from triage_trl.nvfp4.learner import invalidate_nvfp4_weight_caches

    own = dict(reference.named_parameters())
    with torch.no_grad():
        for name, param in model.named_parameters():
            own[name].copy_(_full(param))
    invalidate_nvfp4_weight_caches(reference)


def _blocks_whole(model) -> int:
    """How many decoder blocks have their q_proj weight whole on this rank right now."""
    from torch.distributed.tensor import DTensor

    whole = 0
    for layer in model.model.layers:
        weight = layer.self_attn.q_proj.weight
        partitioned = hasattr(weight, "ds_shape") and weight.numel() != weight.ds_shape.numel()
        whole += not (isinstance(weight, DTensor) or partitioned)
    return whole


def build(mode: str, scales: str, model_dir: str, ids: torch.Tensor):
    """(model, reference, step): the sharded NVFP4 learner, a plain copy of its starting weights, one optimizer step."""
    from transformers import AutoModelForCausalLM

    from triage_trl.nvfp4.callbacks import NVFP4WeightCacheCallback
    from triage_trl.nvfp4.config import NVFP4Config
    from triage_trl.nvfp4.learner import convert_to_nvfp4_learner

    nvfp4 = NVFP4Config(learner_precision="nvfp4", sampler_precision="nvfp4",
                         nvfp4_learner_scales=None if scales == "bf16" else scales)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if scales != "bf16":
        convert_to_nvfp4_learner(reference, nvfp4, native=False)
    if mode == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        model = copy.deepcopy(reference)
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model.model.layers:  # accelerate's TRANSFORMER_BASED_WRAP on Qwen3DecoderLayer, then the root
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step():
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            NVFP4WeightCacheCallback().on_optimizer_step(None, None, None, model=model)  # as the trainer's callback

        return model, reference, step
    import deepspeed

    config = copy.deepcopy(reference.config)
    config.pad_token_id = None  # transformers' init zeroes the padding row, which a partitioned embedding lacks
    with deepspeed.zero.Init(config_dict_or_path=ZERO3):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = reference.state_dict()
    for name, param in model.named_parameters():
        with deepspeed.zero.GatheredParameters([param], modifier_rank=0), torch.no_grad():
            if dist.get_rank() == 0:
                param.copy_(state[name])
    if scales != "bf16":
        convert_to_nvfp4_learner(model, nvfp4, native=False)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ZERO3)

    def step():
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        NVFP4WeightCacheCallback().on_optimizer_step(None, None, None, model=engine)  # as the trainer's callback

    return model, reference, step


def probe_gap(gen, learner, tokenizer) -> float:
    ids = tokenizer(PROBE)["input_ids"]
    with torch.no_grad():
        logits = learner(input_ids=torch.tensor([ids])).logits[0, :-1].float()
    learner_logps = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    return float((learner_logps - torch.tensor(gen.score_logps([ids])[0])).abs().mean())


def shared_prompt_diff(model, tokenizer) -> float:
    """Max |log-prob difference| (nats) on the sharded learner between the shared-prompt forward
    (triage_trl/trainer/shared_prompt.py) and TRL's row-by-row fused forward: 2 prompts x 2 completions."""
    from trl.trainer.utils import add_fused_lm_head

    from triage_trl.trainer.shared_prompt import prompt_groups, shared_prompt_logps

    add_fused_lm_head(model)
    prompts = tokenizer(PROMPTS, padding=True, padding_side="left", return_tensors="pt")
    completion = torch.tensor([tokenizer(" 7.\nThe answer is 7.")["input_ids"][:6]] * 4)
    completion[1, 4:] = tokenizer.pad_token_id
    ids = torch.cat([prompts["input_ids"][[0, 0, 1, 1]], completion], dim=1)
    mask = torch.cat([prompts["attention_mask"][[0, 0, 1, 1]], (completion != tokenizer.pad_token_id).long()], dim=1)
    c = completion.size(1)
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :-c] = -100
    with torch.no_grad():
        rows = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True).log_probs[:, -c:]
        shared, _ = shared_prompt_logps(model, ids, mask, c, prompt_groups(ids[:, :-c], mask[:, :-c]), batch_size=4,
                                        compute_entropy=False, eager_mask=False, autocast=contextlib.nullcontext)
    return float((shared - rows).abs().max())


def main(mode: str, scales: str, precision: str, model_dir: str, out_dir: str):
    """One run; writes ``out_dir/rank<i>.json`` and returns its sampler (the caller keeps it: see the module's
    docstring)."""
    from accelerate import Accelerator
    from transformers import AutoTokenizer

    from triage_trl.nvfp4.checkpoint_tensors import iter_checkpoint_weights
    from triage_trl.nvfp4.learner import set_sampler_input_scales
    from triage_trl.runtime import vllm_process_settings
    from triage_trl.sampler.vllm_generation import TriageVLLMGeneration

    if mode == "zero3":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    torch.manual_seed(0)
    probe_ids = torch.tensor([tokenizer(PROBE)["input_ids"]])
    model, reference, step = build(mode, scales, model_dir, probe_ids)
    facts = {"rank": rank, "world_size": accelerator.num_processes, "mode": mode, "scales": scales,
             "precision": precision, "gaps": [], "learner_diff": [], "learner_moved": []}
    first_logits = None
    with vllm_process_settings(cpu_kv_cache_gib=0.125):  # tests/conftest.py's TEST_KV_CACHE_GIB
        gen = TriageVLLMGeneration(
            model, accelerator, tokenizer, sampler_precision=precision, calibration_prompts=PROMPTS,
            checkpoint_dir=os.path.join(out_dir, "sampler_checkpoint"), max_model_length=256, max_num_seqs=4,
            max_completion_length=8, temperature=1.0,
        )
        facts["scales_before_first_sync"] = gen.input_global_scales is not None
        for i in range(4):
            if i:
                step()
            gen.sync_weights()  # TRL syncs before every generation
            _load_full_weights(reference, model)
            if scales == "sampler":  # the trainer's scale push after each sync
                set_sampler_input_scales(model, gen.input_global_scales)
                set_sampler_input_scales(reference, gen.input_global_scales)
            facts["gaps"].append(probe_gap(gen, reference, tokenizer))
            with torch.no_grad():  # the sharded learner's forward against the plain one on the same weights
                logits = model(input_ids=probe_ids).logits
                diff = (logits - reference(input_ids=probe_ids).logits).abs().max()
            first_logits = logits if first_logits is None else first_logits
            facts["learner_diff"].append(float(diff))
            facts["learner_moved"].append(float((logits - first_logits).abs().max()))  # the steps change the output
        scales = gen.input_global_scales
        facts["input_global_scales"] = {k: float(v) for k, v in (scales or {}).items()}
        selection = gen.nvfp4_selection
        whole_blocks = []
        ours = {}
        for name, tensor in iter_checkpoint_weights(model, selection=selection, input_global_scales=scales):
            whole_blocks.append(_blocks_whole(model))
            ours[name] = tensor.clone()
        facts["max_whole_blocks"] = max(whole_blocks)
        facts["blocks"] = len(model.model.layers)
        plain = dict(iter_checkpoint_weights(reference, selection=selection, input_global_scales=scales))
        facts["export_names_equal"] = sorted(ours) == sorted(plain)
        facts["export_bitwise_equal"] = facts["export_names_equal"] and all(
            torch.equal(ours[n].view(torch.uint8), plain[n].view(torch.uint8)) for n in plain
        )
        facts["structural_files"] = sorted(os.listdir(gen.checkpoint_dir))
    facts["shared_prompt_diff"] = shared_prompt_diff(model, tokenizer)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(facts, f, indent=1)
    dist.barrier()
    return gen


def run_all(model_dir: str, out_dir: str, runs: list[str]) -> None:
    """Every RUN of the command line, one after another (see the module's docstring)."""
    modes = {run.split(":")[0] for run in runs}
    if len(modes) != 1:
        raise SystemExit(f"one sharding per launch (FSDP2 and ZeRO-3 set up torch.distributed differently): {runs}")
    samplers = []  # held until the processes end: closing the last engine would end the process group
    for run in runs:
        run_dir = os.path.join(out_dir, run.replace(":", "-"))
        os.makedirs(run_dir, exist_ok=True)
        samplers.append(main(*run.split(":"), model_dir, run_dir))


if __name__ == "__main__":
    run_all(sys.argv[1], sys.argv[2], sys.argv[3:])
