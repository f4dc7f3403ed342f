"""The colocated vLLM sampler of TRIAGE: bf16 or NVFP4 weights, one-call weight sync, probe scoring.

``TriageVLLMGeneration`` is TRL 1.16's ``VLLMGeneration`` (colocate mode) with three changes:

* **start** (``_init_vllm``): the current policy is written to ``checkpoint_dir`` (NVFP4: a
  compressed-tensors ``nvfp4-pack-quantized`` checkpoint from ``triage_trl.nvfp4.export``, with
  activation global scales calibrated on ``calibration_prompts``; bf16: a plain checkpoint) and
  ``vllm.LLM`` starts on it in this process with ``logprobs_mode="processed_logprobs"`` and
  ``dtype=bfloat16``. On the vLLM CPU platform the NVFP4 layers run
  :class:`~triage_trl.sampler.cpu_kernel.FastCpuNvFp4LinearKernel`; on GPUs vLLM picks its own
  kernel. :attr:`kernel_report` records which linear kernels and precisions really run.
* **sync** (``sync_weights``): every weight, in checkpoint format (re-quantised to NVFP4 for the
  NVFP4 sampler), goes to vLLM in ONE ``model_runner.reload_weights(weights_iterator=...,
  is_checkpoint_format=True)`` call, then the prefix cache is reset. TRL's per-tensor
  ``load_weights`` sync fails on the vLLM CPU build and cannot re-quantise; one tensor per reload
  call silently corrupts the model (each call re-initialises the layers it does not see).
* **probe** (``score_logps``): the sampler's log-probs of given token sequences (vLLM prompt
  log-probs at the sampling temperature) for the trainer's sync probe.

Sampling settings. TRL's learner computes ``log_softmax(logits / temperature)`` and nothing else,
while vLLM's processed log-probs are taken *after* penalties, top-k/top-p/min-p truncation, logit
bias, bad words, min-tokens and structured-output masks. Any of those makes the two log-probs
differ by construction (a truncated, renormalised or penalised distribution), which TRIAGE would
read as sampler/learner mismatch. They are refused at start with a ``ValueError`` naming the
setting; ``temperature <= 0`` (greedy, whose log-probs vLLM does not scale) is refused too.

Source: TRL 1.16 ``trl/generation/vllm_generation.py``; vLLM 0.31 ``gpu_model_runner.reload_weights``
and ``v1/sample/sampler.py``; TRIAGE issue 4 (deliverable 3).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from accelerate.utils import is_peft_model
from trl.generation.vllm_generation import VLLMGeneration

from ..nvfp4.config import PRECISIONS
from .vllm_utils import (
    SAMPLER_DTYPE,
    check_comparable_sampling,
    finish_sampler_checkpoint,
    inspect_kernels,
    model_runner,
    needs_cast,
    start_llm,
    to_sampler_dtype,
)

logger = logging.getLogger(__name__)

__all__ = ["SAMPLER_PRECISIONS", "TriageVLLMGeneration", "check_comparable_sampling"]

SAMPLER_PRECISIONS = PRECISIONS



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
        checkpoint_dir: folder for the checkpoint vLLM starts from (created; overwritten).
        llm_kwargs: extra ``vllm.LLM`` arguments, overriding ours (e.g. ``enforce_eager``,
            ``kv_cache_memory_bytes``). On CPU ``enforce_eager`` defaults to ``True``.
        recalibrate_every_sync: NVFP4 only. ``False`` (default): keep the activation scales calibrated at start,
            as a deployed static-scale checkpoint does; a sync without a weight change then leaves the sampler
            bit-identical (activations growing past the calibrated range clip). ``True``: recalibrate on the current
            learner before each sync, as a fresh export would (one learner forward per calibration prompt); on a
            135M W4A4 model this alone moves greedy outputs, since each calibration sees the previous scales.

        sampler_seed: vLLM's seed is ``sampler_seed + process_index // tensor_parallel_size`` (TRL seeds with the
            rank term only, so every run would sample alike; the trainer passes ``args.seed``).
        nvfp4_config: the NVFP4 settings (``NVFP4Config``; the trainer passes its args): the NVFP4 layer selection
            the export uses (``triage_trl.nvfp4.selection``; the learner's own when it was converted).

    Attributes:
        kernel_report: ``dict[str, str]`` — platform, precision, dtype, which linear kernels run (class names with
            layer counts), GEMM path and activation precision, read from the loaded vLLM model.
        input_global_scales: NVFP4 activation global scales (``{hf_linear_name: 0-dim fp32}``), or ``None``.
        num_syncs: completed ``sync_weights`` calls.

    Raises:
        ValueError: unknown ``sampler_precision``, ``mode != "colocate"``, no calibration prompts for NVFP4, or
            sampling settings refused by :func:`check_comparable_sampling`.
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
        self.kernel_report: dict[str, str] = {}
        self.input_global_scales: dict[str, torch.Tensor] | None = None
        self.num_syncs = 0
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
        check_comparable_sampling(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            generation_kwargs=self.generation_kwargs,
            structured_outputs_regex=self.structured_outputs_regex,
        )
        if self.sampler_precision == "nvfp4" and not self.calibration_prompts:
            raise ValueError(
                "sampler_precision='nvfp4' needs calibration_prompts for the activation global scales "
                "(e.g. the first 8-32 training prompts)."
            )
        accelerator = self.accelerator
        if not accelerator.num_processes % self.tensor_parallel_size == 0:
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
        from trl.trainer.utils import ensure_master_addr_port

        ensure_master_addr_port()

        # Every rank computes the export (collectives under ZeRO-3); the main process writes it.
        self._write_checkpoint()
        accelerator.wait_for_everyone()

        on_cpu = current_platform.is_cpu()
        if self.sampler_precision == "nvfp4" and on_cpu:
            from .cpu_kernel import register_fast_cpu_nvfp4_kernel

            register_fast_cpu_nvfp4_kernel()

        kwargs = dict(
            model=str(self.checkpoint_dir),
            tokenizer=str(self.checkpoint_dir),
            dtype=SAMPLER_DTYPE,
            tensor_parallel_size=self.tensor_parallel_size,
            gpu_memory_utilization=self.gpu_memory_utilization,
            max_model_len=self.max_model_length,
            max_num_seqs=self.max_num_seqs,
            enable_sleep_mode=self.enable_sleep_mode,
            model_impl=self.model_impl,
            distributed_executor_backend="external_launcher",
            seed=self.sampler_seed + accelerator.process_index // self.tensor_parallel_size,
            max_num_batched_tokens=4096,
            logprobs_mode="processed_logprobs",
            trust_remote_code=self.trust_remote_code,
        )
        kwargs["max_logprobs"] = -1  # score_logps at T != 1 rescales full-vocabulary prompt log-probs
        if on_cpu:
            kwargs["enforce_eager"] = True
        kwargs.update(self.llm_kwargs)

        self.llm = start_llm(**kwargs)
        if self.enable_sleep_mode:
            self.llm.sleep(level=2)
        self._llm_weights_sleeping = self.enable_sleep_mode
        self.kernel_report = inspect_kernels(self.llm, self.sampler_precision, self.checkpoint_dir)
        logger.info("TRIAGE sampler kernels: %s", self.kernel_report)
        accelerator.wait_for_everyone()

    def _write_checkpoint(self) -> None:
        write = self.accelerator.is_main_process
        out = self.checkpoint_dir
        if self.sampler_precision == "nvfp4":
            from ..nvfp4.export import save_nvfp4_checkpoint
            from ..nvfp4.selection import nvfp4_layer_selection

            model = self._unwrapped_for_export()
            self.nvfp4_selection = nvfp4_layer_selection(model, self.nvfp4_config)  # stored on the model: once
            self.input_global_scales = self._calibrate(model)
            with self._gathered():
                if write:
                    save_nvfp4_checkpoint(model, _tokenizer_of(self.processing_class), out, self.input_global_scales)
        else:
            tensors = {name: to_sampler_dtype(t).to("cpu").contiguous().clone() for name, t in self._iter_named_params()}
            if write:
                from safetensors.torch import save_file

                out.mkdir(parents=True, exist_ok=True)
                save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
                config = _hf_config(self.model)
                config.save_pretrained(out)
                _tokenizer_of(self.processing_class).save_pretrained(out)
        if write:
            finish_sampler_checkpoint(out)

    @torch.no_grad()
    def _calibrate(self, model) -> dict[str, torch.Tensor]:
        from ..nvfp4.export import calibrate_input_global_scales

        prompts = [self._prompt_text(p) for p in self.calibration_prompts]
        return calibrate_input_global_scales(model, _tokenizer_of(self.processing_class), prompts)

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

    def _unwrapped_for_export(self):
        if self._dist.is_fsdp:
            raise NotImplementedError(
                "The NVFP4 sampler export reads full (unsharded) weights; FSDP is not supported with "
                "sampler_precision='nvfp4'. Use DDP or DeepSpeed ZeRO-2/3, or sampler_precision='bf16'."
            )
        return self.model

    @contextlib.contextmanager
    def _gathered(self):
        """Gather ZeRO-3 partitioned parameters (a no-op otherwise) around an export."""
        with self._dist.gather_params(list(self.model.parameters())):
            yield

    def _model_runner(self):
        return model_runner(self.llm)

    # ------------------------------------------------------------------ sync

    def _iter_sampler_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Checkpoint-format weights for vLLM: NVFP4-packed (re-quantised now) or bf16, all of them."""
        if self.sampler_precision == "bf16":
            for name, tensor in self._iter_named_params():
                yield name, to_sampler_dtype(tensor)
            return
        from ..nvfp4.export import iter_nvfp4_checkpoint_weights

        model = self._unwrapped_for_export()
        if self.recalibrate_every_sync:
            self.input_global_scales = self._calibrate(model)
        with self._gathered():
            for name, tensor in iter_nvfp4_checkpoint_weights(model, self.input_global_scales):
                yield name, (to_sampler_dtype(tensor) if needs_cast(name, tensor) else tensor)

    @torch.no_grad()
    def sync_weights(self):
        """Load the learner's current weights into vLLM in one ``reload_weights`` call; reset the prefix cache.

        NVFP4: the weights are re-quantised (``iter_nvfp4_checkpoint_weights``, activation scales from start);
        vLLM re-runs each layer's ``process_weights_after_loading``, which refreshes the fast CPU kernel's
        dequantised weights. PEFT models send merged weights (adapters merged, then unmerged).
        """
        if self.mode != "colocate":
            raise ValueError("TriageVLLMGeneration.sync_weights supports vllm_mode='colocate' only.")
        if self.enable_sleep_mode:
            self.llm.wake_up(tags=["weights"])
            self._llm_weights_sleeping = False
        self._model_runner().reload_weights(weights_iterator=self._iter_sampler_weights(), is_checkpoint_format=True)
        self.llm.reset_prefix_cache()
        self.num_syncs += 1

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
            One list of ``L - 1`` floats (nats) per sequence: ``log p(t_i | t_<i)`` for ``i = 1 .. L-1``.

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
            temperature=1.0,
            prompt_logprobs=-1 if full else 0,
            detokenize=False,
            flat_logprobs=True,
        )
        prompts = [{"prompt_token_ids": list(map(int, ids))} for ids in token_ids_list]
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


def _tokenizer_of(processing_class):
    return getattr(processing_class, "tokenizer", None) or processing_class


def _hf_config(model):
    if is_peft_model(model):
        model = model.get_base_model()
    return model.config
