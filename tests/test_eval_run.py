"""triage-eval end to end: runner (stub engine), resume, CLI, and a tiny Qwen3 on both backends (CPU)."""

import json

import pytest

from triage_trl.eval import evaluate, load_benchmark
from triage_trl.eval.cli import main

GSM8K_ROWS = [
    {"question": "Ann has 3 apples and buys 4 more. How many apples does she have?", "answer": "3 + 4 = 7\n#### 7"},
    {"question": "A pen costs $2. How much do 5 pens cost?", "answer": "5 * 2 = 10\n#### 10"},
    {"question": "Tom reads 1,000 pages a year for 2 years. How many pages?", "answer": "2 * 1000\n#### 2,000"},
    {"question": "Half of 18 is what?", "answer": "18 / 2 = 9\n#### 9"},
]
MATH_ROWS = [
    {"problem": "Simplify $\\frac{2}{4}$.", "answer": "\\frac{1}{2}", "unique_id": "a"},
    {"problem": "Solve $2x = 6$.", "answer": "3", "unique_id": "b"},
    {"problem": "Give the point $(1,2)$ shifted right by 1.", "answer": "(2,2)", "unique_id": "c"},
    {"problem": "What is $\\sqrt{16}$?", "answer": "4", "unique_id": "d"},
]


@pytest.fixture
def data_dir(tmp_path):
    """A small local data folder in the ../shared/data layout (gsm8k, math500), invented rows."""
    root = tmp_path / "data"
    for name, rows in (("gsm8k", GSM8K_ROWS), ("math500", MATH_ROWS)):
        (root / name).mkdir(parents=True)
        (root / name / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


class StubEngine:
    """Answers problem i (recovered from the seed) right when i is even, else wrong; counts generated prompts."""

    def __init__(self, problems_by_len, seed=0):
        self.problems = problems_by_len
        self.seed = seed
        self.generated = 0
        self.kernel_report = {"platform": "stub"}

    def generate(self, prompt_ids, *, n, temperature, max_new_tokens, seeds):
        out = []
        for ids, s in zip(prompt_ids, seeds):
            i = s - self.seed * 1_000_003
            ref = self.problems[len(ids)].reference
            out.append([f"Work.\nThe final answer is \\boxed{{{ref if (i + j) % 2 == 0 else ref + '+1'}}}." for j in range(n)])
            self.generated += 1
        return out


def _stub(model_dir, data_dir, names=("gsm8k", "math500")):
    from transformers import AutoTokenizer

    from triage_trl.eval.prompting import build_messages, render_prompt

    tok = AutoTokenizer.from_pretrained(model_dir)
    by_len = {}
    for name in names:
        for p in load_benchmark(name, data_dir):
            ids = tok(render_prompt(tok, build_messages(p)), add_special_tokens=False)["input_ids"]
            assert len(ids) not in by_len, "prompt lengths must tell the stub's problems apart"
            by_len[len(ids)] = p
    return StubEngine(by_len)


def test_evaluate_scores_saves_and_tabulates(tiny_qwen3_dir, data_dir, tmp_path):
    out = tmp_path / "out"
    res = evaluate(tiny_qwen3_dir, "gsm8k,math500", data_dir=data_dir, engine=_stub(tiny_qwen3_dir, data_dir),
                   output_dir=out, progress=False)
    assert {k: b.metrics for k, b in res.benchmarks.items()} == {"gsm8k": {"pass@1": 0.5}, "math500": {"pass@1": 0.5}}
    rec = res.benchmarks["math500"].records[0]
    assert rec == {"id": "math500/a", "reference": "\\frac{1}{2}", "completions": [
        "Work.\nThe final answer is \\boxed{\\frac{1}{2}}."], "extracted": ["\\frac{1}{2}"], "correct": [True], "n_correct": 1}
    assert res.benchmarks["gsm8k"].records[1]["correct"] == [False]
    saved = json.loads((out / "results.json").read_text())
    assert saved["metrics"] == {"gsm8k": {"pass@1": 0.5}, "math500": {"pass@1": 0.5}}
    assert saved["records"]["gsm8k"][2]["reference"] == "2000" and saved["engine"] == {"platform": "stub"}
    md = (out / "results.md").read_text()
    assert "| benchmark | problems | pass@1 | wall time (s) |" in md and "| gsm8k | 4 | 50.0 |" in md
    assert md == res.to_markdown()


class WaitEngine(StubEngine):
    """Boxes a wrong 5 first, then corrects itself: "... Wait, that's wrong; the answer is \\boxed{<reference>}"."""

    def generate(self, prompt_ids, *, n, temperature, max_new_tokens, seeds):
        return [[f"I first got \\boxed{{5}}. Wait, that's wrong; the answer is \\boxed{{{self.problems[len(ids)].reference}}}."]
                * n for ids in prompt_ids]


def test_results_record_the_last_box(tiny_qwen3_dir, data_dir, tmp_path):
    stub = _stub(tiny_qwen3_dir, data_dir)
    res = evaluate(tiny_qwen3_dir, "gsm8k,math500", data_dir=data_dir, engine=WaitEngine(stub.problems),
                   output_dir=tmp_path / "out", progress=False)
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["metrics"] == {"gsm8k": {"pass@1": 1.0}, "math500": {"pass@1": 1.0}}
    assert [r["extracted"] for r in saved["records"]["gsm8k"]] == [["7"], ["10"], ["2000"], ["9"]]
    assert [r["extracted"] for r in saved["records"]["math500"]] == [["\\frac{1}{2}"], ["3"], ["(2,2)"], ["4"]]
    assert res.to_dict()["records"] == saved["records"]


def test_resume_generates_only_missing_problems(tiny_qwen3_dir, data_dir, tmp_path):
    out = tmp_path / "out"
    stub = _stub(tiny_qwen3_dir, data_dir)
    evaluate(tiny_qwen3_dir, ["gsm8k", "math500"], data_dir=data_dir, engine=stub, output_dir=out, limit=2,
             progress=False)
    assert stub.generated == 4
    res = evaluate(tiny_qwen3_dir, ["gsm8k", "math500"], data_dir=data_dir, engine=stub, output_dir=out,
                   progress=False, chunk_size=1)
    assert stub.generated == 8  # 2 more per benchmark
    assert res.benchmarks["gsm8k"].resumed == 2 and res.benchmarks["gsm8k"].n_problems == 4
    assert [r["correct"] for r in res.benchmarks["math500"].records] == [[True], [False], [True], [False]]
    again = evaluate(tiny_qwen3_dir, ["gsm8k", "math500"], data_dir=data_dir, engine=stub, output_dir=out,
                     progress=False)
    assert stub.generated == 8 and again.to_dict()["records"] == res.to_dict()["records"]
    lines = (out / "records" / "gsm8k.jsonl").read_text().splitlines()
    assert len(lines) == 4
    with pytest.raises(ValueError, match=r"other settings \(max_new_tokens: 1024 -> 8\)"):
        evaluate(tiny_qwen3_dir, ["gsm8k"], data_dir=data_dir, engine=stub, output_dir=out, max_new_tokens=8)


def test_sampled_metrics(tiny_qwen3_dir, data_dir):
    res = evaluate(tiny_qwen3_dir, ["gsm8k"], data_dir=data_dir, engine=_stub(tiny_qwen3_dir, data_dir, ["gsm8k"]),
                   n=4, temperature=1.0, progress=False)
    # every problem has 2 of 4 right: avg@4 = 0.5, pass@2 = 1 - C(2,2)/C(4,2) = 5/6, pass@4 = 1
    assert res.benchmarks["gsm8k"].metrics == pytest.approx({"avg@4": 0.5, "pass@1": 0.5, "pass@2": 5 / 6, "pass@4": 1.0})


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(n=2), "greedy decoding"),
        (dict(temperature=-1.0), "temperature must be >= 0"),
        (dict(n=0), "n must be >= 1"),
        (dict(backend="hf"), "unknown backend"),
        (dict(precision="fp8"), "unknown precision"),
        (dict(benchmarks=["mmlu"]), "unknown benchmark"),
    ],
)
def test_evaluate_rejects_bad_settings(kwargs, match, data_dir):
    kwargs = {"benchmarks": ["gsm8k"], **kwargs}
    with pytest.raises(ValueError, match=match):
        evaluate("unused", data_dir=data_dir, **kwargs)


