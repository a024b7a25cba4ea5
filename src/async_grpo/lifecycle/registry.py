"""The model registry: which version is champion, resolving models:/ URIs to a local checkpoint, and moving the
champion alias.

The registry is MLflow's, reached only through `mlflow.MlflowClient`. The champion is a registered-model alias
(`champion`), the one before it keeps `previous-champion`, so a rollback is one alias swap; each move is recorded as
tags on the versions involved (`promoted_by`, `promotion_reason`, ...). User strings (URIs, names, versions,
aliases) are parsed once, by MLflow's own parsers, so we accept exactly what MLflow would and refuse what it would
misread; every refusal is a `RegistryError` that names the thing and the fix.
"""

from __future__ import annotations

import enum
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:  # mlflow is imported where it is used: `async-grpo --help` should not pay for it (about 1 s)
    import mlflow
    from mlflow.entities.model_registry import ModelVersion

logger = logging.getLogger(__name__)

CHAMPION_ALIAS = "champion"
PREVIOUS_CHAMPION_ALIAS = "previous-champion"
MODELS_SCHEME = "models:/"
MARKER_FILE = "registered_model.json"  # written into a resolved folder: which registry version it holds
READY = "READY"  # mlflow.entities.model_registry.model_version_status.ModelVersionStatus
_NOT_FOUND = "RESOURCE_DOES_NOT_EXIST"
_STAGES = ("none", "staging", "production", "archived")  # MLflow's deprecated stages (case-insensitive)
_TOKENIZER_COMPONENT = "tokenizer"  # mlflow.transformers: components/<name>/ beside the model binary
_COMPONENTS_DIR = "components"
_TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json")  # either one lets AutoTokenizer build it


class RegistryError(ValueError):
    """A registry request refused because of what the user asked for: an unknown model name, version or alias, no
    previous champion to roll back to, a malformed `models:/` URI, a version whose artifacts hold no Hugging Face
    checkpoint. The message names the thing and the fix; the CLI prints it without a traceback and exits 2."""


class ChampionChanged(RegistryError):
    """`promote(expected_champion=...)` found another champion than the caller expected: another run moved the alias
    since the caller looked (compare-and-set refused, nothing changed)."""


class _Unset(enum.Enum):
    ANY = "any"


ANY = _Unset.ANY  # `promote(expected_champion=ANY)`: promote whatever the current champion is


@dataclass(frozen=True)
class ModelRef:
    """A parsed registry URI: `models:/<name>/<version>` (version set) or `models:/<name>@<alias>` (alias set)."""

    name: str
    version: str | None = None
    alias: str | None = None


@dataclass(frozen=True)
class ResolvedModel:
    """A registry version downloaded as a local Hugging Face folder.

    path: the folder; `AutoModelForCausalLM.from_pretrained(path)` and `AutoTokenizer.from_pretrained(path)` load it.
    version: the concrete version, also when the URI named an alias. run_id: the run that logged it (None when the
    version was registered without one). uri: the concrete `models:/<name>/<version>`.
    """

    path: Path
    name: str
    version: str
    run_id: str | None
    uri: str


@dataclass(frozen=True)
class Promotion:
    """What `promote` or `rollback` did: `alias` of `name` now points at `version`; `previous` is the version that
    held it before (None when no version did; equal to `version` when it already held the alias and nothing
    moved)."""

    name: str
    version: str
    previous: str | None
    alias: str


# ---------------------------------------------------------------------------------------------- parsing user strings
def is_model_uri(text: str) -> bool:
    """True when `text` is meant as a registry URI (starts with `models:/`); whether it is a valid one is for
    `parse_model_uri` to say. Case-sensitive, as MLflow's scheme check."""
    return isinstance(text, str) and text.startswith(MODELS_SCHEME)


