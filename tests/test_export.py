"""``triage-export``: a run folder's weights as a sharded NVFP4 compressed-tensors checkpoint with a card.

The run folders are built, not trained: a tiny random Qwen3 (``save_tiny_qwen3``) as the final weights and as a
``checkpoint-2`` folder, a ``trainer_state.json``, the run's card and its ``triage_run.json`` record. The slow test
loads an export in vLLM's CPU engine (vLLM's own NVFP4 emulation kernel, what ``vllm serve`` runs without our
kernel) and compares its prompt log-probs with the bf16 model's: measured 0.046 nats mean gap on an AMD EPYC (the
W4A4 error of block 0 of a random tiny model; bound 0.15).
"""

import json
import os

import pytest
import torch
from huggingface_hub import ModelCard, ModelCardData
from safetensors.torch import load_file

from triage_trl.export import RUN_RECORD, export_run, find_export_source
from triage_trl.export.cli import main
from triage_trl.models import SMOLLM2_HUB_ID
from triage_trl.runtime import child_process_env
from triage_trl.testing import save_tiny_qwen3

PROMPTS = ["What is 3 + 4?", "Compute 12 - 5 step by step.", "The quick brown fox jumps over the lazy dog."]
TINY_LINEARS = 14  # 2 blocks x (q, k, v, o, gate, up, down)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A finished-looking run: final weights (seed 0), checkpoint-2 (seed 1), state, card and run record."""
    run = tmp_path_factory.mktemp("run") / "tiny_run"
    save_tiny_qwen3(run, seed=0)
    save_tiny_qwen3(run / "checkpoint-2", seed=1)
    (run / "trainer_state.json").write_text(json.dumps({"global_step": 3, "log_history": []}))
    (run / "checkpoint-2" / "trainer_state.json").write_text(json.dumps({"global_step": 2, "log_history": []}))
    data = ModelCardData(base_model=SMOLLM2_HUB_ID, license="apache-2.0", datasets=["openai/gsm8k"])
    ModelCard(f"---\n{data.to_yaml()}\n---\n# tiny_run\n").save(run / "README.md")
    record = {"triage_trl_version": "test", "model_name_or_path": str(run),
              "nvfp4": {"nvfp4_keep_last_blocks": 1, "nvfp4_four_over_six": False}, "calibration_prompts": PROMPTS}
    (run / RUN_RECORD).write_text(json.dumps(record))
    return run


def shards(folder):
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    tensors = {}
    for name in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(folder / name))
    return index, tensors


@pytest.fixture(scope="module")
def exported(run_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("exports") / "tiny-nvfp4"
    result = export_run(run_dir, out, max_shard_size="200KB")
    return out, result


def test_export_writes_a_sharded_compressed_tensors_checkpoint(exported):
    out, result = exported
    # keep_last_blocks=1 from the run record: block 1 stays bf16, block 0's 7 linears are NVFP4
    assert (result.nvfp4_layers, result.bf16_layers, result.calibration) == (7, TINY_LINEARS - 7 + 1, "run")
    index, tensors = shards(out)
    assert len(set(index["weight_map"].values())) > 1 and not (out / "model.safetensors").exists()
    assert set(index["weight_map"]) == set(tensors)
    assert tensors["model.layers.0.self_attn.q_proj.weight_packed"].dtype == torch.uint8
    assert tensors["model.layers.0.self_attn.q_proj.weight_packed"].shape == (128, 64)
    assert tensors["model.layers.0.mlp.down_proj.weight_scale"].dtype == torch.float8_e4m3fn
    assert tensors["model.layers.1.mlp.down_proj.weight"].dtype == torch.bfloat16
    assert "model.layers.1.mlp.down_proj.weight_packed" not in tensors
    config = json.loads((out / "config.json").read_text())
    quant = config["quantization_config"]
    assert quant["format"] == "nvfp4-pack-quantized" and config["dtype"] == "bfloat16"
    assert "model.layers.1.self_attn.q_proj" in quant["ignore"] and "lm_head" in quant["ignore"]
    assert "model.layers.0.self_attn.q_proj" not in quant["ignore"]
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "README.md"):
        assert (out / name).is_file(), name
    assert not [p for p in out.parent.iterdir() if ".partial-" in p.name]


