"""Issue 46, findings 4, 6 and 7: a hostile tenant against the pipeline steps' credentials, the hub dataset card, and
another team's registered model. No cluster, hub or MLflow server is needed: a pod is simulated
(`KUBERNETES_SERVICE_HOST`, a policy file through $ASYNC_GRPO_POLICY_FILE), and every entry point that would load a
credential or reach the network is replaced by a recorder, so each test can assert what happened, in which order.

- 4: `mlflow_tracking_uri=<attacker>` with `warm_start=champion` made the train step load its MLflow credentials and
  read the champion from the attacker's server before the policy looked at the URI. Each step now decides first.
- 6: a hub dataset's card (`configs`: `data_files` on a workspace symlink, reader options) made the dataset step read
  its own secrets into prompt rows. In a pod the step now picks the data files of a private download itself.
- 7: `registered_model_name=<team B's model>` made tenant A's model B's champion. The policy's `registered_models`
  now bounds every registry read and write from a pod.
"""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path

import mlflow
import pytest
import requests
import yaml
from kfp import dsl

from async_grpo import cli, hub, step_secrets
from async_grpo.config import GRPOConfig, dump_config
from async_grpo.data import load_prompt_dataset
from async_grpo.launch import k8s_policy
from async_grpo.launch.k8s_policy import PolicyViolation, registered_model_problems
from async_grpo.launch.platform_policy import PlatformPolicy
from components.cleanup.component import cleanup
from components.evaluate.component import evaluate
from components.prepare_dataset.component import prepare_dataset
from components.register_model.component import register_model
from components.train_grpo.component import train_grpo

from ._k8s_validate import REPO

ATTACKER = "http://attacker.example:8080"
ALLOWED = "http://mlflow:5000"
PASSWORD = "hunter2-from-the-secret"


class Stop(Exception):
    """Raised by a recorder where the test has seen enough (the first network call after the decision)."""


@pytest.fixture
def events(monkeypatch):
    """Recorders on every credential load, MLflow client, HTTP request and policy decision; returns their log.

    `load_step_secrets` records itself and puts the MLflow password into the environment, as the real one does from
    the mounted Secret; an MlflowClient, a store opening or an HTTP request records itself and stops the step.
    """
    log: list[str] = []
    monkeypatch.delenv("MLFLOW_TRACKING_PASSWORD", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)

    def load_step_secrets(*args, **kwargs):
        log.append("load_step_secrets")
        os.environ["MLFLOW_TRACKING_PASSWORD"] = PASSWORD
        return ["MLFLOW_TRACKING_PASSWORD"]

    class Client:
        def __init__(self, *args, **kwargs):
            log.append("MlflowClient")
            raise Stop("MlflowClient")

    def network(name):
        def record(*args, **kwargs):
            log.append(name)
            raise Stop(name)

        return record

    real_check_step = k8s_policy.check_step

    def check_step(step, **kwargs):
        log.append(f"check_step:{step}")
        try:
            return real_check_step(step, **kwargs)
        except PolicyViolation:
            log.append("refused")
            raise

    monkeypatch.setattr(step_secrets, "load_step_secrets", load_step_secrets)
    monkeypatch.setattr(mlflow, "MlflowClient", Client)
    monkeypatch.setattr("async_grpo.tracking.open_store", network("open_store"))
    monkeypatch.setattr("async_grpo.lifecycle.registry_start.resolve_registry_start", network("resolve_registry_start"))
    monkeypatch.setattr(requests.Session, "send", network("http"))
    monkeypatch.setattr(k8s_policy, "check_step", check_step)
    yield log
    os.environ.pop("MLFLOW_TRACKING_PASSWORD", None)


def write_policy(tmp_path: Path, monkeypatch, **fields) -> None:
    """A policy file (the mounted ConfigMap's copy) with `fields`, named by $ASYNC_GRPO_POLICY_FILE."""
    policy = {"mlflow_tracking_uris": [ALLOWED], "registered_models": ["team-a-*"], **fields}
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(policy))
    monkeypatch.setenv("ASYNC_GRPO_POLICY_FILE", str(path))


