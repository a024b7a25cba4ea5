"""The model registry against a real sqlite MLflow store: the champion alias moves with a previous-champion kept,
each move is tagged, rollback swaps back (twice undoes), compare-and-set refuses a champion that moved, models:/
URIs resolve to a folder transformers loads with the logged weights, and the CLI exits 2 on a refusal."""

from __future__ import annotations

import contextlib
import getpass
import os
import shutil
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

import mlflow
import pytest

from async_grpo.cli import main
from async_grpo.lifecycle import registry
from async_grpo.lifecycle.registry import (
    CHAMPION_ALIAS,
    PREVIOUS_CHAMPION_ALIAS,
    ChampionChanged,
    ModelRef,
    RegistryError,
    aliases,
    champion,
    is_model_uri,
    model_versions,
    parse_model_uri,
    promote,
    resolve_model_uri,
    rollback,
)
from async_grpo.tracking import MODEL_URI_TAG, log_transformers_model, open_store


@dataclass
class Store:
    uri: str
    checkpoint: Path  # the HF folder that was logged
    run_id: str  # the run that logged it with the transformers flavour
    model_uri: str  # its logged-model URI (models:/m-...), a version's source
    plain_source: str  # another run's `model` artifact folder: a plain HF folder (versions registered before)
    empty_source: str  # a run artifact folder without a checkpoint

    def client(self) -> mlflow.MlflowClient:
        return mlflow.MlflowClient(tracking_uri=self.uri, registry_uri=self.uri)

    def register(self, name: str, versions: int = 3, source: str | None = None) -> mlflow.MlflowClient:
        """A registered model `name` with `versions` READY versions of the logged model (the sqlite registry looks a
        `models:/m-...` source up in the *global* tracking store, so that is set for the call)."""
        client = self.client()
        client.create_registered_model(name)
        with _global_tracking_uri(self.uri):
            for _ in range(versions):
                client.create_model_version(name, source=source or self.model_uri, run_id=self.run_id)
        return client


@contextlib.contextmanager
def _global_tracking_uri(uri: str):
    """MLflow's global tracking URI set to `uri` for the block, and the environment given back afterwards."""
    before = os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(before)  # None also takes MLFLOW_TRACKING_URI out of the environment again


@pytest.fixture(scope="module")
def store(tmp_path_factory, tiny_model_path) -> Store:
    """One sqlite store per module with the tiny model logged once as the trainer logs it (transformers flavour),
    once as a plain artifact folder, and a run artifact folder with no checkpoint; each test registers its own
    model names."""
    root = tmp_path_factory.mktemp("registry")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    open_store(uri)
    client = mlflow.MlflowClient(uri)
    experiment = client.create_experiment("registry", artifact_location=(root / "mlartifacts").as_uri())
    with _global_tracking_uri(uri):
        with mlflow.start_run(experiment_id=experiment) as run:
            model_uri = log_transformers_model(tiny_model_path).model_uri
            mlflow.set_tag(MODEL_URI_TAG, model_uri)
        with mlflow.start_run(experiment_id=experiment) as plain:
            mlflow.log_artifacts(str(tiny_model_path), "model")
            mlflow.log_text("not a model", "notes/readme.txt")
    return Store(
        uri=uri,
        checkpoint=tiny_model_path,
        run_id=run.info.run_id,
        model_uri=model_uri,
        plain_source=f"{plain.info.artifact_uri}/model",
        empty_source=f"{plain.info.artifact_uri}/notes",
    )


# ---------------------------------------------------------------------------------------------- parsing
def test_model_uris_parse_as_mlflow_reads_them():
    assert is_model_uri("models:/tiny/3") and not is_model_uri("runs:/abc/model") and not is_model_uri("/models/x")
    assert parse_model_uri("models:/tiny/3") == ModelRef("tiny", version="3")
    assert parse_model_uri("models:/tiny/007") == ModelRef("tiny", version="7")  # the store reads it with int()
    assert parse_model_uri("models:/my-model@champion") == ModelRef("my-model", alias="champion")
    assert parse_model_uri("models:/a#b/2") == ModelRef("a#b", version="2")  # MLflow allows '#' in a name


