"""NetworkPolicy semantics of a run, evaluated the way the API defines them: a pod selected by an
Ingress (Egress) policy is isolated that way and admits (reaches) only what some rule of a selecting
policy allows."""

from __future__ import annotations

import ipaddress

import pytest

from async_grpo.launch.k8s_objects import build_run_objects
from async_grpo.launch.platform_policy import EgressRule, PlatformPolicy

from .conftest import RUN

OTHER_RUN = "agrpo-other-ffffff"
NAMESPACE = "team-a"
DNS = {"namespace": "kube-system", "labels": {"k8s-app": "kube-dns"}}
API_SERVER = {"namespace": "kube-system", "labels": {"component": "kube-apiserver"}}
METADATA_IP, API_SERVICE_IP, INTERNET_IP = "169.254.169.254", "10.96.0.1", "1.1.1.1"


def _matches(selector: dict, labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels", "matchExpressions"}, "evaluator handles these selectors only"
    for expr in selector.get("matchExpressions", []):
        assert expr["operator"] == "Exists", "evaluator handles Exists only"
        if expr["key"] not in labels:
            return False
    return selector.get("matchLabels", {}).items() <= labels.items()


def _port_ok(rule: dict, port: int, protocol: str = "TCP") -> bool:
    if "ports" not in rule:
        return True
    return any(
        p.get("protocol", "TCP") == protocol and p["port"] <= port <= p.get("endPort", p["port"]) for p in rule["ports"]
    )


def _peer_ok(peer: dict, dst: dict) -> bool:
    """Does `peer` (a `to` entry) name `dst`: {"ip": ...} or {"namespace": ..., "labels": {...}}?"""
    if "ipBlock" in peer:
        if "ip" not in dst:
            return False  # pods are reached by pod selectors here
        ip = ipaddress.ip_address(dst["ip"])
        block = peer["ipBlock"]
        return ip in ipaddress.ip_network(block["cidr"]) and not any(
            ip in ipaddress.ip_network(e) for e in block.get("except", [])
        )
    if "ip" in dst:
        return False
    if "namespaceSelector" in peer:
        ns_ok = _matches(peer["namespaceSelector"], {"kubernetes.io/metadata.name": dst["namespace"]})
    else:
        ns_ok = dst["namespace"] == NAMESPACE
    return ns_ok and _matches(peer.get("podSelector", {}), dst["labels"])


def reaches(policies: list[dict], src: dict[str, str], dst: dict, port: int, protocol: str = "TCP") -> bool:
    """Egress: may a pod labelled `src` (in NAMESPACE) open a connection to `dst` on `port`?"""
    selecting = [
        p for p in policies if "Egress" in p["spec"]["policyTypes"] and _matches(p["spec"]["podSelector"], src)
    ]
    if not selecting:
        return True
    return any(
        (rule.get("to") is None or any(_peer_ok(peer, dst) for peer in rule["to"])) and _port_ok(rule, port, protocol)
        for policy in selecting
        for rule in policy["spec"].get("egress", [])
    )


def pod(labels: dict[str, str]) -> dict:
    """A destination pod of the run's namespace."""
    return {"namespace": NAMESPACE, "labels": labels}


def admitted(policies: list[dict], src: dict[str, str], dst: dict[str, str], port: int) -> bool:
    """Would a TCP connection from a pod labelled `src` to a pod labelled `dst` on `port` (same
    namespace) be allowed?"""
    selecting = [
        p for p in policies if "Ingress" in p["spec"]["policyTypes"] and _matches(p["spec"]["podSelector"], dst)
    ]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get("ingress", []):
            peers = rule.get("from")
            assert not any("namespaceSelector" in peer or "ipBlock" in peer for peer in peers or []), (
                "run policies must only name pods of their own namespace"
            )
            if (peers is None or any(_matches(peer["podSelector"], src) for peer in peers)) and _port_ok(rule, port):
                return True
    return False


@pytest.fixture
def pods(gpu_config, gpu_settings):
    """Labels of every pod of the run (as templated, plus what the Training Operator adds), and strangers."""
    objs = build_run_objects(gpu_config, gpu_settings, RUN)
    policies = [o for o in objs if o["kind"] == "NetworkPolicy"]
    tpl = {
        o["metadata"]["labels"]["app.kubernetes.io/component"]: o["spec"]["template"]["metadata"]["labels"]
        for o in objs
        if o["kind"] == "Deployment"
    }
    job = next(o for o in objs if o["kind"] == "PyTorchJob")
    trainer = {
        **job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["metadata"]["labels"],
        "training.kubeflow.org/job-name": RUN,
        "training.kubeflow.org/replica-type": "master",
    }
    worker = {
        **job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["metadata"]["labels"],
        "training.kubeflow.org/replica-type": "worker",
    }
    other_trainer = {**trainer, "async-grpo/run": OTHER_RUN, "training.kubeflow.org/job-name": OTHER_RUN}
    return policies, {
        "trainer": trainer,
        "worker": worker,
        "vllm": tpl["vllm"],
        "reward": tpl["reward"],
        "other_trainer": other_trainer,
        "other_vllm": {**tpl["vllm"], "async-grpo/run": OTHER_RUN},
        "kfp_step": {"pipelines.kubeflow.org/v2_component": "true"},
        "mlflow": {"app.kubernetes.io/name": "mlflow"},
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


def test_every_run_pod_is_isolated_by_exactly_one_policy_both_ways(pods):
    policies, p = pods
    for name in ("trainer", "worker", "vllm", "reward"):
        selecting = [pol for pol in policies if _matches(pol["spec"]["podSelector"], p[name])]
        assert len(selecting) == 1, (name, [pol["metadata"]["name"] for pol in selecting])
        assert selecting[0]["spec"]["policyTypes"] == ["Ingress", "Egress"], name
    assert not [pol for pol in policies if _matches(pol["spec"]["podSelector"], p["other_vllm"])]


def _outside() -> dict[str, dict]:
    return {
        "cloud metadata": {"ip": METADATA_IP},
        "Kubernetes API service": {"ip": API_SERVICE_IP},
        "API server pods": API_SERVER,
        "internet": {"ip": INTERNET_IP},
    }


def test_trainer_reaches_exactly_its_run_mlflow_and_dns(pods, gpu_settings):
    policies, p = pods
    lo, hi = gpu_settings.weight_transfer_ports
    for src in ("trainer", "worker"):
        assert reaches(policies, p[src], DNS, 53, "UDP") and reaches(policies, p[src], DNS, 53, "TCP")
        assert reaches(policies, p[src], pod(p["vllm"]), 8000) and reaches(policies, p[src], pod(p["vllm"]), hi)
        assert reaches(policies, p[src], pod(p["reward"]), 8080)
        assert reaches(policies, p[src], pod(p["mlflow"]), 5000)
        assert reaches(policies, p[src], pod(p["trainer"]), 29500)  # torchrun, NCCL between ranks
        assert not reaches(policies, p[src], pod(p["mlflow"]), 22)
        assert not reaches(policies, p[src], pod(p["other_vllm"]), 8000)
        assert not reaches(policies, p[src], pod(p["kfp_step"]), 8888)
        for what, dst in _outside().items():
            assert not reaches(policies, p[src], dst, 443), what
            assert not reaches(policies, p[src], dst, 80), what


def test_vllm_reaches_only_the_trainers_weight_transfer_ports_and_dns(pods, gpu_settings):
    policies, p = pods
    lo, hi = gpu_settings.weight_transfer_ports
    v = p["vllm"]
    assert reaches(policies, v, DNS, 53, "UDP") and reaches(policies, v, pod(p["trainer"]), lo + 3)
    assert not reaches(policies, v, pod(p["trainer"]), 29500)
    for dst in (pod(p["mlflow"]), pod(p["reward"]), pod(p["other_trainer"])):
        assert not reaches(policies, v, dst, 5000) and not reaches(policies, v, dst, lo)
    for what, dst in _outside().items():
        assert not reaches(policies, v, dst, 443), what


def test_reward_code_reaches_nothing_not_even_dns(pods):
    policies, p = pods
    r = p["reward"]
    assert not reaches(policies, r, DNS, 53, "UDP")
    for dst in (pod(p["mlflow"]), pod(p["trainer"]), pod(p["vllm"])):
        for port in (5000, 8000, 29500, 40000):
            assert not reaches(policies, r, dst, port)
    for what, dst in _outside().items():
        assert not reaches(policies, r, dst, 443), what


def test_platform_egress_ranges_never_open_cloud_metadata(gpu_config, gpu_settings):
    """Even `0.0.0.0/0` opened by the platform for reward pods (say, a judge API) keeps metadata closed."""
    policy = PlatformPolicy(
        reward_egress=[EgressRule(cidr="0.0.0.0/0", ports=[443])], trainer_egress=[EgressRule(cidr="169.254.0.0/16")]
    )
    objs = build_run_objects(gpu_config, gpu_settings, RUN, policy=policy)
    policies = [o for o in objs if o["kind"] == "NetworkPolicy"]
    labels = {
        o["metadata"]["labels"]["app.kubernetes.io/component"]: o["spec"]["template"]["metadata"]["labels"]
        for o in objs
        if o["kind"] == "Deployment"
    }
    trainer = next(o for o in objs if o["kind"] == "PyTorchJob")["spec"]["pytorchReplicaSpecs"]["Master"]["template"][
        "metadata"
    ]["labels"]
    assert reaches(policies, labels["reward"], {"ip": INTERNET_IP}, 443)
    assert not reaches(policies, labels["reward"], {"ip": INTERNET_IP}, 80)
    assert not reaches(policies, labels["reward"], {"ip": METADATA_IP}, 443)
    assert reaches(policies, trainer, {"ip": "169.254.1.1"}, 80)
    assert not reaches(policies, trainer, {"ip": METADATA_IP}, 80)
