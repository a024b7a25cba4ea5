"""A hostile tenant against the platform policy: each attack of issue 21 (and the ones found beside them) is tried
here, and the test asserts the refusal (exit 2 naming the field, nothing rendered or started) or that the
submitter's code never ran where credentials are. No cluster is needed: the API is a recording double.

Submitter code in these tests is a file whose import writes a marker named after the importing process's PID, so a
test can tell exactly which process ran it.
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
import textwrap
import types
from pathlib import Path

import httpx
import pytest
import requests
import yaml
from kfp import dsl

from async_grpo import cli
from async_grpo.config import ConfigError, GRPOConfig
from async_grpo.launch import k8s_objects
from async_grpo.launch.image_refs import BadImageReference, parse_image_ref
from async_grpo.launch.k8s_api import LAUNCHER_RBAC_RULES
from async_grpo.launch.k8s_policy import PolicyViolation, check_run, check_work_dir, prepare_run
from async_grpo.launch.k8s_settings import ClusterSettings
from async_grpo.launch.platform_policy import PlatformPolicy
from async_grpo.launch.uris import UnsafeURI, canonical_http_uri, parse_http_uri, uri_allowed
from async_grpo.preflight import preflight
from async_grpo.runner.state import TrainState, load_checkpoint, save_checkpoint
from components.prepare_dataset.component import prepare_dataset
from components.train_grpo.component import train_grpo

from ._k8s_validate import REPO

TINY = REPO / "examples" / "tiny_cpu.yaml"


def hostile_file(folder: Path, name: str = "evil.py", body: str = "") -> tuple[Path, Path]:
    """A submitter's .py file whose import writes `<markers>/<pid>`; returns (file, markers folder)."""
    markers = folder / f"{name}.markers"
    markers.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(
        textwrap.dedent(f"""\
        import os, pathlib
        pathlib.Path({str(markers)!r}, str(os.getpid())).write_text(os.environ.get("MLFLOW_TRACKING_PASSWORD", ""))

        def f(prompts, completions, completion_ids, **kwargs):
            return [0.0] * len(completions)

        def lookup(text: str) -> str:
            \"\"\"Look a word up.

            Args:
                text: the word.
            \"\"\"
            return text
        """)
        + body
    )
    return path, markers


def ran_here(markers: Path) -> bool:
    """True when this process imported the hostile file."""
    return (markers / str(os.getpid())).exists()


def render_and_validate(tmp_path: Path, overrides: list[str], options: list[str], capsys) -> str:
    """Run `render` and `validate --target cluster` on the same input: both must exit 2 with the same errors and
    nothing may be rendered. Returns the errors."""
    out = tmp_path / "rendered"
    assert cli.main(["render", str(TINY), *overrides, "-o", str(out), *options]) == 2
    rendered = capsys.readouterr().err
    assert cli.main(["validate", str(TINY), *overrides, "--target", "cluster", *options]) == 2
    validated = capsys.readouterr().err
    assert rendered == validated and rendered.startswith("error: ")
    assert not out.exists()
    return rendered


# ------------------------------------------------------------------------------------------------ 1: train step
def test_1_the_train_step_checks_the_policy_before_reading_submitter_files(tmp_path, monkeypatch):
    """A reward file on the workspace volume must not run in the train step (MLflow credentials, the launcher's
    token): the policy refuses the run before preflight touches the file."""
    evil, markers = hostile_file(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "hunter2")
    monkeypatch.delenv("ASYNC_GRPO_POLICY_FILE", raising=False)
    data = dsl.Dataset(uri=str(tmp_path / "data"), name="d", metadata={"source": "builtin:reverse"})
    model = dsl.Model(uri=str(tmp_path / "model"), name="m")
    with pytest.raises(PolicyViolation, match="reward_funcs="):
        train_grpo.python_func(
            dataset=data,
            model=model,
            launch_backend="kubernetes",
            reward_funcs=[f"{evil}:f"],
            mlflow_tracking_uri="http://mlflow:5000",
        )
    assert not any(markers.iterdir())


def test_1_cluster_preflight_parses_submitter_files_and_never_imports_them(tmp_path):
    evil, markers = hostile_file(tmp_path)
    tool, tool_markers = hostile_file(tmp_path, "tool.py")
    producer, producer_markers = hostile_file(tmp_path, "producer.py")
    config = GRPOConfig(
        model_name_or_path="builtin:tiny",
        dataset="builtin:reverse",
        reward_funcs=[f"{evil}:f"],
        tools=[f"{tool}:lookup"],
    )
    report = preflight(config, target="cluster")
    assert report.ok, report.problems
    with_producer = GRPOConfig(
        model_name_or_path="builtin:tiny", dataset="builtin:reverse", data_producer=f"{producer}:f"
    )
    assert preflight(with_producer, target="cluster").ok
    assert not any(any(m.iterdir()) for m in (markers, tool_markers, producer_markers))
    # what the parse finds is still reported: a missing function, a syntax error (without quoting the file)
    broken = tmp_path / "broken.py"
    broken.write_text("SECRET = 'hunter2'\ndef f(:\n")
    bad = config.model_copy(update={"reward_funcs": [f"{evil}:nope", f"{broken}:f"]})
    problems = preflight(bad, target="cluster").problems
    text = " ".join(p.message for p in problems)
    assert "defines no 'nope'" in text and "is not valid Python (line 2)" in text and "hunter2" not in text
    assert not any(markers.iterdir())


