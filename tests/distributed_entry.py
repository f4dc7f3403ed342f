"""Entry point of the multi-process tests: train with the CLI, then write what each rank saw to
``<output_dir>/rank<i>.json`` (launched by ``accelerate launch`` from ``tests/test_distributed_launch.py``).

Not a test module: ``python tests/distributed_entry.py --config recipes/tiny_cpu.yaml [overrides]``.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

import torch


def _threads_and_affinity() -> dict:
    return {"torch_threads": torch.get_num_threads(), "affinity": sorted(os.sched_getaffinity(0))}


def _learner_digest(model) -> str:
    """sha256 over every parameter's bytes, in name order (whole tensors: FSDP2 DTensors are gathered)."""
    from torch.distributed.tensor import DTensor

    digest = hashlib.sha256()
    for name, param in sorted(model.named_parameters()):
        tensor = param.full_tensor() if isinstance(param, DTensor) else param
        digest.update(name.encode())
        digest.update(tensor.detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def _engine_facts(gen) -> dict:
    from vllm.distributed.parallel_state import get_tp_group, get_world_group

    config = gen.llm.llm_engine.vllm_config
    cache = config.cache_config
    return {
        "seed": config.model_config.seed,
        "load_format": str(config.load_config.load_format),
        "num_kv_blocks": cache.num_gpu_blocks,
        "block_size": cache.block_size,
        "kv_cache_gib": os.environ.get("VLLM_CPU_KVCACHE_SPACE"),
        "vllm_world_size": get_world_group().world_size,
        "vllm_tp_size": get_tp_group().world_size,
        "vllm_world_rank": get_world_group().rank_in_group,
        "distributed_executor_backend": str(config.parallel_config.distributed_executor_backend),
        "kernel_report": gen.kernel_report,
    }


def main(argv: list[str]) -> None:
    from triage_trl.cli import build_trainer, parse_args
    from triage_trl.runtime import vllm_process_settings

    before = _threads_and_affinity()
    with vllm_process_settings():
        trainer = build_trainer(*parse_args(argv))
        with trainer:  # closed after the report: the report runs one more sync and probe on the live engine
            trainer.train()
            report(trainer, before)


def report(trainer, before: dict) -> None:
    from triage_trl.trainer.sync_probe import probe_gap

    gen = trainer.vllm_generation
    # One more sync (every rank), then each rank's own probe against its own engine.
    gen.sync_weights()
    ids = trainer._probe_ids
    with torch.no_grad():
        learner, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long), len(ids) - 1
        )
    local_gap, _ = probe_gap(learner[0], gen.score_logps([ids])[0])
    acc = trainer.accelerator
    logs = [h for h in trainer.state.log_history if "loss" in h]
    facts = {
        "rank": acc.process_index,
        "local_rank": acc.local_process_index,
        "num_processes": acc.num_processes,
        "distributed_type": str(acc.distributed_type),
        "global_step": trainer.state.global_step,
        "epochs": [h["epoch"] for h in logs],
        "losses": [h["loss"] for h in logs],
        "triage_metrics": sorted({k for h in logs for k in h if k.startswith("triage/")}),
        "probe_gaps": trainer.sync_probe_gaps,
        "probe_rank_gaps": trainer.sync_probe_rank_gaps,
        "probe_bound": trainer.args.resolved_sync_probe_max_gap,
        "final_local_probe_gap": local_gap,
        "num_syncs": gen.num_syncs,
        "input_global_scales": {k: float(v) for k, v in (gen.input_global_scales or {}).items()},
        "learner_forwards": dict(trainer.learner_forwards),
        "learner_digest": _learner_digest(trainer.model),
        "checkpoint_dir": str(gen.checkpoint_dir),
        "checkpoint_files": sorted(os.listdir(gen.checkpoint_dir)),
        "before_start": before,
        "after_train": _threads_and_affinity(),
        "engine": _engine_facts(gen),
        "env": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MASTER_PORT", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                                "VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_DIST_IDENT")},
    }
    with open(os.path.join(trainer.args.output_dir, f"rank{acc.process_index}.json"), "w") as f:
        json.dump(facts, f, indent=1, default=str)


if __name__ == "__main__":
    main(sys.argv[1:])