@pytest.mark.parametrize(
    ("uri", "says"),
    [
        ("runs:/abc/model", "not a registry URI"),
        ("models:/tiny/Production", "stages are deprecated"),
        ("models:/tiny/staging", "stages are deprecated"),
        ("models:/tiny/latest", "'latest'"),
        ("models:/tiny/1;x", "not a version number"),
        ("models:/tiny/²", "not a version number"),  # str.isdigit() is true for it; MLflow's parser would take it
        ("models:/tiny/0", "not a version number"),
        ("models:/m-0123abcd", "logged model"),
        ("models://profile/tiny/1", "host"),
        ("models:/tiny/1?x=1", "query string"),
        ("models:/tiny//1", "Not a proper models:/ URI"),
        ("models:/tiny/1/2", "Not a proper models:/ URI"),
        ("models:/tiny/", "Not a proper models:/ URI"),
        ("models:/", "Not a proper models:/ URI"),
        ("models:/tiny@", "Not a proper models:/ URI"),
        ("models:/@champion", "no model name"),
        ("models:/ tiny/1", "spaces around"),
        ("models:/tiny\n/1", "control characters"),
        ("models:/tiny@best one", "Invalid alias name"),
        ("models:/tiny@v2", "reserved"),
    ],
)
def test_malformed_model_uris_are_refused(uri, says):
    with pytest.raises(RegistryError, match="Fix:") as err:
        parse_model_uri(uri)
    assert says in str(err.value)


# ---------------------------------------------------------------------------------------------- the champion alias
def test_promote_moves_the_alias_keeps_the_previous_champion_and_records_who_why_when(store):
    client = store.register("promote-me")
    assert champion(client, "promote-me") is None and champion(client, "no-such-model") is None
    first = promote(client, "promote-me", "1", reason="first good run", actor="alice")
    assert first == registry.Promotion("promote-me", "1", None, CHAMPION_ALIAS)
    assert aliases(client, "promote-me") == {CHAMPION_ALIAS: "1"}
    assert client.get_model_version("promote-me", "1").tags["promoted_from"] == ""

    second = promote(client, "promote-me", 2, reason="reward 0.81 > 0.74", actor="kfp-run-17")
    assert (second.version, second.previous) == ("2", "1")
    assert aliases(client, "promote-me") == {CHAMPION_ALIAS: "2", PREVIOUS_CHAMPION_ALIAS: "1"}
    assert str(champion(client, "promote-me").version) == "2"  # an int from the sqlite store, a str over REST
    tags = client.get_model_version("promote-me", "2").tags
    assert (tags["promoted_by"], tags["promotion_reason"], tags["promoted_from"]) == (
        "kfp-run-17",
        "reward 0.81 > 0.74",
        "1",
    )
    at = datetime.fromisoformat(tags["promoted_at"])
    assert at.utcoffset() == timedelta(0)  # UTC, with its offset written out

    again = promote(client, "promote-me", "2", reason="again", actor="bob")  # already the champion: nothing moves
    assert again.previous == again.version == "2"
    assert client.get_model_version("promote-me", "2").tags["promoted_by"] == "kfp-run-17"
    assert aliases(client, "promote-me")[PREVIOUS_CHAMPION_ALIAS] == "1"


def test_promote_refuses_unknown_models_versions_and_bad_input(store):
    client = store.register("strict", versions=1)
    with pytest.raises(RegistryError, match="no registered model named 'nope'"):
        promote(client, "nope", "1", reason="", actor="a")
    with pytest.raises(RegistryError, match="has no version 9"):
        promote(client, "strict", "9", reason="", actor="a")
    with pytest.raises(RegistryError, match="version: 'x' is not a version number"):
        promote(client, "strict", "x", reason="", actor="a")
    with pytest.raises(RegistryError, match="reason: .*line breaks"):
        promote(client, "strict", "1", reason="two\nlines", actor="a")
    with pytest.raises(RegistryError, match="alias: Invalid alias name"):
        promote(client, "strict", "1", reason="", actor="a", alias="best one")
    assert aliases(client, "strict") == {}


def test_compare_and_set_refuses_a_champion_that_moved_meanwhile(store):
    client = store.register("contended")
    promote(client, "contended", "1", reason="no champion yet", actor="run-a", expected_champion=None)
    promote(client, "contended", "2", reason="run b won first", actor="run-b", expected_champion="1")
    with pytest.raises(ChampionChanged, match="is version 2, but the caller expected version 1"):
        promote(client, "contended", "3", reason="evaluated against 1", actor="run-c", expected_champion="1")
    with pytest.raises(ChampionChanged, match="but the caller expected no version"):
        promote(client, "contended", "3", reason="thought there was none", actor="run-c", expected_champion=None)
    assert str(champion(client, "contended").version) == "2"  # nothing changed
    assert "promoted_by" not in client.get_model_version("contended", "3").tags
    assert (
        promote(client, "contended", "3", reason="re-evaluated", actor="run-c", expected_champion="2").previous == "2"
    )


