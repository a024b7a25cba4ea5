"""The compiled pipeline: committed IR is current, every knob is a parameter with the demo default, the DAG and the
Kubernetes wiring are what the issue asks for."""

from pathlib import Path

import pytest
import yaml

from async_grpo.config import FIELDS, GRPOConfig, flat_dump, load_config
from async_grpo.pipeline_local import find_repo_root, import_pipeline_module
from async_grpo.step_secrets import HF_SECRET_DIR, MLFLOW_SECRET_DIR

REPO = find_repo_root()
module = import_pipeline_module()
PACKAGES = {"grpo_pipeline.yaml": True, "grpo_pipeline_cpu.yaml": False}


def _load(path: Path) -> tuple[dict, dict]:
    ir, platform = yaml.safe_load_all(path.read_text())
    return ir, platform


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict[str, tuple[dict, dict]]:
    out = tmp_path_factory.mktemp("ir")
    return {name: _load(module.compile_pipeline(out / name, gpu=gpu)) for name, gpu in PACKAGES.items()}


@pytest.mark.parametrize("name", sorted(PACKAGES))
def test_committed_ir_is_up_to_date(compiled, name):
    # compared as data: the compiler's header comment orders dict defaults differently from run to run
    assert _load(REPO / "pipelines" / name) == compiled[name], (
        f"pipelines/{name} is stale. Fix: run `async-grpo pipeline compile` and commit the result."
    )


def test_module_and_packages_agree():
    assert module.PACKAGES == PACKAGES


@pytest.mark.parametrize("name", sorted(PACKAGES))
def test_every_knob_is_a_typed_parameter_defaulting_to_the_flavour_config(compiled, name):
    """CPU: the demo (examples/tiny_cpu.yaml); GPU: a real instruct model on GSM8K (examples/trl_qwen_gsm8k.yaml,
    the model on the workspace volume)."""
    gpu = PACKAGES[name]
    ir, _ = compiled[name]
    params = ir["root"]["inputDefinitions"]["parameters"]
    example = REPO / "examples" / ("trl_qwen_gsm8k.yaml" if gpu else "tiny_cpu.yaml")
    flat = module.flavour_config(gpu)
    expected_config = load_config(example).model_copy(
        update={"output_dir": FIELDS["output_dir"].default, "model_name_or_path": flat["model_name_or_path"]}
    )
    ir_types = {"STRING": str, "NUMBER_INTEGER": int, "NUMBER_DOUBLE": float, "BOOLEAN": bool, "LIST": list}
    for knob in (*module.TYPED_KNOBS, "dataset"):
        spec = params[knob]
        field_type = type(flat_dump(expected_config)[knob])
        assert ir_types[spec["parameterType"]] in (field_type, float if field_type is int else field_type), knob
        assert spec["defaultValue"] == flat.get(knob, FIELDS[knob].default), knob
    # the typed defaults plus the config_yaml default rebuild the flavour's config exactly
    rebuilt = yaml.safe_load(params["config_yaml"]["defaultValue"])
    rebuilt.update({k: params[k]["defaultValue"] for k in (*module.TYPED_KNOBS, "dataset")})
    assert "output_dir" not in rebuilt  # the pipeline sets it from work_dir
    assert GRPOConfig.model_validate(rebuilt) == expected_config
    for name_ in (
        "launch_backend",
        "launch_timeout_s",
        "registered_model_name",
        "min_eval_reward",
        "require_improvement",
        "extra_overrides",
        "kubernetes_options",
        "work_dir",
        "gpu_node_selector",
        "gpu_tolerations",
    ):
        assert "defaultValue" in params[name_], name_
    for name_ in ("mlflow_secret_name", "hf_token_secret_name", "workspace_pvc_name"):  # compiled in, not chosen
        assert name_ not in params, name_
    assert params["launch_backend"]["defaultValue"] == "kubernetes"
    if gpu:  # TRL's learning rate, no supervised warm start, the registered name from the model
        assert params["learning_rate"]["defaultValue"] == 1e-6 and params["warmup_sft_steps"]["defaultValue"] == 0
        assert params["registered_model_name"]["defaultValue"] == "Qwen2.5-0.5B-Instruct-grpo"
        assert (
            params["dataset"]["defaultValue"] == "openai/gsm8k" and params["dataset_config"]["defaultValue"] == "main"
        )


@pytest.mark.parametrize("name", sorted(PACKAGES))
def test_every_pipeline_parameter_has_a_description_for_the_ui(compiled, name):
    ir, _ = compiled[name]
    params = ir["root"]["inputDefinitions"]["parameters"]
    assert not [k for k, v in params.items() if len(v.get("description", "")) < 15]


