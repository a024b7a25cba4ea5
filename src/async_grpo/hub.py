"""Hugging Face Hub ids for models and datasets: resolved to a local snapshot folder through the HF cache.

`model_name_or_path: Qwen/Qwen2.5-0.5B-Instruct` and `dataset: openai/gsm8k` work as in TRL: the repository is
downloaded into the standard HF cache (`HF_HUB_CACHE`, default `~/.cache/huggingface/hub`) when the machine
can reach the hub, or read from that cache when it cannot (offline, `HF_HUB_OFFLINE=1`). Everything after this
point sees a local folder: transformers, datasets and the vLLM server (which we start with `HF_HUB_OFFLINE=1`)
get the same snapshot, so trainer and server load the same files. Without the hub and without a cached copy, a
`HubUnavailable` error says so and how to fix it.
"""

from __future__ import annotations

import re
from pathlib import Path

# org/name, as the hub spells repository ids (a bare name without an org is not accepted: it is more often
# a mistyped local path)
_FILE_SUFFIXES = {".jsonl", ".json", ".parquet", ".csv", ".arrow", ".py", ".yaml", ".yml", ".txt"}
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


class HubUnavailable(ValueError):
    """A hub id could not be resolved: the hub is unreachable (or offline mode is on) and the HF cache has no
    copy, or the repository does not exist / is gated. The message names the id, the cache and the fix."""


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
