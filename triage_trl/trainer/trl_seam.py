"""The one place the trainer reaches into TRL's module internals: how ``GRPOTrainer.__init__`` builds its sampler,
and which positions TRL's fused LM head scores on CPU (:func:`compact_fused_lm_head_on_cpu`).

TRL 1.16 builds its vLLM backend inline in ``GRPOTrainer.__init__`` (``self.vllm_generation = VLLMGeneration(...)``,
the name imported into ``trl.trainer.grpo_trainer``) and offers no factory argument. While TRL's ``__init__`` runs,
that module-level name points at TRIAGE's sampler factory; afterwards the trainer checks that the object TRL built is
really TRIAGE's sampler, so a TRL that builds its sampler another way fails at construction, clearly, instead of
training with TRL's plain sampler. Every TRL name the project relies on is listed in ``tests/test_trl_contract.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

TRL_TESTED = "1.16"


class TRLContractError(RuntimeError):
    """The installed TRL does not offer a name or behaviour triage-trl builds on."""


def trl_version() -> str:
    import trl

    return getattr(trl, "__version__", "unknown")


@contextlib.contextmanager
def trl_builds_sampler_with(factory: Callable | None) -> Iterator[None]:
    """While the block runs, ``GRPOTrainer.__init__`` instantiates ``factory`` as its vLLM backend.

    Raises:
        TRLContractError: TRL's GRPO module has no ``VLLMGeneration`` name to point at the factory.
    """
    if factory is None:
        yield
        return
    import trl.trainer.grpo_trainer as grpo_module

    if not hasattr(grpo_module, "VLLMGeneration"):
        raise TRLContractError(
            f"TRL {trl_version()} no longer builds its vLLM sampler through trl.trainer.grpo_trainer.VLLMGeneration; "
            f"triage-trl supports TRL {TRL_TESTED}.x. Install trl>={TRL_TESTED},<1.17."
        )
    original = grpo_module.VLLMGeneration
    grpo_module.VLLMGeneration = factory
    try:
        yield
    finally:
        grpo_module.VLLMGeneration = original


def check_sampler_built(sampler, expected: type) -> None:
    """Raise when TRL did not build the sampler through :func:`trl_builds_sampler_with`.

    Raises:
        TRLContractError: naming the TRL version and the class TRL built.
    """
    if not isinstance(sampler, expected):
        raise TRLContractError(
            f"TRL {trl_version()} built a {type(sampler).__name__} sampler instead of triage-trl's "
            f"{expected.__name__}: TRIAGE's NVFP4 export, one-call sync and sync probe would not run. triage-trl "
            f"supports TRL {TRL_TESTED}.x; install trl>={TRL_TESTED},<1.17."
        )


@contextlib.contextmanager
def compact_fused_lm_head_on_cpu() -> Iterator[None]:
    """While the block runs, TRL's fused LM head scores only the labelled positions (the completion tokens) of CPU
    tensors, as it does on Triton devices, instead of every position of prompt and completion.

    TRL 1.16's ``add_fused_lm_head`` forward picks the positions with ``trl.trainer.utils._use_triton(device)``:
    off Triton devices it scores every position, so that a varying count of labelled positions cannot recompile
    the kernel's tiles (its comment names Neuron). TRL's CPU path is eager, nothing recompiles, and the prompt
    positions it scores are thrown away: with the demo's batch (16 completions of ~21 tokens after ~113 prompt
    tokens) the head's vocabulary projection ran over 6x the needed rows, and one learner forward and backward of
    SmolLM2-135M took 21.9 s instead of 15.6 s (2-core AVX2 EPYC) with bit-identical log-probs. Only the name
    imported into ``trl.trainer.utils`` is redirected, so the chunked kernel's own choice of Triton or torch tiles
    is untouched, and other devices get TRL's answer. Every launch configuration (one process, DDP, FSDP2, ZeRO-3,
    server mode) runs the same forward; nothing changes on GPUs.

    Raises:
        TRLContractError: ``trl.trainer.utils`` has no ``_use_triton`` (checked with the rest of the contract when
            a trainer is built).
    """
    import trl.trainer.utils as trl_utils

    if not hasattr(trl_utils, "_use_triton"):
        raise TRLContractError(
            f"TRL {trl_version()} no longer chooses its fused LM head's positions through "
            f"trl.trainer.utils._use_triton; triage-trl supports TRL {TRL_TESTED}.x. Install trl>={TRL_TESTED},<1.17."
        )
    original = trl_utils._use_triton

    def _use_triton(device) -> bool:
        return getattr(device, "type", device) == "cpu" or original(device)

    trl_utils._use_triton = _use_triton
    try:
        yield
    finally:
        trl_utils._use_triton = original