def test_dag_is_dataset_train_evaluate_register_inside_an_exit_handler(compiled):
    ir, _ = compiled["grpo_pipeline.yaml"]
    root = ir["root"]["dag"]["tasks"]
    assert set(root) == {"exit-handler-1", "cleanup"}
    assert root["cleanup"]["dependentTasks"] == ["exit-handler-1"]
    assert root["cleanup"]["triggerPolicy"]["strategy"] == "ALL_UPSTREAM_TASKS_COMPLETED"
    assert "taskFinalStatus" in root["cleanup"]["inputs"]["parameters"]["pipeline_status"]

    body = ir["components"][root["exit-handler-1"]["componentRef"]["name"]]["dag"]["tasks"]
    assert set(body) == {"prepare-dataset", "train-grpo", "evaluate", "condition-2"}
    assert "dependentTasks" not in body["prepare-dataset"]
    assert body["train-grpo"]["dependentTasks"] == ["prepare-dataset"]
    assert sorted(body["evaluate"]["dependentTasks"]) == ["prepare-dataset", "train-grpo"]
    assert body["evaluate"]["inputs"]["artifacts"]["model"]["taskOutputArtifact"] == {
        "outputArtifactKey": "model",
        "producerTask": "train-grpo",
    }
    condition = body["condition-2"]
    assert "evaluate" in condition["dependentTasks"]
    assert (
        condition["triggerPolicy"]["condition"] == "inputs.parameter_values['pipelinechannel--evaluate-Output'] == true"
    )
    inner = ir["components"][condition["componentRef"]["name"]]["dag"]["tasks"]
    assert set(inner) == {"register-model"}
    assert inner["register-model"]["inputs"]["artifacts"]["metrics"]["componentInputArtifact"] == (
        "pipelinechannel--evaluate-metrics"
    )
    for task in ("prepare-dataset", "train-grpo", "evaluate"):
        assert body[task]["cachingOptions"] == {}, f"{task} must not be cached (enableCache false)"


def test_kubernetes_wiring_lives_in_the_pipeline(compiled):
    _, platform = compiled["grpo_pipeline.yaml"]
    executors = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]

    def secret_volumes(executor):
        out = {}
        for entry in executors[executor].get("secretAsVolume", []):
            # a constant compiled into the pipeline, never a run parameter (a run cannot mount another Secret)
            assert "componentInputParameter" not in entry["secretNameParameter"], entry
            out[entry["mountPath"]] = (entry["secretNameParameter"]["runtimeValue"]["constant"], entry["optional"])
        return out

    # no credential is an environment variable of any step: KFP passes the run's config in the step's command,
    # where the kubelet would expand a submitter's $(MLFLOW_TRACKING_PASSWORD) (async_grpo.step_secrets)
    assert not any(executor.get("secretAsEnv") for executor in executors.values())
    for executor in ("exec-train-grpo", "exec-evaluate", "exec-register-model"):
        assert secret_volumes(executor) == {MLFLOW_SECRET_DIR: ("mlflow-tracking", False)}, executor
    # the HF token reaches only the dataset step; no step that can run submitter code holds it
    assert secret_volumes("exec-prepare-dataset") == {HF_SECRET_DIR: ("hf-token", True)}
    assert not secret_volumes("exec-cleanup")
    for executor in ("exec-prepare-dataset", "exec-train-grpo", "exec-evaluate", "exec-cleanup"):
        (mount,) = executors[executor]["pvcMount"]
        assert mount["mountPath"] == module.WORKSPACE_MOUNT_PATH, executor
        assert mount["pvcNameParameter"] == {"runtimeValue": {"constant": "async-grpo-workspace"}}, executor
    # every step that launches or deletes run objects, or writes the registry, reads the platform policy, fixed (not a
    # parameter): register-model for its registered_models
    for executor in ("exec-train-grpo", "exec-evaluate", "exec-cleanup", "exec-register-model"):
        (policy,) = executors[executor]["configMapAsVolume"]
        assert policy["configMapName"] == "async-grpo-policy" and policy["mountPath"] == "/etc/async-grpo/policy"
        assert policy["configMapNameParameter"] == {"runtimeValue": {"constant": "async-grpo-policy"}}
        assert not policy.get("optional"), executor
    evaluate = executors["exec-evaluate"]
    assert evaluate["podMetadata"]["labels"] == {"async-grpo/role": "evaluate"}  # its reward service admits it
    assert evaluate["nodeSelector"]["nodeSelectorJson"]["componentInputParameter"].endswith("gpu_node_selector")
    assert evaluate["tolerations"][0]["tolerationJson"]["componentInputParameter"].endswith("gpu_tolerations")
    assert evaluate["emptyDirMounts"] == [
        {"medium": "Memory", "mountPath": "/dev/shm", "sizeLimit": "16Gi", "volumeName": "dshm"}
    ]