@pytest.fixture
def pod(tmp_path, monkeypatch):
    """A simulated pipeline pod of team A's namespace: KUBERNETES_SERVICE_HOST set, team A's policy mounted (the
    local backend allowed, so a step can be followed past its decision without a cluster)."""
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    write_policy(tmp_path, monkeypatch, user_code_with_credentials=True)


def _data(tmp_path: Path) -> dsl.Dataset:
    return dsl.Dataset(uri=str(tmp_path / "data"), name="d", metadata={"source": "builtin:reverse"})


def _model(tmp_path: Path) -> dsl.Model:
    return dsl.Model(uri=str(tmp_path / "model"), name="m", metadata={})


def _train(tmp_path: Path, **kwargs):
    args = {"launch_backend": "local", "warm_start": "champion", "registered_model_name": "team-a-model", **kwargs}
    return train_grpo.python_func(dataset=_data(tmp_path), model=_model(tmp_path), **args)


def _metrics(tmp_path: Path) -> dsl.Metrics:
    return dsl.Metrics(uri=str(tmp_path / "metrics"), name="metrics", metadata={"eval_reward": 0.9})


# ------------------------------------------------------------------------------------------------ 4: the order
def test_4_the_train_step_refuses_the_attackers_uri_before_any_credential_or_mlflow_call(pod, tmp_path, events):
    """The reported attack: warm_start=champion with the attacker's tracking URI. The attacker's server received
    `async-grpo:<password>` through the champion read; now the decision comes first and nothing follows it."""
    with pytest.raises(PolicyViolation, match=f"mlflow_tracking_uri='{ATTACKER}' is not an allowed MLflow server"):
        _train(tmp_path, mlflow_tracking_uri=ATTACKER)
    assert events == ["check_step:train_grpo", "refused"]
    assert "MLFLOW_TRACKING_PASSWORD" not in os.environ


def test_4_an_allowed_run_loads_the_credentials_after_the_decision_and_before_the_champion_read(pod, tmp_path, events):
    """The same step with the platform's server: decided, then the credentials, then the first MLflow call."""
    with pytest.raises(Stop):
        _train(tmp_path, mlflow_tracking_uri=ALLOWED)
    assert events == ["check_step:train_grpo", "load_step_secrets", "open_store"]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"model_name_or_path": "models:/team-a-model/1", "warm_start": "none"},  # a registry model, no champion
        {"warm_start": "none"},
    ],
    ids=["models-uri", "no-warm-start"],
)
def test_4_every_train_path_decides_on_the_uri_before_the_credentials(pod, tmp_path, events, kwargs):
    with pytest.raises(PolicyViolation, match="mlflow_tracking_uri="):
        _train(tmp_path, mlflow_tracking_uri=ATTACKER, **kwargs)
    assert events == ["check_step:train_grpo", "refused"]


def test_4_with_the_kubernetes_backend_the_whole_run_is_judged_before_the_credentials(tmp_path, monkeypatch, events):
    """Outside a pod (kfp.local driving a cluster) the kubernetes backend's check judges the URI, still first."""
    write_policy(tmp_path, monkeypatch)
    with pytest.raises(PolicyViolation, match=f"mlflow_tracking_uri='{ATTACKER}'"):
        _train(tmp_path, mlflow_tracking_uri=ATTACKER, launch_backend="kubernetes")
    assert "load_step_secrets" not in events and "MlflowClient" not in events and "http" not in events
    assert "MLFLOW_TRACKING_PASSWORD" not in os.environ


