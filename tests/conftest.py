"""Shared pytest fixtures. Each owner keeps its fixtures in its own commented block."""

import json
import os
from pathlib import Path

import pytest

# --- scheduling (make test: two xdist workers, --dist loadscope) ---
MODULE_SECONDS = Path(__file__).with_name("module_seconds.json")
_TIMES_OUT = os.environ.get("TRIAGE_TEST_TIMES")
_module_seconds: dict[str, float] = {}


def _module(nodeid: str) -> str:
    return nodeid.split("::", 1)[0].rsplit("/", 1)[-1]


def _rendezvous_port(worker: int) -> int:
    """A free port for worker ``worker``'s in-process engines, below the kernel's ephemeral range: a port the kernel
    hands out (to a child's ``get_free_port``, gloo, an outgoing connection) is never one of these, so no other
    process can hold it between two of the worker's engines. Port 0's choice where that range starts low."""
    import socket

    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            first_ephemeral = int(f.read().split()[0])
    except OSError:  # not Linux
        first_ephemeral = 1024
    candidates = range(max(1024, first_ephemeral - 4000) + 100 * worker, first_ephemeral)[:100]
    for port in [*candidates, 0]:
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return sock.getsockname()[1]
    raise RuntimeError("no free port for the worker's rendezvous")


def pytest_configure(config):
    """On an xdist worker, torch (and the subprocesses it starts, through ``OMP_NUM_THREADS``) gets the worker's share
    of the cores (two workers each spinning two OpenMP threads on two cores oversubscribe them), and the worker gets a
    rendezvous port of its own."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if hasattr(config, "workerinput") and workers > 1:
        import torch

        # Each worker its own rendezvous port for in-process engines: once a vLLM engine has made torch.distributed
        # live, accelerate sets MASTER_PORT=29500 when unset, and two workers' engines then collide on it.
        if not os.environ.get("MASTER_PORT"):
            os.environ["MASTER_PORT"] = str(_rendezvous_port(int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:])))

        threads = max(1, len(os.sched_getaffinity(0)) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


def pytest_collection_modifyitems(config, items):
    """Slowest modules first (``module_seconds.json``), the rest in collection order: with ``--dist loadscope`` each
    worker takes whole modules (module fixtures run once) and the longest ones cannot start last."""
    seconds = {k: v for k, v in json.loads(MODULE_SECONDS.read_text()).items() if not k.startswith("_")}
    items.sort(key=lambda item: -seconds.get(_module(item.nodeid), 0.0))  # stable: ties keep collection order


def pytest_runtest_logreport(report):
    if _TIMES_OUT:
        module = _module(report.nodeid)
        _module_seconds[module] = _module_seconds.get(module, 0.0) + report.duration


def pytest_sessionfinish(session, exitstatus):
    """With ``TRIAGE_TEST_TIMES=<file>``, write each module's seconds there (on the controller: every report)."""
    if _TIMES_OUT and _module_seconds and not hasattr(session.config, "workerinput"):
        import datetime
        import platform

        about = json.loads(MODULE_SECONDS.read_text()).get("_about", "")
        workers = getattr(session.config.option, "numprocesses", 0) or 0
        measured = f"{datetime.date.today()}, {workers} xdist workers, {os.cpu_count()} CPUs ({platform.machine()})"
        ranked = sorted(_module_seconds.items(), key=lambda kv: -kv[1])
        Path(_TIMES_OUT).write_text(json.dumps({"_about": about, "_measured": measured,
                                                **{k: round(v, 1) for k, v in ranked}}, indent=2) + "\n")
# --- end scheduling ---


# 128 MiB: thousands of tokens for the tiny test models. The product's 1 GiB costs each engine about 0.6 s more here
# (allocating and zeroing it, and vLLM's per-block bookkeeping, which every full garbage collection then walks).
TEST_KV_CACHE_GIB = 0.125


@pytest.fixture(scope="session")
def in_process_vllm():
    """The process settings every vLLM engine of the test session runs in (``triage_trl.runtime``): the engine core
    in this process (the one-call weight sync and the CPU NVFP4 kernel need it), a KV cache of ``TEST_KV_CACHE_GIB``,
    torch's threads given back after each engine start; restored at the end of the session."""
    from triage_trl.runtime import vllm_process_settings

    with vllm_process_settings(cpu_kv_cache_gib=TEST_KV_CACHE_GIB):
        yield


