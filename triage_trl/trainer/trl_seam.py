"""The one place the trainer reaches into TRL's module internals: how ``GRPOTrainer.__init__`` builds its sampler.

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