def test_4_the_evaluate_step_refuses_the_attackers_uri_before_the_credentials(pod, tmp_path, events):
    config = dump_config(GRPOConfig(mlflow_tracking_uri=ATTACKER))
    with pytest.raises(PolicyViolation, match=f"mlflow_tracking_uri='{ATTACKER}'"):
        evaluate.python_func(
            model=_model(tmp_path), dataset=_data(tmp_path), mlflow_run_id="r", tracking_uri=ATTACKER,
            resolved_config=config, metrics=_metrics(tmp_path), registered_model_name="team-a-model",
        )  # fmt: skip
    assert events == ["check_step:evaluate", "refused"]
    # allowed: decided, then the credentials, then the step's own work (here: no checkpoint in the artifact)
    events.clear()
    with pytest.raises(FileNotFoundError, match="holds no HF checkpoint"):
        evaluate.python_func(
            model=_model(tmp_path), dataset=_data(tmp_path), mlflow_run_id="r", tracking_uri=ALLOWED,
            resolved_config=config, metrics=_metrics(tmp_path), registered_model_name="team-a-model",
        )  # fmt: skip
    assert events == ["check_step:evaluate", "load_step_secrets"]


def test_4_the_register_step_refuses_the_attackers_uri_before_the_credentials(pod, tmp_path, events):
    with pytest.raises(PolicyViolation, match=f"mlflow_tracking_uri='{ATTACKER}'"):
        register_model.python_func(
            model=_model(tmp_path), metrics=_metrics(tmp_path), mlflow_run_id="r", tracking_uri=ATTACKER,
            registered_model_name="team-a-model",
        )  # fmt: skip
    assert events == ["check_step:register_model", "refused"]
    events.clear()
    with pytest.raises(Stop):
        register_model.python_func(
            model=_model(tmp_path), metrics=_metrics(tmp_path), mlflow_run_id="r", tracking_uri=ALLOWED,
            registered_model_name="team-a-model",
        )  # fmt: skip
    assert events == ["check_step:register_model", "load_step_secrets", "MlflowClient"]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"dataset_uri": "/var/run/secrets/kubernetes.io/serviceaccount/token.json"}, "workspace volume"),
        ({"dataset_uri": "builtin:reverse", "model_name_or_path": "/etc/async-grpo/secrets"}, "model_name_or_path="),
    ],
)
def test_4_the_dataset_step_decides_on_its_paths_before_the_hub_token(pod, tmp_path, events, kwargs, message):
    with pytest.raises(ValueError, match=message):
        prepare_dataset.python_func(dataset=dsl.Dataset(uri=str(tmp_path / "out"), name="d"), **kwargs)
    assert events == []


def test_4_the_cleanup_step_refuses_a_work_dir_off_the_volume_before_any_api_call(pod, tmp_path, monkeypatch):
    made = []
    module = types.ModuleType("async_grpo.launch.kubernetes")
    module.KubernetesBackend = lambda **kwargs: made.append(kwargs)
    monkeypatch.setitem(sys.modules, "async_grpo.launch.kubernetes", module)
    status = types.SimpleNamespace(pipeline_job_resource_name="p", state="FAILED", error_message="")
    with pytest.raises(PolicyViolation, match="work_dir='/etc'"):
        cleanup.python_func(pipeline_status=status, launch_backend="kubernetes", work_dir="/etc", run_name="r")
    assert made == []