@pytest.mark.parametrize("precision", ["bf16", pytest.param("nvfp4", marks=pytest.mark.slow)])  # nvfp4: ~35 s emulated
def test_cli_transformers_backend_end_to_end(tiny_qwen3_dir, data_dir, tmp_path, capsys, precision):
    out = tmp_path / "out"
    argv = ["--model", tiny_qwen3_dir, "--benchmarks", "gsm8k,math500", "--data-dir", str(data_dir), "--limit", "3",
            "--backend", "transformers", "--precision", precision, "--max-new-tokens", "6", "--output-dir", str(out),
            "--no-progress"]
    assert main(argv) == 0
    assert "| math500 | 3 |" in capsys.readouterr().out
    saved = json.loads((out / "results.json").read_text())
    assert saved["config"]["precision"] == precision and saved["config"]["backend"] == "transformers"
    if precision == "nvfp4":
        assert saved["engine"]["linear_kernels"].startswith("nvfp4/native=0, nvfp4/emulated=14")
    for name in ("gsm8k", "math500"):
        recs = saved["records"][name]
        assert [len(r["completions"]) for r in recs] == [1, 1, 1]
        assert all(isinstance(c, str) for r in recs for c in r["completions"])
        assert saved["metrics"][name]["pass@1"] == sum(r["n_correct"] for r in recs) / 3
    before = (out / "records" / "gsm8k.jsonl").read_text()
    assert main(argv) == 0  # resumed: nothing regenerated
    assert (out / "records" / "gsm8k.jsonl").read_text() == before
    assert json.loads((out / "results.json").read_text())["records"] == saved["records"]
    assert main(argv + ["--max-new-tokens", "5"]) == 2  # other settings into the same folder: refused
    assert "other settings (max_new_tokens: 6 -> 5)" in capsys.readouterr().err


