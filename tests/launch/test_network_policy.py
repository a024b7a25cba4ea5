"""NetworkPolicy semantics of a run, evaluated the way the API defines them: a pod selected by an
Ingress policy is isolated and admits only what some rule of a selecting policy allows."""

from __future__ import annotations

import pytest

from async_grpo.launch.k8s_objects import build_run_objects

from .conftest import RUN

OTHER_RUN = "agrpo-other-ffffff"


def _matches(selector: dict, labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, "evaluator handles matchLabels only"
    return selector.get("matchLabels", {}).items() <= labels.items()


def _port_ok(rule: dict, port: int) -> bool:
    if "ports" not in rule:
        return True
    return any(p.get("protocol", "TCP") == "TCP" and p["port"] <= port <= p.get("endPort", p["port"])
               for p in rule["ports"])


def admitted(policies: list[dict], src: dict[str, str], dst: dict[str, str], port: int) -> bool:
    """Would a TCP connection from a pod labelled `src` to a pod labelled `dst` on `port` (same
    namespace) be allowed?"""
    selecting = [p for p in policies
                 if "Ingress" in p["spec"]["policyTypes"] and _matches(p["spec"]["podSelector"], dst)]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get("ingress", []):
            peers = rule.get("from")
            assert not any("namespaceSelector" in peer or "ipBlock" in peer for peer in peers or []), \
                "run policies must only name pods of their own namespace"
            if (peers is None or any(_matches(peer["podSelector"], src) for peer in peers)) and _port_ok(rule, port):
                return True
    return False


@pytest.fixture
def pods(gpu_config, gpu_settings):
    """Labels of every pod of the run (as templated, plus what the Training Operator adds), and strangers."""
    objs = build_run_objects(gpu_config, gpu_settings, RUN)
    policies = [o for o in objs if o["kind"] == "NetworkPolicy"]
    tpl = {o["metadata"]["labels"]["app.kubernetes.io/component"]: o["spec"]["template"]["metadata"]["labels"]
           for o in objs if o["kind"] == "Deployment"}
    job = next(o for o in objs if o["kind"] == "PyTorchJob")
    trainer = {**job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["metadata"]["labels"],
               "training.kubeflow.org/job-name": RUN, "training.kubeflow.org/replica-type": "master"}
    worker = {**job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["metadata"]["labels"],
              "training.kubeflow.org/replica-type": "worker"}
    other_trainer = {**trainer, "async-grpo/run": OTHER_RUN, "training.kubeflow.org/job-name": OTHER_RUN}
    return policies, {
        "trainer": trainer, "worker": worker, "vllm": tpl["vllm"], "reward": tpl["reward"],
        "other_trainer": other_trainer, "other_vllm": {**tpl["vllm"], "async-grpo/run": OTHER_RUN},
        "kfp_step": {"pipelines.kubeflow.org/v2_component": "true"}, "mlflow": {"app.kubernetes.io/name": "mlflow"},
    }


def test_vllm_admits_only_this_runs_trainer_on_http_and_weight_ports(pods, gpu_settings):
    policies, p = pods
    lo, hi = gpu_settings.weight_transfer_ports
    for port in (8000, lo, (lo + hi) // 2, hi):
        assert admitted(policies, p["trainer"], p["vllm"], port)
        assert admitted(policies, p["worker"], p["vllm"], port)
    assert not admitted(policies, p["trainer"], p["vllm"], hi + 1)
    assert not admitted(policies, p["trainer"], p["vllm"], 22)
    for stranger in ("other_trainer", "reward", "kfp_step", "mlflow", "other_vllm", "vllm"):
        assert not admitted(policies, p[stranger], p["vllm"], 8000), stranger
        assert not admitted(policies, p[stranger], p["vllm"], lo), stranger


def test_reward_service_admits_only_the_trainer(pods, gpu_settings):
    policies, p = pods
    assert admitted(policies, p["trainer"], p["reward"], gpu_settings.reward_port)
    assert not admitted(policies, p["trainer"], p["reward"], 8000)
    for stranger in ("vllm", "other_trainer", "kfp_step", "mlflow"):
        assert not admitted(policies, p[stranger], p["reward"], gpu_settings.reward_port), stranger


def test_trainer_admits_its_peers_and_vllm_weight_transfer_only(pods, gpu_settings):
    policies, p = pods
    lo, _ = gpu_settings.weight_transfer_ports
    assert admitted(policies, p["worker"], p["trainer"], 23456)  # torchrun rendezvous, NCCL between ranks
    assert admitted(policies, p["vllm"], p["trainer"], lo + 7)  # vLLM workers join rank 0's rendezvous
    assert not admitted(policies, p["vllm"], p["trainer"], 23456)
    for stranger in ("other_trainer", "other_vllm", "kfp_step", "reward"):
        assert not admitted(policies, p[stranger], p["trainer"], lo + 7), stranger


def test_every_run_pod_is_isolated_by_exactly_one_policy(pods):
    policies, p = pods
    for name in ("trainer", "worker", "vllm", "reward"):
        selecting = [pol["metadata"]["name"] for pol in policies if _matches(pol["spec"]["podSelector"], p[name])]
        assert len(selecting) == 1, (name, selecting)
    assert not [pol for pol in policies if _matches(pol["spec"]["podSelector"], p["other_vllm"])]