def test_1_a_symlink_cannot_make_preflight_read_a_secret(tmp_path):
    secret = tmp_path / "token"
    secret.write_text("eyJhbGciOiJSUzI1NiJ9.secret-service-account-token")
    link = tmp_path / "reward.py"
    link.symlink_to(secret)
    config = GRPOConfig(model_name_or_path="builtin:tiny", dataset="builtin:reverse", reward_funcs=[f"{link}:f"])
    (problem,) = preflight(config, target="cluster").problems
    assert "symbolic link" in problem.message and "secret" not in problem.message.replace("secret-", "")
    assert "eyJ" not in problem.message


def test_1_remote_model_code_never_runs_in_cluster_preflight(tmp_path):
    """trust_remote_code would run the model folder's code while preflight loads the tokenizer or the config."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "evil", "auto_map": {"AutoConfig": "evil.EvilConfig"}}')
    evil, markers = hostile_file(folder, "evil.py")
    config = GRPOConfig(
        model_name_or_path=str(folder),
        dataset="builtin:reverse",
        trust_remote_code=True,
        use_peft=True,
        lora_target_modules=["q_proj"],
    )
    report = preflight(config, target="cluster")
    assert not any(markers.iterdir())
    assert any("remote code" in note for note in report.skipped)
    # and the policy refuses the run: the trainer pod would run that code beside the MLflow credentials
    widened = PlatformPolicy(vllm_flags=[*PlatformPolicy().vllm_flags, "--trust-remote-code"])
    with pytest.raises(PolicyViolation, match="trust_remote_code=true would run the model folder's Python code"):
        check_run(config, ClusterSettings(), widened)


# ------------------------------------------------------------------------------------------------ 2: URIs
@pytest.mark.parametrize(
    "uri",
    [
        "http://evil\\@mlflow:5000",
        "http://evil%5C@mlflow:5000",
        "http://mlflow:5000@evil.com",
        "http://u:p@mlflow:5000",
        "http://evil.com\\.mlflow:5000",
        "http://mlflow:5000 @evil.com",
        "http://mlflow\t:5000",
        "http://mlflow:5000\n",
        "http://mlﬂow:5000",
        "http://mlflow:5000/?next=http://evil.com",
        "http://mlflow:5000/#@evil.com",
        "http://mlflow:5000/../x",
        "http://mlflow:5000/%2e%2e/x",
        "http://[::1]:5000@evil.com",
        "http://mlflow:0",
        "http://mlflow:65536",
        "http://mlflow:5000:80",
        "ftp://mlflow:5000",
        "//mlflow:5000",
        "http:///mlflow:5000",
    ],
)
def test_2_ambiguous_tracking_uris_are_refused_by_every_entry_point(uri, tmp_path, capsys):
    with pytest.raises(UnsafeURI):
        parse_http_uri(uri)
    assert not uri_allowed(uri, ["http://mlflow:5000"])
    errors = render_and_validate(tmp_path, [f"mlflow_tracking_uri={uri}"], [], capsys)
    assert "mlflow_tracking_uri" in errors


@pytest.mark.parametrize(
    "uri",
    [
        "http://mlflow:5000",
        "HTTP://MLflow:5000/",
        "http://mlflow:5000/team-a/",
        "https://mlflow.corp:8443/a/b",
        "http://10.0.0.7:5000",
        "http://[fd00::7]:5000",
    ],
)
def test_2_an_accepted_uri_means_the_same_host_to_every_client(uri):
    """The host the policy checks is the host requests (MLflow's client), urllib3 and httpx connect to, and the pods
    get the rebuilt URI, never the submitter's string."""
    parsed = parse_http_uri(uri)
    prepared = requests.Request("GET", canonical_http_uri(uri)).prepare()
    assert httpx.URL(prepared.url).host == httpx.URL(uri).host == parsed.host.strip("[]")
    assert httpx.URL(uri).port in (parsed.port, None)
    settings = ClusterSettings(mlflow_tracking_uri=uri)
    config = GRPOConfig()
    assert k8s_objects.tracking_uri(config, settings) == canonical_http_uri(uri)


def test_2_the_pods_get_the_rebuilt_uri(gpu_config, gpu_settings):
    policy = PlatformPolicy(mlflow_tracking_uris=["http://mlflow:5000"])
    config = gpu_config.model_copy(update={"mlflow_tracking_uri": "HTTP://MLFLOW:5000/"})
    resolved = prepare_run(config, gpu_settings, policy)
    objects = k8s_objects.build_run_objects(config, resolved, "run-uri", policy=policy)
    job = next(o for o in objects if o["kind"] == "PyTorchJob")
    env = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "MLFLOW_TRACKING_URI", "value": "http://mlflow:5000"} in env
    cm = yaml.safe_load(objects[0]["data"]["config.yaml"])
    assert cm["mlflow_tracking_uri"] == "http://mlflow:5000"