def parse_model_uri(text: str) -> ModelRef:
    """Parse `models:/<name>/<version>` or `models:/<name>@<alias>` with MLflow's own parser
    (`mlflow.store.artifact.utils.models._parse_model_uri`, MLflow 3.x), then refuse the forms MLflow accepts that a
    registry lookup here must not take.

    Refused, each with a RegistryError naming the fix: anything MLflow refuses (empty name or suffix, more than two
    path parts); stage suffixes (`/Production`, `/Staging`: stages are deprecated in MLflow, use an alias) and
    `/latest` (the newest version: not reproducible); any other suffix that is not a version (`/1;x`); a logged-model
    id (`models:/m-...`: not a registry version); a host (`models://profile/...`, a Databricks profile: the tracking
    URI is given separately) or a query string (MLflow ignores both silently); an empty name or one with spaces
    around it; control characters; a version that is not ASCII digits; an alias MLflow would not let anyone set.
    The version is canonical (`007` -> `7`, as MLflow's store reads it with `int`).

    Raises:
        RegistryError: as above.
    """
    import urllib.parse

    from mlflow.exceptions import MlflowException
    from mlflow.store.artifact.utils.models import _parse_model_uri

    if not is_model_uri(text):
        raise RegistryError(
            f"{text!r} is not a registry URI. Fix: give models:/<name>/<version> or models:/<name>@<alias>."
        )
    if any(not ch.isprintable() for ch in text):
        raise RegistryError(f"registry URI {text!r} holds control characters. Fix: give the URI as plain text.")
    split = urllib.parse.urlparse(text, allow_fragments=False)  # as MLflow splits it
    for part, value in (("host", split.netloc), ("query string", split.query)):
        if value:
            raise RegistryError(
                f"registry URI {text!r} has a {part} ({value!r}), which MLflow would ignore. "
                "Fix: give models:/<name>/<version> or models:/<name>@<alias> and the tracking URI separately."
            )
    try:
        parsed = _parse_model_uri(text)
    except MlflowException as err:
        raise RegistryError(f"{err.message} Fix: give models:/<name>/<version> or models:/<name>@<alias>.") from None
    if parsed.model_id is not None:
        raise RegistryError(
            f"{text!r} names a logged model ({parsed.model_id}), not a registered version. "
            "Fix: register it, then give models:/<name>/<version> or models:/<name>@<alias>."
        )
    name = parsed.name
    if not name.strip():
        raise RegistryError(f"registry URI {text!r} has no model name. Fix: give models:/<name>@<alias>.")
    if name != name.strip():
        raise RegistryError(f"registry URI {text!r}: the model name {name!r} has spaces around it. Fix: remove them.")
    if parsed.alias is not None:
        return ModelRef(name=name, alias=_alias(parsed.alias, f"the alias in {text!r}"))
    if parsed.version is not None:
        return ModelRef(name=name, version=_version(parsed.version, f"the version in {text!r}"))
    if parsed.stage is None:  # MLflow reads `latest` as "the newest version"
        raise RegistryError(
            f"registry URI {text!r} names the newest version ('latest'), which moves with every registration. "
            f"Fix: give a version (models:/{name}/<version>) or an alias (models:/{name}@{CHAMPION_ALIAS})."
        )
    if parsed.stage.lower() in _STAGES:
        raise RegistryError(
            f"registry URI {text!r} names the stage {parsed.stage!r}: MLflow model stages are deprecated. "
            f"Fix: give an alias (models:/{name}@{CHAMPION_ALIAS}) or a version (models:/{name}/<version>)."
        )
    raise RegistryError(
        f"registry URI {text!r}: {parsed.stage!r} is not a version number. "
        f"Fix: give a version (models:/{name}/3) or an alias (models:/{name}@{CHAMPION_ALIAS})."
    )


def previous_alias(alias: str) -> str:
    """The alias that keeps the version `alias` pointed at before it moved: `previous-champion` for `champion`
    (`PREVIOUS_CHAMPION_ALIAS`), `previous-<alias>` for any other."""
    return PREVIOUS_CHAMPION_ALIAS if alias == CHAMPION_ALIAS else f"previous-{alias}"


