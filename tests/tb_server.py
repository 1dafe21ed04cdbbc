"""Test helper: run a real TensorBoard server on 127.0.0.1 and read scalars over its HTTP API."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from distributed import HOST, free_port

Scalars = dict[str, dict[str, list[tuple[int, float]]]]


class TensorBoardClient:
    """JSON requests to one local TensorBoard server (no proxies, bounded timeouts)."""

    def __init__(self, port: int) -> None:
        self.base_url = f"http://{HOST}:{port}"
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def get_json(self, path: str, params: dict[str, str] | None = None) -> object:
        """GET base_url + path with query params and decode the JSON body."""
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with self._opener.open(f"{self.base_url}{path}{query}", timeout=10) as response:
            return json.loads(response.read())

    def scalar_tags(self) -> dict[str, list[str]]:
        """Run name -> scalar tags the server has loaded."""
        tags = self.get_json("/data/plugin/scalars/tags")
        return {run: sorted(run_tags) for run, run_tags in tags.items()}

    def scalars(self, run: str, tag: str) -> list[tuple[int, float]]:
        """(step, value) pairs of one scalar series."""
        rows = self.get_json("/data/plugin/scalars/scalars", {"run": run, "tag": tag})
        return [(int(step), float(value)) for _, step, value in rows]

    def wait_for_tags(self, tags: Iterable[str], timeout_s: float) -> dict[str, list[str]]:
        """Poll until one run holds every tag; raise TimeoutError naming the missing ones."""
        wanted = set(tags)
        deadline = time.monotonic() + timeout_s
        loaded: dict[str, list[str]] = {}
        while time.monotonic() < deadline:
            try:
                loaded = self.scalar_tags()
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                loaded = {}
            if any(wanted <= set(run_tags) for run_tags in loaded.values()):
                return loaded
            time.sleep(0.5)
        missing = {run: sorted(wanted - set(run_tags)) for run, run_tags in loaded.items()}
        raise TimeoutError(
            f"TensorBoard at {self.base_url} lacks tags after {timeout_s}s: "
            f"{missing or 'no runs loaded'}"
        )


@contextmanager
def tensorboard_server(logdir: Path, start_timeout_s: float = 60.0) -> Iterator[TensorBoardClient]:
    """Start `python -m tensorboard.main` on a free local port; always terminated on exit."""
    with tempfile.TemporaryFile() as log:
        for _attempt in range(3):
            port = free_port()
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tensorboard.main",
                    "--logdir",
                    str(logdir),
                    "--host",
                    HOST,
                    "--port",
                    str(port),
                    "--load_fast",
                    "false",
                    "--reload_interval",
                    "1",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            try:
                client = TensorBoardClient(port)
                if _wait_until_serving(client, proc, start_timeout_s):
                    yield client
                    return
                exited = proc.poll() is not None
            finally:
                _stop(proc)
            if not exited:
                break
        log.seek(0)
        tail = log.read()[-2000:].decode(errors="replace")
        raise RuntimeError(f"TensorBoard did not serve on {HOST} for {logdir}:\n{tail}")


def _stop(proc: subprocess.Popen) -> None:
    """Terminate the server process, killing it if it lingers."""
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def _wait_until_serving(
    client: TensorBoardClient, proc: subprocess.Popen, timeout_s: float
) -> bool:
    """True once the server answers; False if it exits or the time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            client.get_json("/data/runs")
            return True
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.3)
    return False


def read_tensorboard_scalars(
    logdir: Path, required_tags: Iterable[str], timeout_s: float = 60.0
) -> Scalars:
    """Every scalar series under logdir as run -> tag -> [(step, value)], once all tags load."""
    required_tags = list(required_tags)
    with tensorboard_server(logdir, start_timeout_s=timeout_s) as client:
        runs = client.wait_for_tags(required_tags, timeout_s)
        return {
            run: {tag: client.scalars(run, tag) for tag in run_tags}
            for run, run_tags in runs.items()
        }