def test_rollback_restores_the_previous_champion_and_a_second_rollback_undoes_it(store):
    client = store.register("roll")
    with pytest.raises(RegistryError, match="nothing to roll back to"):
        rollback(client, "roll", reason="no champion", actor="ops")
    promote(client, "roll", "1", reason="", actor="ci")
    with pytest.raises(RegistryError, match="nothing to roll back to"):
        rollback(client, "roll", reason="only one champion ever", actor="ops")
    promote(client, "roll", "2", reason="", actor="ci")

    back = rollback(client, "roll", reason="v2 answers in French", actor="ops")
    assert (back.version, back.previous) == ("1", "2")
    assert aliases(client, "roll") == {CHAMPION_ALIAS: "1", PREVIOUS_CHAMPION_ALIAS: "2"}
    bad = client.get_model_version("roll", "2").tags
    assert (bad["rolled_back_by"], bad["rollback_reason"]) == ("ops", "v2 answers in French")
    assert datetime.fromisoformat(bad["rolled_back_at"]).utcoffset() == timedelta(0)
    restored = client.get_model_version("roll", "1").tags
    assert (restored["promoted_by"], restored["promotion_reason"], restored["promoted_from"]) == (
        "ops",
        "v2 answers in French",
        "2",
    )

    undo = rollback(client, "roll", reason="it was the eval set", actor="ops")
    assert (undo.version, undo.previous) == ("2", "1")
    assert aliases(client, "roll") == {CHAMPION_ALIAS: "2", PREVIOUS_CHAMPION_ALIAS: "1"}
    with pytest.raises(RegistryError, match="no registered model named 'gone'"):
        rollback(client, "gone", reason="", actor="ops")
    client.delete_registered_model_alias("roll", CHAMPION_ALIAS)  # someone took the champion away by hand
    assert rollback(client, "roll", reason="restore", actor="ops").previous is None
    assert aliases(client, "roll") == {CHAMPION_ALIAS: "1"}


def test_versions_of_a_name_with_a_quote_are_listed(store):
    client = store.register("it's-tiny", versions=2)
    assert [str(v.version) for v in model_versions(client, "it's-tiny")] == ["2", "1"]


# ---------------------------------------------------------------------------------------------- resolving
def _state_dict(path: Path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()


def test_an_alias_uri_resolves_to_a_folder_that_loads_with_the_logged_weights(store, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    client = store.register("resolve-me", versions=2)
    promote(client, "resolve-me", "2", reason="", actor="ci")
    dest = tmp_path / "policy"
    resolved = resolve_model_uri("models:/resolve-me@champion", dest, tracking_uri=store.uri)
    assert (resolved.path, resolved.name, resolved.version, resolved.run_id) == (dest, "resolve-me", "2", store.run_id)
    assert resolved.uri == "models:/resolve-me/2"  # the concrete version, not the alias

    logged, loaded = _state_dict(store.checkpoint), _state_dict(resolved.path)
    assert logged.keys() == loaded.keys()
    import torch

    assert all(torch.equal(logged[k], loaded[k]) for k in logged)
    tokenizer = AutoTokenizer.from_pretrained(resolved.path)
    reference = AutoTokenizer.from_pretrained(store.checkpoint)
    assert tokenizer("héllo 42")["input_ids"] == reference("héllo 42")["input_ids"]
    assert tokenizer.decode(tokenizer("héllo 42")["input_ids"]) == "héllo 42"

    def no_download(**kwargs):
        raise AssertionError("downloaded again")

    monkeypatch.setattr(mlflow.artifacts, "download_artifacts", no_download)
    assert resolve_model_uri("models:/resolve-me/2", dest, tracking_uri=store.uri) == resolved  # already there
    monkeypatch.undo()
    other = resolve_model_uri("models:/resolve-me/1", dest, tracking_uri=store.uri)  # our folder: replaced
    assert other.version == "1" and '"version": "1"' in (dest / registry.MARKER_FILE).read_text()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]  # no work folder left behind


def test_a_version_registered_from_a_plain_checkpoint_folder_resolves_too(store, tmp_path, monkeypatch):
    store.register("plain", versions=1, source=store.plain_source)
    mlflow.set_tracking_uri(None)  # forget a URI an earlier test module set, so the environment's is the default
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store.uri)  # tracking_uri=None: MLflow's default
    resolved = resolve_model_uri("models:/plain/1", tmp_path / "plain")
    assert (resolved.path / "config.json").is_file()
    assert _state_dict(resolved.path).keys() == _state_dict(store.checkpoint).keys()