def test_4_off_the_cluster_nothing_is_decided_and_kfp_local_is_unchanged(tmp_path, monkeypatch, events):
    """kfp.local (`make demo`): no pod, the local backend: no policy, the credentials (none mounted) then MLflow."""
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("ASYNC_GRPO_POLICY_FILE", str(tmp_path / "absent.yaml"))  # would raise if it were read
    with pytest.raises(Stop):
        _train(tmp_path, mlflow_tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert events == ["check_step:train_grpo", "load_step_secrets", "open_store"]


def test_4_the_tracking_uri_alone_is_loaded_before_the_decision(tmp_path, monkeypatch):
    """The platform's server address (the Secret's MLFLOW_TRACKING_URI) is what the decision reads; no credential."""
    for key in step_secrets.MLFLOW_SECRET_KEYS:
        monkeypatch.delenv(key, raising=False)
    for key, value in (("MLFLOW_TRACKING_URI", ALLOWED), ("MLFLOW_TRACKING_PASSWORD", PASSWORD)):
        (tmp_path / key).write_text(value)
    assert step_secrets.load_tracking_uri(str(tmp_path)) == ["MLFLOW_TRACKING_URI"]
    assert os.environ["MLFLOW_TRACKING_URI"] == ALLOWED and "MLFLOW_TRACKING_PASSWORD" not in os.environ


# ------------------------------------------------------------------------------------------------ 6: the card
SECRET = "SECRET-hf_tokenvalue-and-the-serviceaccount-jwt"
LEGIT = ["what is 2 + 2?", "what is 3 + 5?", "what is 7 - 4?"]


def _attack(tmp_path: Path) -> tuple[Path, Path]:
    """A hub snapshot as the attacker publishes it, and the workspace beside it: the card's `configs` name a
    workspace glob whose `.csv` is a symlink to a secret, with reader options that turn it into prompt rows; the
    repository's own data file holds the legit prompts. Returns (snapshot, secret)."""
    secret = tmp_path / "secrets" / "token"
    secret.parent.mkdir()
    secret.write_text(SECRET + "\n")
    evil = tmp_path / "workspace" / "evil"
    evil.mkdir(parents=True)
    (evil / "token.csv").symlink_to(secret)
    snap = tmp_path / "snapshot"
    (snap / "data").mkdir(parents=True)
    (snap / "data" / "train-00000-of-00001.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in LEGIT))
    card = {
        "configs": [
            {
                "config_name": "default",
                "data_files": [{"split": "train", "path": f"{evil}/*.csv"}, {"split": "test", "path": f"{evil}/*.csv"}],
                "sep": "\x01",
                "column_names": ["prompt"],
            }
        ]
    }
    (snap / "README.md").write_text(f"---\n{yaml.safe_dump(card)}---\n# a dataset\n")
    return snap, secret


@pytest.fixture
def downloads(monkeypatch):
    """`hub.private_snapshot` serving prepared folders by revision; no hub is reached. Returns the dict to fill."""
    served: dict[str | None, Path] = {}

    def private_snapshot(repo_id, *, repo_type="dataset", revision=None, allow_patterns=None):
        if revision not in served:
            raise hub.HubUnavailable(f"no revision {revision!r} in this test")
        return served[revision]

    monkeypatch.setattr(hub, "private_snapshot", private_snapshot)
    monkeypatch.setattr(hub, "snapshot", lambda *a, **k: pytest.fail("a pod never reads the shared HF cache"))
    return served


def _cells(ds) -> str:
    return json.dumps(ds.to_list())


def test_6_off_the_cluster_the_card_is_still_followed(tmp_path, monkeypatch):
    """The laptop path is unchanged (and this is what the attack did in the dataset step): the card's reader turns
    the secret behind the workspace symlink into a prompt."""
    snap, _ = _attack(tmp_path)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setattr(hub, "snapshot", lambda *a, **k: snap)
    assert SECRET in _cells(load_prompt_dataset("evil-org/card", split="train"))


def test_6_in_a_pod_the_prompts_come_only_from_the_snapshots_own_file(tmp_path, monkeypatch, downloads):
    snap, _ = _attack(tmp_path)
    downloads[None] = snap
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    ds = load_prompt_dataset("evil-org/card", split="train")
    assert list(ds["prompt"]) == LEGIT and SECRET not in _cells(ds)


def test_6_the_dataset_step_in_a_pod_writes_no_secret_into_its_artifact(tmp_path, monkeypatch, downloads):
    import datasets

    snap, _ = _attack(tmp_path)
    downloads[None] = snap  # no parquet export: the test split falls back to held-out rows
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    out = dsl.Dataset(uri=str(tmp_path / "artifact"), name="d")
    result = prepare_dataset.python_func(dataset_uri="evil-org/card", dataset=out, eval_fraction=0.5)
    saved = datasets.load_from_disk(out.path)
    assert sorted([*saved["train"]["prompt"], *saved["eval"]["prompt"]]) == sorted(LEGIT)
    assert result.train_rows + result.eval_rows == len(LEGIT)
    assert not any(SECRET in p.read_text(errors="ignore") for p in Path(out.path).rglob("*") if p.is_file())


def test_6_a_snapshot_file_linking_out_of_the_snapshot_is_refused_naming_it(tmp_path, monkeypatch, downloads):
    snap, secret = _attack(tmp_path)
    (snap / "data" / "train-00000-of-00001.jsonl").unlink()
    (snap / "data" / "train-00000-of-00001.csv").symlink_to(secret)
    downloads[None] = snap
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    with pytest.raises(hub.UnsafeSnapshotFile, match="'data/train-00000-of-00001.csv' is a symbolic link to"):
        load_prompt_dataset("evil-org/card", split="train")
    linked_folder = tmp_path / "snap2"
    (linked_folder / "data").mkdir(parents=True)
    (linked_folder / "train").symlink_to(secret.parent, target_is_directory=True)
    with pytest.raises(hub.UnsafeSnapshotFile, match="'train' is a symbolic link"):
        hub.pick_data_files(linked_folder, None, "train")


def test_6_the_parquet_export_is_read_when_the_layout_names_nothing_for_the_config(tmp_path, monkeypatch, downloads):
    import datasets

    main = tmp_path / "main"
    (main / "odd").mkdir(parents=True)
    (main / "odd" / "rows.jsonl").write_text('{"prompt": "from main"}\n')
    export = tmp_path / "export"
    for split, prompt in (("train", "exported train"), ("test", "exported test")):
        (export / "main" / split).mkdir(parents=True)
        datasets.Dataset.from_dict({"prompt": [prompt]}).to_parquet(str(export / "main" / split / "0000.parquet"))
    downloads[None], downloads[hub.PARQUET_REVISION] = main, export
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    ds = load_prompt_dataset("org/name", split="eval", config_name="main")
    assert list(ds["prompt"]) == ["exported test"]
    with pytest.raises(ValueError, match="no data file of that config and split"):
        load_prompt_dataset("org/name", split="eval", config_name="other")


@pytest.mark.parametrize(
    "files, config, split, picked",
    [
        (["main/train-00000-of-00001.parquet", "main/test-00000-of-00001.parquet", "socratic/train-00000-of-00001.parquet"],
         "main", "test", ["main/test-00000-of-00001.parquet"]),
        (["default/train/0000.parquet", "default/partial-test/0000.parquet"], None, "test",
         ["default/partial-test/0000.parquet"]),
        (["data/train.jsonl", "data/validation.jsonl"], None, "validation", ["data/validation.jsonl"]),
        (["data/train.jsonl", "data/validation.jsonl"], None, "test", None),
        (["rows.jsonl", "more.jsonl", "dataset_info.json"], None, "train", ["more.jsonl", "rows.jsonl"]),
        (["data/train_prefs-00000-of-00001.parquet", "data/train_sft-00000-of-00001.parquet"], None, "train_sft",
         ["data/train_sft-00000-of-00001.parquet"]),
        (["contest.jsonl", "train.jsonl"], None, "test", None),
    ],
)  # fmt: skip
def test_6_data_files_are_picked_by_the_hubs_standard_layout(tmp_path, files, config, split, picked):
    for f in files:
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f).write_text("")
    one_config = files[0].startswith("default/")
    got = hub.pick_data_files(tmp_path, config, split, one_config=one_config)
    root = tmp_path.resolve()
    assert (None if got is None else [p.relative_to(root).as_posix() for p in got[1]]) == picked


def test_6_the_download_is_private_and_holds_no_card(tmp_path, monkeypatch):
    calls = []

    def snapshot_download(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        return str(kwargs["local_dir"])

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setattr(hub, "_PRIVATE_SNAPSHOTS", {})
    folder = hub.private_snapshot("org/name", allow_patterns=["*.parquet"])
    assert hub.private_snapshot("org/name", allow_patterns=["*.parquet"]) == folder  # once per process
    ((repo, kwargs),) = calls
    assert repo == "org/name" and kwargs["local_dir"] == folder and kwargs["repo_type"] == "dataset"
    assert oct(folder.stat().st_mode & 0o777) == "0o700" and not any(folder.iterdir())
    # what the dataset step asks for: data files only, never the README (the card) or a loading script
    served = {}
    monkeypatch.setattr(hub, "private_snapshot", lambda repo_id, **k: served.setdefault("k", k) and tmp_path)
    (tmp_path / "train.jsonl").write_text('{"prompt": "x"}\n')
    hub.pinned_data_files("org/name", None, "train")
    assert all(p.startswith("*.") and not p.endswith((".md", ".py")) for p in served["k"]["allow_patterns"])


# ------------------------------------------------------------------------------------------------ 7: registry
def _store(tmp_path: Path) -> str:
    """A sqlite MLflow store where team B's model has version 1 as champion (made off the cluster, by team B)."""
    from async_grpo.tracking import open_store

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    open_store(uri)
    client = mlflow.MlflowClient(uri)
    run = client.create_run(client.create_experiment("team-b")).info.run_id
    client.create_registered_model("team-b-model")
    client.create_model_version("team-b-model", source=f"runs:/{run}/model", run_id=run)
    client.set_registered_model_alias("team-b-model", "champion", "1")
    return uri


def _aliases(uri: str) -> dict[str, str]:
    """Team B's aliases (versions as strings: the sqlite store returns ints, REST strings)."""
    held = mlflow.MlflowClient(uri).get_registered_model("team-b-model").aliases
    return {alias: str(version) for alias, version in held.items()}


def test_7_a_run_registering_another_teams_model_is_refused_and_writes_nothing(tmp_path, monkeypatch):
    uri = _store(tmp_path)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    write_policy(tmp_path, monkeypatch)
    with pytest.raises(PolicyViolation, match="registered_model_name='team-b-model': this namespace may not register"):
        register_model.python_func(
            model=_model(tmp_path), metrics=_metrics(tmp_path), mlflow_run_id="r", tracking_uri=uri,
            registered_model_name="team-b-model",
        )  # fmt: skip
    client = mlflow.MlflowClient(uri)
    versions = client.search_model_versions("name='team-b-model'")
    assert [str(v.version) for v in versions] == ["1"]
    assert _aliases(uri) == {"champion": "1"}


def test_7_in_a_pod_only_the_name_is_refused_when_the_server_is_allowed(pod, tmp_path, events):
    with pytest.raises(PolicyViolation) as refused:
        register_model.python_func(
            model=_model(tmp_path), metrics=_metrics(tmp_path), mlflow_run_id="r", tracking_uri=ALLOWED,
            registered_model_name="team-b-model",
        )  # fmt: skip
    (line,) = str(refused.value).splitlines()[1:]
    assert line.strip().startswith("registered_model_name='team-b-model'") and "registered_models" in line
    assert events == ["check_step:register_model", "refused"]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"registered_model_name": "team-b-model"},  # warm_start=champion from B's champion
        {"model_name_or_path": "models:/team-b-model@champion", "warm_start": "none"},
    ],
    ids=["champion", "models-uri"],
)
def test_7_reading_another_teams_model_is_refused_too(pod, tmp_path, events, kwargs):
    with pytest.raises(PolicyViolation, match="registered_model_name='team-b-model': this namespace may not read"):
        _train(tmp_path, mlflow_tracking_uri=ALLOWED, **kwargs)
    assert events == ["check_step:train_grpo", "refused"]