def test_2_the_same_parse_guards_external_reward_services(gpu_config):
    policy = PlatformPolicy(reward_urls=["http://rewards.ml.svc:8080"])
    config = gpu_config.model_copy(update={"reward_url": "http://evil\\@rewards.ml.svc:8080"})
    with pytest.raises(PolicyViolation, match="reward_url: .*backslash"):
        check_run(config, ClusterSettings(reward_replicas=0), policy)


# ------------------------------------------------------------------------------------------------ 3: tools
def test_3_tool_files_run_in_the_reward_service_and_never_in_the_trainer(tmp_path, monkeypatch):
    """With a reward service, the trainer (and the evaluate step) take the tool schemas from it: the submitter's
    tool file is imported in the service's process only."""
    from async_grpo.runner.tool_setup import build_tool_backend
    from async_grpo.tools.loading import load_tools
    from tests.rewards.test_reward_server import start_server, stop_server

    tool, markers = hostile_file(tmp_path, "tool.py")
    specs = ["builtin:calculator", f"{tool}:lookup"]
    served = tmp_path / "served.yaml"
    served.write_text(yaml.safe_dump({"reward_funcs": ["builtin:calc_exact_match"], "tools": specs}))
    monkeypatch.setenv("ASYNC_GRPO_REWARD_TOKEN", "tok")
    proc, url = start_server(served, tmp_path / "server.log")
    monkeypatch.delenv("ASYNC_GRPO_REWARD_TOKEN")
    try:
        config = GRPOConfig(dataset="builtin:calc", tools=specs, reward_funcs=["builtin:calc_exact_match"])
        backend = build_tool_backend(config, (url, "tok"))
        try:
            assert [t.name for t in backend.tools] == ["calculator", "lookup"]
            assert not ran_here(markers)
            assert (markers / str(proc.pid)).exists()  # the service did import it
        finally:
            backend.close()
    finally:
        assert stop_server(proc) == 0
    local = load_tools(specs)  # the schemas the service sent equal a local load's
    assert ran_here(markers) and local[1].name == "lookup"


# ------------------------------------------------------------------------------------------------ 4: mount path
@pytest.mark.parametrize(
    "path",
    [
        "/cache",
        "/cache/.local",
        "/usr/local/lib/python3.11/site-packages",
        "/",
        "/workspace/../cache",
        "/etc/async-grpo",
        "/workspace/",
        "workspace",
        "/tmp",
        "/usr",
        "/opt/venv",
        "//workspace",
    ],
)
def test_4_the_workspace_cannot_be_mounted_over_code_or_home(path, tmp_path, capsys):
    errors = render_and_validate(tmp_path, [], ["--set", f"data_mount_path={path}"], capsys)
    assert "data_mount_path" in errors


def test_4_a_mount_path_outside_the_policy_is_refused(tmp_path, capsys):
    assert "is not an allowed mount path" in render_and_validate(
        tmp_path, [], ["--set", "data_mount_path=/data"], capsys
    )


def test_4_no_user_site_directory_in_any_image_or_pod(cpu_config, cpu_settings):
    for dockerfile in (REPO / "images").glob("*/Dockerfile"):
        assert "PYTHONNOUSERSITE=1" in dockerfile.read_text(), dockerfile
    for obj in k8s_objects.build_run_objects(cpu_config, cpu_settings, "run-site"):
        spec = obj.get("spec", {})
        template = spec.get("template") or spec.get("pytorchReplicaSpecs", {}).get("Master", {}).get("template")
        for container in (template or {}).get("spec", {}).get("containers", []):
            assert {"name": "PYTHONNOUSERSITE", "value": "1"} in container["env"], (obj["kind"], container["name"])


# ------------------------------------------------------------------------------------------------ 5: NCCL env
@pytest.mark.parametrize(
    "key",
    [
        "NCCL_CONF_FILE",
        "NCCL_NET_PLUGIN",
        "NCCL_TUNER_PLUGIN",
        "NCCL_TOPO_FILE",
        "NCCL_DEBUG_FILE",
        "LD_PRELOAD",
        "PYTHONPATH",
        "GLOO_X_PLUGIN",
        "NCCL_ALGO\n",
    ],
)
def test_5_nccl_env_never_names_a_file_or_library(key, tmp_path, capsys):
    option = yaml.safe_dump({key: "/workspace/x"}, default_flow_style=True).strip()
    assert "nccl_env" in render_and_validate(tmp_path, [], ["--set", f"nccl_env={option}"], capsys)


