#!/usr/bin/env python3
"""torchrun as the launch scripts run it: the same launcher, ending on a signal with one line.

torchrun forwards SIGTERM and SIGINT to its workers (each finishes its step, saves a
checkpoint and exits; see srtrain.stopping), waits up to its shutdown timeout
(TORCH_ELASTIC_SHUTDOWN_TIMEOUT, seconds) and then raises SignalException, which a bare
torchrun prints as a traceback. Here that is one line and exit code 128 + the signal.
Usage: python launch/torchrun.py [torchrun arguments]
"""

import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.run import main

if __name__ == "__main__":
    try:
        main()
    except SignalException as stop:
        print(
            f"torchrun: stopped by {stop.sigval.name}; its workers were given the signal "
            "(each saves a checkpoint first: see their lines above)",
            file=sys.stderr,
            flush=True,
        )
        sys.exit(128 + int(stop.sigval))