def _alias(alias: str, field: str) -> str:
    """`alias` when MLflow would let it be set (its own validator: letters, digits, `_`, `-`, at most 255 characters,
    not `latest` or `v<digits>`). Raises RegistryError naming `field`."""
    from mlflow.exceptions import MlflowException
    from mlflow.utils.validation import _validate_model_alias_name, _validate_model_alias_name_reserved

    try:
        _validate_model_alias_name(alias)
        _validate_model_alias_name_reserved(alias)
    except MlflowException as err:
        raise RegistryError(f"{field}: {err.message} Fix: give an alias such as {CHAMPION_ALIAS!r}.") from None
    return alias


def _version(version: str | int, field: str) -> str:
    """A registry version number as MLflow's store reads it (`int`), canonical (`"007"` -> `"7"`); ASCII digits only
    (str.isdigit, which MLflow's URI parser uses, also takes `²` and other scripts' digits). Raises RegistryError
    naming `field`."""
    text = str(version).strip() if isinstance(version, (str, int)) and not isinstance(version, bool) else None
    if not text or not text.isascii() or not text.isdigit() or int(text) < 1:
        raise RegistryError(f"{field}: {version!r} is not a version number. Fix: give one such as 3.")
    return str(int(text))


def _tag_value(value: str, field: str) -> str:
    """`value` checked as a model-version tag value (MLflow's validator: its length limit), on one line of printable
    text. Raises RegistryError naming `field`."""
    from mlflow.exceptions import MlflowException
    from mlflow.utils.validation import _validate_model_version_tag

    if not isinstance(value, str) or any(not ch.isprintable() for ch in value):
        raise RegistryError(f"{field}: {value!r} holds control characters or line breaks. Fix: give one line of text.")
    try:
        _validate_model_version_tag("promotion_reason", value)
    except MlflowException as err:
        raise RegistryError(f"{field}: {err.message} Fix: shorten it.") from None
    return value


# ---------------------------------------------------------------------------------------------- reading the registry
def _registered_model(client: mlflow.MlflowClient, name: str):
    """The registered model `name`, or None when there is none (other MLflow errors propagate)."""
    from mlflow.exceptions import MlflowException

    try:
        return client.get_registered_model(name)
    except MlflowException as err:
        if err.error_code == _NOT_FOUND:
            return None
        raise


def _require_model(client: mlflow.MlflowClient, name: str):
    """The registered model `name`. Raises RegistryError when there is none."""
    model = _registered_model(client, name)
    if model is None:
        raise RegistryError(
            f"no registered model named {name!r} in this registry. "
            "Fix: check the name and the tracking URI (`async-grpo model show NAME --tracking-uri URI`)."
        )
    return model


def _require_version(client: mlflow.MlflowClient, name: str, version: str) -> ModelVersion:
    """Version `version` of `name` (which must exist), READY. Raises RegistryError when it does not exist or is not
    READY."""
    from mlflow.exceptions import MlflowException

    try:
        found = client.get_model_version(name, version)
    except MlflowException as err:
        if err.error_code != _NOT_FOUND:
            raise
        raise RegistryError(
            f"registered model {name!r} has no version {version}. "
            f"Fix: list its versions with `async-grpo model show {name}`."
        ) from None
    if found.status != READY:
        raise RegistryError(
            f"{name} version {version} is {found.status}, not {READY} ({found.status_message or 'no message'}). "
            "Fix: wait for its registration to finish, or pick another version."
        )
    return found