def test_5_tuning_variables_outside_the_allow_list_are_refused(tmp_path, capsys):
    errors = render_and_validate(tmp_path, [], ["--set", "nccl_env={NCCL_NET: evil}"], capsys)
    assert "nccl_env sets ['NCCL_NET']" in errors
    check_run(GRPOConfig(), ClusterSettings(nccl_env={"NCCL_ALGO": "Ring"}), PlatformPolicy())


# ------------------------------------------------------------------------------------------------ 6: pipeline
def test_6_secret_and_volume_names_are_compiled_into_the_pipeline():
    ir = yaml.safe_load((REPO / "pipelines" / "grpo_pipeline.yaml").read_text().split("\n---\n")[0])
    params = ir["root"]["inputDefinitions"]["parameters"]
    assert not {"mlflow_secret_name", "hf_token_secret_name", "workspace_pvc_name"} & set(params)


@pytest.mark.parametrize("work_dir", ["/", "/etc", "/workspace/../etc", "/workspacex", "/tmp/w", "relative"])
def test_6_in_a_pod_work_dir_stays_on_the_workspace_volume(work_dir, monkeypatch):
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    with pytest.raises(PolicyViolation, match="work_dir="):
        check_work_dir(work_dir)
    check_work_dir("/workspace")
    check_work_dir("/workspace/team-a")


def test_6_the_dataset_step_reads_no_file_off_the_volume_in_a_pod(tmp_path, monkeypatch):
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    out = dsl.Dataset(uri=str(tmp_path / "out"), name="d")
    for uri in (
        "/etc/passwd.jsonl",
        "file:///var/run/secrets/kubernetes.io/serviceaccount/token.json",
        "/workspace/../proc/self/environ.json",
    ):
        with pytest.raises(ValueError, match="must be a normalized path on the workspace volume"):
            prepare_dataset.python_func(dataset_uri=uri, dataset=out)


# ------------------------------------------------------------------------------------------------ 7: paths
@pytest.mark.parametrize(
    "override, field",
    [
        ("model_name_or_path=/workspace/../etc/models/x", "model_name_or_path"),
        ("dataset=/workspace/../etc/data.jsonl", "dataset"),
        ("eval_dataset=/workspace//../x.jsonl", "eval_dataset"),
        ("reward_funcs=[/workspace/../usr/lib/x.py:f]", "reward_funcs"),
        ("tools=[/workspace/./../x.py:lookup]", "tools"),
        ("resume_from_checkpoint=/workspace/../elsewhere/checkpoint-7", "resume_from_checkpoint"),
        ("dataset=/workspacex/data.jsonl", "dataset"),
    ],
)
def test_7_paths_are_normalized_before_the_prefix_check(override, field, tmp_path, capsys):
    errors = render_and_validate(tmp_path, [override, "reward_weights=null"], [], capsys)
    assert f"{field}=" in errors


def test_7_an_output_dir_off_the_volume_falls_back_to_the_runs_folder(cpu_config, cpu_settings):
    config = cpu_config.model_copy(update={"output_dir": "/workspace/../etc"})
    assert k8s_objects.run_output_dir(config, cpu_settings, "r") == "/workspace/runs/r"


# ------------------------------------------------------------------------------------------------ 8: run name
@pytest.mark.parametrize(
    "override",
    [
        "run_name=someone-elses-run",
        "output_dir=/workspace/other-run",
        "dataset=/workspace/other/data.jsonl",
        "tracking.run_name=x",
    ],
)
def test_8_extra_overrides_cannot_take_another_runs_name_or_folders(override, tmp_path, monkeypatch):
    import datasets

    module = types.ModuleType("async_grpo.launch.kubernetes")
    module.KubernetesBackend = lambda **_: pytest.fail("nothing may be launched")
    monkeypatch.setitem(sys.modules, "async_grpo.launch.kubernetes", module)
    data = dsl.Dataset(uri=str(tmp_path / "data"), name="d", metadata={"source": "builtin:reverse"})
    rows = datasets.Dataset.from_dict({"prompt": ["reverse: ab\n"], "answer": ["ba"]})
    datasets.DatasetDict({"train": rows, "eval": rows}).save_to_disk(data.path)
    with pytest.raises(ConfigError, match="extra_overrides may not set"):
        train_grpo.python_func(
            dataset=data,
            model=dsl.Model(uri=str(tmp_path / "m"), name="m"),
            launch_backend="kubernetes",
            work_dir=str(tmp_path / "w"),
            run_name="mine",
            pipeline_job_id="0123456789",
            extra_overrides=[override],
        )


