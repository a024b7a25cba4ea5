"""`async-grpo pipeline submit|schedule|compile|run-local` argument handling, against a kfp.Client double that records calls."""

import argparse
from types import SimpleNamespace

import pytest
import yaml

from async_grpo import cli_pipeline
from async_grpo.pipeline_local import find_repo_root

REPO = find_repo_root()
GPU_PACKAGE = REPO / "pipelines" / "grpo_pipeline.yaml"
CPU_PACKAGE = REPO / "pipelines" / "grpo_pipeline_cpu.yaml"


class RecordingClient:
    """Stands in for kfp.Client: records each call with its keyword arguments and answers like the real one."""

    def __init__(self, host=None, namespace=None):
        self.host, self.namespace = host, namespace
        self.calls: list[tuple[str, tuple, dict]] = []

    def create_run_from_pipeline_package(self, pipeline_file, **kwargs):
        self.calls.append(("create_run_from_pipeline_package", (pipeline_file,), kwargs))
        return SimpleNamespace(run_id="run-123")

    def create_experiment(self, name, **kwargs):
        self.calls.append(("create_experiment", (name,), kwargs))
        return SimpleNamespace(experiment_id="exp-9")

    def create_recurring_run(self, **kwargs):
        self.calls.append(("create_recurring_run", (), kwargs))
        return SimpleNamespace(recurring_run_id="rr-1")


@pytest.fixture
def client(monkeypatch):
    made = []

    def make_client(host, namespace):
        made.append(RecordingClient(host, namespace))
        return made[-1]

    monkeypatch.setattr(cli_pipeline, "make_client", make_client)
    return made


def run_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="async-grpo")
    cli_pipeline.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["pipeline", *argv])
    return args.func(args)


def test_submit_types_arguments_by_the_compiled_pipeline(client, capsys):
    rc = run_cli(
        "submit",
        "--host",
        "http://kfp:8888",
        "--namespace",
        "team-a",
        "--service-account",
        "async-grpo",
        "--run-name",
        "try-7",
        "max_steps=50",
        "learning_rate=1e-5",
        "require_improvement=false",
        "reward_funcs=[builtin:add_exact_match]",
        "reward_weights=[1]",
        "torch_num_threads=4",
        "gpu_node_selector={pool: a100}",
    )

    assert rc == 0
    (c,) = client
    assert (c.host, c.namespace) == ("http://kfp:8888", "team-a")
    ((method, (package,), kwargs),) = c.calls
    assert method == "create_run_from_pipeline_package" and package == str(GPU_PACKAGE)
    assert kwargs["arguments"] == {
        "max_steps": 50, "learning_rate": 1e-5, "require_improvement": False,
        "reward_funcs": ["builtin:add_exact_match"], "reward_weights": [1.0], "gpu_node_selector": {"pool": "a100"},
        "extra_overrides": ["torch_num_threads=4"],  # a config field with no pipeline parameter
    }  # fmt: skip
    assert kwargs["run_name"] == "try-7" and kwargs["experiment_name"] == "async-grpo"
    assert kwargs["service_account"] == "async-grpo" and kwargs["enable_caching"] is False
    assert "run-123" in capsys.readouterr().out


def test_submit_maps_a_config_file_onto_parameters_and_config_yaml(client, tmp_path):
    config = tmp_path / "qwen.yaml"
    config.write_text(
        "model_name_or_path: /workspace/models/qwen\nmax_steps: 300\nlearning_rate: 1\n"
        "beta: 0\neval_dataset: null\nvllm_dtype: bfloat16\nweight_sync_backend: nccl\n"
    )

    assert run_cli("submit", "--cpu", "--config", str(config), "max_steps=10") == 0

    ((_, (package,), kwargs),) = client[0].calls
    assert package == str(CPU_PACKAGE)
    args = kwargs["arguments"]
    assert args["model_name_or_path"] == "/workspace/models/qwen"
    assert args["max_steps"] == 10  # the command line beats the file
    assert args["learning_rate"] == 1.0 and isinstance(args["learning_rate"], float)
    assert args["beta"] == 0.0 and isinstance(args["beta"], float)
    assert args["eval_dataset"] == ""  # null means unset, which the pipeline spells ""
    assert yaml.safe_load(args["config_yaml"]) == {"vllm_dtype": "bfloat16", "weight_sync_backend": "nccl"}


def test_schedule_creates_a_recurring_run_with_kfp_cron(client, capsys):
    rc = run_cli(
        "schedule", "--cron", "0 3 * * 1", "--name", "weekly-retrain", "--experiment", "retraining", "max_steps=100"
    )

    assert rc == 0
    (c,) = client
    assert [call[0] for call in c.calls] == ["create_experiment", "create_recurring_run"]
    assert c.calls[0][1] == ("retraining",)
    kwargs = c.calls[1][2]
    assert kwargs["experiment_id"] == "exp-9" and kwargs["job_name"] == "weekly-retrain"
    assert kwargs["cron_expression"] == "0 0 3 * * 1"
    assert kwargs["pipeline_package_path"] == str(GPU_PACKAGE)
    assert kwargs["params"] == {"max_steps": 100}
    assert kwargs["max_concurrency"] == 1 and kwargs["no_catchup"] is True and kwargs["enable_caching"] is False
    assert "rr-1" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("submit", "max_steps=abc"), "max_steps: Input should be a valid integer"),
        (("submit", "min_eval_reward=high"), "min_eval_reward='high' is not a number_double"),
        (("submit", "gpu_tolerations={a: b}"), "gpu_tolerations='{a: b}' is not a list"),
        (("submit", "num_generations=1"), "num_generations"),
        (("submit", "no_such_knob=1"), "neither a pipeline parameter nor a config field"),
        (("submit", "max_steps"), "not key=value"),
        (("schedule", "--cron", "every monday"), "has 2 fields"),
        (("schedule", "--cron", "0 3 * * 1", "warm_start=latest"), "warm_start='latest': Fix: none or champion."),
        (("submit", "promotion_confidence=1.5"), "promotion_confidence=1.5: not in (0, 1)"),
        (("submit", "min_improvement=nan"), "min_improvement: not a finite number"),
    ],
)
def test_bad_arguments_exit_2_before_contacting_kfp(client, capsys, argv, message):
    assert run_cli(*argv) == 2
    assert message in capsys.readouterr().err
    assert client == []