def champion(client: mlflow.MlflowClient, name: str, alias: str = CHAMPION_ALIAS) -> ModelVersion | None:
    """The version of registered model `name` that `alias` points at; None when there is no such registered model or
    no version holds the alias.

    Read from the registered model's alias map rather than `get_model_version_by_alias`, whose "no such alias" error
    code differs between stores (INVALID_PARAMETER_VALUE in the sqlite store, RESOURCE_DOES_NOT_EXIST over REST).
    The returned `ModelVersion.version` is an int from the sqlite store and a str over REST: compare `str(version)`.

    Raises:
        RegistryError: `alias` is not a valid alias name.
        mlflow.exceptions.MlflowException: the registry is unreachable or refuses the request.
    """
    from mlflow.exceptions import MlflowException

    _alias(alias, "alias")
    model = _registered_model(client, name)
    if model is None or alias not in (model.aliases or {}):
        return None
    try:
        return client.get_model_version(name, str(model.aliases[alias]))
    except MlflowException as err:  # the version was deleted between the two reads
        if err.error_code == _NOT_FOUND:
            return None
        raise


def aliases(client: mlflow.MlflowClient, name: str) -> dict[str, str]:
    """Alias -> version (as a string) of registered model `name`, from the registered model itself (the sqlite
    store's `search_model_versions` leaves each version's `aliases` empty).

    Raises:
        RegistryError: no registered model `name`.
        mlflow.exceptions.MlflowException: the registry is unreachable or refuses the request.
    """
    return {alias: str(version) for alias, version in (_require_model(client, name).aliases or {}).items()}


def model_versions(client: mlflow.MlflowClient, name: str) -> list[ModelVersion]:
    """Every version of registered model `name`, newest first (all pages of `search_model_versions`).

    The name goes into MLflow's filter string between quotes it does not contain (MLflow's filter has no escape for
    a quote inside a value); results are kept only when their name is exactly `name`.

    Raises:
        RegistryError: no registered model `name`, or its name holds both `'` and `"` (no filter can quote it).
        mlflow.exceptions.MlflowException: the registry is unreachable or refuses the request.
    """
    _require_model(client, name)
    quote = "'" if "'" not in name else '"'
    if quote in name:
        raise RegistryError(
            f"registered model name {name!r} holds both ' and \", which MLflow's search filter cannot quote. "
            "Fix: rename the registered model."
        )
    found, token = [], None
    while True:
        page = client.search_model_versions(f"name = {quote}{name}{quote}", page_token=token)
        found += [v for v in page if v.name == name]
        token = page.token
        if not token:
            break
    return sorted(found, key=lambda v: int(v.version), reverse=True)


