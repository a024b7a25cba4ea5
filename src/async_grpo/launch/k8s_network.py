"""A run's NetworkPolicies: who may reach each pod (ingress) and what each pod may reach (egress).

One policy per component isolates its pods both ways. What is open is only what the run needs:
the trainer reaches its own ranks, vLLM, the reward service, MLflow and DNS; vLLM reaches the
trainer's weight-transfer ports and DNS; reward pods reach nothing unless the platform opens it (and the
run's LLM judge, when it serves one: the judge admits only the pods that ask it and reaches nothing). A
distillation teacher the run serves is asked by the orchestrator, in trainer rank 0: it admits only the trainer
pods and reaches nothing, and the trainer's egress gains it. A run that trains an agent (`agent`, `agent_command`) runs
its episodes in the reward pods, which call the agent endpoint in the trainer pod: the reward pods may reach the
trainer pods on the endpoint's ports (`agent_endpoint_ports`) and the trainer pods admit them there, nothing else.
No rule names the Kubernetes API or any address outside the cluster, so neither is reachable (the
platform's extra egress ranges always have the cloud metadata addresses carved out).
"""

from __future__ import annotations

from typing import Any

from async_grpo.config import GRPOConfig
from async_grpo.config.sections.agents import AGENT_ENDPOINT_PORT_COUNT
from async_grpo.launch.k8s_pods import Manifest, meta, selector
from async_grpo.launch.k8s_settings import ClusterSettings
from async_grpo.launch.platform_policy import EgressRule, PlatformPolicy

EVALUATOR_LABELS = {"async-grpo/role": "evaluate"}  # the pipeline's evaluate step pods (reach eval-reward)


def dns_peer(policy: PlatformPolicy) -> dict[str, Any]:
    """Egress rule to the cluster DNS pods on port 53 (UDP and TCP)."""
    return {
        "to": [
            {
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": policy.dns_namespace}},
                "podSelector": {"matchLabels": dict(policy.dns_pod_labels)},
            }
        ],
        "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}],
    }


def _extra(rules: list[EgressRule]) -> list[dict[str, Any]]:
    out = []
    for rule in rules:
        entry: dict[str, Any] = {"to": [{"ipBlock": rule.ip_block()}]}
        if rule.ports:
            entry["ports"] = [{"protocol": "TCP", "port": p} for p in rule.ports]
        out.append(entry)
    return out


def _policy(
    settings: ClusterSettings,
    run_name: str,
    component: str,
    ingress: list[dict],
    egress: list[dict],
    owner: dict[str, Any] | None,
) -> Manifest:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": meta(f"{run_name}-{component}", run_name, component, settings, owner),
        "spec": {
            "podSelector": {"matchLabels": selector(run_name, component)},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": ingress,
            "egress": egress,
        },
    }


def agent_endpoint_ports(config: GRPOConfig) -> tuple[int, int] | None:
    """The inclusive port range of the agent endpoint (`agent_endpoint_port` and the next
    AGENT_ENDPOINT_PORT_COUNT - 1) when the run trains an agent (`agent` or `agent_command`), else None."""
    a = config.agents
    if a.agent is None and a.agent_command is None:
        return None
    return a.agent_endpoint_port, a.agent_endpoint_port + AGENT_ENDPOINT_PORT_COUNT - 1


def _port_range(ports: tuple[int, int]) -> dict[str, Any]:
    lo, hi = ports
    return {"protocol": "TCP", "port": lo, "endPort": hi} if hi > lo else {"protocol": "TCP", "port": lo}


def reward_policy(
    settings: ClusterSettings,
    run_name: str,
    policy: PlatformPolicy,
    *,
    component: str = "reward",
    clients: dict[str, Any] | None = None,
    owner: dict[str, Any] | None = None,
    judge: bool = False,
    agent_ports: tuple[int, int] | None = None,
) -> Manifest:
    """The reward pods' policy: ingress from `clients` (a peer; default this run's trainer) on the reward
    port only; egress to the platform's `reward_egress` ranges only (none by default, not even DNS), with
    `judge` to the run's judge pods on the vLLM port, and with `agent_ports` (the agent endpoint's inclusive range,
    `agent_endpoint_ports`) to the `clients` pods on those ports (the agent's episodes call the endpoint there)."""
    clients = clients or {"podSelector": {"matchLabels": selector(run_name, "trainer")}}
    ingress = [{"from": [clients], "ports": [{"protocol": "TCP", "port": settings.reward_port}]}]
    egress = [judge_egress(settings, run_name)] if judge else []
    if agent_ports is not None:
        egress.append({"to": [clients], "ports": [_port_range(agent_ports)]})
    egress += _extra(policy.reward_egress)
    return _policy(settings, run_name, component, ingress, egress, owner)


def judge_egress(settings: ClusterSettings, run_name: str) -> dict[str, Any]:
    """Egress rule to the run's judge pods on the vLLM port."""
    return served_egress(settings, run_name, "judge")


def served_egress(settings: ClusterSettings, run_name: str, component: str) -> dict[str, Any]:
    """Egress rule to the pods of a model the run serves (`k8s_served`: "judge", "teacher") on the vLLM port."""
    return {
        "to": [{"podSelector": {"matchLabels": selector(run_name, component)}}],
        "ports": [{"protocol": "TCP", "port": settings.vllm_port}],
    }


def trainjob_status_egress(policy: PlatformPolicy) -> dict[str, Any]:
    """Egress rule to the Kubeflow Trainer controller's status server (`PlatformPolicy.trainjob_status_namespace`,
    its pod labels and port), where a TrainJob's trainer reports its progress (`runner.trainjob_progress`)."""
    return {
        "to": [
            {
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": policy.trainjob_status_namespace}},
                "podSelector": {"matchLabels": dict(policy.trainjob_status_pod_labels)},
            }
        ],
        "ports": [{"protocol": "TCP", "port": policy.trainjob_status_port}],
    }


