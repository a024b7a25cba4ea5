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
    rc = run_cli(["render", str(REPO / "examples/tiny_cpu.yaml"), "max_steps=7", "--backend", "kubernetes",
                  "-o", str(out), "--settings", str(settings), "--set", "trainer_nodes=2", "--run-name", "demo"])
    assert rc == 0 and "wrote 9 objects" in capsys.readouterr().out
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
    # byte-for-byte what the builder returns (YAML is only a serialisation)
    from async_grpo.config import load_config

    expected = build_run_objects(load_config(REPO / "examples/tiny_cpu.yaml", ["max_steps=7"]),
                                 cli_render.load_settings(settings, ["trainer_nodes=2"]), "demo")
    assert objs == expected


@pytest.mark.parametrize("overrides, options, message", [
    (["model_name_or_path=Qwen/Qwen2.5-7B"], [], "must be a folder on the shared volume"),
    ([], ["--set", "device=tpu"], "invalid cluster settings"),
    ([], ["--set", "nproc_per_node"], "is not key=value"),
    (["no_such_field=1"], [], "unknown config field"),
])
def test_render_errors_name_the_problem(tmp_path, capsys, overrides, options, message):
    rc = run_cli(["render", str(REPO / "examples/tiny_cpu.yaml"), *overrides, "-o", str(tmp_path / "o"), *options])
    assert rc == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_only_the_kubernetes_backend_renders(tmp_path):
    with pytest.raises(SystemExit):
        run_cli(["render", str(REPO / "examples/tiny_cpu.yaml"), "--backend", "local", "-o", str(tmp_path)])


def test_default_names_are_the_ones_a_launch_uses(tmp_path):
    from async_grpo.launch.kubernetes import k8s_run_name

    for overrides, expected in (([], "agrpo-async-grpo"), (["run_name=Weekly Qwen"], k8s_run_name("Weekly Qwen"))):
        out = tmp_path / expected
        assert run_cli(["render", str(REPO / "examples/tiny_cpu.yaml"), *overrides, "-o", str(out)]) == 0
        assert (out / f"01-pytorchjob-{expected}.yaml").is_file()