# ---------------------------------------------------------------------------------------------- resolving to a folder
def resolve_model_uri(uri: str, dest: Path, tracking_uri: str | None = None) -> ResolvedModel:
    """Download the registry version `uri` names into `dest` as a local Hugging Face folder.

    `uri` is `models:/<name>/<version>` or `models:/<name>@<alias>` (`parse_model_uri`); an alias is resolved to its
    version first, so the folder and the result name the concrete version. The version's artifacts are downloaded
    with MLflow (`get_model_version_download_uri`, `mlflow.artifacts.download_artifacts`) and assembled:

    - a transformers-flavour MLflow model (`MLmodel`, what `tracking.log_transformers_model` logs): the weights and
      config are the flavour's `model_binary` folder (`model/`), the tokenizer its `components/tokenizer/` (mlflow's
      transformers `model_io` layout; its files win over same-named ones in `model/`, as `mlflow.transformers`
      loads the tokenizer from there);
    - a plain Hugging Face folder (`config.json` at the top: versions registered from a run's `model` artifact
      folder) is taken as it is.

    `dest` becomes exactly that folder, with a marker file (`MARKER_FILE`) naming the version; when `dest` already
    holds the same version (same name, version and artifact source) nothing is downloaded. A `dest` holding another
    version resolved here is replaced; any other non-empty `dest` is refused, never overwritten. The folder is
    assembled beside `dest` and renamed into place, so a crash leaves no half-written `dest`.

    Args:
        uri: the registry URI.
        dest: the folder to create (its parent is created when missing). It is read and reused as it is (the
            marker, `config.json`) through plain paths, so it must be the caller's own folder: a process holding
            credentials passes a step-private one (`shared_volume.private_dir`) and copies the result onto a shared
            volume with `shared_volume.copy_tree` (`registry_start.resolve_registry_start`, the evaluate step).
        tracking_uri: the tracking server (its registry is used); None: MLflow's default (`MLFLOW_TRACKING_URI`).

    Raises:
        RegistryError: a malformed URI; no such registered model, version or alias; a version that is not READY;
            artifacts without a Hugging Face checkpoint (weights, config.json and tokenizer); a non-empty `dest`
            that this function did not write.
        mlflow.exceptions.MlflowException: the registry or artifact store is unreachable.
    """
    import mlflow

    ref = parse_model_uri(uri)
    client = mlflow.MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
    _require_model(client, ref.name)
    if ref.alias is not None:
        held = champion(client, ref.name, ref.alias)
        if held is None:
            raise RegistryError(
                f"no version of {ref.name!r} has the alias {ref.alias!r} ({uri}). "
                f"Fix: promote one (`async-grpo model promote {ref.name} VERSION --alias {ref.alias}`) "
                "or give a version."
            )
        version = str(held.version)
    else:
        version = ref.version
    found = _require_version(client, ref.name, version)
    source = client.get_model_version_download_uri(ref.name, version)
    dest = Path(dest)
    marker = {"name": ref.name, "version": version, "run_id": found.run_id or None, "source": source}
    result = ResolvedModel(dest, ref.name, version, found.run_id or None, f"{MODELS_SCHEME}{ref.name}/{version}")
    held_marker = _read_marker(dest)
    same = held_marker is not None and all(held_marker.get(k) == marker[k] for k in ("name", "version", "source"))
    if same and (dest / "config.json").is_file():
        logger.info("%s already holds %s", dest, result.uri)
        return result
    if dest.exists() and held_marker is None and (not dest.is_dir() or any(dest.iterdir())):
        raise RegistryError(
            f"{dest} exists and holds files this did not write. Fix: give an empty or new folder for the model."
        )
    dest.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".partial", dir=dest.parent))
    try:
        downloaded = Path(
            mlflow.artifacts.download_artifacts(
                artifact_uri=source, dst_path=str(work / "download"), tracking_uri=tracking_uri
            )
        )
        folder = _assemble_hf_folder(downloaded, work / "model", what=result.uri)
        (folder / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
        if dest.exists():
            shutil.rmtree(dest) if dest.is_dir() else dest.unlink()
        os.replace(folder, dest)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    logger.info("resolved %s (%s) into %s", uri, result.uri, dest)
    return result


def _read_marker(dest: Path) -> dict | None:
    """The marker `resolve_model_uri` left in `dest`, or None (no marker, or not one we can read)."""
    try:
        marker = json.loads((dest / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def _inside(root: Path, relative: str) -> Path | None:
    """`root / relative` when it stays inside `root` (a path read from a downloaded MLmodel is not trusted)."""
    if not isinstance(relative, str) or not relative:
        return None
    path = (root / relative).resolve()
    return path if path.is_relative_to(root.resolve()) else None


def _assemble_hf_folder(downloaded: Path, out: Path, *, what: str) -> Path:
    """Move the Hugging Face checkpoint inside `downloaded` (a transformers-flavour MLflow model, or a plain HF folder)
    to `out` and return `out`. Raises RegistryError when there is none."""
    if (downloaded / "MLmodel").is_file():
        from mlflow.models import Model

        flavor = Model.load(str(downloaded / "MLmodel")).flavors.get("transformers")
        if flavor is None:
            raise RegistryError(
                f"{what} is an MLflow model without the transformers flavour. "
                "Fix: register a model logged with mlflow.transformers (the trainer's final model)."
            )
        binary = _inside(downloaded, flavor.get("model_binary"))
        if binary is None or not (binary / "config.json").is_file():
            raise RegistryError(
                f"{what} holds no weights (its transformers flavour has no model folder with config.json: logged "
                "with save_pretrained=False, or a PEFT adapter). Fix: register a model logged with its weights."
            )
        shutil.move(str(binary), str(out))
        tokenizer = _inside(downloaded, f"{_COMPONENTS_DIR}/{_TOKENIZER_COMPONENT}")
        if tokenizer is not None and tokenizer.is_dir():
            for item in tokenizer.iterdir():
                target = out / item.name
                if target.is_dir():
                    shutil.rmtree(target)
                shutil.move(str(item), str(target))
    elif (downloaded / "config.json").is_file():
        shutil.move(str(downloaded), str(out))
    else:
        entries = sorted(p.name for p in downloaded.iterdir())[:10]
        raise RegistryError(
            f"{what} holds no Hugging Face checkpoint (no MLmodel and no config.json; found {entries}). "
            "Fix: register a run's transformers-flavour model or a folder written by save_pretrained."
        )
    if not any((out / name).is_file() for name in _TOKENIZER_FILES):
        raise RegistryError(
            f"{what} holds weights but no tokenizer (none of {list(_TOKENIZER_FILES)}). "
            "Fix: register a model saved with its tokenizer."
        )
    return out


# ---------------------------------------------------------------------------------------------- moving the alias
def _now() -> str:
    """UTC now, ISO 8601 to the second (`2026-11-26T18:05:43+00:00`)."""
    return datetime.now(UTC).isoformat(timespec="seconds")


def _record_promotion(
    client: mlflow.MlflowClient, name: str, version: str, *, actor: str, reason: str, previous: str | None
) -> None:
    """Tag `version` with who promoted it, why, when (UTC ISO 8601) and from which version ("" for none)."""
    for key, value in (
        ("promoted_by", actor),
        ("promotion_reason", reason),
        ("promoted_at", _now()),
        ("promoted_from", previous or ""),
    ):
        client.set_model_version_tag(name, version, key, value)


def promote(
    client: mlflow.MlflowClient,
    name: str,
    version: str | int,
    *,
    reason: str,
    actor: str,
    alias: str = CHAMPION_ALIAS,
    expected_champion: str | None | Literal[_Unset.ANY] = ANY,
) -> Promotion:
    """Make `version` of registered model `name` the holder of `alias` (the champion by default).

    The version that held `alias` before (if another one) gets `previous_alias(alias)` (`previous-champion`), so
    `rollback` can restore it; then `alias` moves to `version`, and `version` gets the tags `promoted_by` (actor),
    `promotion_reason`, `promoted_at` (UTC, ISO 8601) and `promoted_from` (the previous version, "" for none).
    Promoting the version that already holds `alias` moves and tags nothing.

    `expected_champion` is a compare-and-set for concurrent pipeline runs: a version string, or None for "no version
    holds the alias"; when the holder differs, `ChampionChanged` is raised and nothing changes, so a run evaluated
    against version 3 never overwrites a champion that moved to 4 meanwhile. MLflow's registry has no transactions:
    the check is the read right before the two alias writes, and a promotion that lands between that read and those
    writes (milliseconds) is still overwritten; run promotions of one model from one place where that matters.

    Args:
        client: an MlflowClient on the registry.
        name: the registered model.
        version: the version to promote (digits; `"007"` means 7).
        reason: why, recorded as `promotion_reason` (one line).
        actor: who, recorded as `promoted_by` (one line).
        alias: the alias to move.
        expected_champion: ANY (no check), a version string, or None.

    Raises:
        ChampionChanged (a RegistryError): the alias holder is not `expected_champion`.
        RegistryError: no registered model `name`, no version `version` or not READY, an invalid alias, version,
            expected_champion, reason or actor.
        mlflow.exceptions.MlflowException: the registry is unreachable or refuses a write.
    """
    version = _version(version, "version")
    alias, keep = _alias(alias, "alias"), _alias(previous_alias(alias), "alias (its previous- alias)")
    reason, actor = _tag_value(reason, "reason"), _tag_value(actor, "actor")
    expected = expected_champion if expected_champion in (ANY, None) else _version(expected_champion, "expected")
    _require_model(client, name)
    _require_version(client, name, version)
    current = champion(client, name, alias)
    held = str(current.version) if current is not None else None
    if expected is not ANY and held != expected:
        raise ChampionChanged(
            f"the {alias} of {name!r} is {'version ' + held if held else 'no version'}, but the caller expected "
            f"{'version ' + expected if expected else 'no version'}: another promotion moved it. "
            f"Fix: evaluate against the new {alias} (`async-grpo model show {name}`) and promote again."
        )
    if held == version:
        logger.info("%s version %s already holds %r; nothing moved", name, version, alias)
        return Promotion(name, version, held, alias)
    if held is not None:  # first, so a crash before the next write leaves the alias where it was
        client.set_registered_model_alias(name, keep, held)
    client.set_registered_model_alias(name, alias, version)
    _record_promotion(client, name, version, actor=actor, reason=reason, previous=held)
    logger.info("%s: %r moved %s -> %s by %s (%s)", name, alias, held or "(none)", version, actor, reason)
    return Promotion(name, version, held, alias)


def rollback(
    client: mlflow.MlflowClient, name: str, *, reason: str, actor: str, alias: str = CHAMPION_ALIAS
) -> Promotion:
    """Give `alias` back to the version holding `previous_alias(alias)` (`previous-champion`), which then points at
    the version rolled back from, so a second rollback undoes the first.

    The version rolled back from gets the tags `rolled_back_by`, `rollback_reason` and `rolled_back_at` (UTC, ISO
    8601); the restored version is tagged as a promotion (`promoted_by`, `promotion_reason`, `promoted_at`,
    `promoted_from`). `alias` moves first, so a crash between the two alias writes leaves the rollback done.

    Raises:
        RegistryError: no registered model `name`; no version holds the previous alias (nothing to roll back to), or
            it is already the one holding `alias`; an invalid alias, reason or actor.
        mlflow.exceptions.MlflowException: the registry is unreachable or refuses a write.
    """
    alias, keep = _alias(alias, "alias"), _alias(previous_alias(alias), "alias (its previous- alias)")
    reason, actor = _tag_value(reason, "reason"), _tag_value(actor, "actor")
    _require_model(client, name)
    restore = champion(client, name, keep)
    if restore is None:
        raise RegistryError(
            f"{name!r} has no {keep!r} version: nothing to roll back to. "
            f"Fix: promote the version you want (`async-grpo model promote {name} VERSION`)."
        )
    restored = str(restore.version)
    current = champion(client, name, alias)
    held = str(current.version) if current is not None else None
    if held == restored:
        raise RegistryError(
            f"{name!r}: {keep!r} and {alias!r} are both version {restored}: nothing to roll back to. "
            f"Fix: promote the version you want (`async-grpo model promote {name} VERSION`)."
        )
    client.set_registered_model_alias(name, alias, restored)
    if held is None:
        client.delete_registered_model_alias(name, keep)
    else:
        client.set_registered_model_alias(name, keep, held)
        for key, value in (("rolled_back_by", actor), ("rollback_reason", reason), ("rolled_back_at", _now())):
            client.set_model_version_tag(name, held, key, value)
    _record_promotion(client, name, restored, actor=actor, reason=reason, previous=held)
    logger.info("%s: %r rolled back %s -> %s by %s (%s)", name, alias, held or "(none)", restored, actor, reason)
    return Promotion(name, restored, held, alias)
