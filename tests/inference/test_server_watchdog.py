"""`inference.server.ServerWatchdog` against a real child process that answers `/health` like vLLM (a stand-in: the
watchdog only reads the process and its health). The launched judge's end-to-end form, a real vLLM judge killed
mid-run, is tests/integration/test_judge.py."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from async_grpo.inference.server import ServerWatchdog, VLLMServer, free_port

HEALTH_SERVER = """
import http.server, sys
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


def _server(tmp_path: Path, script: str = HEALTH_SERVER) -> VLLMServer:
    port = free_port()
    command = [sys.executable, "-c", script, str(port)]
    return VLLMServer(command, dict(os.environ), tmp_path / "server.log", f"http://127.0.0.1:{port}", 30.0)


def _wait_for(predicate, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_a_killed_server_is_started_again_on_its_port(tmp_path):
    server = _server(tmp_path).start()
    watchdog = ServerWatchdog(server, "the stand-in", interval_s=0.2).start()
    try:
        first = server.process.pid
        os.kill(first, signal.SIGKILL)
        _wait_for(lambda: watchdog.restarts == 1 and server.healthy())
        assert server.process.pid != first and not server.exited()
        time.sleep(1.0)  # alive and healthy: left alone
        assert watchdog.restarts == 1 and watchdog.failed_restarts == 0
    finally:
        watchdog.close()
        server.close()
    assert server.process is None and not server.exited()


def test_a_server_that_does_not_come_back_is_tried_again_and_close_ends_the_watch(tmp_path):
    marker = tmp_path / "started-once"
    crash_after_first = (
        f"import pathlib, sys\np = pathlib.Path({str(marker)!r})\nif p.exists(): sys.exit(3)\np.touch()\n"
    )
    server = _server(tmp_path, crash_after_first + HEALTH_SERVER).start()
    watchdog = ServerWatchdog(server, "the stand-in", interval_s=0.2).start()
    try:
        os.kill(server.process.pid, signal.SIGKILL)
        _wait_for(lambda: watchdog.failed_restarts >= 2)  # exits 3 at every start now: retried, never fatal
        assert watchdog.restarts == 0
        marker.unlink()  # the next start serves again
        _wait_for(lambda: watchdog.restarts == 1 and server.healthy())
    finally:
        watchdog.close()
        server.close()


@pytest.mark.parametrize("closed_first", ["server", "watchdog"])
def test_closing_stops_restarts(tmp_path, closed_first):
    server = _server(tmp_path).start()
    watchdog = ServerWatchdog(server, "the stand-in", interval_s=0.2).start()
    if closed_first == "server":
        server.close()
    watchdog.close()
    server.close()
    time.sleep(0.6)
    assert watchdog.restarts == 0 and server.process is None
