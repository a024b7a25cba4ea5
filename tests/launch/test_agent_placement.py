"""An agent run on Kubernetes (issue 51): its episodes run in the reward pods, which may reach the agent endpoint in
the trainer pods on the endpoint's ports and nothing more; the objects that carry it (NetworkPolicies, the reward
Deployment's volume, the evaluate step's reward service) for both trainer APIs, valid against their schemas."""

from __future__ import annotations

import yaml

from async_grpo.config import GRPOConfig
from async_grpo.config.sections.agents import AGENT_ENDPOINT_PORT_COUNT
from async_grpo.launch.k8s_network import EVALUATOR_LABELS, agent_endpoint_ports
from async_grpo.launch.k8s_objects import POD_IP_ENV, RunTokens, build_eval_reward_objects, build_run_objects
from async_grpo.launch.k8s_policy import check_run
from async_grpo.launch.k8s_trainjob import build_objects_for_api
from async_grpo.launch.platform_policy import PlatformPolicy

from ._k8s_validate import validate_any
from .conftest import RUN
from .test_network_policy import DNS, INTERNET_IP, _matches, admitted, pod, reaches

AGENT = "/workspace/agents/react.py:run"
PORTS = (8700, 8700 + AGENT_ENDPOINT_PORT_COUNT - 1)


def _agent(config: GRPOConfig, **update) -> GRPOConfig:
    return config.model_copy(update={"agent": AGENT, **update})


def _policies_and_pods(config: GRPOConfig, settings) -> tuple[list[dict], dict[str, dict]]:
    objs = build_run_objects(config, settings, RUN)
    policies = [o for o in objs if o["kind"] == "NetworkPolicy"]
    job = next(o for o in objs if o["kind"] == "PyTorchJob")["spec"]["pytorchReplicaSpecs"]
    pods = {
        "trainer": job["Master"]["template"]["metadata"]["labels"],
        "worker": job["Worker"]["template"]["metadata"]["labels"],
    }
    for o in objs:
        if o["kind"] == "Deployment":
            pods[o["metadata"]["labels"]["app.kubernetes.io/component"]] = o["spec"]["template"]["metadata"]["labels"]
    return policies, pods


def test_the_endpoint_ports_are_the_configs_range_only_for_an_agent_run(gpu_config):
    assert agent_endpoint_ports(gpu_config) is None
    assert agent_endpoint_ports(_agent(gpu_config)) == PORTS == (8700, 8703)
    command = gpu_config.model_copy(
        update={"agent_command": ["python", "/workspace/a.py"], "agent_endpoint_port": 9100}
    )
    assert agent_endpoint_ports(command) == (9100, 9103)


def test_the_reward_pods_reach_the_trainers_agent_endpoint_and_nothing_else(gpu_config, gpu_settings):
    policies, p = _policies_and_pods(_agent(gpu_config), gpu_settings)
    lo, hi = gpu_settings.weight_transfer_ports
    reward = p["reward"]
    for port in range(PORTS[0], PORTS[1] + 1):  # egress from the reward pods and ingress into the trainer pods
        assert reaches(policies, reward, pod(p["trainer"]), port) and admitted(policies, reward, p["trainer"], port)
        assert admitted(policies, reward, p["worker"], port)  # selected as trainer pods; only rank 0 listens
    for port in (PORTS[0] - 1, PORTS[1] + 1, 29500, 23456, lo, hi, 5000, 8000):
        assert not reaches(policies, reward, pod(p["trainer"]), port), port
        assert not admitted(policies, reward, p["trainer"], port), port
    assert not reaches(policies, reward, DNS, 53, "UDP")  # still no DNS: the URL holds the pod's IP
    assert not reaches(policies, reward, {"ip": INTERNET_IP}, 443)
    for dst in ("vllm", "reward"):
        assert not reaches(policies, reward, pod(p[dst]), PORTS[0]), dst
    for src in ("vllm", "trainer"):  # the endpoint's ports are opened to the reward pods alone
        assert not admitted(policies, p[src], p["reward"], PORTS[0]), src
    assert not admitted(policies, p["vllm"], p["trainer"], PORTS[0])
    stranger = {**reward, "async-grpo/run": "agrpo-other-ffffff"}  # another run's reward pods
    assert not admitted(policies, stranger, p["trainer"], PORTS[0])


def test_a_run_without_an_agent_opens_nothing_new(gpu_config, gpu_settings):
    policies, p = _policies_and_pods(gpu_config, gpu_settings)
    assert not reaches(policies, p["reward"], pod(p["trainer"]), PORTS[0])
    assert not admitted(policies, p["reward"], p["trainer"], PORTS[0])
    with_agent, _ = _policies_and_pods(_agent(gpu_config), gpu_settings)
    changed = [(a, b) for a, b in zip(policies, with_agent, strict=True) if a != b]
    assert [a["metadata"]["name"] for a, _ in changed] == [f"{RUN}-trainer", f"{RUN}-reward"]
    for before, after in changed:  # exactly one rule more each: ingress into the trainer, egress from the reward pods
        direction = "ingress" if before["metadata"]["name"].endswith("trainer") else "egress"
        extra = [r for r in after["spec"][direction] if r not in before["spec"][direction]]
        assert [r["ports"] for r in extra] == [[{"protocol": "TCP", "port": PORTS[0], "endPort": PORTS[1]}]]
        other = "egress" if direction == "ingress" else "ingress"
        assert after["spec"][other] == before["spec"][other]


