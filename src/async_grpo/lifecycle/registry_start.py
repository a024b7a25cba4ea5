"""Warm start from the model registry: `model_name_or_path: models:/<name>@<alias>` (or `models:/<name>/<version>`)
becomes a local checkpoint before anything starts, and the run records the version it started from.

The URI is resolved once, by the process that launches the run (`async-grpo train`, the `train_grpo` step), to a
concrete version downloaded into `<output_dir>/warm-start/<name>-v<version>` (on Kubernetes, the workspace volume
the trainer and vLLM pods mount), and the config's `model_name_or_path` is replaced by that folder: the trainer and
every vLLM server load the same files, and an alias that moves during the run changes nothing. The folder carries
`registry.MARKER_FILE`, from which the training run tags itself with its parent version (`run_tags`). On the shared
volume the step downloads into a folder of its own first and copies the version into a folder it creates new
(`async_grpo.shared_volume`), so nothing a tenant planted there is taken for the download.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from async_grpo import shared_volume
from async_grpo.config import GRPOConfig
from async_grpo.lifecycle import registry

logger = logging.getLogger(__name__)

PARENT_VERSION_TAG = "async_grpo.parent_version"  # run tag: `<name>/<version>` the run warm-started from
WARM_START_TAG = (
    "async_grpo.lifecycle.registry_start"  # run tag: how the run started (`registry models:/...` or `base ...`)
)
MARKER_MAX_BYTES = 1 << 20  # a registry marker file is a few hundred bytes; a larger one is not ours
LOCK_TIMEOUT_S = 600.0  # how long a trainer rank waits for another rank's download of the same version


@dataclass(frozen=True)
class RegistryStart:
    """Where a run's initial weights came from.

    Attributes:
        requested: what `model_name_or_path` asked for (a `models:/` URI, a folder, a hub id, `builtin:tiny`).
        path: the local folder the run loads (None: resolved by the trainer itself, e.g. a hub id).
        parent_version: `<name>/<version>` of the registry version, "" for anything else.
    """

    requested: str
    path: Path | None
    parent_version: str = ""

    def tags(self) -> dict[str, str]:
        """The run tags that record it (`PARENT_VERSION_TAG`, `WARM_START_TAG`)."""
        how = f"registry models:/{self.parent_version}" if self.parent_version else f"base {self.requested}"
        return {PARENT_VERSION_TAG: self.parent_version, WARM_START_TAG: how}


def resolve_registry_start(
    config: GRPOConfig, tracking_uri: str | None = None, *, volume_root: str | Path | None = None
) -> tuple[GRPOConfig, RegistryStart]:
    """`config` with a `models:/` `model_name_or_path` replaced by the downloaded folder (and `warmup_sft_steps` set
    to 0: the registered version had its supervised warm start already); any other config unchanged.

    Two ways, by who may write `output_dir`:

    - `volume_root` given (the `train_grpo` step: `output_dir` lies on a shared, tenant-writable volume): the version
      is downloaded into a step-private folder (`shared_volume.private_dir`), then copied (`shared_volume.copy_tree`)
      into `<output_dir>/warm-start/<name>-v<version>`, which is created exclusively: a folder or marker a tenant
      planted there first is refused, never taken for the download, and no link on the way is followed. One process
      calls it (the step, before any pod starts).
    - `volume_root` None (`async-grpo train` on one machine, the user's own folder): several processes may call it at
      once for the same run (every trainer rank under torchrun): the download runs under an exclusive lock on
      `<output_dir>/warm-start/.lock`, and the later callers find the folder in place.

    Args:
        config: the run's config.
        tracking_uri: the registry's tracking URI; None: the config's (`GRPOConfig.tracking_uri`).
        volume_root: the shared volume's root `output_dir` lies under (the workspace mount); None: a folder of the
            caller's own.

    Returns:
        (config, RegistryStart).

    Raises:
        RegistryError (a ValueError): a malformed URI, or no such model, version or alias (the message names
            `model_name_or_path` and the fix), or a version without a Hugging Face checkpoint.
        UnsafeVolumePath (a ValueError): with `volume_root`, `<output_dir>/warm-start/<name>-v<version>` exists
            already, `output_dir` lies outside the volume root, or a link is on the way.
        TimeoutError: another process held the download lock for LOCK_TIMEOUT_S.
        mlflow.exceptions.MlflowException: the registry is unreachable.
    """
    requested = config.model_name_or_path
    if not registry.is_model_uri(requested):
        return config, RegistryStart(requested, Path(requested) if Path(requested).is_dir() else None)
    try:
        ref = registry.parse_model_uri(requested)
    except registry.RegistryError as err:
        raise registry.RegistryError(f"model_name_or_path: {err}") from None
    uri = tracking_uri or config.tracking_uri
    root = Path(config.output_dir) / "warm-start"
    if volume_root is not None:
        version = ref.version or _alias_version(requested, ref, uri)
        private = shared_volume.private_dir("warm-start", volume_root=volume_root)
        try:
            downloaded = registry.resolve_model_uri(
                f"models:/{ref.name}/{version}", private / f"{_safe(ref.name)}-v{version}", tracking_uri=uri
            )
            dest = root / downloaded.path.name
            shared_volume.copy_tree(downloaded.path, dest, root=private, dst_root=volume_root)
        finally:
            shutil.rmtree(private, ignore_errors=True)
        resolved = dataclasses.replace(downloaded, path=dest)
    else:
        root.mkdir(parents=True, exist_ok=True)
        with _locked(root / ".lock"):
            version = ref.version or _alias_version(requested, ref, uri)
            resolved = registry.resolve_model_uri(
                f"models:/{ref.name}/{version}", root / f"{_safe(ref.name)}-v{version}", tracking_uri=uri
            )
    logger.info("warm start: %s is %s, downloaded into %s", requested, resolved.uri, resolved.path)
    update: dict = {"model_name_or_path": str(resolved.path)}
    if config.data.warmup_sft_steps:
        logger.warning(
            "warmup_sft_steps=%d is skipped: the run starts from %s, which had its supervised warm start already",
            config.data.warmup_sft_steps,
            resolved.uri,
        )
        update["warmup_sft_steps"] = 0
    parent = f"{resolved.name}/{resolved.version}"
    return config.model_copy(update=update), RegistryStart(requested, resolved.path, parent)


def registry_start_of(model_path: Path | str, requested: str = "") -> RegistryStart:
    """The RegistryStart of a folder a run loads: its `registry.MARKER_FILE` names the registry version it holds; a
    folder without one, or whose marker is a link, a special file or unreadable, is a base model."""
    path = Path(model_path)
    try:  # the folder may lie on the shared volume: the marker is read without following a link (UnsafeVolumePath)
        marker = json.loads(shared_volume.read_text(path / registry.MARKER_FILE, root=path, max_bytes=MARKER_MAX_BYTES))
        parent = f"{marker['name']}/{marker['version']}"
    except (OSError, ValueError, KeyError, TypeError):
        parent = ""
    return RegistryStart(requested or str(model_path), path, parent)


def _alias_version(requested: str, ref: registry.ModelRef, tracking_uri: str) -> str:
    """The version an alias points at now (so the folder is named by version)."""
    import mlflow

    held = registry.champion(mlflow.MlflowClient(tracking_uri=tracking_uri), ref.name, ref.alias)
    if held is None:
        raise registry.RegistryError(
            f"model_name_or_path={requested!r}: no version of {ref.name!r} has the alias {ref.alias!r}. Fix: promote "
            f"one (`async-grpo model promote {ref.name} VERSION`), give a version, or start from the base model."
        )
    return str(held.version)


def _safe(name: str) -> str:
    """A registered model's name as one path component (MLflow names may hold `/`)."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name).lstrip(".") or "model"


class _locked:
    """An exclusive `fcntl.flock` on `path`, polled until LOCK_TIMEOUT_S (TimeoutError)."""

    def __init__(self, path: Path):
        self.path = path
        self.file = None

    def __enter__(self) -> None:
        self.file = self.path.open("a")
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        while True:
            try:
                fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    self.file.close()
                    raise TimeoutError(f"{self.path} stayed locked for {LOCK_TIMEOUT_S:.0f} s") from None
                time.sleep(0.2)

    def __exit__(self, *exc) -> None:
        fcntl.flock(self.file, fcntl.LOCK_UN)
        self.file.close()
