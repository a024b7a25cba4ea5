"""Screenshot MLflow's compare view of the latest pipeline runs in a store, with headless Chromium (for the docs).

Starts `mlflow server` on the store (a child process, stopped by PID at the end), finds the newest `--runs` pipeline
runs (the parent runs, tag `async_grpo.role = pipeline`) of the experiment, and has Chromium render the compare page
of those runs to a PNG.

    .venv/bin/python scripts/mlflow_compare_screenshot.py --store /tmp/demo24 --out docs/images/mlflow_compare.png

Needs Debian's `chromium` (`apt-get install chromium`); nothing here runs in CI.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

STARTUP_TIMEOUT_S = 120.0
RENDER_BUDGET_MS = 20_000  # Chromium's virtual time for the single-page app to fetch and draw the runs


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_up(url: str, timeout_s: float) -> None:
    """Return once `url`/health answers 200; TimeoutError after `timeout_s` seconds."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as answer:
                if answer.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"mlflow server at {url} not up after {timeout_s:.0f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", required=True, type=Path, help="folder holding mlflow.db and mlartifacts/")
    parser.add_argument("--experiment", default="async-grpo")
    parser.add_argument("--runs", type=int, default=2, help="how many of the newest pipeline runs to compare")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--size", default="1600,1500", help="window width,height in pixels")
    args = parser.parse_args(argv)
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        print("error: chromium not found. Fix: apt-get install chromium", file=sys.stderr)
        return 2

    from mlflow import MlflowClient

    uri = f"sqlite:///{args.store.resolve() / 'mlflow.db'}"
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name(args.experiment)
    if experiment is None:
        print(f"error: no experiment {args.experiment!r} in {uri}", file=sys.stderr)
        return 2
    runs = client.search_runs(
        [experiment.experiment_id],
        filter_string="tags.`async_grpo.role` = 'pipeline'",
        order_by=["attributes.start_time DESC"],
        max_results=args.runs,
    )
    ids = [r.info.run_id for r in reversed(runs)]
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", uri, "--host", "127.0.0.1", "--port",
         str(port), "--artifacts-destination", (args.store.resolve() / "mlartifacts").as_uri()],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_up(base, STARTUP_TIMEOUT_S)
        query = urllib.parse.urlencode(
            {"runs": json.dumps(ids), "experiments": json.dumps([experiment.experiment_id])}, safe='[]",'
        )
        page = f"{base}/#/compare-runs?{query}"
        args.out.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [chromium, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
             f"--window-size={args.size}", f"--virtual-time-budget={RENDER_BUDGET_MS}",
             f"--screenshot={args.out.resolve()}", page],
            check=True, timeout=180, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        print(f"wrote {args.out} ({page})")
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
