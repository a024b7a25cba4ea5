"""The screenshots of docs/observability.md, taken with headless Chromium from a real MLflow UI on a finished run.

It starts `mlflow server` on the run's sqlite store (stopped by its PID at the end), opens the newest run's experiment
in Chromium through Playwright, and saves:
- `observability_trace.png`: the trace view of an episode that called a tool, its tool-call span selected;
- `observability_time_split.png`: the run's Model metrics tab, searched for `time/`.

Playwright and Chromium are documentation tools, not dependencies of the package: install them beside it, e.g.
`python3 -m venv /tmp/pw && /tmp/pw/bin/pip install playwright` and Debian's `chromium`, then run this script with
the repo's venv on PYTHONPATH for mlflow:

    .venv/bin/python -m async_grpo.cli train examples/tools_cpu.yaml output_dir=runs/tools-shots max_steps=60
    PYTHONPATH=.venv/lib/python3.11/site-packages /tmp/pw/bin/python scripts/observability_screenshots.py \\
        --store runs/tools-shots/mlflow.db --out docs/images
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path

from mlflow_compare_screenshot import free_port, wait_up  # this folder is on sys.path when run as a script

START_TIMEOUT_S = 60.0
UI_SETTLE_MS = 6000  # the UI loads its bundle and queries the server after the page's load event


def tool_trace(store_uri: str) -> tuple[str, str, str, str]:
    """(experiment id, run id, trace id, tool span name) of the newest run and one of its episodes with a tool-call
    span."""
    import mlflow

    client = mlflow.MlflowClient(store_uri)
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    run = max(runs, key=lambda r: r.info.start_time)
    for trace in client.search_traces(locations=[run.info.experiment_id], run_id=run.info.run_id, max_results=200):
        tools = [span.name for span in trace.data.spans if span.span_type == "TOOL"]
        if tools:
            return run.info.experiment_id, run.info.run_id, trace.info.trace_id, tools[0]
    raise RuntimeError(f"run {run.info.run_id} has no episode trace with a tool call (log_traces_steps, tools)")


def dismiss(page) -> None:
    """Close the UI's first-visit popups (a tip, the assistant panel) so that they hide nothing (a page without an
    open drawer: its close button is labelled the same)."""
    for button in (page.get_by_role("button", name="Got it"), page.locator("[aria-label='Close']")):
        if button.count():
            button.first.click(force=True, timeout=3000)  # force: an open trace drawer may cover the tip
    page.wait_for_timeout(500)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", type=Path, required=True, help="the run's sqlite MLflow store (mlflow.db)")
    p.add_argument("--out", type=Path, default=Path("docs/images"))
    p.add_argument("--chromium", default="/usr/bin/chromium")
    args = p.parse_args(argv)
    from playwright.sync_api import sync_playwright

    store_uri = f"sqlite:///{args.store.resolve()}"
    experiment, run_id, trace_id, tool = tool_trace(store_uri)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", store_uri, "--host", "127.0.0.1",
         "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        wait_up(base, START_TIMEOUT_S)
        args.out.mkdir(parents=True, exist_ok=True)
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=args.chromium, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1050, "height": 950})  # the trace drawer's width
            page.goto(f"{base}/#/experiments/{experiment}/traces?selectedEvaluationId={trace_id}")
            page.wait_for_timeout(UI_SETTLE_MS)  # the trace opens in a drawer over the list (and its tips)
            page.get_by_text(tool, exact=True).first.click(timeout=10_000)  # its span in the tree
            page.wait_for_timeout(1500)
            page.screenshot(path=str(args.out / "observability_trace.png"))
            page.set_viewport_size({"width": 1500, "height": 950})
            page.goto(f"{base}/#/experiments/{experiment}/runs/{run_id}/model-metrics")
            page.wait_for_timeout(UI_SETTLE_MS)
            dismiss(page)
            page.get_by_placeholder("Search metric charts").fill("time/")
            page.wait_for_timeout(2000)
            page.screenshot(path=str(args.out / "observability_time_split.png"))
            browser.close()
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # the server and the workers it started, by its process group
        server.wait(timeout=30)
    print(f"wrote {args.out / 'observability_trace.png'} and {args.out / 'observability_time_split.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