def test_7_evaluate_compares_only_against_its_own_models_champion(pod, tmp_path, events):
    with pytest.raises(PolicyViolation, match="may not compare against the champion of it"):
        evaluate.python_func(
            model=_model(tmp_path), dataset=_data(tmp_path), mlflow_run_id="r", tracking_uri=ALLOWED,
            resolved_config=dump_config(GRPOConfig()), metrics=_metrics(tmp_path),
            registered_model_name="team-b-model", require_improvement=False,
        )  # fmt: skip
    assert events == ["check_step:evaluate", "refused"]


@pytest.mark.parametrize(
    "command", [["promote", "team-b-model", "1"], ["rollback", "team-b-model"], ["show", "team-b-model"]]
)
def test_7_the_model_cli_in_a_pod_moves_only_listed_models(pod, tmp_path, events, command, capsys):
    assert cli.main(["model", *command, "--tracking-uri", ALLOWED]) == 2
    err = capsys.readouterr().err
    assert "registered_model_name='team-b-model'" in err and "Fix:" in err
    assert "http" not in events and "MlflowClient" not in events and "open_store" not in events


def test_7_the_model_cli_with_a_policy_file_refuses_off_the_cluster_too(tmp_path, monkeypatch, capsys):
    uri = _store(tmp_path)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    policy = tmp_path / "team-a.yaml"
    policy.write_text("registered_models: [team-a-*]\n")
    assert cli.main(["model", "rollback", "team-b-model", "--tracking-uri", uri, "--policy", str(policy)]) == 2
    assert "registered_model_name='team-b-model'" in capsys.readouterr().err
    assert _aliases(uri) == {"champion": "1"}


