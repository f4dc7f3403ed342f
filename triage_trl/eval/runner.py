"""``evaluate``: generate, score with math-verify, summarise, save and resume.

Output folder (``output_dir``):

* ``config.json`` - the run's settings; a rerun with other settings is refused (results would mix);
* ``records/<benchmark>.jsonl`` - one line per finished problem, appended as chunks finish: ``id``,
  ``reference``, ``completions``, ``extracted`` (per completion: the answer that was scored, from the
  last ``\\boxed{}``; ``None`` when no answer was found),
  ``correct`` (per completion), ``n_correct``. A rerun reads them and generates only the missing
  problems (resume after an interruption, or a larger ``limit``);
* ``results.json`` - config, per-benchmark metrics, wall times and all records;
* ``results.md`` - one markdown table for all benchmarks.

Nothing is written before every input (settings, model, benchmark files) has been checked.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..answers import check_answer
from ..models import resolve_model
from ..runtime.preflight import check_model_source
from ..runtime import vllm_process_settings
from .benchmarks import BENCHMARK_RECORDS, Problem, load_benchmark
from .metrics import summarize
from .prompting import build_messages, render_prompt

__all__ = ["BenchmarkResult", "EvalConfig", "EvalResults", "evaluate", "score_completions"]

_RESUME_KEYS = ("model", "precision", "backend", "n", "temperature", "max_new_tokens", "seed", "one_shot")


@dataclass
class EvalConfig:
    """The settings that decide the completions (all of them are checked on resume)."""

    model: str
    precision: str = "bf16"
    backend: str = "vllm"
    n: int = 1
    temperature: float = 0.0
    max_new_tokens: int = 1024
    seed: int = 0
    one_shot: bool = True

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class BenchmarkResult:
    """One benchmark: ``metrics`` (fractions in [0, 1]), ``records`` (per problem), ``wall_time_s`` of this call."""

    name: str
    metrics: dict[str, float]
    records: list[dict]
    wall_time_s: float = 0.0
    resumed: int = 0

    @property
    def n_problems(self) -> int:
        return len(self.records)


@dataclass
class EvalResults:
    """What ``evaluate`` returns (and saves): config, one :class:`BenchmarkResult` per benchmark."""

    config: EvalConfig
    benchmarks: dict[str, BenchmarkResult] = field(default_factory=dict)
    engine_report: dict | None = None
    """The backend's ``kernel_report`` (linear kernels and precisions that ran); ``None`` when all was resumed."""

    def to_dict(self) -> dict:
        return {
            "config": asdict(self.config),
            "engine": self.engine_report,
            "metrics": {k: b.metrics for k, b in self.benchmarks.items()},
            "wall_time_s": {k: round(b.wall_time_s, 2) for k, b in self.benchmarks.items()},
            "records": {k: b.records for k, b in self.benchmarks.items()},
        }

    def to_markdown(self) -> str:
        """One table: a row per benchmark, a column per metric (percentages), problem count and wall time."""
        keys: list[str] = []
        for b in self.benchmarks.values():
            keys += [k for k in b.metrics if k not in keys]
        c = self.config
        head = (f"model `{c.model}`, {c.precision}, {c.backend}, "
                + ("greedy" if c.greedy else f"T={c.temperature}, n={c.n}") + f", max {c.max_new_tokens} new tokens")
        lines = [head, "", "| benchmark | problems | " + " | ".join(keys) + " | wall time (s) |",
                 "|---|---:|" + "---:|" * len(keys) + "---:|"]
        for name, b in self.benchmarks.items():
            cells = [f"{100 * b.metrics[k]:.1f}" if k in b.metrics else "" for k in keys]
            lines.append(f"| {name} | {b.n_problems} | " + " | ".join(cells) + f" | {b.wall_time_s:.0f} |")
        return "\n".join(lines) + "\n"

    def save(self, output_dir: str | os.PathLike) -> Path:
        """Write ``results.json`` and ``results.md`` into ``output_dir``; returns the JSON path."""
        out = Path(output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(self.to_dict(), indent=1))
        (out / "results.md").write_text(self.to_markdown())
        return out / "results.json"


def score_completions(problem: Problem, completions: Sequence[str]) -> dict:
    """The record of one problem: each completion's extracted answer and correctness (``check_answer``)."""
    checks = [check_answer(c, problem.reference, kind=problem.kind, unit=problem.unit) for c in completions]
    extracted = [c.extracted for c in checks]
    correct = [c.correct for c in checks]
    return {
        "id": problem.id,
        "reference": problem.reference,
        "completions": list(completions),
        "extracted": extracted,
        "correct": correct,
        "n_correct": sum(correct),
    }


