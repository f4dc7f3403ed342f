"""What the trainer needs to know about its launch: which parallelism runs, what is refused before a model loads,
per-rank values, and the node-local folder the sampler starts from.

The launch is read from ``TrainingArguments`` (``fsdp``/``fsdp_config``, ``deepspeed``, ``use_cpu``) and from the
variables ``accelerate launch`` and ``torchrun`` set (``ACCELERATE_USE_FSDP``, ``FSDP_VERSION``,
``ACCELERATE_USE_DEEPSPEED``, ``ACCELERATE_DEEPSPEED_ZERO_STAGE``, ``ACCELERATE_USE_CPU``, ``WORLD_SIZE``), so the
refusals run in ``TriageGRPOConfig`` before anything is loaded. ``docs/scale.md`` says what runs where.

Source: accelerate 1.15 ``state.py`` (``AcceleratorState`` enables FSDP and DeepSpeed only on accelerators: with
``cpu=True`` both are dropped and the run is plain multi-process CPU data parallel) and ``commands/launch.py``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
from dataclasses import dataclass

import torch

__all__ = ["SAMPLER_CHECKPOINT", "Launch", "check_launch", "check_process_count", "launch_of", "per_rank", "sampler_checkpoint_dir"]

CPU_DDP_CONFIG = "accelerate_configs/cpu_ddp.yaml"
SAMPLER_CHECKPOINT = "_sampler_checkpoint"
"""Default sampler start folder inside ``output_dir``; ``Trainer.push_to_hub`` skips names starting with ``_``."""
@dataclass(frozen=True)
class Launch:
    """The parallelism a run was launched with.

    Attributes:
        kind: ``"single"``, ``"ddp"``, ``"fsdp"`` or ``"deepspeed"``.
        world_size: processes started by the launcher (``WORLD_SIZE``; 1 without one).
        fsdp_version: 1 or 2 under FSDP, else ``None``.
        zero_stage: DeepSpeed ZeRO stage (0-3) under DeepSpeed, else ``None``.
        cpu: the run asked for CPU (``use_cpu`` or ``ACCELERATE_USE_CPU``).
    """

    kind: str
    world_size: int
    fsdp_version: int | None = None
    zero_stage: int | None = None
    cpu: bool = False

    @property
    def shards_parameters(self) -> bool:
        """FSDP or ZeRO-3: no rank holds every parameter whole after the trainer prepares the model."""
        return self.kind == "fsdp" or (self.kind == "deepspeed" and self.zero_stage == 3)

    def describe(self) -> str:
        extra = {"fsdp": f" (fsdp_version {self.fsdp_version})", "deepspeed": f" (ZeRO-{self.zero_stage})"}
        return f"{self.kind}{extra.get(self.kind, '')} on {self.world_size} process(es){' on CPU' if self.cpu else ''}"


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "false").lower() in ("1", "true", "yes")


def launch_of(args) -> Launch:
    """The :class:`Launch` of ``args`` (a ``TrainingArguments``) in this process's environment."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    cpu = bool(getattr(args, "use_cpu", False)) or _env_flag("ACCELERATE_USE_CPU")
    fsdp_config = getattr(args, "fsdp_config", None) or {}
    if getattr(args, "fsdp", None) or _env_flag("ACCELERATE_USE_FSDP"):
        version = fsdp_config.get("version") if isinstance(fsdp_config, dict) else None
        version = int(version or os.environ.get("FSDP_VERSION") or (2 if getattr(args, "fsdp", None) else 1))
        return Launch("fsdp", world_size, fsdp_version=version, cpu=cpu)
    if getattr(args, "deepspeed", None) or _env_flag("ACCELERATE_USE_DEEPSPEED"):
        return Launch("deepspeed", world_size, zero_stage=_zero_stage(args), cpu=cpu)
    return Launch("ddp" if world_size > 1 else "single", world_size, cpu=cpu)


def _zero_stage(args) -> int:
    # Read before TrainingArguments.__post_init__ builds `hf_deepspeed_config` (which needs DeepSpeed installed).
    hf_config = getattr(args, "hf_deepspeed_config", None)
    ds_config = hf_config.config if hf_config is not None else getattr(args, "deepspeed", None)
    if isinstance(ds_config, str) and os.path.isfile(ds_config):
        with open(ds_config) as f:
            ds_config = json.load(f)
    if isinstance(ds_config, dict):
        return int(ds_config.get("zero_optimization", {}).get("stage", 0))
    return int(os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "0"))