def test_resolving_refuses_unknown_versions_checkpointless_artifacts_and_foreign_folders(store, tmp_path):
    store.register("refuse", versions=1)
    store.register("empty", versions=1, source=store.empty_source)
    for uri, says in (
        ("models:/nope/1", "no registered model named 'nope'"),
        ("models:/refuse/4", "has no version 4"),
        ("models:/refuse@champion", "no version of 'refuse' has the alias 'champion'"),
        ("models:/refuse/latest", "'latest'"),
        ("models:/empty/1", "holds no Hugging Face checkpoint"),
    ):
        with pytest.raises(RegistryError, match=says):
            resolve_model_uri(uri, tmp_path / "out", tracking_uri=store.uri)
    assert not (tmp_path / "out").exists()
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(RegistryError, match="holds files this did not write"):
        resolve_model_uri("models:/refuse/1", foreign, tracking_uri=store.uri)
    assert (foreign / "notes.txt").read_text() == "keep me"


# ---------------------------------------------------------------------------------------------- the command line
def test_the_cli_promotes_rolls_back_and_shows(store, capsys):
    client = store.register("cli-model")
    client.set_model_version_tag("cli-model", "2", "eval_reward", "0.81")
    client.set_model_version_tag("cli-model", "2", "parent_version", "1")
    args = ["--tracking-uri", store.uri]
    assert main(["model", "promote", "cli-model", "1", *args]) == 0
    assert main(["model", "promote", "cli-model", "2", "--reason", "beats v1", *args]) == 0
    assert "moved from version 1 to version 2" in capsys.readouterr().out
    assert client.get_model_version("cli-model", "2").tags["promoted_by"] == getpass.getuser()

    assert main(["model", "show", "cli-model", *args]) == 0
    out = capsys.readouterr().out
    assert "  champion: 2\n  previous-champion: 1\n" in out
    assert "version 2 [champion] READY" in out and "  eval_reward: 0.81\n  parent_version: 1\n" in out
    assert "  promotion_reason: beats v1" in out

    assert main(["model", "rollback", "cli-model", "--reason", "regression", "--actor", "ops", *args]) == 0
    assert "rolled back from version 2 to version 1" in capsys.readouterr().out
    assert str(champion(client, "cli-model").version) == "1"
    assert main(["model", "promote", "cli-model", "3", "--expected-champion", "2", *args]) == 2
    assert "but the caller expected version 2" in capsys.readouterr().err


@pytest.fixture(scope="module")
def one_version(store) -> str:
    """A registered model with one version and no champion."""
    store.register("cli-refuse", versions=1)
    return "cli-refuse"


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["model", "promote", "cli-refuse", "7"], "has no version 7"),
        (["model", "promote", "no-such-model", "1"], "no registered model named 'no-such-model'"),
        (["model", "rollback", "cli-refuse"], "nothing to roll back to"),
        (["model", "show", "no-such-model"], "no registered model named 'no-such-model'"),
    ],
)
def test_the_cli_exits_2_with_the_fix_and_no_traceback(store, one_version, capsys, argv, says):
    assert main([*argv, "--tracking-uri", store.uri]) == 2
    err = capsys.readouterr().err
    assert says in err and "Fix:" in err and "Traceback" not in err


def test_the_cli_needs_a_tracking_uri_and_takes_it_from_the_environment(store, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert main(["model", "show", "anything"]) == 2
    assert "--tracking-uri" in capsys.readouterr().err
    assert main(["model", "show", "anything", "--tracking-uri", f"sqlite:///{tmp_path / 'typo.db'}"]) == 2
    assert "no MLflow store at that path" in capsys.readouterr().err
    assert not (tmp_path / "typo.db").exists()  # not created empty
    store.register("from-env", versions=1)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store.uri)
    assert main(["model", "show", "from-env"]) == 0
    assert "  champion: (none)" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------- warm start