# ------------------------------------------------------------------------------------------------ 9: validate
@pytest.mark.parametrize(
    "overrides, options",
    [
        (["vllm_extra_args=[--trust-remote-code]"], []),
        (["vllm_extra_args=[--middleware, x.Y]"], []),
        (["mlflow_tracking_uri=https://collector.example.com"], []),
        ([], ["--set", "trainer_image=docker.io/evil/x:latest"]),
        ([], ["--set", "service_account=async-grpo-launcher"]),
        ([], ["--set", "pvc_name=mlflow-data"]),
        ([], ["--set", "mlflow_secret=mlflow-postgres"]),
        (["data_producer=/workspace/p.py:make"], []),
        (["reward_funcs=[/workspace/r.py:f]", "reward_weights=null"], ["--set", "reward_replicas=0"]),
        (["trust_remote_code=true"], []),
    ],
)
def test_9_validate_refuses_what_render_refuses_with_the_same_message(overrides, options, tmp_path, capsys):
    assert "the platform policy refuses this run" in render_and_validate(tmp_path, overrides, options, capsys)


def test_9_the_compliant_gpu_example_validates_and_renders(tmp_path, capsys):
    example = REPO / "manifests" / "examples" / "gpu-2x8"
    args = ["--settings", str(example / "settings.yaml"), "--policy", str(example / "policy.yaml")]
    assert cli.main(["validate", str(example / "config.yaml"), "--target", "cluster", *args]) == 0
    assert cli.main(["render", str(example / "config.yaml"), "-o", str(tmp_path / "o"), *args]) == 0


# ------------------------------------------------------------------------------------------------ 10: the rest
def test_10_the_reward_server_will_not_listen_unauthenticated_off_loopback(tmp_path, monkeypatch, capsys):
    from async_grpo.rewards.server import main

    config = tmp_path / "c.yaml"
    config.write_text("reward_funcs: [builtin:reverse_exact_match]\n")
    monkeypatch.delenv("ASYNC_GRPO_REWARD_TOKEN", raising=False)
    for host in ("0.0.0.0", "::", "10.1.2.3", "reward.example.com"):
        assert main(["--config", str(config), "--host", host]) == 2
        assert "without a token" in capsys.readouterr().err


@pytest.mark.parametrize(
    "ref, message",
    [
        ("ghcr.io/async-grpo/trainer@sha256:" + "a" * 64 + "\n", "not written in full"),
        ("ghcr.io/async-grpo.evil.com/trainer@sha256:" + "a" * 64, "not an allowed image"),
        ("ghcr.io/async-grpo/../evil/x@sha256:" + "a" * 64, "not a valid reference"),
        ("ghcr.io/async-grpo-evil/x@sha256:" + "a" * 64, "not an allowed image"),
        ("ghcr.io/async-grpo/trainer:latest", "not pinned by digest"),
        ("ghcr.io/async-grpo/trainer@sha256:" + "a" * 63, "not a valid reference"),
        (" ghcr.io/async-grpo/trainer@sha256:" + "a" * 64, "not a valid reference"),
    ],
)
def test_10_image_references_are_parsed_not_matched_as_strings(ref, message):
    policy = PlatformPolicy(require_digest=True)
    with pytest.raises(PolicyViolation, match=message):
        check_run(GRPOConfig(), ClusterSettings(trainer_image=ref), policy)
    with pytest.raises(BadImageReference):
        parse_image_ref(ref.rstrip("\n") + "\n")


def test_10_the_launcher_role_cannot_touch_the_platforms_own_objects():
    rbac = yaml.safe_load_all((REPO / "manifests" / "base" / "rbac.yaml").read_text())
    role = next(doc for doc in rbac if doc["kind"] == "Role")
    for rule in role["rules"]:
        if set(rule["resources"]) & {"configmaps", "networkpolicies", "services", "secrets"}:
            assert rule["verbs"] == ["create"], rule
    for resource in ("configmaps", "networkpolicies", "services", "secrets"):
        assert LAUNCHER_RBAC_RULES[("networking.k8s.io" if resource == "networkpolicies" else "", resource)] == {
            "create"
        }


