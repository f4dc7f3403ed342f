"""Entry point of the checkpoint kill test (``tests/test_checkpoints.py``): train a tiny model without vLLM
(``triage_mode="off"``), saving a checkpoint every step, optionally hanging inside one save so the test can kill it.

Not a test module: ``python tests/checkpoint_worker.py MODEL_DIR OUTPUT_DIR MAX_STEPS [--resume] [--hang-at N]``.
With ``--hang-at N`` the save of step ``N`` writes ``OUTPUT_DIR/../hanging`` after the model and optimizer files are
written, then sleeps. At the end it writes ``OUTPUT_DIR/../result.json``: the checkpoint resumed from and the
final step.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from datasets import Dataset

import triage_trl.trainer.grpo_trainer as grpo_trainer
from triage_trl.trainer import TriageGRPOConfig, TriageGRPOTrainer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("output_dir")
    parser.add_argument("max_steps", type=int)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--hang-at", type=int, default=None)
    cli = parser.parse_args()
    side = os.path.dirname(os.path.abspath(cli.output_dir))

    resumed = []
    resolve = grpo_trainer.resolve_resume
    grpo_trainer.resolve_resume = lambda *a: resumed.append(resolve(*a)) or resumed[-1]

    args = TriageGRPOConfig(
        output_dir=cli.output_dir, triage_mode="off", use_vllm=False, use_cpu=True, bf16=False,
        per_device_train_batch_size=4, num_generations=4, max_completion_length=4, learning_rate=1e-3,
        report_to="none", logging_steps=1, save_strategy="steps", save_steps=1, max_steps=cli.max_steps, seed=0,
        model_init_kwargs={"dtype": torch.float32},
    )
    trainer = TriageGRPOTrainer(
        cli.model_dir, reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions], args=args,
        train_dataset=Dataset.from_dict({"prompt": [f"What is {i} + {i}?\n" for i in range(16)]}),
    )
    if cli.hang_at is not None:
        save_rng = trainer._save_rng_state

        def hanging_save_rng(output_dir):
            if trainer.state.global_step == cli.hang_at:
                with open(os.path.join(side, "hanging"), "w") as f:
                    f.write(output_dir)
                time.sleep(600)
            save_rng(output_dir)

        trainer._save_rng_state = hanging_save_rng
    trainer.train(resume_from_checkpoint=True if cli.resume else None)
    with open(os.path.join(side, "result.json"), "w") as f:
        json.dump({"resumed_from": resumed[-1], "global_step": trainer.state.global_step}, f)


if __name__ == "__main__":
    main()