def test_warm_start_downloads_the_champion_before_anything_starts(store, tmp_path):
    from async_grpo.config import GRPOConfig
    from async_grpo.lifecycle.registry_start import (
        PARENT_VERSION_TAG,
        WARM_START_TAG,
        registry_start_of,
        resolve_registry_start,
    )

    client = store.register("warm", versions=2)
    promote(client, "warm", "2", reason="test", actor="ci")
    config = GRPOConfig(
        model_name_or_path="models:/warm@champion", output_dir=str(tmp_path / "run"), mlflow_tracking_uri=store.uri,
        warmup_sft_steps=5,
    )  # fmt: skip

    resolved, warm = resolve_registry_start(config)

    assert warm.parent_version == "warm/2" and warm.requested == "models:/warm@champion"
    assert Path(resolved.model_name_or_path) == tmp_path / "run" / "warm-start" / "warm-v2" == warm.path
    assert resolved.data.warmup_sft_steps == 0  # the registered version had its supervised warm start
    assert warm.tags() == {PARENT_VERSION_TAG: "warm/2", WARM_START_TAG: "registry models:/warm/2"}
    assert registry_start_of(resolved.model_name_or_path).parent_version == "warm/2"  # what the trainer tags
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(resolved.model_name_or_path)
    logged = AutoModelForCausalLM.from_pretrained(store.checkpoint)
    assert all(torch_equal(a, b) for a, b in zip(loaded.state_dict().values(), logged.state_dict().values()))
    again, _ = resolve_registry_start(config)  # a second rank (or a retry) finds it in place
    assert again.model_name_or_path == resolved.model_name_or_path


def test_warm_start_on_the_shared_volume_downloads_privately_and_takes_nothing_planted(store, tmp_path):
    """The train step's way (`volume_root`): a tenant who pre-made `<run>/warm-start/<name>-v<version>` with a forged
    marker (so the old way skipped the download and the run trained on the tenant's weights under the champion's
    name), or a link in its place, is refused; an honest run gets the registry's files, copied into a new folder."""
    from async_grpo.config import GRPOConfig
    from async_grpo.lifecycle.registry_start import registry_start_of, resolve_registry_start
    from async_grpo.shared_volume import UnsafeVolumePath

    client = store.register("shared-warm", versions=1)
    promote(client, "shared-warm", "1", reason="test", actor="ci")
    volume = tmp_path / "workspace"

    def config(run: str) -> GRPOConfig:
        return GRPOConfig(
            model_name_or_path="models:/shared-warm@champion", output_dir=str(volume / run),
            mlflow_tracking_uri=store.uri,
        )  # fmt: skip

    resolved, warm = resolve_registry_start(config("honest"), volume_root=volume)
    assert Path(resolved.model_name_or_path) == volume / "honest" / "warm-start" / "shared-warm-v1" == warm.path
    assert warm.parent_version == "shared-warm/1" == registry_start_of(warm.path).parent_version
    assert (warm.path / "config.json").read_bytes() == (Path(store.checkpoint) / "config.json").read_bytes()

    forged = volume / "forged" / "warm-start" / "shared-warm-v1"
    shutil.copytree(warm.path, forged)  # the marker names the champion; the weights are the tenant's
    with pytest.raises(UnsafeVolumePath, match="shared-warm-v1 already exists"):
        resolve_registry_start(config("forged"), volume_root=volume)
    (volume / "linked").mkdir()
    (volume / "linked" / "warm-start").symlink_to(tmp_path)
    with pytest.raises(UnsafeVolumePath, match="warm-start is a symbolic link"):
        resolve_registry_start(config("linked"), volume_root=volume)
    assert not (tmp_path / "shared-warm-v1").exists()  # nothing written through the link


def test_warm_start_leaves_other_models_alone_and_refuses_a_missing_alias(store, tmp_path):
    from async_grpo.config import GRPOConfig
    from async_grpo.lifecycle.registry_start import resolve_registry_start

    base = GRPOConfig(output_dir=str(tmp_path / "run"), mlflow_tracking_uri=store.uri)
    same, warm = resolve_registry_start(base)
    assert (
        same is base
        and warm.parent_version == ""
        and warm.tags()["async_grpo.lifecycle.registry_start"] == "base builtin:tiny"
    )
    store.register("no-champion", versions=1)
    with pytest.raises(RegistryError, match="model_name_or_path=.*no version of 'no-champion' has the alias"):
        resolve_registry_start(base.model_copy(update={"model_name_or_path": "models:/no-champion@champion"}))
    with pytest.raises(RegistryError, match="model_name_or_path"):
        resolve_registry_start(base.model_copy(update={"model_name_or_path": "models:/x/Production"}))


def torch_equal(a, b) -> bool:
    import torch

    return torch.equal(a, b)
