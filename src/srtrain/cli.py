"""Command line of ``train``: ``train [--config FILE] [section.key=value ...]``."""

from __future__ import annotations

import argparse
import sys

from srtrain.stopping import RunStopped, StopSignals, handling


def main(argv: list[str] | None = None) -> int:
    """Parse arguments and train; an error a user can cause is one line from rank 0 and exit
    code 2 on every rank (see srtrain.errors; ``SRTRAIN_DEBUG=1`` adds tracebacks). SIGTERM
    or SIGINT stops the run with one line (see srtrain.stopping): exit code 75 once a
    checkpoint is saved, 128 + the signal's number otherwise."""
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
    with handling() as stop:  # before the heavy imports: a signal during them is one line
        try:
            from srtrain.config import load_config

            cfg = load_config(args.config, args.overrides)
            from srtrain.trainer import run

            run(cfg)
        except RunStopped as stopped:
            return _report(stop, stopped)
        except Exception as err:  # bugs: exit_code re-raises them
            if stop.signum is not None and not stop.in_training:  # a setup a signal broke
                return _report(stop, stop.failed(stop.signum, err))
            from srtrain.errors import exit_code

            return exit_code(err)
        finally:
            _destroy_process_group()
    return 0


def _report(stop: StopSignals, stopped: RunStopped) -> int:
    """Print a stopped run's line (rank 0); its exit code."""
    if stop.rank == 0:
        print(stopped.line, flush=True)
    return stopped.code


def _destroy_process_group() -> None:
    dist = sys.modules.get("torch.distributed")  # not imported: nothing to destroy
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