def judge_policy(
    settings: ClusterSettings, run_name: str, clients: str, owner: dict[str, Any] | None = None
) -> Manifest:
    """The judge pods' policy: ingress only from this run's `clients` component (the pods that ask the judge) on
    the vLLM port; no egress at all (the judge loads its model from the volume and calls nothing)."""
    return served_policy(settings, run_name, "judge", clients, owner)


def served_policy(
    settings: ClusterSettings, run_name: str, component: str, clients: str, owner: dict[str, Any] | None = None
) -> Manifest:
    """The policy of a model the run serves (`k8s_served`: the judge, the teacher): ingress only from this run's
    `clients` component (the pods that ask it) on the vLLM port; no egress at all (it loads its model from the
    volume and calls nothing)."""
    peer = {"podSelector": {"matchLabels": selector(run_name, clients)}}
    ingress = [{"from": [peer], "ports": [{"protocol": "TCP", "port": settings.vllm_port}]}]
    return _policy(settings, run_name, component, ingress, [], owner)


def build_network_policies(
    settings: ClusterSettings,
    run_name: str,
    policy: PlatformPolicy | None = None,
    owner: dict[str, Any] | None = None,
    *,
    judge_clients: str | None = None,
    teacher: bool = False,
    agent_ports: tuple[int, int] | None = None,
) -> list[Manifest]:
    """The run's policies: vllm, trainer, (with reward_replicas > 0) reward, (with `judge_clients`) judge and (with
    `teacher`) teacher.

    vLLM's dev-mode endpoints load weights, so only this run's trainer pods reach vLLM (HTTP port +
    weight-transfer range); the reward service admits only the trainer; trainer pods admit each other
    (torchrun, NCCL) and vLLM's weight-transfer connections back to rank 0.

    Args:
        policy: the platform policy (DNS pods, MLflow pods and port, extra egress); None: its defaults.
        judge_clients: the component whose pods ask the run's LLM judge ("reward" or "trainer",
            `k8s_judge.judge_clients`): the judge admits only them and only they reach it; None: no judge.
        teacher: the run serves a distillation teacher (`k8s_teacher.serves_teacher`): it admits only the trainer
            pods (the orchestrator asks it from rank 0), and only they reach it.
        agent_ports: the agent endpoint's inclusive port range (`agent_endpoint_ports`) when the run trains an
            agent: with reward_replicas > 0 its episodes run in the reward pods, which may then reach the trainer
            pods on these ports, and the trainer pods admit them there; None: no agent.
    """
    policy = policy or PlatformPolicy()
    lo, hi = settings.weight_transfer_ports
    wt_ports = {"protocol": "TCP", "port": lo, "endPort": hi}
    trainer_peer = {"podSelector": {"matchLabels": selector(run_name, "trainer")}}
    vllm_peer = {"podSelector": {"matchLabels": selector(run_name, "vllm")}}
    mlflow = {
        "to": [{"podSelector": {"matchLabels": dict(policy.mlflow_pod_labels)}}],
        "ports": [{"protocol": "TCP", "port": policy.mlflow_port}],
    }
    trainer_egress = [
        dns_peer(policy),
        {"to": [trainer_peer]},
        {"to": [vllm_peer], "ports": [{"protocol": "TCP", "port": settings.vllm_port}, wt_ports]},
        mlflow,
        *_extra(policy.trainer_egress),
    ]
    if settings.reward_replicas:
        trainer_egress.insert(
            3,
            {
                "to": [{"podSelector": {"matchLabels": selector(run_name, "reward")}}],
                "ports": [{"protocol": "TCP", "port": settings.reward_port}],
            },
        )
    if judge_clients == "trainer":
        trainer_egress.insert(len(trainer_egress) - len(policy.trainer_egress), judge_egress(settings, run_name))
    if teacher:
        trainer_egress.insert(
            len(trainer_egress) - len(policy.trainer_egress), served_egress(settings, run_name, "teacher")
        )
    if settings.trainer_api == "trainjob" and policy.trainjob_status_namespace:  # the run's progress (KEP-2779)
        trainer_egress.insert(len(trainer_egress) - len(policy.trainer_egress), trainjob_status_egress(policy))
    trainer_ingress = [{"from": [trainer_peer]}, {"from": [vllm_peer], "ports": [wt_ports]}]
    if settings.reward_replicas and agent_ports is not None:  # the agent's episodes call the endpoint beside rank 0
        reward_peer = {"podSelector": {"matchLabels": selector(run_name, "reward")}}
        trainer_ingress.append({"from": [reward_peer], "ports": [_port_range(agent_ports)]})
    policies = [
        _policy(
            settings,
            run_name,
            "vllm",
            [{"from": [trainer_peer], "ports": [{"protocol": "TCP", "port": settings.vllm_port}, wt_ports]}],
            [dns_peer(policy), {"to": [trainer_peer], "ports": [wt_ports]}],
            owner,
        ),
        _policy(
            settings,
            run_name,
            "trainer",
            trainer_ingress,
            trainer_egress,
            owner,
        ),
    ]
    if settings.reward_replicas:
        policies.append(
            reward_policy(
                settings, run_name, policy, owner=owner, judge=judge_clients == "reward", agent_ports=agent_ports
            )
        )
    if judge_clients:
        policies.append(judge_policy(settings, run_name, judge_clients, owner))
    if teacher:
        policies.append(served_policy(settings, run_name, "teacher", "trainer", owner))
    return policies
