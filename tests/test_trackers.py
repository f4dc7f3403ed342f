"""The recipes' tracker: the `triage/` metrics a trainer logs land in trackio's local store (no account, no network).

A real ``transformers.Trainer`` logs a record holding TRIAGE metrics (``Trainer.log`` is where TRL's GRPOTrainer sends
its averaged ``triage/`` metrics) to the callback that the tiny recipe's ``report_to`` selects; trackio's own CLI
then reads the values back from its local database. Both run in subprocesses with ``TRACKIO_DIR`` in ``tmp_path``:
trackio fixes its folder when first imported, and TRL imports it as soon as it is installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from triage_trl.runtime import child_process_env
import yaml

pytest.importorskip("trackio")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LOG_TRAINING = textwrap.dedent("""\
    import sys
    import torch
    from transformers import Trainer, TrainingArguments

    report_to, output_dir = sys.argv[1], sys.argv[2]
    args = TrainingArguments(output_dir=output_dir, report_to=report_to, project="triage-test", run_name="tiny",
                             use_cpu=True, logging_steps=1)
    trainer = Trainer(model=torch.nn.Linear(2, 2), args=args)
    trainer.callback_handler.on_train_begin(args, trainer.state, trainer.control)
    for step, k3_kl in ((1, 0.125), (2, 0.0625)):
        trainer.state.global_step = step
        trainer.log({"loss": 0.5, "triage/k3_kl": k3_kl, "triage/amp_imbalance": 0.25 * step})
    trainer.callback_handler.on_train_end(args, trainer.state, trainer.control)
""")


def run(cmd, env, cwd):
    done = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_triage_metrics_land_in_trackio_local_store(tmp_path):
    with open(os.path.join(ROOT, "recipes", "tiny_cpu.yaml"), encoding="utf-8") as f:
        report_to = yaml.safe_load(f)["report_to"]
    assert report_to == "trackio"
    env = child_process_env(TRACKIO_DIR=str(tmp_path / "trackio"), HF_HUB_OFFLINE="1",
                            PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    script = tmp_path / "log_training.py"
    script.write_text(LOG_TRAINING)
    run([sys.executable, str(script), report_to, str(tmp_path / "out")], env, tmp_path)
    assert (tmp_path / "trackio" / "triage-test.db").is_file()

    trackio = [sys.executable, "-c", "from trackio.cli import main; main()"]
    listed = json.loads(run([*trackio, "list", "metrics", "--project", "triage-test", "--run", "tiny", "--json"],
                            env, tmp_path))
    assert {"train/triage/k3_kl", "train/triage/amp_imbalance", "train/loss"} <= set(listed["metrics"])
    got = json.loads(run([*trackio, "get", "metric", "--project", "triage-test", "--run", "tiny",
                          "--metric", "train/triage/k3_kl", "--json"], env, tmp_path))
    assert [v["value"] for v in got["values"]] == [0.125, 0.0625]