def test_kfp_cron_accepts_six_fields_unchanged():
    assert cli_pipeline.kfp_cron("30 0 4 * * *") == "30 0 4 * * *"
    assert cli_pipeline.kfp_cron("*/15 * * * *") == "0 */15 * * * *"


def test_compile_writes_one_flavour_with_a_mirrored_image(tmp_path, capsys):
    from components import ASYNC_GRPO_CPU_IMAGE

    out = tmp_path / "cpu.yaml"
    assert run_cli("compile", "--cpu", "-o", str(out), "--image", "registry.local/async-grpo:dev") == 0

    ir, _ = yaml.safe_load_all(out.read_text())
    images = {e["container"]["image"] for e in ir["deploymentSpec"]["executors"].values()}
    assert images == {"registry.local/async-grpo:dev"} and ASYNC_GRPO_CPU_IMAGE not in out.read_text()
    assert ir["pipelineInfo"]["name"] == "async-grpo-cpu"


def test_run_local_refuses_the_kubernetes_backend_before_running(tmp_path, capsys):
    assert run_cli("run-local", "--output-dir", str(tmp_path), "launch_backend=kubernetes") == 2
    assert "uses the local backend" in capsys.readouterr().err
    assert not (tmp_path / "kfp-local").exists()


def test_the_demo_config_maps_onto_the_pipeline_without_loss():
    """`run-local --config examples/tiny_cpu.yaml` (make demo) trains exactly the demo config."""
    from async_grpo.config import GRPOConfig, load_config
    from async_grpo.pipeline_local import pipeline_parameters

    demo = REPO / "examples" / "tiny_cpu.yaml"
    params = pipeline_parameters(CPU_PACKAGE)
    args = cli_pipeline.pipeline_arguments(params, str(demo), [])

    merged = yaml.safe_load(args.pop("config_yaml"))
    assert set(args) <= set(params)
    merged.update(args)  # what train_grpo does: config_yaml, then the typed knobs
    assert GRPOConfig.model_validate(merged) == load_config(demo)


@pytest.mark.parametrize(
    "items, message",
    [
        (
            ['kubernetes_options={"trainer_image": "docker.io/evil/x:latest"}'],
            "trainer_image='docker.io/evil/x:latest'",
        ),
        (['kubernetes_options={"service_account": "default"}'], "service_account='default' is not allowed"),
        (['kubernetes_options={"mlflow_secret": "any"}'], "mlflow_secret='any' is not an allowed secret"),
        (
            ['kubernetes_options={"pvc_name": "mlflow-data"}'],
            "pvc_name='mlflow-data' is not an allowed workspace volume",
        ),
        (["work_dir=/workspace/../etc"], "work_dir='/workspace/../etc' is not the workspace volume"),
        (["mlflow_tracking_uri=https://collector.example.com"], "mlflow_tracking_uri='https://collector.example.com'"),
        (["vllm_extra_args=[--trust-remote-code]"], "flag '--trust-remote-code' is not allowed"),
    ],
)
@pytest.mark.parametrize("command", ["submit", "schedule"])
def test_submit_and_schedule_refuse_what_the_policy_does_not_allow(
    client, capsys, monkeypatch, items, message, command
):
    monkeypatch.delenv("ASYNC_GRPO_POLICY_FILE", raising=False)
    extra = ["--cron", "0 3 * * 1"] if command == "schedule" else []
    assert run_cli(command, *extra, *items) == 2
    err = capsys.readouterr().err
    assert "the platform policy refuses this run" in err and message in err and "Fix:" in err
    assert client == []  # nothing reached KFP


@pytest.mark.parametrize("name", ["mlflow_secret_name", "hf_token_secret_name", "workspace_pvc_name"])
def test_secret_and_volume_names_are_no_run_parameters(client, capsys, name):
    """The Secrets and volume the steps mount are compiled into the pipeline (PipelineWiring): a run cannot name them."""
    assert run_cli("submit", f"{name}=mlflow-data") == 2
    assert "is neither a pipeline parameter nor a config field" in capsys.readouterr().err and client == []


def test_submit_checks_against_the_given_policy_file_and_skips_the_local_backend(client, capsys, tmp_path):
    policy = tmp_path / "policy.yaml"
    policy.write_text("image_prefixes: [registry.corp/]\n")
    assert run_cli("submit", "--policy", str(policy)) == 2  # the default ghcr.io images are not allowed there
    assert "is not an allowed image" in capsys.readouterr().err and client == []
    assert run_cli("submit", "--policy", str(policy), 'kubernetes_options={"image_registry": "registry.corp/ml"}') == 0
    assert f"passes the platform policy ({policy})" in capsys.readouterr().out
    assert run_cli("submit", "--policy", str(policy), "launch_backend=local") == 0  # no cluster objects to check
