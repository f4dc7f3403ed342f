"""``triage-export`` / ``triage-trl export``: a training run's weights as an NVFP4 checkpoint ``vllm serve`` loads.

Example::

    triage-export runs/tiny_cpu --output runs/tiny_cpu-nvfp4
    vllm serve runs/tiny_cpu-nvfp4
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import sys
import threading

from .. import __version__

EPILOG = """\
examples:
  triage-export runs/tiny_cpu --output runs/tiny_cpu-nvfp4 && vllm serve runs/tiny_cpu-nvfp4
  triage-export runs/mine --checkpoint checkpoint-200 --output mine-200-nvfp4 --push-to-hub me/mine-nvfp4"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="triage-export",
        description="Export a TRIAGE-GRPO run's trained weights (final, or a checkpoint-N folder) as a sharded "
        "compressed-tensors NVFP4 checkpoint with config, tokenizer, generation config and a model card: the format "
        "the run's vLLM sampler served, with its layer selection and activation scales calibrated on the run's "
        "prompts (triage_run.json), or on built-in prompts when the run folder records none.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_dir", help="the training run's --output_dir")
    p.add_argument("--output", required=True, help="folder to write (must not hold files, unless --overwrite)")
    p.add_argument("--checkpoint", default=None, help="a checkpoint-N folder of the run (default: the final weights)")
    p.add_argument("--push-to-hub", default=None, metavar="REPO_ID", help="upload the folder to this Hub model repo")
    p.add_argument("--private", action="store_true", default=None, help="create the Hub repo private")
    p.add_argument("--base-model", default=None,
                   help="the card's base_model (default: the run's, from its card), e.g. the trained run's Hub repo")
    p.add_argument("--max-shard-size", default="5GB", help="safetensors shard size (default: %(default)s)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing --output folder (an earlier export; never a run folder or one "
                   "holding one)")
    p.add_argument("--version", action="version", version=f"triage-trl {__version__}")
    return p


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``triage-export``; returns 0, or 2 with one line on stderr when an input is bad (nothing is
    written then)."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s", level=logging.WARNING)
    logging.getLogger("triage_trl").setLevel(logging.INFO)
    with _sigterm_exits():
        return _export(args)


@contextlib.contextmanager
def _sigterm_exits():
    """SIGTERM raises ``SystemExit`` (an ordinary exit, so the partial folder is deleted) while exporting."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _export(args) -> int:
    from .writer import export_run

    try:
        result = export_run(args.run_dir, args.output, checkpoint=args.checkpoint, push_to_hub=args.push_to_hub,
                            base_model=args.base_model, overwrite=args.overwrite, max_shard_size=args.max_shard_size,
                            private=args.private)
    except (FileNotFoundError, FileExistsError, ValueError) as err:
        print(f"triage-export: error: {err}", file=sys.stderr)
        return 2
    print(f"NVFP4 checkpoint ({result.nvfp4_layers} NVFP4 layers, {result.bf16_layers} bf16; activation scales from "
          f"{result.calibration} prompts) written to {result.output_dir}")
    print(f"serve it with: vllm serve {result.output_dir}")
    if result.hub_url:
        print(f"pushed: {result.hub_url}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
