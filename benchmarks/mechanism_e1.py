"""E1, the mechanism test (``docs/stability.md``, "E1: the mechanism"): do amplifying updates widen the
learner-sampler gap, and does TRIAGE's step widen it less than the other objectives' steps from the same state?

A naive NVFP4 run (lab configuration ``nvfp4_naive``, default dose ``stress``) generates rollout batches with the
project's trainer and sampler. For each batch, from the identical state (model, optimizer, batch), every arm of
:data:`triage_trl.lab.mechanism.ARMS` (naive, TIS, OPSM, TRIAGE full, rebalance only, repair only, the
direction-blind control, and naive with the advantages permuted within groups: the null model of the quadrant
changes) takes one optimizer step through ``TriageGRPOTrainer.compute_loss`` with its own objective
fields; the sampler is re-synced and both engines re-score the same completions (at ``--score-temperature``, default
1: the learner through its own forward, the sampler through vLLM's prompt log-probs). Recorded per (batch, arm), as
``after - before``: k3, the mean gap, the mean gap per quadrant (NA, PA, NC, PC: fixed by the advantage and the gap
before the step), the p99 |gap|, and the learner's teacher-forced log-likelihood of reference answers of held-out
items (none among the training items). Naive's step then advances the run to the next batch. The report pairs
every arm with naive over the batches (mean difference, percentile bootstrap 95% interval).

Usage:
    python benchmarks/mechanism_e1.py [--scale cpu] [--lora-rank 16 | --lora-rank 0] [--batches 20]
        [--dose stress] [--learning-rate LR] [--eval-size 128] [--score-temperature 1]
        [--arms naive tis ...] [--output-dir runs/mechanism_e1] [--report-only]
    python benchmarks/mechanism_e1.py --smoke        # tiny random Qwen3, 2 batches of 2 x 4, a length-parity reward

Layout of ``OUTPUT_DIR/<lora<R>|full>/``: ``e1.json`` (the settings; a folder made with others is refused),
``progress.json`` (the next batch), ``batches/b<NNN>.pt`` (the rollout batch: prompts, completions, sampler and
learner log-probs, advantages, and the re-scored log-probs before the step), ``results/b<NNN>_<arm>.json`` (one file
per batch and arm), ``state.pt`` (the run's model and optimizer state at the next batch: the resume point; one
state, overwritten, since a full fine-tuning state of SmolLM2-135M is 1.6 GB), ``report.json``, ``report.md`` and
``e1_quadrants.png`` (the per-quadrant gap changes and the paired k3 changes, with their intervals).
Rerunning the same command resumes at the first unfinished batch (a larger ``--batches`` extends a finished run):
its saved rollouts are reused, and its existing (batch, arm) results are not recomputed. A result deleted from an
earlier batch cannot be redone (its start state is not kept): the script says so. A folder without ``state.pt``
(a committed run copied to a new machine: its ``e1.json``, ``batches/`` and ``results/``, as in
``docs/stability/e1_full/``) resumes by replaying naive's step over its saved batches from the fresh model and
optimizer (about a minute a batch on 2 CPU cores), each replayed step's loss and grad norm checked against the
recorded ones (``replay.json``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import sys
import time

import torch

from triage_trl.lab.configs import add_setting_arguments, build_trainer_config, resolve_settings
from triage_trl.lab.mechanism import (ARMS, MEASURES, OBJECTIVE_FIELDS, PERMUTED_ARMS, batch_quadrants,
                                      engine_moves, mismatch_stats, paired_bootstrap, permute_within_groups,
                                      trl_importance_ratio)
from triage_trl.lab.plots import write_e1_quadrants
from triage_trl.lab.probe import learner_logps, rescore

BATCH_KEYS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages", "old_per_token_logps",
              "sampling_per_token_logps", "ref_per_token_logps", "num_items_in_batch", "importance_sampling_ratio",
              "triage_zero_signal")
REFERENCE_TEMPLATE = "The final answer is \\boxed{{{answer}}}."
"""The reference completion of a held-out item (the format of the task's one-shot example)."""
SETTINGS_FILE = "e1.json"


# ---------------------------------------------------------------------------------------------- set-up

def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python benchmarks/mechanism_e1.py", description=__doc__.split("\n\n")[0])
    add_setting_arguments(parser)
    parser.add_argument("--smoke", action="store_true",
                        help="--scale smoke --batches 2 --num-generations 4 (a tiny random Qwen3, a length-parity reward)")
    parser.add_argument("--batches", type=int, default=None, help="rollout batches (default 20; smoke 2)")
    parser.add_argument("--dose", default="stress", help="mismatch dose of the naive run (default: stress)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS), help="arms (naive always runs)")
    parser.add_argument("--score-temperature", type=float, default=1.0,
                        help="temperature at which both engines re-score the completions (default 1: vLLM returns "
                        "the sampled token's log-prob; any other value needs its full-vocabulary prompt log-probs, "
                        "about 6 million values per 128-token sequence on SmolLM2)")
    parser.add_argument("--output-dir", default="runs/mechanism_e1")
    parser.add_argument("--report-only", action="store_true", help="write the report from the saved results")
    parser.add_argument("--replay-rtol", type=float, default=REPLAY_RTOL,
                        help="largest relative difference of a replayed naive step's loss and grad norm from the "
                        "recorded ones (default 1e-2); raise it knowingly to go on on another CPU kind, "
                        "whose GEMM dtype differs")
    parser.add_argument("--nulls", action="store_true",
                        help="the paper's two observations on the saved rollout batches (before any step), each "
                        "against its null model (triage_trl.lab.null_models): nulls.md")
    args = parser.parse_args(argv)
    if args.smoke:
        args.scale = "smoke"
        args.batches = args.batches or 2
        args.num_generations = args.num_generations or 4  # groups of 4: the smoke reward gives most of them spread
    args.batches = args.batches or 20
    if args.batches < 1:
        parser.error("--batches must be >= 1")
    if "naive" not in args.arms:
        args.arms = ["naive", *args.arms]
    args.arms = [a for a in ARMS if a in args.arms]
    return args


def run_dir(args, settings) -> str:
    rank = settings["lora_rank"] or 0
    return os.path.join(args.output_dir, f"lora{rank}" if rank else "full")


def _check_settings(out: str, record: dict) -> None:
    path = os.path.join(out, SETTINGS_FILE)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
        if saved != record:
            changed = sorted(k for k in set(saved) | set(record) if saved.get(k) != record.get(k))
            raise SystemExit(f"{out} holds an E1 run with other settings ({', '.join(changed)}): use another "
                             "--output-dir, or delete the folder to start again.")
    else:
        os.makedirs(out, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=2)


def arm_fields(settings: dict, out: str, seed: int, dose: str) -> dict[str, dict]:
    """Each arm's objective fields, taken from its lab configuration (validated by ``TriageGRPOConfig``)."""
    fields = {}
    for arm, config in ARMS.items():
        built = build_trainer_config(config, settings, out, seed, settings.get("trainer_overrides"), dose)
        fields[arm] = {name: getattr(built, name) for name in OBJECTIVE_FIELDS}
    return fields


@contextlib.contextmanager
def objective(trainer, fields: dict):
    """The trainer computes its loss with ``fields`` (an arm's objective) inside the block."""
    mirrored = {"triage_mode": "triage_mode", "off_policy_mask_threshold": "off_policy_mask_threshold",
                "vllm_importance_sampling_mode": "vllm_importance_sampling_mode",
                "vllm_importance_sampling_clip_min": "vllm_importance_sampling_clip_min",
                "vllm_importance_sampling_clip_max": "vllm_importance_sampling_clip_max"}
    saved_args = {k: getattr(trainer.args, k) for k in fields}
    saved_attrs = {a: getattr(trainer, a) for a in mirrored.values()}
    try:
        for k, v in fields.items():
            setattr(trainer.args, k, v)
        for k, a in mirrored.items():
            setattr(trainer, a, fields[k])
        yield
    finally:
        for k, v in saved_args.items():
            setattr(trainer.args, k, v)
        for a, v in saved_attrs.items():
            setattr(trainer, a, v)


def smoke_reward(completions, **kwargs) -> list[float]:
    """The smoke mode's reward: 1 for a completion text of odd length. A tiny random model never answers right, so
    with the task's rewards every group would have zero spread and every arm would take the same (KL-only) step;
    this one gives the groups spread, so each objective acts."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [float(len(t) % 2) for t in texts]


# ---------------------------------------------------------------------------------------------- measurements

def heldout_items(trainer, held_out, train, limit: int) -> dict:
    """Left-padded prompts + right-padded reference completions of the distinct held-out items that are not among
    the training items (the task's small item space repeats items: each counts once), at most ``limit``."""
    tokenizer = trainer.processing_class
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
    seen = {json.dumps(p, sort_keys=True) for p in train["prompt"]}
    prompts, refs = [], []
    for row in held_out:
        key = json.dumps(row["prompt"], sort_keys=True)
        if key in seen:
            continue
        seen.add(key)
        ids = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids))
        refs.append(tokenizer(REFERENCE_TEMPLATE.format(answer=row["answer"]), add_special_tokens=False)["input_ids"])
        if len(prompts) == limit:
            break
    if not prompts:
        raise SystemExit("Every held-out item is among the training items: raise --eval-size or lower --train-size.")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    p_len, r_len = max(map(len, prompts)), max(map(len, refs))
    ids = torch.full((len(prompts), p_len + r_len), pad, dtype=torch.long)
    attention = torch.zeros_like(ids)
    ref_mask = torch.zeros(len(prompts), r_len)
    for i, (p, r) in enumerate(zip(prompts, refs)):
        ids[i, p_len - len(p):p_len] = torch.tensor(p)
        ids[i, p_len:p_len + len(r)] = torch.tensor(r)
        attention[i, p_len - len(p):p_len + len(r)] = 1
        ref_mask[i, :len(r)] = 1
    return {"input_ids": ids, "attention_mask": attention, "ref_mask": ref_mask, "n": len(prompts)}


@torch.no_grad()
def heldout_ll(trainer, items: dict) -> float:
    """Mean over held-out items of the learner's mean log-likelihood per reference token (nats/token, T = 1)."""
    logps = learner_logps(trainer.model, items["input_ids"], items["attention_mask"], items["ref_mask"].size(1), 1.0,
                          rows=16)
    per_item = (logps.float() * items["ref_mask"]).sum(1) / items["ref_mask"].sum(1)
    return float(per_item.mean())


# ---------------------------------------------------------------------------------------------- state

class State:
    """The trainable parameters and the optimizer state, copied in memory (the arms' common start)."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.params = [p for p in trainer.model.parameters() if p.requires_grad]

    def snapshot(self) -> dict:
        return {"params": [p.detach().clone() for p in self.params],
                "optimizer": copy.deepcopy(self.trainer.optimizer.state_dict())}

    @torch.no_grad()
    def restore(self, saved: dict) -> None:
        from triage_trl.nvfp4.learner import invalidate_nvfp4_weight_caches

        for p, value in zip(self.params, saved["params"]):
            p.copy_(value)
        self.trainer.optimizer.load_state_dict(copy.deepcopy(saved["optimizer"]))
        invalidate_nvfp4_weight_caches(self.trainer.model)


def optimizer_step(trainer, batch: dict, fields: dict) -> dict:
    """One optimizer step with an arm's objective through ``TriageGRPOTrainer.compute_loss``; returns the loss,
    the grad norm and the arm's TRIAGE metrics (``triage/`` as logged)."""
    from triage_trl.nvfp4.learner import invalidate_nvfp4_weight_caches
    from triage_trl.trainer.grpo_trainer import ZERO_SIGNAL_KEY

    inputs = {k: v for k, v in batch.items() if k in BATCH_KEYS}
    if fields["vllm_importance_sampling_correction"]:
        mask = batch["completion_mask"]
        inputs["importance_sampling_ratio"] = trl_importance_ratio(
            batch["old_per_token_logps"], batch["sampling_per_token_logps"], mask,
            fields["vllm_importance_sampling_mode"], fields["vllm_importance_sampling_clip_min"],
            fields["vllm_importance_sampling_clip_max"])
    if ZERO_SIGNAL_KEY in batch:
        inputs[ZERO_SIGNAL_KEY] = batch[ZERO_SIGNAL_KEY]
    model = trainer.model
    model.train()
    trainer.current_gradient_accumulation_steps = 1
    with objective(trainer, fields):
        loss = trainer.compute_loss(model, inputs)
    trainer.accelerator.backward(loss)
    grad_norm = trainer.accelerator.clip_grad_norm_(model.parameters(), trainer.args.max_grad_norm)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    invalidate_nvfp4_weight_caches(model)
    triage = trainer.triage_metrics.pop("train")
    trainer._metrics["train"].clear()
    return {"loss": float(loss.detach()), "grad_norm": float(grad_norm), "triage": triage}


def opsm_dropped_frac(trainer, batch: dict, threshold: float) -> float:
    """Share of the batch's completions TRL's OPSM drops at the saved state (TRL's own ``get_off_policy_mask``)."""
    adv = batch["advantages"]
    keep = trainer.get_off_policy_mask(adv[:, None] if adv.dim() == 1 else adv, batch["old_per_token_logps"],
                                       batch["sampling_per_token_logps"], batch["completion_mask"].float(), threshold)
    return float(1.0 - keep.float().mean())


# ---------------------------------------------------------------------------------------------- report

def load_results(out: str) -> list[dict]:
    folder = os.path.join(out, "results")
    if not os.path.isdir(folder):
        return []
    records = []
    for name in sorted(os.listdir(folder)):
        if name.endswith(".json"):
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                records.append(json.load(f))
    return records


def report(out: str) -> dict:
    """Paired differences of every arm against naive over the batches both have; writes report.json, report.md and
    e1_quadrants.png."""
    records = load_results(out)
    by = {(r["batch"], r["arm"]): r for r in records}
    arms = [a for a in ARMS if any(r["arm"] == a for r in records)]
    table = {}
    for arm in arms:
        batches = sorted(b for (b, a) in by if a == arm and (b, "naive") in by)
        row = {"batches": len(batches)}
        for m in MEASURES:
            own = [by[(b, arm)]["delta"][m] for b in batches]
            row[m] = paired_bootstrap(own)
            if arm != "naive":
                row[f"{m}_vs_naive"] = paired_bootstrap([by[(b, arm)]["delta"][m] - by[(b, "naive")]["delta"][m]
                                                         for b in batches])
        table[arm] = row
    with open(os.path.join(out, "report.json"), "w", encoding="utf-8") as f:
        json.dump(table, f, indent=2, default=float)
    lines = ["| arm | batches | " + " | ".join(f"Δ{m}" for m in MEASURES) + " |",
             "|---|---|" + "---|" * len(MEASURES)]
    for arm, row in table.items():
        cells = []
        for m in MEASURES:
            own = row[m]
            cell = f"{own['mean']:+.4f}"
            if arm != "naive":
                d = row[f"{m}_vs_naive"]
                cell += f" ({d['mean']:+.4f} [{d['low']:+.4f}, {d['high']:+.4f}])"
            cells.append(cell)
        lines.append(f"| {arm} | {row['batches']} | " + " | ".join(cells) + " |")
    text = ("Change over one optimizer step (after - before), mean over batches; in parentheses the paired "
            "difference with naive's change, with its bootstrap 95% interval over batches. k3, gaps: learner - "
            "sampler, nats/token; p99: nats; heldout_ll: nats/token.\n\n" + "\n".join(lines) + "\n")
    with open(os.path.join(out, "report.md"), "w", encoding="utf-8") as f:
        f.write(text)
    if table:
        write_e1_quadrants(table, os.path.join(out, "e1_quadrants.png"))
    return table


# ---------------------------------------------------------------------------------------------- main loop

def _result_path(out: str, b: int, arm: str) -> str:
    return os.path.join(out, "results", f"b{b:03d}_{arm}.json")


PROGRESS_FILE = "progress.json"


def read_progress(out: str) -> int:
    """The next batch to run (0 for a new folder): ``progress.json`` is written right after ``state.pt``."""
    path = os.path.join(out, PROGRESS_FILE)
    if not os.path.isfile(path):
        return 0
    with open(path, encoding="utf-8") as f:
        return int(json.load(f)["next_batch"])


def write_progress(out: str, next_batch: int) -> None:
    path = os.path.join(out, PROGRESS_FILE)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump({"next_batch": next_batch}, f)
    os.replace(path + ".tmp", path)


def _atomic_save(obj, path: str) -> None:
    tmp = path + ".tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _cpu(batch: dict) -> dict:
    return {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def nulls_report(out: str, model_path: str, group_size: int) -> dict:
    """The NA share of the amplifying tail and the tail concentration of every saved batch (the learner and sampler
    log-probs re-scored before the step), each against its null model, and their means over the batches against the
    pooled null (``triage_trl.lab.null_models.pooled_null``); writes ``nulls.md`` and ``nulls.json``."""
    from transformers import AutoTokenizer

    from triage_trl.lab.null_models import na_share_null, pooled_null, segment_tail_counts, tail_concentration_null
    from triage_trl.objective.segments import build_newline_table, segment_ids

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    table = None
    rows = []
    for name in sorted(os.listdir(os.path.join(out, "batches"))):
        saved = torch.load(os.path.join(out, "batches", name), weights_only=False)
        batch, learner, sampler = saved["batch"], saved["learner_before"], saved["sampler_before"]
        adv = batch["advantages"].float().view(-1)
        zero_signal = batch.get("triage_zero_signal")
        if zero_signal is not None:  # no direction without signal: those completions join no quadrant (as E1's own)
            adv = torch.where(zero_signal.view(-1).bool(), torch.zeros_like(adv), adv)
        if table is None:
            table = build_newline_table(tokenizer, vocab_size=max(len(tokenizer), int(batch["completion_ids"].max()) + 1))
        segments = segment_ids(batch["completion_ids"], mode="newline", newline_table=table)
        na = na_share_null(learner, sampler, adv, batch["completion_mask"], group_size, keep_draws=True)
        lengths, counts = segment_tail_counts(learner, sampler, adv, batch["completion_mask"], segments)
        conc = tail_concentration_null(lengths, counts, keep_draws=True)
        rows.append({"batch": name, "na_share": na, "tail_concentration": conc})
    pooled = {key: pooled_null([r[key] for r in rows]) for key in ("na_share", "tail_concentration")}
    for r in rows:
        for key in ("na_share", "tail_concentration"):
            r[key].pop("draws")
    lines = ["| batch | NA share of amplifying tail | null mean [95%] | p | tail conc. | null mean [95%] | p | "
             "segments |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        na, conc = r["na_share"], r["tail_concentration"]
        lines.append(f"| {r['batch']} | {na['observed']:.3f} (n={na['n_tail']}) | {na['null_mean']:.3f} "
                     f"[{na['null_low']:.3f}, {na['null_high']:.3f}] | {na['p_value']:.3f} | {conc['observed']:.3f} | "
                     f"{conc['null_mean']:.3f} [{conc['null_low']:.3f}, {conc['null_high']:.3f}] | "
                     f"{conc['p_value']:.3f} | {conc['n_segments']} |")
    na, conc = pooled["na_share"], pooled["tail_concentration"]
    lines.append(f"| mean over {na['batches']} / {conc['batches']} batches (pooled null) | {na['observed']:.3f} | "
                 f"{na['null_mean']:.3f} [{na['null_low']:.3f}, {na['null_high']:.3f}] | {na['p_value']:.3f} | "
                 f"{conc['observed']:.3f} | {conc['null_mean']:.3f} [{conc['null_low']:.3f}, {conc['null_high']:.3f}] "
                 f"| {conc['p_value']:.3f} | |")
    with open(os.path.join(out, "nulls.json"), "w", encoding="utf-8") as f:
        json.dump({"batches": rows, "pooled": pooled}, f, indent=2, default=float)
    with open(os.path.join(out, "nulls.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    return {"rows": rows, "pooled": pooled, "text": "\n".join(lines)}


def replayable_batches(out: str, arms) -> int:
    """How many batches from 0 have their rollout saved and every arm's result: a committed run copied into a new
    folder (its ``state.pt``, 1.6 GB for full fine-tuning, is not kept in git) resumes after them."""
    b = 0
    while os.path.exists(os.path.join(out, "batches", f"b{b:03d}.pt")) and all(
            os.path.exists(_result_path(out, b, arm)) for arm in arms):
        b += 1
    return b


REPLAY_RTOL = 1e-2
"""Largest relative difference of a replayed naive step's loss and grad norm from the recorded ones (float
reordering between runs and CPU kinds moves them by about 1e-5; a different batch or start state by far more)."""


def replay(trainer, out: str, naive_fields: dict, arms, rtol: float = REPLAY_RTOL) -> int:
    """Rebuild the run's state at its first unfinished batch from the fresh model and optimizer by re-applying
    naive's step to each saved batch (no generation, no scoring), checking each step's loss and grad norm against
    naive's recorded result; returns the number of batches replayed. Raises ``SystemExit`` when a replayed step
    differs from the record by more than ``rtol`` (default :data:`REPLAY_RTOL`: the saved files come from another
    run, or another CPU kind computed them: ``--replay-rtol``)."""
    count = replayable_batches(out, arms)
    if not count:
        return 0
    print(f"E1 {out}: no state.pt; replaying naive's step over the {count} saved batches", flush=True)
    checks = []
    for b in range(count):
        batch = torch.load(os.path.join(out, "batches", f"b{b:03d}.pt"), weights_only=False)["batch"]
        with open(_result_path(out, b, "naive"), encoding="utf-8") as f:
            recorded = json.load(f)
        step = optimizer_step(trainer, batch, naive_fields)
        trainer.state.global_step += 1
        check = {"batch": b, **{f"{k}_diff": step[k] - recorded[k] for k in ("loss", "grad_norm")},
                 **{f"{k}_recorded": recorded[k] for k in ("loss", "grad_norm")}}
        checks.append(check)
        print(f"replayed batch {b}: loss {step['loss']:.6f} (recorded {recorded['loss']:.6f}), grad norm "
              f"{step['grad_norm']:.6f} (recorded {recorded['grad_norm']:.6f})", flush=True)
        for k in ("loss", "grad_norm"):
            if abs(step[k] - recorded[k]) > rtol * max(abs(recorded[k]), 1e-3):
                raise SystemExit(f"Replaying batch {b} gave {k} {step[k]:.6g}, recorded {recorded[k]:.6g}: the saved "
                                 f"batches and results in {out} come from another run or settings (delete it to "
                                 "start again), or from another CPU kind (--replay-rtol to accept the difference).")
    with open(os.path.join(out, "replay.json"), "w", encoding="utf-8") as f:
        json.dump(checks, f, indent=2)
    return count


def main(argv=None) -> dict:
    args = parse_args(argv)
    settings = resolve_settings(args)
    out = run_dir(args, settings)
    if args.nulls:
        from triage_trl.runs import resolve_model

        result = nulls_report(out, resolve_model(settings.get("model"), out), settings["num_generations"])
        print(result["text"])
        return result
    if args.report_only:
        table = report(out)
        print(open(os.path.join(out, "report.md"), encoding="utf-8").read())
        return table
    record = {"scale": settings["scale"], "smoke": args.smoke, "dose": args.dose,
              "score_temperature": args.score_temperature, "seed": args.seed, "batches": args.batches,
              **{k: settings[k] for k in ("model", "task", "prompts_per_step", "num_generations",
                                          "max_completion_length", "temperature", "learning_rate", "lora_rank",
                                          "train_size", "eval_size")}}
    _check_settings(out, {k: v for k, v in record.items() if k != "batches"})
    for sub in ("batches", "results"):
        os.makedirs(os.path.join(out, sub), exist_ok=True)
    first = read_progress(out)
    if not os.path.exists(os.path.join(out, "state.pt")):
        first = replayable_batches(out, args.arms)  # replayed below, once the trainer exists
    missing = [b for b in range(min(first, args.batches))
               if any(not os.path.exists(_result_path(out, b, a)) for a in args.arms)]
    if missing:  # their start state is gone (only the resume point's is kept)
        print(f"Batches {missing} lack some arms' results and cannot be redone (their state was not kept): delete "
              f"{out} to redo them.", flush=True)
    if first >= args.batches:
        print(f"All {args.batches} batches done.")
        return report(out)

    from triage_trl.runs import demo_rewards, lora_config, recipe_datasets, resolve_model
    from triage_trl.runtime import native_bf16_gemm, vllm_process_settings
    from triage_trl.trainer import TriageGRPOTrainer

    start = time.perf_counter()
    # both engines' compute dtype follows the CPU kind: recorded per result, since a run resumed by replay may go on
    # on another kind (each batch's arms still share one machine)
    native_bf16 = native_bf16_gemm()
    settings["max_steps"] = args.batches
    settings["num_iterations"] = 1  # one step per batch and arm (TRL's sampler would repeat each batch otherwise)
    with vllm_process_settings():
        model_path = resolve_model(settings.get("model"), out)
        config = build_trainer_config("nvfp4_naive", settings, os.path.join(out, "trainer"), args.seed,
                                      settings.get("trainer_overrides"), args.dose)
        config.triage_fuse_rollout_logps = False  # every arm's step needs the rollout-time learner log-probs
        fields = arm_fields(settings, os.path.join(out, "trainer"), args.seed, args.dose)
        train, held_out, calibration = recipe_datasets(settings, args.seed, config.nvfp4_calibration_prompts)
        rewards = [smoke_reward] if args.smoke else demo_rewards()
        if args.smoke:
            config.reward_weights = None
        trainer = TriageGRPOTrainer(model=model_path, reward_funcs=rewards, args=config, train_dataset=train,
                                    calibration_dataset=calibration, peft_config=lora_config(settings["lora_rank"]))
        try:
            trainer.create_optimizer()
            items = heldout_items(trainer, held_out, train, settings["eval_size"])
            state = State(trainer)
            state_path = os.path.join(out, "state.pt")
            if not os.path.exists(state_path):
                first = replay(trainer, out, fields["naive"], args.arms, args.replay_rtol)
                if first:
                    _atomic_save({**state.snapshot(), "next_batch": first, "global_step": trainer.state.global_step},
                                 state_path)
                    write_progress(out, first)
            elif first:
                saved = torch.load(state_path, weights_only=False)
                if saved["next_batch"] != first:
                    raise SystemExit(f"{state_path} is at batch {saved['next_batch']}, {PROGRESS_FILE} at {first}: "
                                     f"delete {out} to start again.")
                state.restore(saved)
                trainer.state.global_step = saved["global_step"]
            startup = time.perf_counter() - start
            print(f"E1 {out}: start-up {startup:.0f} s, {items['n']} held-out items, resuming at batch {first}",
                  flush=True)
            loader = iter(trainer.get_train_dataloader())
            for _ in range(first):
                next(loader)  # the same prompts as an uninterrupted run
            per_batch = []
            for b in range(first, args.batches):
                t0 = time.perf_counter()
                raw = next(loader)
                batch_path = os.path.join(out, "batches", f"b{b:03d}.pt")
                if os.path.exists(batch_path):
                    saved_batch = torch.load(batch_path, weights_only=False)
                    trainer.sync_sampler()
                else:
                    trainer.model.train()
                    generated = _cpu(trainer._generate_and_score_completions(raw))
                    trainer._metrics["train"].clear()
                    learner0, sampler0 = rescore(trainer, generated, args.score_temperature)
                    saved_batch = {"batch": {k: v for k, v in generated.items() if k in BATCH_KEYS},
                                   "prompts": [r["prompt"] for r in raw[::config.num_generations]],
                                   "learner_before": learner0, "sampler_before": sampler0,
                                   "heldout_before": heldout_ll(trainer, items)}
                    _atomic_save(saved_batch, batch_path)
                batch = saved_batch["batch"]
                zero_signal = batch.get("triage_zero_signal")
                quadrants = batch_quadrants(saved_batch["learner_before"], saved_batch["sampler_before"],
                                            batch["advantages"], batch["completion_mask"], zero_signal)
                before = {**mismatch_stats(saved_batch["learner_before"], saved_batch["sampler_before"],
                                           batch["completion_mask"], quadrants),
                          "heldout_ll": saved_batch["heldout_before"]}
                start_state = state.snapshot()
                next_state = None
                for arm in args.arms:
                    path = _result_path(out, b, arm)
                    if arm != "naive" and os.path.exists(path):
                        continue
                    t_arm = time.perf_counter()
                    state.restore(start_state)
                    arm_batch = batch
                    if arm in PERMUTED_ARMS:
                        permuted = permute_within_groups(batch["advantages"], config.num_generations,
                                                         torch.Generator().manual_seed(b))
                        arm_batch = {**batch, "advantages": permuted}
                    step = optimizer_step(trainer, arm_batch, fields[arm])
                    if arm == "naive":
                        next_state = state.snapshot()
                        if os.path.exists(path):
                            continue
                    phases = {"step": time.perf_counter() - t_arm}
                    trainer.sync_sampler()
                    phases["sync"] = time.perf_counter() - t_arm - sum(phases.values())
                    learner1, sampler1 = rescore(trainer, batch, args.score_temperature)
                    phases["rescore"] = time.perf_counter() - t_arm - sum(phases.values())
                    after = {**mismatch_stats(learner1, sampler1, batch["completion_mask"], quadrants),
                             "heldout_ll": heldout_ll(trainer, items)}
                    phases["heldout"] = time.perf_counter() - t_arm - sum(phases.values())
                    delta = {m: after[m] - before[m] for m in MEASURES if m in after}
                    delta.update(engine_moves(saved_batch["learner_before"], saved_batch["sampler_before"],
                                              learner1, sampler1, batch["completion_mask"]))
                    result = {"batch": b, "arm": arm, "config": ARMS[arm], "before": before, "after": after,
                              "delta": delta, **step, "seconds": time.perf_counter() - t_arm,
                              "phase_seconds": phases, "native_bf16_gemm": native_bf16}
                    if arm == "opsm":
                        result["opsm_dropped_frac"] = opsm_dropped_frac(trainer, batch,
                                                                        fields[arm]["off_policy_mask_threshold"])
                    with open(path + ".tmp", "w", encoding="utf-8") as f:
                        json.dump(result, f, indent=2, default=float)
                    os.replace(path + ".tmp", path)
                state.restore(next_state)
                trainer.state.global_step += 1
                _atomic_save({**next_state, "next_batch": b + 1, "global_step": trainer.state.global_step},
                             state_path)
                write_progress(out, b + 1)
                per_batch.append(time.perf_counter() - t0)
                left = (args.batches - b - 1) * sum(per_batch) / len(per_batch)
                print(f"batch {b + 1}/{args.batches}: {per_batch[-1]:.0f} s (about {left / 60:.1f} min left)",
                      flush=True)
        finally:
            trainer.close()
    table = report(out)
    timing = {"startup_seconds": startup, "batch_seconds": per_batch, "wall_seconds": time.perf_counter() - start}
    with open(os.path.join(out, "timing.json"), "w", encoding="utf-8") as f:
        json.dump(timing, f, indent=2)
    print(open(os.path.join(out, "report.md"), encoding="utf-8").read())
    return table


if __name__ == "__main__":
    main(sys.argv[1:])
