"""Preflight: the examples pass `async-grpo validate`; the cluster target skips exactly the checks of this machine;
`run_local`, `render` and `pipeline submit` refuse bad input before anything starts; reachable services and valid
reward functions pass."""

from __future__ import annotations

import argparse
import http.server
import threading
from pathlib import Path

import pytest

from async_grpo import cli, cli_pipeline
from async_grpo.config import GRPOConfig, load_config
from async_grpo.inference.server import VLLMServer
from async_grpo.preflight import CHECKS, LOCAL_ONLY, PreflightError, preflight
from async_grpo.tasks import TASKS

REPO_ROOT = Path(__file__).resolve().parents[1]
CPU_EXAMPLES = [
    "tiny_cpu.yaml",
    "tools_cpu.yaml",
    "guess_cpu.yaml",
    "agent_cpu.yaml",
    "trl_qwen_gsm8k.yaml",
    "lora_cpu.yaml",
    "reward_model_cpu.yaml",
]
BAD = "tests/bad_inputs"


@pytest.fixture(autouse=True)
def _from_the_repo_root(monkeypatch):
    monkeypatch.chdir(REPO_ROOT)
    for key in ("MLFLOW_TRACKING_URI", "ASYNC_GRPO_REWARD_URL"):
        monkeypatch.delenv(key, raising=False)


def test_every_example_is_covered():
    assert {p.name for p in (REPO_ROOT / "examples").glob("*.yaml")} == {
        *CPU_EXAMPLES,
        "tools_gpu.yaml",
        "distill_cpu.yaml",
    }


def test_the_distillation_example_passes_once_its_teacher_is_built(tmp_path, capsys):
    """examples/distill_cpu.yaml names a teacher the user builds first (`make-tiny-model --sft-steps`): without it
    validate exits 2 naming the field; with one built (a few steps here) it passes."""
    missing = f"teacher_model_name_or_path={tmp_path / 'none'}"
    assert cli.main(["validate", "examples/distill_cpu.yaml", missing]) == 2
    assert "error: distillation.teacher_model_name_or_path" in capsys.readouterr().err
    teacher = tmp_path / "teacher"
    assert cli.main(["make-tiny-model", str(teacher), "--sft-steps", "3"]) == 0
    assert (teacher / "config.json").is_file() and "trained 3 supervised steps" in capsys.readouterr().out
    built = f"teacher_model_name_or_path={teacher}"
    assert cli.main(["validate", "examples/distill_cpu.yaml", built]) == 0, capsys.readouterr().err


@pytest.mark.parametrize("name", CPU_EXAMPLES)
def test_cpu_examples_pass_validate(name, capsys):
    assert cli.main(["validate", f"examples/{name}"]) == 0, capsys.readouterr().err
    assert capsys.readouterr().out.startswith(f"OK: examples/{name} passes")


def test_the_gpu_example_fails_only_for_its_model_folder_on_this_machine(capsys):
    assert cli.main(["validate", "examples/tools_gpu.yaml"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith("error: model_name_or_path: '/models/Qwen2.5-1.5B-Instruct'")
    assert cli.main(["validate", "examples/tools_gpu.yaml", "--skip", "model"]) == 0
    # on a cluster the model folder and tool files must lie on the workspace volume: the policy says so first
    capsys.readouterr()
    assert cli.main(["validate", "examples/tools_gpu.yaml", "--target", "cluster"]) == 2
    errors = capsys.readouterr().err
    assert "model_name_or_path='/models/Qwen2.5-1.5B-Instruct'" in errors and "examples/tools/arithmetic.py" in errors
    on_volume = [
        "model_name_or_path=/workspace/models/Qwen2.5-1.5B-Instruct",
        "tools=[/workspace/tools/arithmetic.py:multiply, /workspace/tools/arithmetic.py:add]",
    ]
    assert cli.main(["validate", "examples/tools_gpu.yaml", *on_volume, "--target", "cluster"]) == 0


def test_the_hub_example_says_what_it_could_not_check(capsys):
    assert cli.main(["validate", "examples/trl_qwen_gsm8k.yaml"]) == 0
    out = capsys.readouterr().out
    assert "not checked: model: 'Qwen/Qwen2.5-0.5B-Instruct' is a hub id" in out
    assert "not checked: data.dataset: 'openai/gsm8k' is read at launch (a hub id)" in out


def test_the_cluster_target_skips_exactly_the_checks_of_this_machine(tmp_path):
    config = GRPOConfig(
        model_name_or_path="/nonexistent/model",
        output_dir=f"{BAD}/README.md/run",
        weight_sync_backend="nccl",
        mlflow_tracking_uri="http://127.0.0.1:9",
        reward_url="http://127.0.0.1:9",
    )
    local = preflight(config, skip=["weight_sync_device"])
    assert [p.field for p in local.problems] == [
        "output_dir",
        "tracking.mlflow_tracking_uri",
        "rewards.reward_url",
        "model_name_or_path",
    ]
    cluster = preflight(config, target="cluster")
    assert cluster.ok, cluster.problems
    assert set(cluster.checked) == set(CHECKS) - set(LOCAL_ONLY)
    bad_args = config.model_copy(update={"vllm_extra_args": ["--dtype", "half"]})
    assert [p.field for p in preflight(bad_args, target="cluster").problems] == ["inference.vllm_extra_args"]


def test_unknown_check_names_and_targets_are_refused():
    with pytest.raises(ValueError, match="unknown preflight checks"):
        preflight(GRPOConfig(), skip=["modle"])
    with pytest.raises(ValueError, match="target="):
        preflight(GRPOConfig(), target="laptop")


@pytest.mark.parametrize("task", sorted(TASKS))
def test_every_builtin_task_passes_with_its_own_rewards(task, tmp_path):
    rewards = [f"builtin:{name}" for name in TASKS[task].reward_funcs]
    config = GRPOConfig(
        dataset=f"builtin:{task}", reward_funcs=rewards, output_dir=str(tmp_path), environment=TASKS[task].environment
    )
    report = preflight(config)
    assert report.ok, report.problems
    assert "reward_probe" in report.checked


def test_a_reachable_mlflow_server_passes_whatever_it_answers(tmp_path):
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)  # answers 501
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        uri = f"http://127.0.0.1:{server.server_address[1]}"
        assert preflight(GRPOConfig(mlflow_tracking_uri=uri, output_dir=str(tmp_path))).ok
    finally:
        server.shutdown()
        server.server_close()


def test_run_local_refuses_bad_input_before_any_process(monkeypatch, tmp_path):
    from async_grpo.launch import local

    launched, envs = [], []
    monkeypatch.setattr(VLLMServer, "launch", lambda self: launched.append(self))
    monkeypatch.setattr(local, "check_env", lambda: envs.append(1) or 1)
    config = load_config(f"{BAD}/configs/37_reward_signature_one_arg.yaml", [f"output_dir={tmp_path}"])
    with pytest.raises(PreflightError, match=r"rewards.reward_funcs: reward function one_arg .* Fix: define it"):
        local.run_local(config)
    assert launched == [] and envs == []
    assert not any(tmp_path.iterdir())  # nothing written either


def test_render_refuses_bad_input_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "objects"
    assert cli.main(["render", f"{BAD}/configs/31_extra_args_seed.yaml", "-o", str(out)]) == 2
    assert "error: vllm_extra_args: flag '--seed' is not allowed" in capsys.readouterr().err  # the policy first
    assert not out.exists()


def test_pipeline_submit_refuses_bad_input_before_kfp(monkeypatch, capsys):
    made = []
    monkeypatch.setattr(cli_pipeline, "make_client", lambda host, namespace: made.append(host))
    monkeypatch.delenv("ASYNC_GRPO_POLICY_FILE", raising=False)
    parser = argparse.ArgumentParser(prog="async-grpo")
    cli_pipeline.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["pipeline", "submit", "warmup_sft_steps=0", "max_prompt_length=600"])
    assert args.func(args) == 2
    assert "error: inference.vllm_max_model_len: max_prompt_length=600" in capsys.readouterr().err
    assert made == []