def test_without_reward_pods_the_agent_stays_in_the_trainer_and_nothing_is_opened(gpu_config, gpu_settings):
    settings = gpu_settings.model_copy(update={"reward_replicas": 0})
    config = _agent(gpu_config)
    check_run(config, settings, PlatformPolicy(user_code_with_credentials=True))
    policies, p = _policies_and_pods(config, settings)
    assert [o["metadata"]["name"] for o in policies] == [f"{RUN}-vllm", f"{RUN}-trainer"]
    trainer = next(o for o in policies if o["metadata"]["name"] == f"{RUN}-trainer")
    assert all(r.get("ports", [{}])[0].get("port") != PORTS[0] for r in trainer["spec"]["ingress"])


def test_the_agent_runs_objects_validate_and_the_trainer_advertises_its_pod_ip(gpu_config, gpu_settings):
    objs = build_run_objects(_agent(gpu_config), gpu_settings, RUN, mlflow_run_id="0123abcd")
    for obj in objs:
        validate_any(obj)
    env = next(o for o in objs if o["kind"] == "PyTorchJob")["spec"]["pytorchReplicaSpecs"]["Master"]["template"]
    env = {e["name"]: e for e in env["spec"]["containers"][0]["env"]}
    assert env[POD_IP_ENV]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}  # agents.remote.POD_IP_ENV
    config = yaml.safe_load(next(o for o in objs if o["kind"] == "ConfigMap")["data"]["config.yaml"])
    assert config["agent"] == AGENT and config["reward_url"]  # the trainer sends the episodes to its reward service


def test_a_trainjob_run_gets_the_same_policies(gpu_config, gpu_settings):
    config = _agent(gpu_config)
    settings = gpu_settings.model_copy(update={"trainer_api": "trainjob"})
    objs = build_objects_for_api(config, settings, RUN, mlflow_run_id="0123abcd")
    for obj in objs:
        validate_any(obj)
    old = [o for o in build_run_objects(config, gpu_settings, RUN) if o["kind"] == "NetworkPolicy"]
    assert [o for o in objs if o["kind"] == "NetworkPolicy"] == old


def test_the_reward_pods_mount_the_volume_for_an_agent_file_or_a_commands_path(gpu_config, gpu_settings):
    def mounts(config: GRPOConfig) -> list[str]:
        objs = build_run_objects(config, gpu_settings, RUN)
        dep = next(o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"] == f"{RUN}-reward")
        return [m for m in dep["spec"]["template"]["spec"]["containers"][0]["volumeMounts"] if m["name"] == "data"]

    for config in (_agent(gpu_config), gpu_config.model_copy(update={"agent_command": ["python", "/workspace/a.py"]})):
        (mount,) = mounts(config)
        assert mount["mountPath"] == "/workspace" and mount["readOnly"] is True
    assert mounts(gpu_config.model_copy(update={"agent": "acme_agents.react:run"})) == []  # image code
    assert mounts(gpu_config.model_copy(update={"agent_command": ["/usr/bin/true"]})) == []


def test_the_evaluate_steps_reward_service_runs_the_agent_and_reaches_the_evaluating_pod(gpu_config, gpu_settings):
    objs = build_eval_reward_objects(_agent(gpu_config), gpu_settings, RUN, RunTokens.generate())
    served = yaml.safe_load(next(o for o in objs if o["kind"] == "ConfigMap")["data"]["config.yaml"])
    assert served["agent"] == AGENT and served["agent_timeout_s"] == gpu_config.agents.agent_timeout_s
    GRPOConfig.model_validate(served)  # the eval service loads it
    (policy,) = [o for o in objs if o["kind"] == "NetworkPolicy"]
    evaluator = {**EVALUATOR_LABELS, "pipelines.kubeflow.org/v2_component": "true"}
    eval_reward = next(o for o in objs if o["kind"] == "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert _matches(policy["spec"]["podSelector"], eval_reward)
    for port in (PORTS[0], PORTS[1]):
        assert reaches([policy], eval_reward, pod(evaluator), port)
    assert not reaches([policy], eval_reward, pod(evaluator), 5000)
    assert not reaches([policy], eval_reward, pod({"async-grpo/run": RUN}), PORTS[0])
    for obj in objs:
        validate_any(obj)
    plain = build_eval_reward_objects(gpu_config, gpu_settings, RUN, RunTokens.generate())
    (plain_policy,) = [o for o in plain if o["kind"] == "NetworkPolicy"]
    assert not reaches([plain_policy], eval_reward, pod(evaluator), PORTS[0])