def check_launch(args) -> None:
    """Refuse, before any model loads, every launch the trainer cannot run correctly; each message names what to use.

    Args:
        args: a ``TriageGRPOConfig`` (its ``use_vllm``, ``learner_precision``, ``resolved_nvfp4_learner_scales``).

    Raises:
        ImportError: a DeepSpeed launch without DeepSpeed installed.
        NotImplementedError: FSDP or DeepSpeed on CPU (accelerate would silently run plain data parallel), FSDP
            version 1 with the vLLM sampler, ZeRO-3 with the NVFP4 learner mirroring the sampler's scales, FSDP2 or
            ZeRO-3 with the NVFP4 learner's weight cache on (a whole weight per layer and rank).
    """
    launch = launch_of(args)
    if launch.kind in ("fsdp", "deepspeed") and launch.cpu:
        raise NotImplementedError(
            f"{launch.describe()}: accelerate runs FSDP and DeepSpeed only on accelerators; on CPU it drops them and "
            f"silently runs plain data parallel. Launch CPU runs with {CPU_DDP_CONFIG} (DDP over gloo), or use GPUs."
        )
    if launch.kind == "fsdp" and launch.fsdp_version != 2 and args.use_vllm:
        raise NotImplementedError(
            f"{launch.describe()}: the vLLM sampler's sync gathers FSDP2 (DTensor) parameters one decoder block at a "
            "time; FSDP1's flat parameters are not supported. Set fsdp_version: 2 (accelerate_configs/fsdp2.yaml)."
        )
    nvfp4_learner = args.learner_precision == "nvfp4"
    if launch.kind == "deepspeed" and launch.zero_stage == 3 and nvfp4_learner \
            and args.resolved_nvfp4_learner_scales == "sampler":
        raise NotImplementedError(
            f"{launch.describe()} with nvfp4_learner_scales='sampler': each emulated layer's weight scale is shared "
            "with its vLLM-fused siblings (q/k/v, gate/up), and ZeRO-3 gathers only the running layer's weights. "
            "Set nvfp4_learner_scales='dynamic' (torchao's recipe), or use FSDP2 (accelerate_configs/fsdp2.yaml)."
        )
    if launch.shards_parameters and nvfp4_learner and args.nvfp4_weight_cache:
        raise NotImplementedError(
            f"{launch.describe()} with learner_precision='nvfp4' and nvfp4_weight_cache=True: the cache keeps each "
            "layer's dequantised weight whole on every rank between steps, which undoes the sharding. Set "
            "nvfp4_weight_cache: false (the layers re-quantise at each forward; docs/scale.md)."
        )
    if launch.kind == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        raise ImportError(f"{launch.describe()} needs DeepSpeed, which is not installed: pip install deepspeed.")


def check_process_count(args) -> None:
    """Refuse a multi-process launch in which accelerate sees one process (each process would train alone).

    Happens on a machine without a GPU when the launcher starts several processes (``accelerate launch`` with a
    multi-GPU config, ``torchrun``) but ``use_cpu`` is off: accelerate then finds no accelerator and no CPU request.

    Raises:
        RuntimeError: ``WORLD_SIZE > 1`` but ``args.distributed_state`` has one process.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    processes = args.distributed_state.num_processes if args.distributed_state is not None else 1
    if world_size > 1 and processes == 1:
        raise RuntimeError(
            f"The launcher started {world_size} processes but accelerate sees 1 in each (no accelerator found and "
            "use_cpu is off), so every process would train its own copy of the model. On CPU set use_cpu: true and "
            f"launch with {CPU_DDP_CONFIG}; on GPUs check that the devices are visible."
        )


def per_rank(accelerator, value: float) -> list[float]:
    """``value`` from every process, in rank order (a collective with more than one process)."""
    local = torch.tensor([float(value)], dtype=torch.float64, device=accelerator.device)
    if accelerator.num_processes == 1:
        return [float(value)]
    return [float(v) for v in accelerator.gather(local).cpu()]


def sampler_checkpoint_dir(args, accelerator) -> str:
    """The node-local folder the sampler starts from: ``args.sampler_checkpoint_dir`` or
    ``<output_dir>/_sampler_checkpoint``, with a ``node<i>`` subfolder (``i``: the node's index among the run's
    host names) when the run spans several nodes, so nodes sharing a filesystem never write the same files.
    A collective with more than one process (the host names are gathered).

    The leading underscore keeps the folder out of ``Trainer.push_to_hub`` and the pushes during training, which
    skip ``_*``: it holds the engine's start files (config and empty weights), not the trained model."""
    base = args.sampler_checkpoint_dir or os.path.join(args.output_dir, SAMPLER_CHECKPOINT)
    if accelerator is None or accelerator.num_processes == 1:
        return base
    from accelerate.utils import gather_object

    hosts = sorted(set(gather_object([socket.gethostname()])))
    return base if len(hosts) == 1 else os.path.join(base, f"node{hosts.index(socket.gethostname())}")