def test_only_the_gpu_flavour_asks_for_a_gpu(compiled):
    for name, gpu in PACKAGES.items():
        ir, _ = compiled[name]
        container = ir["deploymentSpec"]["executors"]["exec-evaluate"]["container"]
        accelerator = container.get("resources", {}).get("accelerator", {})
        assert accelerator.get("resourceType") == ("nvidia.com/gpu" if gpu else None), name
        params = ir["root"]["inputDefinitions"]["parameters"]
        assert bool(params["gpu_tolerations"]["defaultValue"]) is gpu, name


@pytest.mark.parametrize("name", sorted(PACKAGES))
def test_every_step_runs_the_project_image_and_installs_nothing(compiled, name):
    from components import ASYNC_GRPO_CPU_IMAGE, ASYNC_GRPO_IMAGE

    ir, _ = compiled[name]
    executors = ir["deploymentSpec"]["executors"]
    assert len(executors) == 5
    for executor_name, executor in executors.items():
        container = executor["container"]
        assert container["image"] == (ASYNC_GRPO_IMAGE if PACKAGES[name] else ASYNC_GRPO_CPU_IMAGE), executor_name
        assert "pip install" not in " ".join(container["command"]), executor_name


def test_train_and_cleanup_name_the_run_with_the_kfp_run_id(compiled):
    """Two runs given the same run_name get different names (folders, MLflow runs, objects)."""
    ir, _ = compiled["grpo_pipeline.yaml"]
    root = ir["root"]["dag"]["tasks"]
    body = ir["components"][root["exit-handler-1"]["componentRef"]["name"]]["dag"]["tasks"]
    for task in (root["cleanup"], body["train-grpo"]):
        params = task["inputs"]["parameters"]
        assert params["pipeline_job_id"]["runtimeValue"]["constant"] == "{{$.pipeline_job_uuid}}"
        assert params["run_name"]["componentInputParameter"].removeprefix("pipelinechannel--") == "run_name"
    evaluate = body["evaluate"]["inputs"]["parameters"]
    assert evaluate["run_name"]["taskOutputParameter"] == {
        "outputParameterKey": "run_name",
        "producerTask": "train-grpo",
    }
    assert evaluate["launch_backend"]["componentInputParameter"].removeprefix("pipelinechannel--") == "launch_backend"


@pytest.mark.parametrize("name", sorted(PACKAGES))
def test_the_dataset_step_gets_the_kfp_run_times_for_date_paths(compiled, name):
    """A recurring run's `{date}` is its scheduled date: the dataset step takes the KFP run's times, which the
    backend substitutes (a one-off run's scheduled time is its creation time; backends without the fix for
    kubeflow/pipelines#12616 pass the placeholder through and the step falls back, `dataset_source.run_date`)."""
    ir, _ = compiled[name]
    body = ir["components"][ir["root"]["dag"]["tasks"]["exit-handler-1"]["componentRef"]["name"]]["dag"]["tasks"]
    params = body["prepare-dataset"]["inputs"]["parameters"]
    assert params["schedule_time_utc"]["runtimeValue"]["constant"] == "{{$.pipeline_job_schedule_time_utc}}"
    assert params["create_time_utc"]["runtimeValue"]["constant"] == "{{$.pipeline_job_create_time_utc}}"


def test_the_kfp_local_package_leaves_the_run_times_out(tmp_path):
    """kfp 2.17's local runner fails on the time placeholders (IndexError), so run-local compiles without them."""
    from async_grpo.pipeline_local import KFP_TIME_PLACEHOLDERS, check_local_package

    assert set(KFP_TIME_PLACEHOLDERS) == set(module.KFP_TIME_PLACEHOLDERS)
    local_package = module.compile_pipeline(tmp_path / "local.yaml", gpu=False, for_kfp_local=True)
    ir, _ = _load(local_package)
    body = ir["components"][ir["root"]["dag"]["tasks"]["exit-handler-1"]["componentRef"]["name"]]["dag"]["tasks"]
    assert body["prepare-dataset"]["inputs"]["parameters"]["schedule_time_utc"]["runtimeValue"]["constant"] == ""
    check_local_package(local_package)
    with pytest.raises(ValueError, match=r"kfp.local cannot resolve. Fix: compile it for kfp.local"):
        check_local_package(REPO / "pipelines" / "grpo_pipeline_cpu.yaml")