def _check_config(output_dir: Path, config: EvalConfig, *, write: bool) -> None:
    """Refuse an ``output_dir`` holding results of other settings; with ``write``, record these settings there."""
    path = output_dir / "config.json"
    mine = {k: asdict(config)[k] for k in _RESUME_KEYS}
    if path.is_file():
        saved = json.loads(path.read_text())
        diff = {k: (saved.get(k), mine[k]) for k in _RESUME_KEYS if saved.get(k) != mine[k]}
        if diff:
            raise ValueError(
                f"{output_dir} holds results made with other settings ({', '.join(f'{k}: {a!r} -> {b!r}' for k, (a, b) in diff.items())}); "
                "use another --output-dir, or delete that folder to start again."
            )
    elif write:
        output_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(mine, indent=1))


def _read_records(path: Path) -> dict[str, dict]:
    records = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                records[rec["id"]] = rec
    return records


def _check_settings(names: list[str], *, n: int, temperature: float, backend: str, precision: str) -> None:
    for b in names:
        if b not in BENCHMARK_RECORDS:
            raise ValueError(f"unknown benchmark {b!r}; choose from {', '.join(BENCHMARK_RECORDS)}")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if temperature == 0 and n > 1:
        raise ValueError("greedy decoding (temperature 0) gives one completion per problem: use n=1 or a "
                         f"temperature > 0 (got n={n}).")
    if backend not in ("vllm", "transformers"):
        raise ValueError(f"unknown backend {backend!r}; use vllm or transformers")
    if precision not in ("bf16", "nvfp4"):
        raise ValueError(f"unknown precision {precision!r}; use bf16 or nvfp4")


def evaluate(
    model: str,
    benchmarks: Sequence[str] | str = ("gsm8k", "math500"),
    *,
    data_dir: str | os.PathLike | None = None,
    precision: str = "bf16",
    backend: str = "vllm",
    n: int = 1,
    temperature: float = 0.0,
    max_new_tokens: int = 1024,
    limit: int | None = None,
    seed: int = 0,
    output_dir: str | os.PathLike | None = None,
    one_shot: bool = True,
    chunk_size: int = 32,
    batch_size: int = 16,
    max_model_len: int | None = None,
    engine=None,
    progress: bool = True,
) -> EvalResults:
    """Evaluate ``model`` on math ``benchmarks``: greedy pass@1, or avg@n and unbiased pass@k when ``n > 1``.

    Args:
        model: a model folder, a Hub id, ``"smollm2-135m-instruct"`` (the embedded default) or ``"tiny-qwen3"``
            (built offline into the model cache): :func:`triage_trl.models.resolve_model`, as ``triage-grpo``.
        benchmarks: names from ``BENCHMARKS`` (a list, or one comma-separated string).
        data_dir: folder of local ``<benchmark>/test.jsonl`` files; ``None`` loads the Hub datasets.
        precision: ``"bf16"`` or ``"nvfp4"`` (see ``triage_trl.eval.backends``).
        backend: ``"vllm"`` or ``"transformers"``.
        n: completions per problem; ``temperature=0`` (greedy) needs ``n=1``.
        temperature: sampling temperature (plain temperature sampling: top-k/top-p off).
        max_new_tokens: completion length limit in tokens.
        limit: the first ``limit`` problems of each benchmark.
        seed: generation seed (problem ``i`` of a benchmark gets seed ``seed * 1_000_003 + i``).
        output_dir: where records and results are written and resumed from (``None``: nothing saved).
        one_shot: prepend the worked example turn (SmolLM2-135M only writes ``\\boxed{}`` with it).
        chunk_size: problems generated between two saves / progress updates.
        batch_size: transformers backend batch size.
        max_model_len: vLLM context length (default: the longest prompt + ``max_new_tokens``).
        engine: a backend object to reuse (its ``generate`` is called; ``precision``/``backend`` are then
            only recorded), e.g. one shared engine across calls in a notebook or tests.
        progress: show a tqdm progress bar per benchmark.

    Returns:
        :class:`EvalResults` (``.to_markdown()``, ``.to_dict()``; also saved when ``output_dir`` is set).

    Raises:
        ValueError: unknown benchmark/precision/backend, ``n < 1``, ``temperature < 0``, greedy with
            ``n > 1``, or an ``output_dir`` holding results of other settings.
        FileNotFoundError: a model that is neither a local folder nor a Hub model this machine can reach, or a
            missing benchmark file. Nothing is written to ``output_dir`` before all inputs are checked.
    """
    from transformers import AutoTokenizer

    names = [b.strip() for b in benchmarks.split(",")] if isinstance(benchmarks, str) else list(benchmarks)
    _check_settings(names, n=n, temperature=temperature, backend=backend, precision=precision)
    config = EvalConfig(model=str(model), precision=precision, backend=backend, n=n, temperature=float(temperature),
                        max_new_tokens=max_new_tokens, seed=seed, one_shot=one_shot)
    out = Path(output_dir) if output_dir is not None else None
    if out is not None:
        _check_config(out, config, write=False)

    # Every input is checked before anything is written: a refused run leaves no config.json behind.
    model_path = resolve_model(str(model))
    if engine is None:
        check_model_source(model_path)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    problems = {b: load_benchmark(b, data_dir, limit) for b in names}
    if out is not None:
        _check_config(out, config, write=True)
    prompt_ids = {
        b: [tokenizer(render_prompt(tokenizer, build_messages(p, one_shot=one_shot)), add_special_tokens=False)["input_ids"]
            for p in ps]
        for b, ps in problems.items()
    }
    done = {b: (_read_records(out / "records" / f"{b}.jsonl") if out is not None else {}) for b in names}
    todo = {b: [i for i, p in enumerate(problems[b]) if p.id not in done[b]] for b in names}

    own_engine = engine is None and any(todo.values())
    with vllm_process_settings() if own_engine and backend == "vllm" else contextlib.nullcontext():
        if own_engine:
            engine = _build_engine(backend, model_path, precision, tokenizer, problems, prompt_ids, todo,
                                   max_new_tokens=max_new_tokens, seed=seed, batch_size=batch_size,
                                   max_model_len=max_model_len, one_shot=one_shot)
        results = EvalResults(config=config, engine_report=getattr(engine, "kernel_report", None))
        for b in names:
            results.benchmarks[b] = _run_benchmark(b, problems[b], prompt_ids[b], todo[b], done[b], engine, config,
                                                   out, chunk_size=chunk_size, progress=progress)
    if out is not None:
        results.save(out)
    return results


