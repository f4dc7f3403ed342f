"""What ``TriageGRPOTrainer`` checks before TRL loads the model: the output folder and the prompts.

* the output folder can be written and has room for one checkpoint
  (``triage_trl.runtime.run_folder.check_output_dir``);
* the main process takes the folder's run lock (``triage_trl.runtime.run_folder.RunLock``), so a second live run on
  the same ``output_dir`` is refused; the lock is released when the trainer is garbage-collected or the process exits;
* ``triage_shared_prompt_forward=True`` is refused for a model it cannot serve (``check_shared_prompt_forward``);
* every prompt of ``train_dataset``/``eval_dataset`` and of the calibration prompts is non-empty text (or chat
  messages) and fits the sampler's context (``triage_trl.runtime.preflight.check_prompts``).

Launch configurations: single process, DDP, FSDP2, ZeRO; the checks run on every process (read-only), the lock is
taken by the main process only (``args.should_save``).
"""

from __future__ import annotations

import weakref

from ..runtime.preflight import check_prompts, context_tokens, dataset_prompts
from ..runtime.run_folder import RunLock, check_output_dir, checkpoint_bytes, existing_run, model_bytes


def _model_config_and_tokenizer(model, processing_class):
    """The model's config and tokenizer without loading its weights (``None`` for what cannot be had)."""
    config = getattr(model, "config", None)
    tokenizer = getattr(processing_class, "tokenizer", None) or processing_class
    if isinstance(model, str):
        from transformers import AutoConfig, AutoTokenizer

        try:
            config = AutoConfig.from_pretrained(model)
            if tokenizer is None:
                tokenizer = AutoTokenizer.from_pretrained(model)
        except (OSError, ValueError):  # TRL raises its own error for a model it cannot find
            return config, tokenizer if callable(tokenizer) else None
    return config, tokenizer if callable(tokenizer) else None


def check_run_inputs(model, args, *, train_dataset=None, eval_dataset=None, calibration_prompts=None,
                     processing_class=None) -> list[str]:
    """Check the output folder and the prompts of a run before its model loads.

    Returns:
        What ``args.output_dir`` already held (``checkpoint-N``, ``trainer_state.json``): a new run there is refused
        at ``train()`` unless it resumes.

    Raises:
        triage_trl.runtime.run_folder.OutputFolderError: a read-only or full output folder.
        triage_trl.runtime.preflight.PromptError: an empty, non-text or too long prompt (names the data set and row).
    """
    weights = model_bytes(model)
    needed = checkpoint_bytes(weights, save_only_model=args.save_only_model) if weights else None
    check_output_dir(args.output_dir, needed_bytes=needed if args.save_strategy != "no" else weights)
    config, tokenizer = _model_config_and_tokenizer(model, processing_class)
    if args.triage_shared_prompt_forward and config is not None:
        check_shared_prompt_forward(config, _attn_implementation(model, args, config))
    context = context_tokens(args, config)
    datasets = [("train_dataset", train_dataset)]
    if isinstance(eval_dataset, dict):
        datasets += [(f"eval_dataset[{k!r}]", v) for k, v in eval_dataset.items()]
    else:
        datasets.append(("eval_dataset", eval_dataset))
    for name, data in datasets:
        prompts = dataset_prompts(data)
        if prompts is not None:
            check_prompts(prompts, what=name, tokenizer=tokenizer, context_tokens=context)
    if calibration_prompts:
        check_prompts(calibration_prompts, what="calibration_dataset", tokenizer=tokenizer, context_tokens=context)
    return existing_run(args.output_dir)


# Module names of the vocabulary layers in the transformers families the project serves (embeddings, output heads).
_VOCAB_MODULES = ("embed_tokens", "lm_head", "wte", "embed_in", "embed_out", "word_embeddings", "output")


def check_sampler_peft_config(peft_config) -> None:
    """Refuse, before the model loads, a ``peft`` LoRA configuration whose adapters the sampler sync cannot serve
    (``nvfp4.modules.merged_weight`` merges plain LoRA into each linear's weight, ``W + scaling * B @ A``; the export
    sends decoder linears and vocabulary matrices as stored).

    Raises:
        ValueError: DoRA (``use_dora``), LoRA biases (``lora_bias``), or adapters on a vocabulary layer
            (``target_modules`` naming an embedding or the output head): the sampler would serve another model than
            the learner trains. The message names the field to change.
    """
    if peft_config is None or not hasattr(peft_config, "target_modules"):
        return
    if getattr(peft_config, "use_dora", False):
        raise ValueError("peft_config.use_dora=True: the sampler sync merges plain LoRA only (W + scaling * B @ A), "
                         "so its DoRA weights would differ from the learner's. Set use_dora=False.")
    if getattr(peft_config, "lora_bias", False):
        raise ValueError("peft_config.lora_bias=True: the sampler sync does not export LoRA biases. Set "
                         "lora_bias=False.")
    targets = peft_config.target_modules
    if isinstance(targets, str):
        import re

        hit = [] if targets == "all-linear" else [n for n in _VOCAB_MODULES if re.fullmatch(targets, n)
                                                  or re.fullmatch(targets, f"model.{n}")]
    else:
        hit = [n for n in (targets or ()) if n.split(".")[-1] in _VOCAB_MODULES]
    if hit:
        raise ValueError(f"peft_config.target_modules includes {hit}: the sampler sync serves LoRA on decoder "
                         "linears only. Drop the embedding and output head from target_modules (to train them, "
                         "full fine-tuning).")


def _attn_implementation(model, args, config) -> str | None:
    if not isinstance(model, str):
        return getattr(config, "_attn_implementation", None)
    return (args.model_init_kwargs or {}).get("attn_implementation")


def check_shared_prompt_forward(config, attn_implementation: str | None) -> None:
    """Refuse ``triage_shared_prompt_forward=True`` for a model the shared-prompt forward cannot serve.

    Raises:
        ValueError: naming why (``triage_trl.trainer.shared_prompt.unsupported_reason``) and the remedy.
    """
    from .shared_prompt import unsupported_reason

    reason = unsupported_reason(config, attn_implementation)
    if reason is not None:
        raise ValueError(f"triage_shared_prompt_forward=True, but {reason}. Unset it (TRL's row-by-row forward "
                         "where unsupported) or set it to False.")


def hold_output_dir(trainer, args) -> RunLock | None:
    """Take ``args.output_dir``'s run lock on the main process, released when ``trainer`` is collected or at exit."""
    if not args.should_save:
        return None
    lock = RunLock(args.output_dir).acquire()
    weakref.finalize(trainer, lock.release)
    return lock
