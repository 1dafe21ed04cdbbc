"""Command line of ``train``: ``train [--config FILE] [section.key=value ...]``."""

from __future__ import annotations

import argparse

import torch.distributed as dist

from srtrain.config import load_config
from srtrain.errors import exit_code


def main(argv: list[str] | None = None) -> int:
    """Parse arguments and train; an error a user can cause is one line from rank 0 and exit
    code 2 on every rank (see srtrain.errors; ``SRTRAIN_DEBUG=1`` adds tracebacks)."""
    parser = argparse.ArgumentParser(
        prog="train",
        description="Pretrain a LLaMA or GPT-NeoX model with low-precision Adam states. "
        "Without --config the tiny default runs (configs/tiny.yaml).",
    )
    parser.add_argument("--config", help="YAML config file (see configs/)")
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="section.key=value",
        help="override any config value, e.g. optim.v_format=fp8",
    )
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        from srtrain.trainer import run

        run(cfg)
    except Exception as err:  # bugs: exit_code re-raises them
        return exit_code(err)
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    return 0