def _build_engine(backend, model_path, precision, tokenizer, problems, prompt_ids, todo, *, max_new_tokens, seed,
                  batch_size, max_model_len, one_shot):
    from .backends import TransformersBackend, VLLMBackend

    if backend == "transformers":
        return TransformersBackend(model_path, precision=precision, tokenizer=tokenizer, batch_size=batch_size)
    if max_model_len is None:
        longest = max(len(ids) for b in prompt_ids for ids in prompt_ids[b])
        max_model_len = -(-(longest + max_new_tokens) // 16) * 16
    calibration = None
    if precision == "nvfp4":
        # As the sampler calibrates on its first training prompts: the first prompts to evaluate, up to 16.
        calibration = [render_prompt(tokenizer, build_messages(problems[b][i], one_shot=one_shot))
                       for b in todo for i in todo[b]][:16]
    return VLLMBackend(model_path, precision=precision, tokenizer=tokenizer, max_model_len=max_model_len, seed=seed,
                       calibration_prompts=calibration)


def _run_benchmark(name, problems, prompt_ids, todo, done, engine, config, out, *, chunk_size, progress):
    from tqdm.auto import tqdm

    records_path = out / "records" / f"{name}.jsonl" if out is not None else None
    if records_path is not None:
        records_path.parent.mkdir(parents=True, exist_ok=True)
    resumed = len(problems) - len(todo)
    bar = tqdm(total=len(problems), initial=resumed, desc=name, unit="problem", disable=not progress)
    start = time.perf_counter()
    for c in range(0, len(todo), chunk_size):
        idx = todo[c : c + chunk_size]
        completions = engine.generate(
            [prompt_ids[i] for i in idx], n=config.n, temperature=config.temperature,
            max_new_tokens=config.max_new_tokens, seeds=[config.seed * 1_000_003 + i for i in idx],
        )
        new = [score_completions(problems[i], comps) for i, comps in zip(idx, completions)]
        for rec in new:
            done[rec["id"]] = rec
        if records_path is not None:
            with open(records_path, "a", encoding="utf-8") as f:
                f.writelines(json.dumps(r) + "\n" for r in new)
        bar.update(len(idx))
        bar.set_postfix(acc=f"{sum(r['n_correct'] for r in done.values()) / max(1, len(done) * config.n):.3f}")
    bar.close()
    wall = time.perf_counter() - start
    records = [done[p.id] for p in problems]
    metrics = summarize([r["correct"] for r in records], greedy=config.greedy)
    return BenchmarkResult(name=name, metrics=metrics, records=records, wall_time_s=wall, resumed=resumed)