# ------------------------------------------------------------------------------------------------ found beside
class _Planted:
    """A pickle that runs code when loaded."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "pwned"))


def test_a_planted_checkpoint_cannot_run_code_on_resume(tmp_path):
    """resume_from_checkpoint may name a folder the submitter wrote: its state is read with weights_only."""
    good = save_checkpoint(TrainState(step=3), tmp_path / "checkpoint-3")
    assert load_checkpoint(good).step == 3
    marker = tmp_path / "pwned"
    evil = tmp_path / "checkpoint-7"
    evil.mkdir()
    import torch

    torch.save({"step": _Planted(marker)}, evil / "train_state.pt")
    with pytest.raises(pickle.UnpicklingError):
        load_checkpoint(evil)
    assert not marker.exists()


def test_a_submitter_cannot_launch_into_another_namespace(tmp_path, monkeypatch):
    from async_grpo.launch.kubernetes import KubernetesBackend

    ns = tmp_path / "namespace"
    ns.write_text("team-a\n")
    monkeypatch.setattr("async_grpo.launch.kubernetes.SA_NAMESPACE_FILE", ns)
    with pytest.raises(PolicyViolation, match="namespace='team-b' is not this launcher's namespace"):
        KubernetesBackend(settings={"namespace": "team-b"}, policy=PlatformPolicy())


@pytest.mark.parametrize(
    "kwargs",
    [
        {"cache_dir": "/workspace/evil-cache"},
        {"gguf_file": "/workspace/x.gguf"},
        {"attn_implementation": "kernels-community/flash-attn"},
    ],
)
def test_model_init_kwargs_cannot_load_files_or_kernels_in_the_trainer(kwargs, gpu_config):
    config = gpu_config.model_copy(update={"model_init_kwargs": kwargs})
    with pytest.raises(PolicyViolation, match="model_init_kwargs"):
        check_run(config, ClusterSettings(), PlatformPolicy())
    check_run(
        gpu_config.model_copy(update={"model_init_kwargs": {"attn_implementation": "sdpa", "revision": "main"}}),
        ClusterSettings(),
        PlatformPolicy(),
    )


def test_gpu_resource_is_an_extended_resource_name():
    for bad in ("memory", "cpu", "nvidia.com/gpu\n", "a/b/c"):
        with pytest.raises(ValueError, match="gpu_resource"):
            ClusterSettings(gpu_resource=bad)
    assert ClusterSettings(gpu_resource="amd.com/gpu").gpu_resource == "amd.com/gpu"


def test_policy_entries_that_do_not_parse_are_refused_at_load():
    for field, value in (
        ("mlflow_tracking_uris", ["http://evil\\@mlflow:5000"]),
        ("images", ["ubuntu"]),
        ("data_mount_paths", ["/cache"]),
        ("image_prefixes", ["ghcr.io/ x"]),
    ):
        with pytest.raises(ValueError):
            PlatformPolicy(**{field: value})


def test_the_argparse_namespace_of_render_and_validate_is_the_same():
    """validate takes render's cluster flags (one shared definition), so the two cannot drift."""
    from async_grpo import cli_render

    parser = argparse.ArgumentParser()
    cli_render.add_cluster_arguments(parser)
    assert {a.dest for a in parser._actions} >= {"settings", "set", "policy"}


# ---------------------------------------------------------------------------- 11: kubelet variable expansion
def _references(value: str) -> list[str]:
    """The variable names the kubelet would expand in `value` (`$(NAME)`; `$$` is a literal `$`), as in Kubernetes'
    `third_party/forked/golang/expansion`."""
    names, i = [], 0
    while i < len(value):
        if value.startswith("$$", i):
            i += 2
        elif value.startswith("$(", i) and ")" in value[i:]:
            end = value.index(")", i)
            names.append(value[i + 2 : end])
            i = end + 1
        else:
            i += 1
    return names


def _expanded_strings(node, where: str = "") -> list[tuple[str, str]]:
    """(container, string) for every command, args and env value of every container in `node` (any object)."""
    found = []
    if isinstance(node, dict):
        for key in ("containers", "initContainers"):
            for container in node.get(key) or []:
                strings = [*container.get("command", []), *container.get("args", [])]
                strings += [e["value"] for e in container.get("env", []) if "value" in e]
                found += [(container["name"], s) for s in strings]
        for value in node.values():
            found += _expanded_strings(value)
    elif isinstance(node, list):
        for value in node:
            found += _expanded_strings(value)
    return found


HOSTILE = "$(VLLM_API_KEY)-$(MLFLOW_TRACKING_PASSWORD)-$(JUDGE_API_KEY)"


