"""Generation backends of the evaluator: in-process vLLM (CPU or GPU) and transformers, in bf16 or NVFP4.

Both take tokenised prompts and return decoded completions, ``n`` per prompt:

* :class:`VLLMBackend` - ``vllm.LLM`` in this process, started by the project's one engine start
  (``triage_trl.sampler.vllm_engine.start_engine``). ``precision="nvfp4"`` serves the same compressed-tensors
  ``nvfp4-pack-quantized`` checkpoint the TRIAGE sampler serves (activation global scales calibrated on the first
  benchmark prompts, written by ``write_engine_checkpoint``); on vLLM's CPU platform that needs the engine core in
  this process: run inside ``triage_trl.runtime.vllm_process_settings()`` (``evaluate`` and ``triage-eval`` do).
* :class:`TransformersBackend` - ``model.generate`` in bf16; ``precision="nvfp4"`` converts the
  decoder linears with ``triage_trl.nvfp4.learner.convert_to_nvfp4_learner`` (the learner's W4A4
  path: native on sm100 GPUs, exact emulation elsewhere).

Greedy decoding is ``temperature=0``.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

from ..nvfp4.config import PRECISIONS
from ..sampler.vllm_engine import start_engine, write_engine_checkpoint

logger = logging.getLogger(__name__)

__all__ = ["BACKENDS", "PRECISIONS", "TransformersBackend", "VLLMBackend"]

BACKENDS = ("vllm", "transformers")


def _check(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; use one of {', '.join(PRECISIONS)}")


def _load_hf_model(model_path: str, device: str | None = None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16)
    if device is not None:
        model.to(device)
    return model.eval()


class VLLMBackend:
    """In-process ``vllm.LLM`` serving ``model_path`` in bf16, or its NVFP4 export.

    Args:
        model_path: a transformers model folder (or Hub id).
        precision: ``"bf16"`` or ``"nvfp4"``.
        tokenizer: the model's tokenizer (saved into the NVFP4 checkpoint).
        max_model_len: prompt + completion tokens per sequence (keep it small on CPU: it sizes the KV cache).
        seed: engine seed.
        calibration_prompts: rendered prompt strings for the NVFP4 activation scales (required for nvfp4).
        checkpoint_dir: where the NVFP4 checkpoint is written (default: a temporary folder removed with the backend).
        llm_kwargs: extra ``vllm.LLM`` arguments (override the defaults).

    Raises:
        ValueError: unknown precision, nvfp4 without calibration prompts, or NVFP4 on CPU with the engine core in a
            subprocess (see ``start_engine``).
    """

    name = "vllm"

    def __init__(
        self,
        model_path: str,
        *,
        precision: str = "bf16",
        tokenizer=None,
        max_model_len: int = 2048,
        seed: int = 0,
        calibration_prompts: Sequence[str] | None = None,
        checkpoint_dir: str | os.PathLike | None = None,
        llm_kwargs: dict | None = None,
    ):
        _check(precision)
        self.precision = precision
        self._tmp = None
        served = model_path
        if precision == "nvfp4":
            if not calibration_prompts:
                raise ValueError("precision='nvfp4' needs calibration_prompts for the activation global scales.")
            served = str(self._export_nvfp4(model_path, tokenizer, calibration_prompts, checkpoint_dir))
        self.llm, self.kernel_report = start_engine(
            served, precision, seed=seed, max_model_len=max_model_len,
            max_num_batched_tokens=max(4096, max_model_len), **(llm_kwargs or {}),
        )
        self.served_path = served

    def _export_nvfp4(self, model_path, tokenizer, prompts, checkpoint_dir) -> Path:
        from ..nvfp4.checkpoint_tensors import calibrate_input_global_scales, iter_nvfp4_checkpoint_weights, nvfp4_quantization_config

        if checkpoint_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="triage-eval-nvfp4-")
            checkpoint_dir = self._tmp.name
        model = _load_hf_model(model_path)
        with torch.no_grad():
            scales = calibrate_input_global_scales(model, tokenizer, list(prompts))
            out = write_engine_checkpoint(checkpoint_dir, "nvfp4", iter_nvfp4_checkpoint_weights(model, scales),
                                          model.config, tokenizer, nvfp4_quantization_config(model))
        del model
        return out

    def generate(
        self, prompt_ids: Sequence[Sequence[int]], *, n: int, temperature: float, max_new_tokens: int,
        seeds: Sequence[int],
    ) -> list[list[str]]:
        """``n`` completions per prompt (``temperature=0``: greedy, ``n`` must be 1); one vLLM seed per prompt."""
        from vllm import SamplingParams

        params = [
            SamplingParams(n=n, temperature=temperature, max_tokens=max_new_tokens, seed=int(s)) for s in seeds
        ]
        outputs = self.llm.generate(
            [{"prompt_token_ids": list(ids)} for ids in prompt_ids], params, use_tqdm=False
        )
        return [[c.text for c in out.outputs] for out in outputs]


class TransformersBackend:
    """``transformers`` ``generate`` in bf16, or with the NVFP4 learner's W4A4 linears.

    Args:
        model_path: a transformers model folder (or Hub id); ``None`` with ``model``.
        precision: ``"bf16"`` or ``"nvfp4"`` (``convert_to_nvfp4_learner``, native where available); ``"bf16"``
            with ``model`` (used as it is).
        tokenizer: the model's tokenizer (its pad token, or eos, pads on the left).
        device: torch device (default: CUDA when available, else CPU).
        batch_size: prompts per ``generate`` call.
        model: a loaded causal LM to generate with instead of loading ``model_path`` (not converted, not moved).

    Raises:
        ValueError: unknown precision, or ``"nvfp4"`` with ``model``.
    """

    name = "transformers"

    def __init__(self, model_path: str | None, *, precision: str = "bf16", tokenizer=None, device: str | None = None,
                 batch_size: int = 16, model=None):
        _check(precision)
        if model is not None and precision != "bf16":
            raise ValueError(f"TransformersBackend(model=...) generates with the model as it is: precision "
                             f"{precision!r} would need a conversion; pass model_path instead.")
        self.precision = precision
        if model is not None:  # a model already in memory (e.g. a trainer's learner, as it is)
            self.device = str(next(model.parameters()).device)
            self.model = model
        else:
            self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
            self.model = _load_hf_model(model_path, self.device)
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.kernel_report = {"platform": self.device, "precision": precision,
                              "dtype": str(next(self.model.parameters()).dtype).removeprefix("torch.")}
        if precision == "nvfp4":
            from ..nvfp4.learner import convert_to_nvfp4_learner, learner_execution_summary

            convert_to_nvfp4_learner(self.model)
            counts = learner_execution_summary(self.model)
            self.kernel_report["linear_kernels"] = ", ".join(f"{k}={v}" for k, v in counts.items())
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if pad is None:
            raise ValueError("the tokenizer has neither a pad nor an eos token: set tokenizer.pad_token.")
        self.pad_id = pad
        eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        gen_eos = getattr(self.model.generation_config, "eos_token_id", None)
        eos |= set(gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos] if gen_eos is not None else [])
        self.eos_ids = sorted(eos)

    @torch.no_grad()
    def generate(
        self, prompt_ids: Sequence[Sequence[int]], *, n: int, temperature: float, max_new_tokens: int,
        seeds: Sequence[int],
    ) -> list[list[str]]:
        """``n`` completions per prompt, left-padded batches of ``batch_size``; ``torch.manual_seed(seeds[i])`` per batch,
        inside a forked RNG state: the caller's torch generators are left as they were (a sampler or trainer in the
        same process keeps its random stream)."""
        device = torch.device(self.device)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            return self._generate(prompt_ids, n=n, temperature=temperature, max_new_tokens=max_new_tokens,
                                  seeds=seeds)

    def _generate(self, prompt_ids, *, n, temperature, max_new_tokens, seeds) -> list[list[str]]:
        out: list[list[str]] = []
        for start in range(0, len(prompt_ids), self.batch_size):
            batch = [list(p) for p in prompt_ids[start : start + self.batch_size]]
            width = max(len(p) for p in batch)
            ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in batch], device=self.device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=self.device)
            torch.manual_seed(int(seeds[start]))
            kwargs = dict(do_sample=False) if temperature == 0 else dict(do_sample=True, temperature=temperature,
                                                                          top_k=0, top_p=1.0)
            gen = self.model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, num_return_sequences=n,
                pad_token_id=self.pad_id, eos_token_id=self.eos_ids, **kwargs,
            )
            texts = self.tokenizer.batch_decode(gen[:, width:], skip_special_tokens=True)
            out += [texts[i * n : (i + 1) * n] for i in range(len(batch))]
        return out