@pytest.mark.parametrize("package", ["grpo_pipeline.yaml", "grpo_pipeline_cpu.yaml"])
def test_7_the_base_policy_lets_the_default_pipeline_register(package):
    """manifests/base/policy.yaml lists the pipelines' default registered_model_name, so a default run registers."""
    ir = yaml.safe_load((REPO / "pipelines" / package).read_text().split("\n---\n")[0])
    default = ir["root"]["inputDefinitions"]["parameters"]["registered_model_name"]["defaultValue"]
    config_map = yaml.safe_load((REPO / "manifests" / "base" / "policy.yaml").read_text())
    policy = PlatformPolicy.from_yaml(config_map["data"]["policy.yaml"], "async-grpo-policy")
    assert registered_model_problems(default, policy) == []
    assert registered_model_problems("team-b-model", policy)


def test_7_registry_uris_name_their_model():
    assert k8s_policy.registry_model_name("models:/team-a-x/3") == "team-a-x"
    assert k8s_policy.registry_model_name("models:/team-a-x@champion") == "team-a-x"
    assert k8s_policy.registry_model_name("/workspace/models/x") is None
    # any other shape is judged whole: no pattern but `*` lets it through
    odd = "models:/team-a-x/../team-b/1"
    assert k8s_policy.registry_model_name(odd) == odd
    assert registered_model_problems(odd, PlatformPolicy(registered_models=["team-a-*"]))


