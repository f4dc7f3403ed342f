"""The colocated vLLM sampler of TRIAGE: bf16 or NVFP4 weights, one-call weight sync, probe scoring.

``TriageVLLMGeneration`` is TRL 1.16's ``VLLMGeneration`` (colocate mode) with three changes:

* **start** (``_init_vllm``): the local main process of each node writes a *structural* checkpoint into
  ``checkpoint_dir`` (config, tokenizer and, for NVFP4, the compressed-tensors ``nvfp4-pack-quantized`` quantisation
  config; no weights) and ``vllm.LLM`` starts on it in every process with ``load_format="dummy"`` through the
  project's one engine start (:func:`~triage_trl.sampler.vllm_engine.start_engine`) with
  ``logprobs_mode="processed_logprobs"``. The learner's weights are then loaded from memory like a sync: at once when
  every rank holds them whole (one process, DDP), at the first sync when they are sharded or partitioned (FSDP2,
  ZeRO-3: the trainer shards only in ``train()``). NVFP4 activation global scales are calibrated on
  ``calibration_prompts`` at that first load and reduced across ranks (the largest activation any rank saw), so every
  rank serves the same quantised model. :attr:`kernel_report` records which linear kernels really run.
* **sync** (``sync_weights``): every weight, in checkpoint format (re-quantised to NVFP4 for the NVFP4 sampler), goes
  to vLLM in ONE ``reload_weights(weights_iterator=..., is_checkpoint_format=True)`` call on the worker (inside vLLM's
  config context), produced one decoder block at a time
  (:func:`~triage_trl.nvfp4.checkpoint_tensors.iter_checkpoint_weights`: FSDP2 and ZeRO-3 gather one block at a
  time); then the prefix cache is reset and :attr:`on_sync` runs (the trainer's scale push and probe).
  TRL's per-tensor ``load_weights`` sync fails on the vLLM CPU build and cannot re-quantise; one tensor per reload
  call silently corrupts the model (each call re-initialises the layers it does not see).
* **probe** (``score_logps``): the sampler's log-probs of given token sequences (vLLM prompt log-probs at the
  sampling temperature) for the trainer's sync probe.

Which sampling settings are allowed is decided once, in ``TriageGRPOConfig`` (``triage_trl/trainer/sampling_rules.py``).

Source: TRL 1.16 ``trl/generation/vllm_generation.py``; vLLM 0.31 ``Worker.reload_weights`` and
``v1/sample/sampler.py``.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import os
import re
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
from accelerate.utils import is_peft_model
from trl.generation.vllm_generation import VLLMGeneration

from ..nvfp4.checkpoint_tensors import DequantisedWeights
from ..nvfp4.config import PRECISIONS
from ..models.blocks import parameters_materialized
from .direct_write import DirectWrite, direct_write_supported
from .frozen_vocab import FrozenVocabSkip
from .kernel_choice import check_sampler_kernel, resolve_sampler_kernel, sampler_kernel_engine_kwargs
from .ranks import all_ranks_agree, reduce_input_global_scales
from .vllm_engine import sampler_dtype, sampler_tensors, start_engine, write_engine_checkpoint

logger = logging.getLogger(__name__)

__all__ = ["SAMPLER_PRECISIONS", "TriageVLLMGeneration"]

SAMPLER_PRECISIONS = PRECISIONS

# Checkpoint tensors that vLLM 0.31's in-place ``reload_weights`` cannot place, per architecture: the model's
# ``load_weights`` copies them with ``param.copy_`` instead of the weight loaders the layerwise reload wraps, so the
# reload leaves their layers at the previous (at start: dummy) values (vLLM 0.31 ``models/gpt_oss.py``
# ``_load_weights_other``; measured: probe gap inf before any update, then 0.12 nats with the experts exported as
# stored). They are loaded again, after the reload, with the model's own ``load_weights``.
RELOAD_DIRECT_COPY = {"GptOssForCausalLM": re.compile(r"\.mlp\.experts\.|\.self_attn\.sinks$")}

# The engines of this process not yet shut down (tokens), and the process state the first of them found.
_LIVE: set[int] = set()
_uncollected = False  # an engine shut down since the last full collection (collect_dropped_samplers)
_FOUND: dict = {}


class TriageVLLMGeneration(VLLMGeneration):
    """TRL's colocated ``VLLMGeneration`` with a bf16 or NVFP4 vLLM sampler, kept in sync in one reload call.

    Args:
        model, accelerator, processing_class, **kwargs: as ``trl.generation.vllm_generation.VLLMGeneration``
            (only ``mode="colocate"`` is supported; sleep mode only where vLLM supports it, not on CPU).
        sampler_precision: ``"bf16"`` (plain bf16 checkpoint) or ``"nvfp4"`` (NVFP4 W4A4 compressed-tensors
            checkpoint, re-quantised at every sync).
        calibration_prompts: prompts for the NVFP4 activation global scales (vLLM's NVFP4 activations use static
            per-tensor scales, calibrated on the learner at start and, on request, again at every sync). Each is a
            string, a list of token ids (decoded with ``processing_class``) or a chat (list of
            ``{"role", "content"}``, rendered with the chat template). Required for ``"nvfp4"``.
        checkpoint_dir: node-local folder for the structural checkpoint vLLM starts from (created; overwritten by
            the local main process of each node).
        llm_kwargs: extra ``vllm.LLM`` arguments, overriding ours (e.g. ``enforce_eager``,
            ``kv_cache_memory_bytes``). On CPU ``enforce_eager`` defaults to ``True``.
        recalibrate_every_sync: NVFP4 only. ``False`` (default): keep the activation scales calibrated at the first
            weight load, as a deployed static-scale checkpoint does; a sync without a weight change then leaves the
            sampler bit-identical (activations growing past the calibrated range clip). ``True``: recalibrate on the
            current learner before each sync, as a fresh export would (one learner forward per calibration prompt);
            on a 135M W4A4 model this alone moves greedy outputs, since each calibration sees the previous scales.
        sampler_seed: vLLM's seed is ``sampler_seed + process_index // tensor_parallel_size`` (TRL seeds with the
            rank term only, so every run would sample alike; the trainer passes ``args.seed``).
        nvfp4_config: the NVFP4 settings (``NVFP4Config``; the trainer passes its args): the NVFP4 layer selection
            the export uses (``triage_trl.nvfp4.selection``; the learner's own when it was converted).

    Attributes:
        kernel_report: ``dict[str, str]`` — platform, precision, dtype, which linear kernels run (class names with
            layer counts), GEMM path and activation precision, read from the loaded vLLM model; for NVFP4 also
            ``nvfp4_sampler_kernel`` (the kernel chosen and why, ``triage_trl.sampler.kernel_choice``).
        sampler_kernel: ``(kernel, reason)``, the resolved ``nvfp4_sampler_kernel`` (``None`` for bf16).
        input_global_scales: NVFP4 activation global scales (``{hf_linear_name: 0-dim fp32}``, identical on every
            rank), or ``None`` before the first weight load.
        num_syncs: completed ``sync_weights`` calls.
        on_sync: ``Callable[[], None] | None``, called after every completed sync (the trainer installs its scale
            push and its sync probe here, so the syncs TRL triggers are checked on the trainer's schedule).

    Raises:
        ValueError: unknown ``sampler_precision``, ``mode != "colocate"``, no calibration prompts for NVFP4, sleep
            mode on CPU, an ``nvfp4_sampler_kernel`` this platform cannot run.
        RuntimeError: the NVFP4 kernels vLLM loaded do not run the recipe chosen
            (``kernel_choice.check_sampler_kernel``).
    """

    def __init__(
        self,
        model,
        accelerator,
        processing_class,
        *,
        sampler_precision: str = "nvfp4",
        calibration_prompts: Sequence[str | Sequence[int] | Sequence[dict]] | None = None,
        checkpoint_dir: str | os.PathLike | None = None,
        llm_kwargs: dict | None = None,
        recalibrate_every_sync: bool = False,
        sampler_seed: int = 0,
        nvfp4_config=None,
        **kwargs,
    ):
        if sampler_precision not in SAMPLER_PRECISIONS:
            raise ValueError(f"sampler_precision must be one of {SAMPLER_PRECISIONS}, got {sampler_precision!r}.")
        if checkpoint_dir is None:
            raise ValueError("checkpoint_dir is required: the sampler's initial checkpoint is written there.")
        self.sampler_precision = sampler_precision
        self.calibration_prompts = list(calibration_prompts or [])
        self.checkpoint_dir = Path(checkpoint_dir)
        self.llm_kwargs = dict(llm_kwargs or {})
        self.recalibrate_every_sync = recalibrate_every_sync
        self.sampler_seed = sampler_seed
        self.nvfp4_config = nvfp4_config
        self.nvfp4_selection = None
        self.sampler_kernel: tuple[str, str] | None = None
        self.kernel_report: dict[str, str] = {}
        self.input_global_scales: dict[str, torch.Tensor] | None = None
        self.num_syncs = 0
        self.on_sync: Callable[[], None] | None = None
        self.frozen_vocab = FrozenVocabSkip()
        self._model_class: str | None = None  # the learner's Hugging Face class, read at the first sync
        self.direct_write = DirectWrite()
        self.direct_write_ok: tuple[bool, str] = (False, "the engine has not started")
        self._engine_loaded = False
        super().__init__(model, accelerator, processing_class, **kwargs)

    # ------------------------------------------------------------------ start

    def _init_vllm(self):
        """Export the policy, start ``vllm.LLM`` in this process on it, record the kernels that run."""
        from vllm.platforms import current_platform

        if self.mode != "colocate":
            raise ValueError(
                f"TriageVLLMGeneration supports vllm_mode='colocate' only (got {self.mode!r}): the one-call NVFP4 "
                "re-quantising sync needs the engine in this process. Use vllm_mode='colocate'."
            )
        if self.enable_sleep_mode and current_platform.is_cpu():
            raise ValueError("vLLM has no sleep mode on CPU; set vllm_enable_sleep_mode=False.")
        if self.sampler_precision == "nvfp4" and not self.calibration_prompts:
            raise ValueError(
                "sampler_precision='nvfp4' needs calibration_prompts for the activation global scales "
                "(e.g. the first 8-32 training prompts)."
            )
        collect_dropped_samplers()
        if not _LIVE:
            _FOUND.clear()
            _FOUND.update(_process_state())
        rendezvous = _process_state()["env"]
        self._join_colocated_ranks()
        self._write_structural_checkpoint()
        kernel_kwargs = self._choose_nvfp4_kernel()
        with _restored_env(rendezvous):  # read once, when the engine joins its group; left set, they would make
            self._start_engine(kernel_kwargs)  # every later Accelerator of this process a MULTI_CPU one
        self._shutdown = _own_engine_teardown(self, self.llm)
        try:
            self.direct_write_ok = self._direct_write_supported()
            self.kernel_report["weight_sync"] = ("direct write into the engine's layers after the first load "
                                                 "(triage_trl.sampler.direct_write)" if self.direct_write_ok[0] else
                                                 f"one reload_weights call ({self.direct_write_ok[1]})")
            if self.sampler_kernel is not None:
                check_sampler_kernel(self.sampler_kernel[0], self.kernel_report)
                self.kernel_report["nvfp4_sampler_kernel"] = "{} ({})".format(*self.sampler_kernel)
            # Weights whole on every rank (one process, DDP): load them now. Sharded or partitioned (FSDP2, ZeRO-3,
            # meta-device loading): the first sync loads them, after the trainer has prepared the model.
            whole = not (self._dist.is_fsdp or self._dist.is_zero3) and parameters_materialized(self.model)
            if all_ranks_agree(whole, self.accelerator):
                self._load_learner_weights()
            if self.enable_sleep_mode:
                self.llm.sleep(level=2)
            self._llm_weights_sleeping = self.enable_sleep_mode
        except BaseException:  # a start that fails after the engine started closes it
            self.close()
            raise
        logger.info("TRIAGE sampler kernels: %s", self.kernel_report)
        self.accelerator.wait_for_everyone()

    def _start_engine(self, kernel_kwargs: dict) -> None:
        self.llm, self.kernel_report = start_engine(
            self.checkpoint_dir,
            self.sampler_precision,
            tensor_parallel_size=self.tensor_parallel_size,
            gpu_memory_utilization=self.gpu_memory_utilization,
            max_model_len=self.max_model_length,
            max_num_seqs=self.max_num_seqs,
            enable_sleep_mode=self.enable_sleep_mode,
            model_impl=self.model_impl,
            distributed_executor_backend="external_launcher",
            seed=self.sampler_seed + self.accelerator.process_index // self.tensor_parallel_size,
            max_num_batched_tokens=4096,
            logprobs_mode="processed_logprobs",
            max_logprobs=-1,  # score_logps at T != 1 rescales full-vocabulary prompt log-probs
            trust_remote_code=self.trust_remote_code,
            load_format="dummy",  # the weights come from the learner, in memory: see _load_learner_weights
            **{**kernel_kwargs, **self.llm_kwargs},
        )

    def _direct_write_supported(self) -> tuple[bool, str]:
        from vllm.platforms import current_platform

        return direct_write_supported(
            model_class=self.llm.apply_model(lambda model: type(model).__name__)[0], on_cpu=current_platform.is_cpu(),
            enforce_eager=bool(self.llm.llm_engine.vllm_config.model_config.enforce_eager),
            tensor_parallel_size=self.tensor_parallel_size, sharded_learner=self._dist.is_fsdp or self._dist.is_zero3,
            sleep_mode=self.enable_sleep_mode)

    def _choose_nvfp4_kernel(self) -> dict:
        """Resolve ``nvfp4_sampler_kernel`` for this platform (``sampler.kernel_choice``), log it, and return the
        engine arguments that make vLLM run it (empty for a bf16 sampler)."""
        if self.sampler_precision != "nvfp4":
            return {}
        from vllm.platforms import current_platform

        device = "cpu" if current_platform.is_cpu() else "cuda"
        capability = None if device == "cpu" else current_platform.get_device_capability().to_int()
        choice = getattr(self.nvfp4_config, "nvfp4_sampler_kernel", "auto")
        self.sampler_kernel = resolve_sampler_kernel(choice, device, capability)
        logger.info("TRIAGE NVFP4 sampler kernel: %s (%s)", *self.sampler_kernel)
        return sampler_kernel_engine_kwargs(self.sampler_kernel[0], device)

    def _join_colocated_ranks(self) -> None:
        """What vLLM's ``external_launcher`` needs from a colocated rank (as TRL's colocate start does): tensor-parallel
        groups over consecutive ranks and the torch.distributed rendezvous variables."""
        from trl.trainer.utils import ensure_master_addr_port

        accelerator = self.accelerator
        if accelerator.num_processes % self.tensor_parallel_size:
            raise ValueError(
                f"tensor_parallel_size ({self.tensor_parallel_size}) must divide world size "
                f"({accelerator.num_processes}) evenly."
            )
        if self.tensor_parallel_size > 1:
            self.tp_group, _ = torch.distributed.new_subgroups_by_enumeration(
                [
                    list(range(i * self.tensor_parallel_size, (i + 1) * self.tensor_parallel_size))
                    for i in range(accelerator.num_processes // self.tensor_parallel_size)
                ]
            )
        os.environ["RANK"] = str(accelerator.process_index)
        os.environ["LOCAL_RANK"] = str(accelerator.local_process_index)
        os.environ["WORLD_SIZE"] = str(accelerator.num_processes)
        ensure_master_addr_port()

    def _write_structural_checkpoint(self) -> None:
        """The folder vLLM starts from: config (with the compressed-tensors quantisation config for NVFP4) and
        tokenizer, no weights (vLLM starts with ``load_format="dummy"``). Written by the local main process of each
        node into ``checkpoint_dir`` (node-local); the other ranks wait. Reads no parameter value, so it works on
        sharded, partitioned and meta-device models alike."""
        if self.sampler_precision == "nvfp4":
            from ..nvfp4.selection import nvfp4_layer_selection

            # computed once and stored on the model: the learner conversion reads the same object
            self.nvfp4_selection = nvfp4_layer_selection(self.model, self.nvfp4_config)
            from ..nvfp4.experts import check_sampler_nvfp4_experts

            check_sampler_nvfp4_experts(self.nvfp4_selection)  # before vLLM starts, with the remedy
        if self.accelerator.is_local_main_process:
            quantization_config = None
            if self.sampler_precision == "nvfp4":
                from ..nvfp4.checkpoint_tensors import nvfp4_quantization_config

                quantization_config = nvfp4_quantization_config(self.model, selection=self.nvfp4_selection)
            write_engine_checkpoint(self.checkpoint_dir, self.sampler_precision, (), _hf_config(self.model),
                                    _tokenizer_of(self.processing_class), quantization_config, dtype=sampler_dtype())
        self.accelerator.wait_for_everyone()

    def _load_learner_weights(self) -> None:
        """Calibrate the NVFP4 activation scales if due (identical on every rank), then load the learner's weights
        into the engine: after the first load, on a CPU engine that allows it, written into the layers directly
        (``direct_write.DirectWrite``) with anything else in one ``reload_weights`` call; otherwise all of them in
        one ``reload_weights`` call (a collective under FSDP2 and ZeRO-3)."""
        if self.sampler_precision == "nvfp4" and (self.input_global_scales is None or self.recalibrate_every_sync):
            self.input_global_scales = reduce_input_global_scales(self._calibrate(self.model), self.accelerator)
        if self._model_class is None:  # once: accelerate's is_peft_model walks every module (~15 ms, SmolLM2 + LoRA)
            self._model_class = type(_hf_model(self.model)).__name__
        copy_after = RELOAD_DIRECT_COPY.get(self._model_class)
        kept: list[tuple[str, torch.Tensor]] = []
        skip = self.frozen_vocab
        # Sharded learners gather a copy per sync; sleep mode (level 2) discards the engine's weights.
        skip.plan(self.model, enabled=not (self._dist.is_fsdp or self._dist.is_zero3 or self.enable_sleep_mode))
        writer = self.direct_write
        writer.reset()
        direct = self._engine_loaded and self.direct_write_ok[0]
        # Written directly, an NVFP4 layer takes the values the export's quantisation pass computed (no decode)
        values = (DequantisedWeights(self.llm.llm_engine.model_config.dtype)
                  if direct and self.sampler_precision == "nvfp4" else None)
        weights = self._iter_sampler_weights(copy_after, kept, skip, values)
        if direct:  # the rest (often nothing) goes through the reload below
            weights = iter(self.llm.apply_model(
                lambda model: writer.write(model, weights, skip.skipped, values.by_name if values else None))[0])
        if not direct or writer.passed_on:
            with skip.quiet_reload(), writer.quiet_reload():
                self.llm.collective_rpc("reload_weights",
                                        kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
        if kept:  # after the reload, outside its wrapped loaders (see RELOAD_DIRECT_COPY)
            self.llm.apply_model(lambda model: sorted(model.load_weights(iter(kept))))
        from .cpu_reload import after_cpu_reload

        # vLLM 0.31 CPU: a tied lm_head (when the embedding was sent) and MoE experts go stale on reload
        self.llm.apply_model(functools.partial(after_cpu_reload, lm_heads=skip.input_embedding_sent))
        self.llm.reset_prefix_cache()
        skip.commit()
        self._engine_loaded = True

    @torch.no_grad()
    def _calibrate(self, model) -> dict[str, torch.Tensor]:
        from ..nvfp4.calibration import calibrate_input_global_scales

        return calibrate_input_global_scales(model, _tokenizer_of(self.processing_class), self.calibration_texts(),
                                             selection=self.nvfp4_selection)

    def calibration_texts(self) -> list[str]:
        """The calibration prompts as the text the NVFP4 activation scales are calibrated on (chats rendered with
        the chat template, token ids decoded); the run folder records them for ``triage-export``.

        Raises:
            ValueError: a prompt is neither a string, a list of token ids nor a chat.
        """
        return [self._prompt_text(p) for p in self.calibration_prompts]

    def _prompt_text(self, prompt) -> str:
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, dict) and "prompt" in prompt:
            return self._prompt_text(prompt["prompt"])
        if isinstance(prompt, Sequence) and prompt and all(isinstance(t, int) for t in prompt):
            return _tokenizer_of(self.processing_class).decode(list(prompt))
        if isinstance(prompt, Sequence) and prompt and all(isinstance(m, dict) for m in prompt):
            return self.processing_class.apply_chat_template(list(prompt), tokenize=False, add_generation_prompt=True)
        raise ValueError(
            f"Cannot use calibration prompt {prompt!r}: give a string, a list of token ids or a chat "
            "(list of {'role', 'content'} dicts)."
        )

    # ------------------------------------------------------------------ sync

    def _iter_sampler_weights(self, keep: re.Pattern | None = None, kept: list | None = None,
                              skip: FrozenVocabSkip | None = None, values: DequantisedWeights | None = None
                              ) -> Iterator[tuple[str, torch.Tensor]]:
        """Checkpoint-format weights for vLLM, as the engine stores them (NVFP4-packed, re-quantised now, or bf16),
        one decoder block made whole at a time (``triage_trl.nvfp4.checkpoint_tensors.iter_checkpoint_weights``),
        less what ``skip`` leaves out (``frozen_vocab.FrozenVocabSkip.filter``, before any cast); a copy of each
        tensor whose name matches ``keep`` is appended to ``kept``; each NVFP4 linear's dequantised weight is left
        in ``values`` when given."""
        from ..nvfp4.checkpoint_tensors import iter_checkpoint_weights

        weights = iter_checkpoint_weights(
            self.model, selection=self.nvfp4_selection, input_global_scales=self.input_global_scales,
            dequantised=values,
        )
        if skip is not None:
            weights = skip.filter(weights)
        for name, tensor in sampler_tensors(weights, self.llm.llm_engine.model_config.dtype):
            if keep is not None and keep.search(name):
                kept.append((name, tensor.detach().clone()))
            yield name, tensor

    @torch.no_grad()
    def sync_weights(self):
        """Load the learner's current weights into vLLM in one ``reload_weights`` call; reset the prefix cache; run
        :attr:`on_sync`.

        NVFP4: the weights are re-quantised (activation scales from the first load unless ``recalibrate_every_sync``);
        vLLM re-runs each layer's ``process_weights_after_loading``, which refreshes the fast CPU kernel's
        dequantised weights. PEFT models send merged weights (LoRA deltas added in float32). The reload runs on
        the worker (``LLM.collective_rpc``), inside vLLM's config context. A collective under FSDP2 and ZeRO-3:
        every rank calls it (TRL's ``_generate`` does).
        """
        if self.mode != "colocate":
            raise ValueError("TriageVLLMGeneration.sync_weights supports vllm_mode='colocate' only.")
        self._require_engine()
        if self.enable_sleep_mode:
            self.llm.wake_up(tags=["weights"])
            self._llm_weights_sleeping = False
        self._load_learner_weights()
        self.num_syncs += 1
        if self.on_sync is not None:
            self.on_sync()

    # ------------------------------------------------------------------ close

    def close(self) -> None:
        """Shut the in-process vLLM engine down and drop it, so another engine can start in this process; a second
        call does nothing.

        vLLM 0.31's own teardown (``EngineCore.shutdown``: executor and scheduler shutdown), run now. vLLM's parallel
        groups and torch.distributed's default group are process globals that every engine of the process shares:
        they are destroyed (``cleanup_dist_env_and_memory``) only when the last engine of the process shuts down,
        which then puts the process back as the first engine found it (the rendezvous variables the colocated start
        sets, torch's thread count). A sampler dropped without ``close()`` shuts down the same way when it is
        collected (at the latest when the next sampler starts), so it never ends another engine's groups. In a
        multi-process run, close only at the end (after saving and pushing).
        """
        self.llm = None
        shutdown = getattr(self, "_shutdown", None)
        if shutdown is not None and shutdown.alive:
            shutdown()  # runs once
            _collect_shut_down_engines()  # the core holds itself in cycles: only a full collection frees its memory

    def _require_engine(self) -> None:
        if getattr(self, "llm", "unset") is None:
            raise RuntimeError(
                "This sampler's vLLM engine was closed (by close(), or because a newer trainer in this process started "
                "its own engine): build a new trainer to generate again."
            )

    def generate(self, *args, **kwargs):
        self._require_engine()
        return super().generate(*args, **kwargs)

    # ------------------------------------------------------------------ probe

    @torch.no_grad()
    def score_logps(self, token_ids_list: Sequence[Sequence[int]], temperature: float | None = None) -> list[list[float]]:
        """The sampler's log-probs of given token sequences (for the sync probe).

        Args:
            token_ids_list: sequences of token ids, each of length ``L >= 2``.
            temperature: scoring temperature; defaults to the sampling temperature (what TRL's learner uses).
                At 1.0 vLLM's prompt log-probs are used as they are; otherwise the full-vocabulary prompt
                log-probs are rescaled, ``log_softmax(logp / T)``, which equals ``log_softmax(logits / T)``.

        Returns:
            One list of ``L - 1`` floats (nats) per sequence: ``log p(t_i | t_<i)`` for ``i = 1 .. L-1``. The call
            draws no random number (the engine's sampling generator is left as it was).

        Raises:
            ValueError: a sequence has fewer than 2 tokens, or ``temperature <= 0``.
        """
        from vllm import SamplingParams

        temp = self.temperature if temperature is None else float(temperature)
        if not temp > 0:
            raise ValueError(f"score_logps needs temperature > 0, got {temp}.")
        for ids in token_ids_list:
            if len(ids) < 2:
                raise ValueError("score_logps needs sequences of at least 2 tokens (the first one is not scored).")
        full = temp != 1.0
        params = SamplingParams(
            max_tokens=1,
            # Prompt log-probs skip the sampling processors; a greedy pick of the one token vLLM must generate draws
            # no random number, so the rollouts after a probe are the ones without it, whatever the probe schedule.
            temperature=0.0,
            prompt_logprobs=-1 if full else 0,
            detokenize=False,
            flat_logprobs=True,
        )
        prompts = [{"prompt_token_ids": list(map(int, ids))} for ids in token_ids_list]
        if self.enable_sleep_mode:  # the probe runs on a fully awake engine (TRL's generate sleeps it again)
            self.llm.wake_up(tags=["kv_cache"])
        outputs = self.llm.generate(prompts, sampling_params=params, use_tqdm=False)
        result = []
        for ids, out in zip(token_ids_list, outputs, strict=True):
            flat = out.prompt_logprobs
            row = []
            for pos in range(1, len(ids)):
                start, end = flat.start_indices[pos], flat.end_indices[pos]
                token_ids = flat.token_ids[start:end]
                logps = flat.logprobs[start:end]
                if token_ids[0] != ids[pos]:
                    raise RuntimeError(f"vLLM scored token {token_ids[0]} at position {pos}, expected {ids[pos]}.")
                if not full:
                    row.append(float(logps[0]))
                    continue
                vocab = torch.tensor(logps[1:], dtype=torch.float64) / temp
                row.append(float(logps[0] / temp - torch.logsumexp(vocab, dim=0)))
            result.append(row)
        return result


def collect_dropped_samplers() -> None:
    """Collect samplers whose trainers were dropped without ``close()`` (TRL's users and tests never call it), so
    their engines shut down now, before the next engine starts; warn, naming ``close()``, about engines still held
    (each keeps its KV cache until its trainer is closed or dropped). Collects only while an engine runs or one shut
    down since the last collection (a full collection costs about 0.45 s in a process that has imported torch,
    transformers and vLLM). Freezes the heap after collecting, as the engine about to start does first thing
    (vLLM's ``freeze_gc_heap``: a full collection, then ``gc.freeze``), so that its full collection walks only what
    the start allocates instead of the whole heap a second time."""
    if not (_LIVE or _uncollected):
        return
    _collect_shut_down_engines()
    gc.freeze()
    if _LIVE:
        warnings.warn(
            f"{len(_LIVE)} vLLM engine(s) of earlier TRIAGE trainers still run in this process, each holding its KV "
            "cache; they keep working next to the new one. Call trainer.close() (or use `with "
            "TriageGRPOTrainer(...) as trainer:`) when a trainer is done.",
            stacklevel=3,
        )


def _collect_shut_down_engines() -> None:
    """A full collection that can free a trainer dropped while an engine ran: vLLM 0.31's engine start
    (``EngineCore.__init__``: ``freeze_gc_heap``) moves every object then alive, the trainers of the process included,
    into the permanent generation, which ``gc.collect`` never examines; only an engine's shutdown unfreezes it
    (``EngineCore.shutdown``). Unfrozen first, so a dropped trainer is found (measured: without it, every dropped
    trainer's engine kept running, four after four trainer starts). A dropped sampler's engine shuts down inside
    the collection (its finalizer), still referenced by the shutdown, so a second collection frees it (its KV cache
    before the next engine allocates one)."""
    global _uncollected
    _uncollected = False
    gc.unfreeze()
    gc.collect()
    if _uncollected:
        _uncollected = False
        gc.collect()


def _own_engine_teardown(owner, llm) -> weakref.finalize:
    """Replace vLLM's teardown of ``llm`` (run by a finalizer when it is collected, destroying the process-wide
    parallel groups whichever engine they now serve) with one run by :meth:`TriageVLLMGeneration.close` or when
    ``owner`` is collected: shut this engine down, and tear the groups down only if no other engine is left."""
    client = llm.llm_engine.engine_core  # vLLM's InprocClient (the engine core runs in this process)
    finalizer = getattr(client, "_finalizer", None)
    if finalizer is not None:
        finalizer.detach()
    token = id(owner)
    _LIVE.add(token)
    return weakref.finalize(owner, _shutdown_engine, client.engine_core, token)


def _shutdown_engine(core, token: int) -> None:
    import vllm.v1.engine.core as core_module

    global _uncollected
    _LIVE.discard(token)
    _uncollected = True  # the core stays referenced until this returns: freed by the next full collection
    with _shutdown_collections_deferred() as deferred:
        if _LIVE:  # other engines still use the shared groups: shut this one down without destroying them
            cleanup = core_module.cleanup_dist_env_and_memory

            def cleanup_if_last(*args, **kwargs):  # decided when called: a collection inside may end the others
                if not _LIVE:
                    return cleanup(*args, **kwargs)
                if not deferred:
                    gc.collect()

            core_module.cleanup_dist_env_and_memory = cleanup_if_last
            try:
                core.shutdown()
            finally:
                core_module.cleanup_dist_env_and_memory = cleanup
            return
        core.shutdown()  # the last engine: vLLM's full teardown, then the process as the first engine found it
    if _FOUND:
        _restore_process_state(_FOUND)


# vLLM 0.31 modules whose shutdown code runs a full collection (`gc.collect()`): the model runner's KV-cache cleanup
# and `cleanup_dist_env_and_memory`. Both run while the engine core is still referenced (by the shutdown itself), so
# they cannot free it; `close()`'s one collection afterwards does.
_SHUTDOWN_COLLECTORS = ("vllm.v1.worker.gpu_model_runner", "vllm.distributed.parallel_state")


@contextlib.contextmanager
def _shutdown_collections_deferred() -> Iterator[bool]:
    """On vLLM's CPU platform, make vLLM's full collections inside an engine's shutdown no-ops for the block (two,
    each about 0.45 s with torch, transformers and vLLM imported); the garbage they would free is freed by the
    collection after the shutdown: ``close()``'s, or for a sampler dropped without ``close()`` the next engine's
    start (``collect_dropped_samplers``). Elsewhere (GPU) vLLM's order is kept: its collections precede
    ``empty_cache``."""
    import importlib

    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        yield False
        return
    modules = [importlib.import_module(name) for name in _SHUTDOWN_COLLECTORS]
    found = [module for module in modules if getattr(module, "gc", None) is gc]
    for module in found:
        module.gc = _NO_COLLECT_GC
    try:
        yield True
    finally:
        for module in found:
            module.gc = gc


class _NoCollectGC:
    """The ``gc`` module with ``collect`` a no-op (see :func:`_shutdown_collections_deferred`)."""

    @staticmethod
    def collect(*args, **kwargs) -> int:
        return 0

    def __getattr__(self, name):
        return getattr(gc, name)


_NO_COLLECT_GC = _NoCollectGC()


_RENDEZVOUS_SET = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _process_state() -> dict:
    """What an engine's start changes in the process and the last engine's shutdown puts back."""
    return {"env": {k: os.environ.get(k) for k in _RENDEZVOUS_SET}, "threads": torch.get_num_threads()}


@contextlib.contextmanager
def _restored_env(values: dict):
    try:
        yield
    finally:
        for key, value in values.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _restore_process_state(found: dict) -> None:
    for key, value in found["env"].items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    torch.set_num_threads = torch._C.set_num_threads  # vLLM's CPU worker leaves a no-op in its place
    torch.set_num_threads(found["threads"])


def _tokenizer_of(processing_class):
    return getattr(processing_class, "tokenizer", None) or processing_class


def _hf_model(model):
    return model.get_base_model() if is_peft_model(model) else model


def _hf_config(model):
    if is_peft_model(model):
        model = model.get_base_model()
    return model.config