def test_export_matches_the_samplers_own_export(exported, run_dir):
    """Same selection, same calibration code, same tensors as the sampler's in-memory export of those weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from triage_trl.nvfp4.calibration import calibrate_input_global_scales
    from triage_trl.nvfp4.config import NVFP4Config
    from triage_trl.nvfp4.checkpoint_tensors import iter_nvfp4_checkpoint_weights
    from triage_trl.nvfp4.selection import nvfp4_layer_selection
    from triage_trl.sampler.vllm_engine import sampler_tensors

    out, _ = exported
    model = AutoModelForCausalLM.from_pretrained(run_dir, dtype="auto")
    selection = nvfp4_layer_selection(model, NVFP4Config(nvfp4_keep_last_blocks=1))
    scales = calibrate_input_global_scales(model, AutoTokenizer.from_pretrained(run_dir), PROMPTS, selection=selection)
    expected = dict(sampler_tensors(iter_nvfp4_checkpoint_weights(model, scales, selection=selection)))
    _, tensors = shards(out)
    assert set(tensors) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(tensors[name].view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn else tensors[name],
                           tensor.view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn else tensor), name
    scale = float(tensors["model.layers.0.self_attn.q_proj.input_global_scale"])
    assert scale == 2.0 ** round(torch.log2(torch.tensor(scale)).item())  # rounded down to a power of two


def test_export_card_names_base_model_relation_run_and_serve_line(exported):
    out, _ = exported
    card = ModelCard.load(out / "README.md")
    assert card.data.base_model == SMOLLM2_HUB_ID
    assert card.data.base_model_relation == "quantized"
    assert card.data.license == "apache-2.0" and card.data.datasets == ["openai/gsm8k"]
    assert card.data.pipeline_tag == "text-generation" and "nvfp4" in card.data.tags
    assert f"vllm serve {out}" in card.text
    assert "tiny_run" in card.text and "final weights, step 3" in card.text
    assert "the run's 3 calibration prompts" in card.text


def test_checkpoint_export_and_built_in_prompts(run_dir, tmp_path):
    """A checkpoint folder exports its own weights; without a run record the built-in prompts calibrate."""
    plain = tmp_path / "plain_run"
    save_tiny_qwen3(plain / "checkpoint-5", seed=1)
    assert find_export_source(plain, "checkpoint-5").record is None
    result = export_run(plain, tmp_path / "out", checkpoint="checkpoint-5")
    assert result.calibration == "built-in" and result.nvfp4_layers == TINY_LINEARS
    card = ModelCard.load(tmp_path / "out" / "README.md")
    assert "built-in prompts (the run folder records no prompts)" in card.text and "checkpoint-5" in card.text
    assert card.data.base_model is None  # a local random model names no Hub model
    source = find_export_source(run_dir, "checkpoint-2")
    assert (source.weights_dir.name, source.step) == ("checkpoint-2", 2)


@pytest.mark.parametrize("args, message", [
    (["{missing}", "--output", "{out}"], "Run folder {missing} does not exist"),
    (["{empty}", "--output", "{out}"], "holds no model weights"),
    (["{run}", "--output", "{out}", "--checkpoint", "checkpoint-9"], "checkpoint-9 does not exist (checkpoints with "
                                                                     "weights: checkpoint-2)"),
    (["{run}", "--output", "{out}", "--checkpoint", "step-9"], "is not a checkpoint-N folder name"),
    (["{run}", "--output", "{taken}"], "already exists: choose a new --output folder, or pass --overwrite"),
])
def test_bad_inputs_exit_2_with_one_line_and_write_nothing(run_dir, tmp_path, capsys, args, message):
    paths = {"missing": tmp_path / "nope", "empty": tmp_path / "empty", "out": tmp_path / "out",
             "run": run_dir, "taken": tmp_path / "taken"}
    paths["empty"].mkdir()
    paths["taken"].mkdir()
    (paths["taken"] / "keep.txt").write_text("mine")
    before = sorted(os.listdir(tmp_path))
    assert main([a.format(**paths) for a in args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("triage-export: error: ") and message.format(**paths) in err[0]
    assert sorted(os.listdir(tmp_path)) == before and (paths["taken"] / "keep.txt").read_text() == "mine"


def test_failed_export_leaves_nothing(run_dir, tmp_path, monkeypatch):
    import triage_trl.export.writer as writer

    def broken(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(writer, "export_card", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        export_run(run_dir, tmp_path / "out")
    assert os.listdir(tmp_path) == []


def test_push_to_hub_uploads_the_finished_folder(run_dir, tmp_path, monkeypatch, capsys):
    from huggingface_hub import HfApi

    calls = []
    monkeypatch.setattr(HfApi, "create_repo", lambda self, repo_id, **kw: calls.append(("create", repo_id, kw)))

    def upload_folder(self, *, repo_id, folder_path, **kw):
        calls.append(("upload", repo_id, sorted(os.listdir(folder_path))))
        return "https://huggingface.co/me/tiny-nvfp4/commit/0"

    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    out = tmp_path / "out"
    assert main([str(run_dir), "--output", str(out), "--push-to-hub", "me/tiny-nvfp4", "--base-model", "me/tiny"]) == 0
    assert calls[0] == ("create", "me/tiny-nvfp4", {"repo_type": "model", "exist_ok": True, "private": None})
    assert calls[1][:2] == ("upload", "me/tiny-nvfp4") and "model.safetensors" in calls[1][2]
    card = ModelCard.load(out / "README.md")
    assert card.data.base_model == "me/tiny" and "vllm serve me/tiny-nvfp4" in card.text
    assert "pushed: https://huggingface.co/me/tiny-nvfp4/commit/0" in capsys.readouterr().out


@pytest.mark.slow
def test_export_generates_in_vllm_cpu_engine(exported, run_dir, in_process_vllm):
    pytest.importorskip("vllm")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import SamplingParams

    from triage_trl.sampler.vllm_engine import start_engine

    out, _ = exported
    llm, report = start_engine(out, "nvfp4", nvfp4_cpu_kernel="emulation", max_model_len=128, seed=0)
    try:
        assert "EmulationNvFp4LinearKernel x4" in report["linear_kernels"]  # block 0: qkv, o, gate_up, down
        ids = AutoTokenizer.from_pretrained(out)(PROMPTS[0] + " The answer is")["input_ids"]
        params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
        result = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
    finally:
        llm.llm_engine.engine_core.shutdown()
    assert len(result.outputs[0].token_ids) == 5
    sampler = torch.tensor([result.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))])
    model = AutoModelForCausalLM.from_pretrained(run_dir, dtype=torch.bfloat16)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    learner = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    gap = float((learner - sampler).abs().mean())
    assert gap < 0.15, gap


# --- an export never replaces or deletes a run, and cleans its partial folder ---
@pytest.mark.parametrize("target", ["run", "parent", "holder"])
def test_overwrite_never_replaces_or_deletes_a_run(run_dir, tmp_path, capsys, target):
    import shutil

    runs = tmp_path / "runs"
    run = runs / "mine"
    shutil.copytree(run_dir, run)
    (runs / "sibling" / "checkpoint-1").mkdir(parents=True)  # another run next to it
    holder = tmp_path / "holder"
    (holder / "deep" / "r").mkdir(parents=True)
    (holder / "deep" / "r" / "trainer_state.json").write_text("{}")
    output = {"run": run, "parent": runs, "holder": holder}[target]
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    assert main([str(run), "--output", str(output), "--overwrite"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"triage-export: error: --output {output} ")
    assert "choose an --output outside it" in err[0] and "--overwrite only replaces an earlier export" in err[0]
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before  # nothing written, nothing deleted


def test_overwrite_still_replaces_an_earlier_export(exported, run_dir, tmp_path):
    import shutil

    out = tmp_path / "again"
    shutil.copytree(exported[0], out)
    export_run(run_dir, out, overwrite=True, max_shard_size="200KB")
    assert (out / "model.safetensors.index.json").is_file()


def _hanging_export(run_dir, out, flag):
    """``triage-export RUN --output OUT`` in a subprocess that stops before writing the card (the shards are written),
    once ``flag`` exists."""
    import subprocess
    import sys
    import time

    code = ("import sys, time, pathlib\nimport triage_trl.export.writer as w\n"
            "def hang(*a, **k):\n    pathlib.Path(sys.argv[3]).write_text('x'); time.sleep(600)\n"
            "w.export_card = hang\nfrom triage_trl.export.cli import main\n"
            "main([sys.argv[1], '--output', sys.argv[2]])\n")
    env = child_process_env(PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-c", code, str(run_dir), str(out), str(flag)], env=env,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600
    while not flag.exists():
        assert proc.poll() is None, proc.stderr.read()[-2000:]
        assert time.monotonic() < deadline
        time.sleep(0.5)
    return proc


def test_a_killed_exports_partial_folder_is_removed_by_the_next_export(run_dir, tmp_path):
    import signal

    out = tmp_path / "out"
    proc = _hanging_export(run_dir, out, tmp_path / "writing")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    partial = [p for p in tmp_path.iterdir() if p.name.startswith(".out.partial-")]
    assert len(partial) == 1 and partial[0].name.startswith(f".out.partial-{proc.pid}-")
    assert not out.exists()
    export_run(run_dir, out, max_shard_size="200KB")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "writing"]


def test_sigterm_during_an_export_removes_its_partial_folder(run_dir, tmp_path):
    import signal

    proc = _hanging_export(run_dir, tmp_path / "out", tmp_path / "writing")
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    assert sorted(p.name for p in tmp_path.iterdir()) == ["writing"]