@pytest.mark.parametrize("trainer_api", ["pytorchjob", "trainjob"])
def test_11_a_submitters_variable_reference_reaches_the_process_as_written(trainer_api):
    """The kubelet expands `$(NAME)` in a container's command, args and env values to the container's variable NAME:
    `--kv-cache-dtype=$(VLLM_API_KEY)` would put the run's token in vLLM's error message and the pod log. Every
    submitter string there is escaped (`$$`), the launcher's own references stay, and the argv a TrainJob runtime
    execs from its ConfigMap (a file: never expanded) is the submitter's string exactly."""
    from async_grpo.launch.k8s_trainjob import VLLM_ARGV_KEY, VLLM_STARTUP_ENV, VLLM_URL_ENV, build_objects_for_api

    config = GRPOConfig(
        model_name_or_path=f"/workspace/models/{HOSTILE}",
        dataset="/workspace/datasets/math.jsonl",
        vllm_extra_args=[f"--kv-cache-dtype={HOSTILE}", "--max-num-seqs", HOSTILE],
        mlflow_tracking_uri=f"http://mlflow:5000/{HOSTILE}",
        **(
            {
                "reward_funcs": ["builtin:llm_judge"],
                "judge_model_name_or_path": f"/workspace/models/{HOSTILE}",
                "teacher_model_name_or_path": f"/workspace/teachers/{HOSTILE}",
            }
            if trainer_api == "pytorchjob"  # the TrainJob runtime serves no judge or teacher (refused there)
            else {}
        ),
    )
    settings = ClusterSettings(
        namespace="team-a",
        device="gpu",
        vllm_gpus=1,
        reward_replicas=1,
        trainer_api=trainer_api,
        nccl_env={"NCCL_DEBUG_SUBSYS": HOSTILE},
        nccl_socket_ifname="$(VLLM_API_KEY)",
    )
    check_run(config, settings, PlatformPolicy(mlflow_tracking_uris=["http://mlflow:5000"]))  # the policy admits all
    objects = build_objects_for_api(config, settings, "agrpo-x")

    strings = _expanded_strings(objects)
    hostile = [(name, s) for name, s in strings if "VLLM_API_KEY" in s or "MLFLOW_TRACKING_PASSWORD" in s]
    if trainer_api == "pytorchjob":  # vLLM's, the judge's and the teacher's commands, NCCL variables, tracking URI
        assert {name for name, _ in hostile} >= {"vllm", "judge", "teacher", "pytorch"}, strings
    launcher_own = {VLLM_URL_ENV, VLLM_STARTUP_ENV}  # the TrainJob's wait-for-vllm reads its own variables
    expanded = [(name, s, _references(s)) for name, s in strings if set(_references(s)) - launcher_own]
    assert expanded == [], expanded
    if trainer_api == "trainjob":
        (config_map,) = [o for o in objects if o["kind"] == "ConfigMap" and VLLM_ARGV_KEY in o.get("data", {})]
        argv = yaml.safe_load(config_map["data"][VLLM_ARGV_KEY])
        assert f"--kv-cache-dtype={HOSTILE}" in argv and HOSTILE in argv, argv


def test_11_references_are_read_as_the_kubelet_reads_them():
    assert _references("a$(X)b$$(Y)c$$$(Z)$(") == ["X", "Z"]


# ------------------------------------------------------------------------------ 12: the shared volume (issue 46)
SECRET_TOKEN = b"eyJhbGciOi-the-launchers-serviceaccount-token"


class _FinishedRunBackend:
    """The kubernetes backend's double: the policy admits the run, and the "trainer" leaves its final model on the
    workspace volume, where `plant(model_dir)` lets a tenant add what it likes before the step copies it."""

    plant = staticmethod(lambda model_dir: None)

    def __init__(self, settings=None, tracking=None, **_):
        self.tracking = tracking

    def check(self, config):
        pass

    def launch(self, config, *, timeout_s):
        from async_grpo.launch.base import LaunchResult

        model_dir = Path(config.output_dir) / "final-model"
        model_dir.mkdir(parents=True)
        (model_dir / "config.json").write_text("{}")
        (model_dir / "model.safetensors").write_bytes(b"weights")
        type(self).plant(model_dir)
        if type(self).plant is _FinishedRunBackend.plant:  # an honest run: the step tags its MLflow run at the end
            import mlflow

            run_id = mlflow.MlflowClient(config.tracking_uri).create_run("0").info.run_id
            return LaunchResult(run_id, config.tracking_uri, str(model_dir), {})
        return LaunchResult("never-tagged", config.tracking_uri, str(model_dir), {})


def _train_on_the_volume(tmp_path, monkeypatch, plant, **kwargs):
    """The train step with the kubernetes backend's double, its run folder on a fake workspace volume
    (`tmp_path/workspace`); returns the step's Model artifact. Raises what the step raises."""
    import datasets

    module = types.ModuleType("async_grpo.launch.kubernetes")
    module.KubernetesBackend = type("KubernetesBackend", (_FinishedRunBackend,), {"plant": staticmethod(plant)})
    monkeypatch.setitem(sys.modules, "async_grpo.launch.kubernetes", module)
    monkeypatch.setenv("MLFLOW_RUN_ID", "kfp-opened-run")  # KFP's MLflow integration: no pipeline run to open here
    monkeypatch.delenv("ASYNC_GRPO_POLICY_FILE", raising=False)
    data = dsl.Dataset(uri=str(tmp_path / "artifacts" / "data"), name="d", metadata={"source": "builtin:reverse"})
    rows = datasets.Dataset.from_dict({"prompt": ["reverse: ab\n"], "answer": ["ba"]})
    datasets.DatasetDict({"train": rows, "eval": rows}).save_to_disk(data.path)
    model = dsl.Model(uri=str(tmp_path / "artifacts" / "model"), name="m")
    train_grpo.python_func(
        dataset=data,
        model=model,
        config_yaml=TINY.read_text(),
        launch_backend="kubernetes",
        work_dir=str(tmp_path / "workspace"),
        run_name="victim",
        pipeline_job_id="0123456789abcdef",
        mlflow_tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
        **kwargs,
    )
    return model