# --- trainer fixtures ---
@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory):
    """A tiny random Qwen3 (2 blocks, hidden 128, NVFP4-friendly shapes) and its tokenizer, saved once per session."""
    from triage_trl.testing import save_tiny_qwen3

    return str(save_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3-trainer")))


@pytest.fixture(scope="session")
def vllm_trainers(tmp_path_factory, tiny_qwen3_dir, in_process_vllm):
    """Build-once cache of TriageGRPOTrainer runs with the real in-process vLLM CPU sampler.

    ``vllm_trainers(key, **config)`` builds a trainer (its own vLLM engine), runs ``trainer.train()`` once and
    caches it under ``key`` for the session, so several tests share one engine and one run. ``train_seed`` draws
    the 8 training prompts (``arith_dataset``); ``calibration_dataset`` goes to the trainer as it is.
    ``vllm_trainers.build(key, train=False, **config)`` builds one outside the cache (close it after use).
    """
    import torch

    cache = {}

    def build(key, peft_config=None, train_seed=0, calibration_dataset=None, train=True, **config):
        from triage_trl.trainer import TriageGRPOConfig, TriageGRPOTrainer
        from triage_trl.data.arith import arith_dataset
        from triage_trl.rewards import digit_share_reward

        kwargs = dict(
            output_dir=str(tmp_path_factory.mktemp(f"trainer-{key}")), use_cpu=True, bf16=False,
            use_vllm=True, vllm_mode="colocate", vllm_max_model_length=256, per_device_train_batch_size=4,
            num_generations=4, max_completion_length=16, learning_rate=1e-4, max_steps=1, logging_steps=1,
            save_strategy="no", report_to="none", seed=0, loss_type="grpo", nvfp4_calibration_prompts=2,
            model_init_kwargs={"dtype": torch.bfloat16},
        )
        kwargs.update(config)
        trainer = TriageGRPOTrainer(
            model=tiny_qwen3_dir, reward_funcs=digit_share_reward, args=TriageGRPOConfig(**kwargs),
            train_dataset=arith_dataset(8, seed=train_seed), peft_config=peft_config,
            calibration_dataset=calibration_dataset,
        )
        if train:
            trainer.train()
        return trainer

    def get(key, **config):
        if key not in cache:
            cache[key] = build(key, **config)
        return cache[key]

    get.build = build
    try:
        yield get
    finally:
        cache.clear()
# --- end trainer fixtures ---


# --- nvfp4 fixtures ---
@pytest.fixture(scope="session")
def nvfp4_tiny_qwen3(tmp_path_factory):
    """``load(dtype=torch.bfloat16) -> (model, tokenizer)``: a fresh copy of a tiny random Qwen3 (2 blocks, 14 linears
    that NVFP4 can quantise), saved once per session; ``load.path`` is its folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from triage_trl.testing import save_tiny_qwen3

    path = save_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3-nvfp4"))

    def load(dtype=torch.bfloat16):
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype), AutoTokenizer.from_pretrained(path)

    load.path = path
    return load


@pytest.fixture(scope="session")
def nvfp4_vllm_engine(tmp_path_factory, in_process_vllm):
    """vLLM on CPU (in-process, eager, 1 GiB KV cache) serving an NVFP4 export of a tiny Qwen3.

    Yields a namespace: ``llm`` (``vllm.LLM``), ``hf_dir`` (the bf16 model it was exported from;
    its ``lm_head`` is scaled x20 so greedy log-probs are far from uniform), ``ckpt_dir`` and
    ``input_global_scales``. Runs the sampler's CPU kernel (``FastCpuNvFp4LinearKernel``).
    """
    from types import SimpleNamespace

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from triage_trl.nvfp4.checkpoint_tensors import calibrate_input_global_scales, save_nvfp4_checkpoint
    from triage_trl.sampler.vllm_engine import start_engine
    from triage_trl.testing import save_tiny_qwen3

    root = tmp_path_factory.mktemp("nvfp4-vllm")
    src = save_tiny_qwen3(root / "src")
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    tok = AutoTokenizer.from_pretrained(src)
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    hf_dir = root / "hf"
    model.save_pretrained(hf_dir)
    tok.save_pretrained(hf_dir)
    prompts = ["What is 3 + 4? Let me think step by step.", "Compute 12 - 5.\nFirst, 12 - 5 = 7."]
    scales = calibrate_input_global_scales(model, tok, prompts)
    ckpt_dir = save_nvfp4_checkpoint(model, tok, root / "nvfp4", scales)
    llm, _ = start_engine(ckpt_dir, "nvfp4", max_model_len=512, seed=0)
    yield SimpleNamespace(llm=llm, hf_dir=hf_dir, ckpt_dir=ckpt_dir, input_global_scales=scales)
    del llm
# --- end nvfp4 fixtures ---


# --- sampler fixtures ---
@pytest.fixture(scope="session")
def triage_samplers(tmp_path_factory, in_process_vllm):
    """Build-once cache of ``TriageVLLMGeneration`` engines (in-process vLLM CPU, eager, 1 GiB KV cache).

    ``triage_samplers(precision)`` returns a namespace with ``gen`` (the sampler), ``model`` (its learner in the
    engines' dtype, ``runtime.engine_dtype()``: bf16, float32 on CPUs without bf16 instructions; a
    tiny random Qwen3 whose ``lm_head`` is scaled, x8 for bf16 and x2 for nvfp4, so log-probs are far from
    uniform while the NVFP4 error the big logits amplify stays moderate), ``tokenizer`` and
    ``temperature`` (1.0 for bf16, 0.7 for nvfp4, so both probe-scoring paths run). ``tied=True``: the same model
    with its ``lm_head`` tied to the embedding (scaled alike). One engine per setting per session; tests that
    change the learner's weights must restore them and sync again.
    """
    from types import SimpleNamespace

    import torch

    cache = {}

    def get(precision, tied=False, architecture="Qwen3"):
        if (precision, tied, architecture) not in cache:
            from accelerate import Accelerator
            from transformers import AutoModelForCausalLM, AutoTokenizer

            from triage_trl.runtime import engine_dtype
            from triage_trl.sampler.vllm_generation import TriageVLLMGeneration
            from triage_trl.testing import save_tiny_model, save_tiny_qwen3

            root = tmp_path_factory.mktemp(f"sampler-{architecture}-{precision}{'-tied' if tied else ''}")
            src = (save_tiny_qwen3(root / "src", tie_word_embeddings=tied) if architecture == "Qwen3" else
                   save_tiny_model(root / "src", architecture, hidden_size=128, intermediate_size=256,
                                   num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                                   tie_word_embeddings=tied))
            model = AutoModelForCausalLM.from_pretrained(src, dtype=engine_dtype())
            tokenizer = AutoTokenizer.from_pretrained(src)
            with torch.no_grad():
                model.lm_head.weight.mul_(8 if precision == "bf16" else 2)
            temperature = 1.0 if precision == "bf16" else 0.7
            gen = TriageVLLMGeneration(
                model, Accelerator(cpu=True), tokenizer,
                sampler_precision=precision,
                calibration_prompts=["What is 3 + 4? Let me think step by step.", tokenizer("Compute 12 - 5.")["input_ids"]],
                checkpoint_dir=str(root / "ckpt"),
                max_model_length=256, max_num_seqs=8, max_completion_length=8, temperature=temperature,
            )
            cache[precision, tied, architecture] = SimpleNamespace(gen=gen, model=model, tokenizer=tokenizer,
                                                                   temperature=temperature)
        return cache[precision, tied, architecture]

    try:
        yield get
    finally:
        cache.clear()
# --- end sampler fixtures ---


# --- eval fixtures ---
@pytest.fixture(scope="session")
def eval_vllm_nvfp4(tmp_path_factory, in_process_vllm):
    """``triage_trl.eval.backends.VLLMBackend`` serving an NVFP4 export of a tiny Qwen3 (in-process vLLM CPU).

    Yields a namespace: ``backend`` (exported with the evaluator's own path: calibration, compressed-tensors
    checkpoint, fast CPU kernel), ``model_dir`` (the bf16 source folder). 1 GiB KV cache, max_model_len 1024.
    """
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from triage_trl.eval.backends import VLLMBackend
    from triage_trl.testing import save_tiny_qwen3

    root = tmp_path_factory.mktemp("eval-vllm")
    model_dir = save_tiny_qwen3(root / "model")
    tok = AutoTokenizer.from_pretrained(model_dir)
    backend = VLLMBackend(
        str(model_dir), precision="nvfp4", tokenizer=tok, max_model_len=1024, seed=0,
        calibration_prompts=["What is 3 + 4? Put your final answer within \\boxed{}.", "Compute 12 - 5."],
        checkpoint_dir=root / "nvfp4",
    )
    yield SimpleNamespace(backend=backend, model_dir=str(model_dir))
    del backend
# --- end eval fixtures ---


# --- demo / embedded model fixtures ---
@pytest.fixture(scope="session")
def smollm2_dir():
    """The embedded default SmolLM2-135M-Instruct as a plain folder (converted once into the model cache)."""
    from triage_trl.models import resolve_model_path

    return resolve_model_path()
# --- end demo / embedded model fixtures ---


# --- device fixtures (scripts/gpu_check.py) ---
@pytest.fixture(scope="session")
def test_device():
    """The device the device-aware tests run on: ``TRIAGE_TEST_DEVICE`` (``cpu`` by default; ``scripts/gpu_check.py``
    sets ``cuda``). Skips, with the reason, when CUDA is asked for and absent."""
    import torch

    device = os.environ.get("TRIAGE_TEST_DEVICE", "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        pytest.skip(f"TRIAGE_TEST_DEVICE={device} but torch sees no CUDA device")
    return torch.device(device)


@pytest.fixture
def grpo_config(tmp_path):
    """``make(**overrides) -> TriageGRPOConfig``: a CPU config in ``tmp_path`` (batch 4, 4 generations, no saving, no
    trackers); ``overrides`` are any ``TriageGRPOConfig`` fields. It validates, so a refused launch raises here."""
    from triage_trl.trainer import TriageGRPOConfig

    def make(**overrides):
        kwargs = dict(output_dir=str(tmp_path), use_cpu=True, bf16=False, per_device_train_batch_size=4,
                      num_generations=4, report_to="none", save_strategy="no")
        kwargs.update(overrides)
        return TriageGRPOConfig(**kwargs)

    return make