def test_cli_reports_bad_data_dir(tmp_path, capsys, tiny_qwen3_dir):
    assert main(["--model", tiny_qwen3_dir, "--benchmarks", "gsm8k", "--data-dir", str(tmp_path),
                 "--output-dir", str(tmp_path / "o"), "--backend", "transformers"]) == 2
    assert "test.jsonl does not exist" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()  # refused before anything was written


def test_cli_checks_every_input_before_writing(tmp_path, capsys, tiny_qwen3_dir, data_dir, monkeypatch):
    import huggingface_hub.constants

    out = tmp_path / "o"
    common = ["--benchmarks", "gsm8k", "--data-dir", str(data_dir), "--output-dir", str(out), "--limit", "2",
              "--backend", "transformers", "--max-new-tokens", "4", "--no-progress"]
    assert main(["--model", str(tmp_path / "no-model"), *common]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not exist: give a local folder" in err[0]  # the resolver of triage-grpo too
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert main(["--model", "nobody/no-such-model-x1", *common]) == 2
    assert "the Hub cannot be reached" in capsys.readouterr().err
    assert main(["--model", tiny_qwen3_dir, *common[:3], str(tmp_path / "empty"), *common[4:]]) == 2
    assert not out.exists()
    # The folder was left untouched, so a good run with any settings starts there.
    assert main(["--model", tiny_qwen3_dir, *common, "--seed", "3"]) == 0
    assert json.loads((out / "config.json").read_text())["seed"] == 3


def test_cli_version(capsys):
    from triage_trl import __version__

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"triage-trl {__version__}"


@pytest.mark.slow
def test_vllm_nvfp4_backend_end_to_end(eval_vllm_nvfp4, data_dir, tmp_path):
    backend = eval_vllm_nvfp4.backend
    assert backend.kernel_report["linear_kernels"] == "CompressedTensorsW4A4Fp4/FastCpuNvFp4LinearKernel x8"
    assert backend.kernel_report["activations"].startswith("nvfp4")
    kw = dict(data_dir=data_dir, limit=3, max_new_tokens=6, engine=backend, precision="nvfp4", progress=False)
    first = evaluate(eval_vllm_nvfp4.model_dir, "gsm8k,math500", output_dir=tmp_path / "a", **kw)
    again = evaluate(eval_vllm_nvfp4.model_dir, "gsm8k,math500", output_dir=tmp_path / "b", **kw)
    recs = first.to_dict()["records"]
    assert recs == again.to_dict()["records"]  # greedy is deterministic
    assert [len(r["completions"]) for r in recs["math500"]] == [1, 1, 1]
    assert all(len(c) > 0 for r in recs["gsm8k"] for c in r["completions"])
    assert first.to_dict()["engine"]["sampler_precision"] == "nvfp4"
    sampled = evaluate(eval_vllm_nvfp4.model_dir, "gsm8k", n=3, temperature=1.0, **kw)
    r = sampled.benchmarks["gsm8k"]
    assert [len(x["completions"]) for x in r.records] == [3, 3, 3]
    assert set(r.metrics) == {"avg@3", "pass@1", "pass@2", "pass@3"}
    assert len(set(r.records[0]["completions"])) > 1  # n samples differ


def test_cli_puts_the_results_into_a_run_card(tiny_qwen3_dir, data_dir, tmp_path, capsys):
    from huggingface_hub import ModelCard, ModelCardData

    run, out = tmp_path / "run", tmp_path / "out"
    common = ["--model", tiny_qwen3_dir, "--benchmarks", "gsm8k", "--data-dir", str(data_dir), "--limit", "2",
              "--backend", "transformers", "--max-new-tokens", "4", "--output-dir", str(out), "--no-progress"]
    assert main([*common, "--to-card", str(run)]) == 2  # no training run there: refused before anything is written
    assert "holds no README.md" in capsys.readouterr().err and not out.exists()
    run.mkdir()
    ModelCard.from_template(ModelCardData(license="apache-2.0"), template_str="---\n{{ card_data }}\n---\n# run\n").save(
        run / "README.md")
    assert main([*common, "--to-card", str(run)]) == 0
    saved = json.loads((out / "results.json").read_text())
    card = ModelCard.load(run / "README.md")
    (result,) = card.data.eval_results
    assert (result.dataset_name, result.metric_type) == ("gsm8k", "pass@1")
    assert result.metric_value == pytest.approx(100 * saved["metrics"]["gsm8k"]["pass@1"])
    assert card.data.license == "apache-2.0"
