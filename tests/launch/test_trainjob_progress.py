"""A TrainJob's progress (issue 53, KEP-2779): what the trainer reports through the Kubeflow SDK fits the TrainJob
CRD's status.trainerStatus, the reporting thread never blocks a step, and the trainer may reach the status server
only where the platform opens it."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from async_grpo.launch.k8s_network import build_network_policies
from async_grpo.launch.k8s_trainjob import build_trainjob
from async_grpo.launch.platform_policy import PlatformPolicy
from async_grpo.runner.trainjob_progress import SERVER_URL_ENV, TrainJobProgress, trainer_status

from ._k8s_validate import validate_trainer_object
from .conftest import RUN


def test_the_report_counts_steps_and_estimates_the_rest_from_the_rate_so_far():
    status = trainer_status(30, 120, 60.0, {"reward": 0.512345678, "eval/reward": 0.4, "loss": 3.0, "kl": None})
    assert status["progress_percent"] == 25 and status["estimated_remaining_seconds"] == 180  # 90 steps at 0.5 step/s
    assert status["metrics"] == {"step": 30, "max_steps": 120, "reward": 0.5123, "eval/reward": 0.4}
    assert trainer_status(0, 120, 0.0, {})["estimated_remaining_seconds"] is None
    assert trainer_status(130, 120, 10.0, {})["progress_percent"] == 100


def test_what_the_kubeflow_sdk_posts_fits_the_trainjob_crd_status(gpu_config, gpu_settings, tmp_path, monkeypatch):
    received = []

    class StatusServer(BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.append((self.path, self.headers["Authorization"], json.loads(body)))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), StatusServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    token = tmp_path / "token"
    token.write_text("projected-sa-token")
    monkeypatch.setenv(SERVER_URL_ENV, f"http://127.0.0.1:{server.server_port}/status/ns/{RUN}")
    monkeypatch.setenv("KUBEFLOW_TRAINER_SERVER_TOKEN", str(token))
    try:
        from kubeflow.trainer import update_trainjob_status

        assert update_trainjob_status(**trainer_status(30, 120, 60.0, {"reward": 0.51, "staleness/mean": 1.25}))
    finally:
        server.shutdown()
        thread.join(5)
    ((path, auth, body),) = received
    assert path == f"/status/ns/{RUN}" and auth == "Bearer projected-sa-token"
    status = body["trainerStatus"]
    assert status["progressPercentage"] == 25 and status["estimatedRemainingSeconds"] == 180
    assert {m["name"]: m["value"] for m in status["metrics"]} == {"step": "30", "max_steps": "120", "reward": "0.51",
                                                                  "staleness/mean": "1.25"}  # fmt: skip
    job = build_trainjob(gpu_config, gpu_settings.model_copy(update={"trainer_api": "trainjob"}), RUN)
    validate_trainer_object({**job, "status": {"trainerStatus": status}})  # the CRD's status schema, strictly


def test_the_thread_reports_the_last_step_when_the_run_stops_and_nothing_outside_a_trainjob():
    posts = []
    progress = TrainJobProgress(10, post=lambda **kw: posts.append(kw) or True, environ={SERVER_URL_ENV: "https://x"})
    progress.start()
    progress.update(4, {"reward": 0.5})
    progress.update(5, {"reward": 0.75})  # only the latest snapshot is reported
    progress.stop(timeout_s=10)
    assert [p["metrics"] for p in posts] == [{"step": 5, "max_steps": 10, "reward": 0.75}]
    assert progress.reports == 1 and posts[0]["progress_percent"] == 50

    idle = TrainJobProgress(10, post=lambda **kw: pytest.fail("posted outside a TrainJob"), environ={})
    idle.start()
    idle.update(1, {})
    idle.stop()
    assert not idle.enabled and idle.reports == 0


def _trainer_egress(settings, policy):
    (trainer,) = [p for p in build_network_policies(settings, RUN, policy) if p["metadata"]["name"].endswith("trainer")]
    return trainer["spec"]["egress"]


def test_the_trainer_reaches_the_status_server_only_in_a_trainjob_run_where_the_platform_opens_it(gpu_settings):
    opened = PlatformPolicy(trainjob_status_namespace="kubeflow-system", trainjob_status_port=8443)
    trainjob = gpu_settings.model_copy(update={"trainer_api": "trainjob"})
    status_rule = {
        "to": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kubeflow-system"}},
                "podSelector": {"matchLabels": {"app.kubernetes.io/name": "trainer"}}}],
        "ports": [{"protocol": "TCP", "port": 8443}],
    }  # fmt: skip
    assert status_rule in _trainer_egress(trainjob, opened)
    assert status_rule not in _trainer_egress(gpu_settings, opened)  # a PyTorchJob reports no TrainJob status
    assert _trainer_egress(trainjob, PlatformPolicy()) == _trainer_egress(gpu_settings, PlatformPolicy())  # default
