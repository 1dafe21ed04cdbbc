"""Command line of ``train``: ``train [--config FILE] [section.key=value ...]``."""

from __future__ import annotations

import argparse
import sys

import torch.distributed as dist

from srtrain.config import ConfigError, load_config
from srtrain.data import DataError


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, train, and turn configuration and data errors into one line."""
    parser = argparse.ArgumentParser(
        prog="train",
        description="Pretrain a LLaMA or GPT-NeoX model with low-precision Adam states. "
        "Without --config the tiny default runs (configs/tiny.yaml).",
    )
    parser.add_argument("--config", help="YAML config file (see configs/)")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value",
                        help="override any config value, e.g. optim.v_format=fp8")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        from srtrain.trainer import run

        run(cfg)
    except (ConfigError, DataError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    return 0