def test_a_launcher_set_reward_service_is_waited_for_at_launch_not_probed(monkeypatch, tmp_path):
    monkeypatch.setenv("ASYNC_GRPO_REWARD_URL", "http://127.0.0.1:9")  # the reward pod may still be starting
    report = preflight(GRPOConfig(output_dir=str(tmp_path)))
    assert report.ok, report.problems
    assert any(note.startswith("reward_url: ASYNC_GRPO_REWARD_URL") for note in report.skipped)
    assert "reward_probe" not in report.checked  # the service runs the reward functions


def test_with_a_reward_service_submitter_code_is_never_imported_in_the_trainer_pod(monkeypatch, tmp_path):
    """In a trainer pod (a reward service is in use) the tool and agent files are loaded by the reward service; a
    preflight that imported them would run submitter code beside the credentials."""
    marker = tmp_path / "imported"
    code = f"open({str(marker)!r}, 'w').write('x')\n"
    (tmp_path / "my_tools.py").write_text(
        code + 'def lookup(q: str) -> str:\n    """Look q up.\n\n    Args:\n        q: what.\n    """\n    return q\n'
    )
    (tmp_path / "my_agent.py").write_text(code + "def play(row, base_url, api_key):\n    return 1.0\n")
    monkeypatch.setenv("ASYNC_GRPO_REWARD_URL", "http://127.0.0.1:9")
    for fields in ({"tools": [f"{tmp_path}/my_tools.py:lookup"]}, {"agent": f"{tmp_path}/my_agent.py:play"}):
        report = preflight(GRPOConfig(output_dir=str(tmp_path), dataset="builtin:guess", **fields))
        assert not marker.exists(), f"{fields} was imported in the trainer pod"
        assert any("the reward service loads" in note for note in report.skipped), report.skipped


def _pipeline(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="async-grpo")
    cli_pipeline.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["pipeline", *argv])
    return args.func(args)


def test_pipeline_checks_the_dataset_argument_it_will_train_on(monkeypatch, capsys, tmp_path):
    made, ran = [], []
    monkeypatch.setattr(cli_pipeline, "make_client", lambda host, namespace: made.append(host))
    monkeypatch.setattr(cli_pipeline, "run_local_pipeline", lambda *a, **k: ran.append(a))
    monkeypatch.delenv("ASYNC_GRPO_POLICY_FILE", raising=False)
    bad = [f"dataset=file://{REPO_ROOT}/{BAD}/data/good.jsonl", "warmup_sft_steps=20"]
    assert _pipeline("submit", *bad) == 2
    assert "error: data.warmup_sft_steps: warmup_sft_steps=20 needs a builtin dataset" in capsys.readouterr().err
    out = tmp_path / "pipeline-runs"
    assert _pipeline("run-local", "--output-dir", str(out), *bad) == 2
    assert "error: data.warmup_sft_steps" in capsys.readouterr().err
    assert made == [] and ran == []
    assert not out.exists() or not any(out.rglob("*.yaml"))  # refused before anything ran: no trace
