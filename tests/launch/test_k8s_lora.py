"""The Kubernetes objects of a LoRA run with adapter-only sync (vllm_lora_sync): schema-valid, the vLLM server gets
the LoRA flags and env, and reads the trainer's adapter folder on the shared workspace PVC at the same path."""

from __future__ import annotations

import yaml

from async_grpo.config import GRPOConfig
from async_grpo.launch.k8s_objects import build_run_objects
from async_grpo.runner.peft_setup import lora_sync_folder

from ._k8s_validate import validate_any
from .conftest import RUN


def _objects(config, settings) -> dict[tuple[str, str], dict]:
    objs = build_run_objects(
        config,
        settings,
        RUN,
        mlflow_run_id="0123abcd",
        owner={"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "name": RUN, "uid": "u-1"},
    )
    for obj in objs:
        validate_any(obj)
    return {(o["kind"], o["metadata"]["name"]): o for o in objs}


def _mounts(pod_spec: dict, container: dict) -> dict[str, dict]:
    """mountPath -> {the volume, readOnly} of one container."""
    volumes = {v["name"]: v for v in pod_spec["volumes"]}
    return {
        m["mountPath"]: {**volumes[m["name"]], "readOnly": m.get("readOnly", False)} for m in container["volumeMounts"]
    }


def test_lora_sync_run_objects_validate_and_share_the_adapter_folder(cpu_settings):
    config = GRPOConfig(
        model_name_or_path="builtin:tiny", dataset="builtin:reverse", use_peft=True, lora_r=12, vllm_lora_sync=True
    )
    objs = _objects(config, cpu_settings)
    vllm_pod = objs[("Deployment", f"{RUN}-vllm")]["spec"]["template"]["spec"]
    (server,) = vllm_pod["containers"]
    cmd = server["command"]
    assert "--enable-lora" in cmd
    assert cmd[cmd.index("--max-lora-rank") + 1] == "16"  # the smallest rank vLLM accepts >= lora_r
    assert cmd[cmd.index("--max-loras") + 1] == "2" and cmd[cmd.index("--max-cpu-loras") + 1] == "2"
    env = {e["name"]: e.get("value") for e in server["env"]}
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"

    trainer_pod = objs[("PyTorchJob", RUN)]["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    trainer_cfg = GRPOConfig.model_validate(yaml.safe_load(objs[("ConfigMap", f"{RUN}-config")]["data"]["config.yaml"]))
    assert trainer_cfg.peft.vllm_lora_sync and trainer_cfg.peft.lora_r == 12
    folder = str(lora_sync_folder(trainer_cfg))
    mount = cpu_settings.data_mount_path
    assert folder.startswith(f"{mount}/")  # the adapters land on the PVC ...
    trainer_mounts = _mounts(trainer_pod, trainer_pod["containers"][0])
    server_mounts = _mounts(vllm_pod, server)
    claim = trainer_mounts[mount]["persistentVolumeClaim"]["claimName"]
    assert server_mounts[mount]["persistentVolumeClaim"]["claimName"] == claim == cpu_settings.pvc_name  # ... which
    assert not trainer_mounts[mount]["readOnly"] and server_mounts[mount]["readOnly"]  # vLLM reads at that path


def test_without_lora_sync_the_server_gets_no_lora_flags_and_the_tiny_model_no_pvc(cpu_settings):
    config = GRPOConfig(model_name_or_path="builtin:tiny", dataset="builtin:reverse", use_peft=True)
    objs = _objects(config, cpu_settings)
    vllm_pod = objs[("Deployment", f"{RUN}-vllm")]["spec"]["template"]["spec"]
    (server,) = vllm_pod["containers"]
    assert "--enable-lora" not in server["command"]  # merged weights go through the usual weight transfer
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in {e["name"] for e in server["env"]}
    assert not any("persistentVolumeClaim" in v for v in vllm_pod["volumes"])