def test_check_step_decides_in_a_pod_and_for_the_kubernetes_backend_only(tmp_path, monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("ASYNC_GRPO_POLICY_FILE", str(tmp_path / "absent.yaml"))  # reading it would raise
    foreign = [("team-b-model", "register a version of")]
    assert k8s_policy.check_step("s", tracking_uri=ATTACKER, registered_models=foreign, work_dir="/etc") is None
    write_policy(tmp_path, monkeypatch)
    # the kubernetes backend off the cluster: the URI only (the registry and the folders are the user's own)
    assert k8s_policy.check_step("s", launch_backend="kubernetes", tracking_uri=ALLOWED, registered_models=foreign)
    with pytest.raises(PolicyViolation, match="mlflow_tracking_uri="):
        k8s_policy.check_step("s", launch_backend="kubernetes", tracking_uri=ATTACKER)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    with pytest.raises(PolicyViolation) as refused:
        k8s_policy.check_step("s", tracking_uri=ATTACKER, registered_models=foreign, work_dir="/etc")
    fields = [line.strip().split("=", 1)[0] for line in str(refused.value).splitlines()[1:]]
    assert fields == ["work_dir", "mlflow_tracking_uri", "registered_model_name"]
    assert all("Fix:" in line for line in str(refused.value).splitlines()[1:])