def _files_holding(folder: Path, needle: bytes) -> list[Path]:
    """The regular files under `folder` (links not followed) whose bytes hold `needle`."""
    return [p for p in folder.rglob("*") if p.is_file() and not p.is_symlink() and needle in p.read_bytes()]


def test_12_a_link_planted_in_the_final_model_never_reaches_the_model_artifact(tmp_path, monkeypatch):
    """Finding 5: a tenant plants `final-model/tokenizer.json -> <the pod's ServiceAccount token>` while the run
    trains; the train step's copy into the KFP Model artifact (downloadable from the Kubeflow UI) followed it. Now the
    step refuses, naming the link, and the token is copied nowhere."""
    token = tmp_path / "var-run-secrets" / "token"
    token.parent.mkdir()
    token.write_bytes(SECRET_TOKEN)
    planted: list[Path] = []

    def plant(model_dir: Path) -> None:
        (model_dir / "tokenizer.json").symlink_to(token)
        planted.append(model_dir / "tokenizer.json")

    with pytest.raises(ValueError, match="symbolic link") as refused:
        _train_on_the_volume(tmp_path, monkeypatch, plant)
    assert type(refused.value).__name__ == "UnsafeVolumePath"
    assert str(planted[0]) in str(refused.value) and "Fix:" in str(refused.value)
    assert _files_holding(tmp_path, SECRET_TOKEN) == [token]  # in no artifact, no copy


def test_12_a_link_to_a_secret_folder_or_a_fifo_in_the_final_model_is_refused(tmp_path, monkeypatch):
    token = tmp_path / "var-run-secrets" / "token"
    token.parent.mkdir()
    token.write_bytes(SECRET_TOKEN)
    with pytest.raises(ValueError, match="secrets is a symbolic link"):
        _train_on_the_volume(tmp_path, monkeypatch, lambda d: (d / "secrets").symlink_to(token.parent))
    assert _files_holding(tmp_path, SECRET_TOKEN) == [token]
    with pytest.raises(ValueError, match="pipe is a FIFO"):
        _train_on_the_volume(tmp_path / "again", monkeypatch, lambda d: os.mkfifo(d / "pipe"))


def test_12_an_honest_final_model_is_copied_whole(tmp_path, monkeypatch):
    model = _train_on_the_volume(tmp_path, monkeypatch, _FinishedRunBackend.plant)
    assert sorted(p.name for p in Path(model.path).iterdir()) == ["config.json", "model.safetensors"]
    assert (Path(model.path) / "model.safetensors").read_bytes() == b"weights"
    staged = tmp_path / "workspace" / "victim-01234567" / "staging" / "dataset"
    assert (staged / "dataset_dict.json").is_file()  # the staging copy went through the same module


def test_12_a_run_folder_planted_before_the_run_is_refused_before_anything_starts(tmp_path, monkeypatch):
    """The run's folder name holds the KFP run id, so before the step it exists only if a tenant made it (as a
    link to redirect the staging copy and the warm-start download, or a folder holding a forged champion)."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "workspace").mkdir()
    (tmp_path / "workspace" / "victim-01234567").symlink_to(elsewhere)
    with pytest.raises(ValueError, match="victim-01234567 is a symbolic link"):
        _train_on_the_volume(tmp_path, monkeypatch, lambda d: pytest.fail("nothing may be launched"))
    assert list(elsewhere.iterdir()) == []  # nothing staged through the link
    (tmp_path / "workspace" / "victim-01234567").unlink()
    (tmp_path / "workspace" / "victim-01234567").mkdir()
    with pytest.raises(ValueError, match="already exists"):
        _train_on_the_volume(tmp_path, monkeypatch, lambda d: pytest.fail("nothing may be launched"))


def test_12_every_step_reads_and_copies_the_volume_only_through_shared_volume():
    """No step copies, deletes or walks a folder with the raw functions, which follow links (the train step's final
    model, its staging copy, cleanup's staging folder); warm starts and uploads copy through the module too."""
    import ast

    raw = {"copytree", "rmtree", "copy", "copy2", "copyfile", "walk", "rglob", "iterdir"}
    launch = REPO / "src" / "async_grpo" / "launch"
    steps = [*sorted((REPO / "components").glob("*/component.py")), *sorted(launch.glob("*_step.py"))]
    assert {p.name for p in steps} >= {"train_step.py", "evaluate_step.py", "register_step.py", "cleanup_step.py"}
    for path in steps:
        calls = [
            node.func.attr
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in raw
        ]
        allowed = ["rmtree"] if path.name == "evaluate_step.py" else []  # its own private champion copy
        assert calls == allowed, f"{path.relative_to(REPO)} calls {calls}: use async_grpo.shared_volume"
    train = (launch / "train_step.py").read_text()
    assert "copy_tree(result.model_dir, model_path" in train and "make_run_dir(" in train
    for module in ("lifecycle/registry_start.py", "tracking.py"):
        assert "shared_volume.copy_tree(" in (REPO / "src" / "async_grpo" / module).read_text()
