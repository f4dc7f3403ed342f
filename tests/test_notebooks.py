"""The example notebooks run as stored (executed with nbclient in a temporary working folder, offline).

``triage_grpo_quickstart.ipynb`` with its CI parameters (tiny random Qwen3, 2 steps): about 2 minutes on 2 CPU cores.
"""

import json
import os
from pathlib import Path

import pytest

from triage_trl.runtime import child_process_env
from triage_trl.provenance import git_revision

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("vllm")

NOTEBOOKS = Path(__file__).resolve().parents[1] / "examples" / "notebooks"
QUICKSTART = NOTEBOOKS / "triage_grpo_quickstart.ipynb"


def test_notebooks_are_stored_without_outputs():
    for path in NOTEBOOKS.glob("*.ipynb"):
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert all(not c.outputs and c.execution_count is None for c in code), path.name
        assert sum("parameters" in c.metadata.get("tags", []) for c in code) == 1, path.name


def stdout(cell) -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")


@pytest.mark.slow
def test_quickstart_notebook_runs(tmp_path):
    nb = nbformat.read(QUICKSTART, as_version=4)
    # The kernel imports this checkout of triage_trl. Without PYTEST_CURRENT_TEST: under pytest ipykernel does not
    # capture the process's stdout file descriptor, and vLLM's engine start needs sys.stdout.fileno().
    # The kernel is a child process: without this session's torch.distributed rendezvous (an earlier in-process
    # engine's MASTER_PORT), and without PYTEST_CURRENT_TEST (ipykernel then leaves stdout's file descriptor alone,
    # and vLLM's engine start needs `sys.stdout.fileno()`).
    env = {k: v for k, v in child_process_env().items() if k != "PYTEST_CURRENT_TEST"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(QUICKSTART.parents[2]), os.environ.get("PYTHONPATH")]))
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute(env=env)
    out = {i: stdout(c) for i, c in enumerate(nb.cells) if c.cell_type == "code"}
    text = "\n".join(out.values())
    assert "steps: 2\n" in text
    assert "triage/ records: 2;" in text
    assert "held-out accuracy before: " in text and "held-out accuracy after: " in text
    # tiny Qwen3: 2 blocks x 7 linears, all NVFP4 by default; calibrated on the run's recorded prompts
    assert "exported: 14 NVFP4 layers, 1 bf16; calibration: run" in text
    assert "card: text-generation ['triage', 'trl', 'grpo', 'nvfp4', 'compressed-tensors', 'vllm']" in text
    assert "vllm serve triage-quickstart-nvfp4\n" in text
    run = tmp_path / "triage-quickstart"
    record = json.loads((run / "triage_run.json").read_text())
    assert len(record["calibration_prompts"]) == 4 and record["nvfp4"]["learner_precision"] == "nvfp4"
    assert record["git_commit"] == git_revision()["git_commit"]  # the checkout the run came from (None: installed)
    assert json.loads((run / "trainer_state.json").read_text())["global_step"] == 2
    assert (run / "triage_metrics.png").is_file() and (tmp_path / "triage-quickstart-nvfp4" / "config.json").is_file()
