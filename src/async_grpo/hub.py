"""Hugging Face Hub ids for models and datasets: resolved to a local snapshot folder through the HF cache.

`model_name_or_path: Qwen/Qwen2.5-0.5B-Instruct` and `dataset: openai/gsm8k` work as in TRL: the repository is
downloaded into the standard HF cache (`HF_HUB_CACHE`, default `~/.cache/huggingface/hub`) when the machine
can reach the hub, or read from that cache when it cannot (offline, `HF_HUB_OFFLINE=1`). Everything after this
point sees a local folder: transformers, datasets and the vLLM server (which we start with `HF_HUB_OFFLINE=1`)
get the same snapshot, so trainer and server load the same files. Without the hub and without a cached copy, a
`HubUnavailable` error says so and how to fix it.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

# org/name, as the hub spells repository ids (a bare name without an org is not accepted: it is more often
# a mistyped local path)
_FILE_SUFFIXES = {".jsonl", ".json", ".parquet", ".csv", ".arrow", ".py", ".yaml", ".yml", ".txt"}
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


class HubUnavailable(ValueError):
    """A hub id could not be resolved: the hub is unreachable (or offline mode is on) and the HF cache has no
    copy, or the repository does not exist / is gated. The message names the id, the cache and the fix."""


class UnsafeSnapshotFile(ValueError):
    """A downloaded snapshot holds a symbolic link that leaves the snapshot's folder; the message names the path.
    Nothing of the dataset is read."""


def looks_like_repo_id(spec: str) -> bool:
    """True when `spec` has the shape of a hub repository id (`org/name`), is not an existing local path and does
    not end like a data file (`data/train.jsonl` is a missing file, not a repository)."""
    return bool(_REPO_ID.match(spec)) and not Path(spec).exists() and Path(spec).suffix.lower() not in _FILE_SUFFIXES


def snapshot(
    repo_id: str, *, repo_type: str = "model", revision: str | None = None, allow_patterns: list[str] | None = None
) -> Path:
    """The local folder of `repo_id` at `revision`: downloaded into the HF cache when the hub is reachable,
    else the cached snapshot (`huggingface_hub.snapshot_download`, which falls back to the cache by itself
    when offline mode is on or the network fails).

    Args:
        repo_id: `org/name`.
        repo_type: "model" or "dataset".
        revision: branch, tag or commit; None: the default branch.
        allow_patterns: only these files (globs); None: the whole repository.

    Returns:
        The snapshot folder (…/hub/<type>s--org--name/snapshots/<commit>).

    Raises:
        HubUnavailable: neither the hub nor the cache has it (offline, unreachable, unknown or gated repo).
    """
    from huggingface_hub import constants, errors, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    not_cached = (LocalEntryNotFoundError, getattr(errors, "IncompleteSnapshotError", LocalEntryNotFoundError))

    try:
        return Path(snapshot_download(repo_id, repo_type=repo_type, revision=revision, allow_patterns=allow_patterns))
    except not_cached as err:
        offline = " (offline mode: HF_HUB_OFFLINE is set)" if constants.HF_HUB_OFFLINE else ""
        raise HubUnavailable(
            f"{repo_type} {repo_id!r} is a Hugging Face Hub id, but the hub cannot be reached{offline} and the HF "
            f"cache ({constants.HF_HUB_CACHE}) has no copy. Fix: run where the hub is reachable once (the copy is "
            f"cached), download it with `hf download {repo_id}{' --repo-type dataset' if repo_type == 'dataset' else ''}`"
            f" on a machine that can, or point the field at a local folder."
        ) from err
    except HfHubHTTPError as err:
        raise HubUnavailable(
            f"{repo_type} {repo_id!r}: the hub answered {err}. Fix: check the id and, for a gated "
            "repository, that HF_TOKEN has access."
        ) from err


# ------------------------------------------------------------------------------------------------ pinned data files
# On the cluster a hub dataset is read from data files the step picks itself (`pinned_data_files`), never from what
# the dataset card names: a card's `configs` may point `data_files` at any local path (a workspace symlink to the
# pod's ServiceAccount token) and set reader options that turn any file into rows. The formats a pinned dataset may
# hold, by suffix, and the `datasets` packaged builder that reads each:
DATA_FILE_FORMATS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv", ".arrow": "arrow"}
PARQUET_REVISION = "refs/convert/parquet"  # the hub's own parquet export: <config>/<split>/NNNN.parquet
# Files that end like data files but hold no rows (metadata of `datasets` and of saved datasets).
_METADATA_FILES = frozenset({"dataset_info.json", "dataset_infos.json", "dataset_dict.json", "state.json"})
# `datasets.data_files.SPLIT_KEYWORDS`: a folder or file named with one of these words holds that split.
SPLIT_KEYWORDS = {
    "train": ("train", "training"),
    "validation": ("validation", "valid", "dev", "val"),
    "test": ("test", "testing", "eval", "evaluation"),
}
_SEP = r"[-._ 0-9]"  # what may stand beside a split keyword in a name (datasets' `{sep}`)
_SHARDED = re.compile(r"(?P<split>\w+?)-\d{5}-of-\d{5}.*")  # `<split>-00000-of-00003.parquet`, the hub's shards
_PRIVATE_SNAPSHOTS: dict[tuple[str, str, str | None, tuple[str, ...]], Path] = {}


def on_cluster() -> bool:
    """True inside a Kubernetes pod (KUBERNETES_SERVICE_HOST, set by the kubelet), as `launch.k8s_policy.in_cluster_pod`
    says (this module imports nothing of the package)."""
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST"))


def private_snapshot(
    repo_id: str, *, repo_type: str = "dataset", revision: str | None = None, allow_patterns: list[str] | None = None
) -> Path:
    """Download `repo_id` into a new folder of this process (`tempfile.mkdtemp`, mode 0700) instead of the shared HF
    cache, which others may write: what lies there is exactly what the hub served (plain files, no links into a
    cache), and nobody else can add to it. Downloaded once per process for the same arguments.

    Args:
        repo_id: `org/name`.
        repo_type: "dataset" or "model".
        revision: branch, tag or commit (e.g. PARQUET_REVISION); None: the default branch.
        allow_patterns: only these files (globs over the repository path); None: every file.

    Returns:
        The folder.

    Raises:
        HubUnavailable: the hub cannot be reached, or the repository or revision does not exist or is gated.
    """
    key = (repo_id, repo_type, revision, tuple(allow_patterns or ()))
    if key in _PRIVATE_SNAPSHOTS:
        return _PRIVATE_SNAPSHOTS[key]
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    folder = Path(tempfile.mkdtemp(prefix="async-grpo-hub-"))
    try:
        snapshot_download(
            repo_id, repo_type=repo_type, revision=revision, local_dir=folder, allow_patterns=allow_patterns
        )
    except (HfHubHTTPError, LocalEntryNotFoundError) as err:
        at = f" at revision {revision!r}" if revision else ""
        raise HubUnavailable(
            f"{repo_type} {repo_id!r}{at}: the hub could not be read ({err}). Fix: check the id and that this pod "
            "reaches the hub, and for a gated repository that HF_TOKEN has access."
        ) from err
    _PRIVATE_SNAPSHOTS[key] = folder
    return folder


def snapshot_files(folder: Path) -> list[str]:
    """Every regular file of a downloaded snapshot, as sorted POSIX paths relative to it; hidden entries (`.cache`,
    `.git`, `.gitattributes`, ...) are skipped. A linked folder is never entered.

    Raises:
        UnsafeSnapshotFile: an entry is a symbolic link whose target lies outside `folder` or does not exist (the
            message names it).
    """
    root = Path(folder).resolve(strict=True)
    found = []
    for dirpath, dirnames, filenames in os.walk(root):  # followlinks=False: a linked folder is listed, not entered
        here = Path(dirpath)
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in [*dirnames, *sorted(f for f in filenames if not f.startswith("."))]:
            path = here / name
            if path.is_symlink():
                target = path.resolve()
                if not target.is_relative_to(root) or not target.exists():
                    raise UnsafeSnapshotFile(
                        f"hub snapshot file {path.relative_to(root).as_posix()!r} is a symbolic link to "
                        f"{str(target)!r}, outside the snapshot: it is refused and nothing of the dataset is read. "
                        "Fix: publish the data files themselves in the dataset repository."
                    )
            if name in filenames and path.is_file():
                found.append(path.relative_to(root).as_posix())
    return sorted(found)


def _split_words(split: str) -> tuple[str, ...]:
    """The names that mean `split` in a file layout: its SPLIT_KEYWORDS family, or the name itself."""
    for name, words in SPLIT_KEYWORDS.items():
        if split == name or split in words:
            return (name, *words)
    return (split,)


def _names_split(parts: list[str], words: tuple[str, ...]) -> bool:
    """True when a file (its path segments below the config folder) belongs to the split that `words` name, by the
    hub's standard layout: a shard name `<split>-00000-of-00001.*`, a folder named with a keyword (`train/`,
    `partial-train/`), or a file name starting with or holding one (`train.jsonl`, `gsm8k_test.csv`)."""
    *dirs, base = parts
    sharded = _SHARDED.fullmatch(base)
    if sharded:
        return sharded.group("split") in words
    for word in (re.escape(w) for w in words):
        if any(re.fullmatch(rf"(?:.*{_SEP})?{word}(?:{_SEP}.*)?", d) for d in dirs):
            return True
        if re.fullmatch(rf"(?:.*{_SEP})?{word}{_SEP}.*", base):
            return True
    return False


def pick_data_files(
    folder: Path, config_name: str | None, split: str, *, one_config: bool = False
) -> tuple[str, list[Path]] | None:
    """The data files of `split` in a downloaded snapshot, picked by the hub's standard layout alone (the dataset
    card is never read): files with a DATA_FILE_FORMATS suffix; with `config_name`, only those under the top-level
    folder of that name; then those whose folder or file name says `split` (`_names_split`), or, when no file names
    any split, every file as "train".

    Args:
        folder: the snapshot (`private_snapshot`).
        config_name: the configuration (TRL `dataset_config`); None: every file (or, with `one_config`, the folder
            `default`, else the only top-level folder).
        split: the split's name (`train`, `test`, `validation` or any other the files name).
        one_config: the layout is `<config>/<split>/...` (PARQUET_REVISION).

    Returns:
        (the `datasets` builder: parquet, json, csv or arrow; the files' real paths, each inside `folder`), or None
        when the snapshot has no data file of that config and split.

    Raises:
        UnsafeSnapshotFile: the snapshot holds a link that leaves it (`snapshot_files`).
        ValueError: the picked files mix formats, or (`one_config`) several configurations and none chosen.
    """
    root = Path(folder).resolve(strict=True)
    files = [
        f
        for f in snapshot_files(root)
        if Path(f).suffix.lower() in DATA_FILE_FORMATS and Path(f).name not in _METADATA_FILES
    ]
    config = config_name
    if config is None and one_config:
        tops = sorted({f.split("/")[0] for f in files if "/" in f})
        if "default" in tops or len(tops) == 1:
            config = "default" if "default" in tops else tops[0]
        elif tops:
            raise ValueError(
                f"the hub dataset has configurations {tops} and none was chosen. Fix: set dataset_config to one."
            )
    if config is not None:
        files = [f for f in files if f.split("/")[0] == config and "/" in f]
    below = {f: f.split("/")[1 if config is not None else 0 :] for f in files}
    every_split = [w for name in SPLIT_KEYWORDS for w in _split_words(name)]
    named = any(_SHARDED.fullmatch(parts[-1]) or _names_split(parts, tuple(every_split)) for parts in below.values())
    words = _split_words(split)
    if named:
        picked = [f for f, parts in below.items() if _names_split(parts, words)]
    else:
        picked = files if split in _split_words("train") else []
    if not picked:
        return None
    formats = sorted({DATA_FILE_FORMATS[Path(f).suffix.lower()] for f in picked})
    if len(formats) > 1:
        raise ValueError(
            f"the hub dataset's {split!r} files {picked[:5]} mix the formats {formats}. Fix: publish one format per "
            "split."
        )
    paths = []
    for f in picked:  # snapshot_files refused links leaving the folder; the real paths are what is read
        real = (root / f).resolve(strict=True)
        if not real.is_relative_to(root):
            raise UnsafeSnapshotFile(f"hub snapshot file {f!r} resolves to {str(real)!r}, outside the snapshot.")
        paths.append(real)
    return formats[0], paths


def pinned_data_files(repo_id: str, config_name: str | None, split: str) -> tuple[str, list[Path]]:
    """The data files of a hub dataset's `split`, picked by this process: the repository's data files are downloaded
    into a private folder (`private_snapshot`; the card, scripts and other files are not even downloaded) and picked
    by the hub's standard layout (`pick_data_files`); when that layout holds no file of the config and split (a
    dataset whose card maps its files), the hub's parquet export (PARQUET_REVISION, `<config>/<split>/*.parquet`) is
    read instead. The card's `configs` (data file paths, URLs, reader options) are never used.

    Args:
        repo_id: `org/name`.
        config_name: the configuration (TRL `dataset_config`); None: the default one.
        split: the split to read.

    Returns:
        (the `datasets` builder name, the files' real paths): give them to `datasets.load_dataset(builder,
        data_files=[...])`, with no other reader option.

    Raises:
        HubUnavailable: the hub cannot be reached, or the repository does not exist or is gated.
        UnsafeSnapshotFile: a downloaded file is a link leaving the download folder.
        ValueError: no data file of that config and split in either layout (the message lists what there is and the
            fix), or mixed formats.
    """
    under = f"{config_name}/" if config_name else ""  # a config's files lie in its folder: download only those
    patterns = [f"{under}*{suffix}" for suffix in DATA_FILE_FORMATS]
    folder = private_snapshot(repo_id, allow_patterns=patterns)
    picked = pick_data_files(folder, config_name, split)
    export = None
    if picked is None:
        try:
            export = private_snapshot(repo_id, revision=PARQUET_REVISION, allow_patterns=[f"{under}*.parquet"])
        except HubUnavailable:
            export = None
        if export is not None:
            picked = pick_data_files(export, config_name, split, one_config=True)
    if picked is None:
        seen = snapshot_files(folder) + ([f"{PARQUET_REVISION}: {f}" for f in snapshot_files(export)] if export else [])
        raise ValueError(
            f"dataset {repo_id!r} (config {config_name!r}, split {split!r}): no data file of that config and split in "
            f"the hub's standard layout (files: {seen[:10]}{' ...' if len(seen) > 10 else ''}). On the cluster the "
            "dataset card's `configs` are not followed. Fix: check dataset_config and dataset_train_split / "
            "dataset_test_split against the repository's folders, or copy the data onto the workspace volume."
        )
    return picked
