"""`async-grpo render`: the subcommand writes the backend's objects as YAML files plus a kustomization."""

from __future__ import annotations

import argparse

import pytest
import yaml

from async_grpo import cli_render
from async_grpo.launch.k8s_objects import build_run_objects

from ._k8s_validate import REPO, validate_any


def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="async-grpo")
    cli_render.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_render_writes_the_same_objects_the_backend_builds(tmp_path, capsys):
    out = tmp_path / "out"
    settings = tmp_path / "settings.yaml"
    settings.write_text("device: cpu\nnamespace: team-b\nreward_replicas: 1\n")
    rc = run_cli(
        [
            "render",
            str(REPO / "examples/tiny_cpu.yaml"),
            "max_steps=7",
            "--backend",
            "kubernetes",
            "-o",
            str(out),
            "--settings",
            str(settings),
            "--set",
            "trainer_nodes=2",
            "--run-name",
            "demo",
        ]
    )
    assert rc == 0 and "wrote 10 objects" in capsys.readouterr().out
    files = sorted(out.glob("*.yaml"))
    kustomization = yaml.safe_load((out / "kustomization.yaml").read_text())
    assert kustomization["resources"] == [f.name for f in files if f.name != "kustomization.yaml"]
    objs = [yaml.safe_load((out / name).read_text()) for name in kustomization["resources"]]
    for obj in objs:
        validate_any(obj)
        assert obj["metadata"]["namespace"] == "team-b" and obj["metadata"]["labels"]["async-grpo/run"] == "demo"
    job = next(o for o in objs if o["kind"] == "PyTorchJob")
    assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 1
    cm = next(o for o in objs if o["kind"] == "ConfigMap")
    assert yaml.safe_load(cm["data"]["config.yaml"])["max_steps"] == 7
    # byte-for-byte what the builder returns (YAML is only a serialisation), with the tokens it drew
    from async_grpo.config import load_config
    from async_grpo.launch.k8s_objects import RunTokens

    secret = next(o for o in objs if o["kind"] == "Secret")["stringData"]
    expected = build_run_objects(
        load_config(REPO / "examples/tiny_cpu.yaml", ["max_steps=7"]),
        cli_render.load_settings(settings, ["trainer_nodes=2"]),
        "demo",
        tokens=RunTokens(secret["vllm-api-key"], secret["reward-token"]),
    )
    assert objs == expected


@pytest.mark.parametrize(
    "overrides, options, message",
    [
        (["model_name_or_path=Qwen/Qwen2.5-7B"], [], "must be a builtin, a normalized path on the shared volume"),
        ([], ["--set", "device=tpu"], "invalid cluster settings"),
        ([], ["--set", "nproc_per_node"], "is not key=value"),
        (["no_such_field=1"], [], "unknown config field"),
    ],
)
def test_render_errors_name_the_problem(tmp_path, capsys, overrides, options, message):
    rc = run_cli(["render", str(REPO / "examples/tiny_cpu.yaml"), *overrides, "-o", str(tmp_path / "o"), *options])
    assert rc == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "options, message",
    [
        (
            ["--set", "trainer_image=docker.io/evil/x:latest"],
            "trainer_image='docker.io/evil/x:latest' is not an allowed",
        ),
        (["--set", "service_account=default"], "service_account='default' is not allowed"),
        (["--set", "mlflow_secret=any"], "mlflow_secret='any' is not an allowed secret"),
        (["--set", "reward_replicas=0", "--set", "reward_image=docker.io/evil/x:1"], "reward_image="),
    ],
)
def test_render_refuses_what_the_policy_does_not_allow(tmp_path, capsys, options, message):
    rc = run_cli(["render", str(REPO / "examples/tiny_cpu.yaml"), "-o", str(tmp_path / "o"), *options])
    err = capsys.readouterr().err
    assert rc == 2 and "the platform policy refuses this run" in err and message in err and "Fix:" in err
    assert not (tmp_path / "o").exists()


def test_render_reads_the_policy_file_and_flags_placeholder_digests(tmp_path, capsys, monkeypatch):
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        "image_prefixes: [registry.corp/]\nrequire_digest: true\ndefault_images:\n"
        "  cpu: registry.corp/cpu@sha256:" + "0" * 64 + "\n  reward: registry.corp/reward@sha256:" + "b" * 64 + "\n"
    )
    args = ["render", str(REPO / "examples/tiny_cpu.yaml"), "-o", str(tmp_path / "o"), "--set", "device=cpu"]
    assert run_cli([*args, "--policy", str(policy)]) == 0
    out = capsys.readouterr()
    assert f"platform policy: {policy}" in out.out and "carry the placeholder digest" in out.err
    job = yaml.safe_load(next((tmp_path / "o").glob("*-pytorchjob-*.yaml")).read_text())
    assert (
        job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["image"]
        == "registry.corp/cpu@sha256:" + "0" * 64
    )
    # the same file through the environment; an unpinned override is refused
    monkeypatch.setenv("ASYNC_GRPO_POLICY_FILE", str(policy))
    assert run_cli([*args, "--set", "reward_image=registry.corp/reward:latest"]) == 2
    assert "is not pinned by digest" in capsys.readouterr().err
    monkeypatch.setenv("ASYNC_GRPO_POLICY_FILE", str(tmp_path / "missing.yaml"))
    assert run_cli(args) == 2 and "platform policy file" in capsys.readouterr().err


def test_only_the_kubernetes_backend_renders(tmp_path):
    with pytest.raises(SystemExit):
        run_cli(["render", str(REPO / "examples/tiny_cpu.yaml"), "--backend", "local", "-o", str(tmp_path)])


def test_default_names_are_the_ones_a_launch_uses(tmp_path):
    from async_grpo.launch.kubernetes import k8s_run_name

    for overrides, expected in (([], "agrpo-async-grpo"), (["run_name=Weekly Qwen"], k8s_run_name("Weekly Qwen"))):
        out = tmp_path / expected
        assert run_cli(["render", str(REPO / "examples/tiny_cpu.yaml"), *overrides, "-o", str(out)]) == 0
        assert (out / f"01-pytorchjob-{expected}.yaml").is_file()


def test_render_with_trainjob_writes_the_trainjob_and_the_runtime(tmp_path):
    from async_grpo.cli_render import EXAMPLES

    example = EXAMPLES["gpu-2x8"]
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(example["config"]))
    sets = [a for k, v in example["settings"].items() if not isinstance(v, dict | list) for a in ("--set", f"{k}={v}")]
    rc = run_cli(
        ["render", str(tmp_path / "config.yaml"), "-o", str(tmp_path / "o"), *sets, "--set", "trainer_api=trainjob"]
    )
    assert rc == 0
    objs = [yaml.safe_load(p.read_text()) for p in sorted((tmp_path / "o").glob("[0-9][0-9]-*.yaml"))]
    assert [o["kind"] for o in objs] == ["ConfigMap", "TrainJob", "Secret"] + ["NetworkPolicy"] * 3
    (runtime,) = (tmp_path / "o" / "cluster").glob("*.yaml")  # cluster-scoped: not in the kustomization
    objs.append(yaml.safe_load(runtime.read_text()))
    assert (
        objs[-1]["kind"] == "ClusterTrainingRuntime"
        and runtime.name not in (tmp_path / "o/kustomization.yaml").read_text()
    )
    for obj in objs:
        validate_any(obj)
