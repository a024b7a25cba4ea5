"""Adapter-only weight sync (axolotl `vllm_lora_sync`): push a LoRA adapter to vLLM instead of the full weights.

Each `push(version)` saves the trainer's adapter (peft safetensors, a few MB) into a fresh folder
`<folder>/policy-v<version>-<n>/` that the server can read (the same filesystem locally; on Kubernetes the workspace
PVC that the trainer and the vLLM pod both mount at the same path), then loads it through vLLM's runtime LoRA
route `POST /v1/load_lora_adapter {"lora_name", "lora_path", "load_inplace"}` (vLLM 0.32,
`vllm/entrypoints/serve/lora/`; the server needs `--enable-lora` and env `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`)
under the name `adapter_name(version)`. Generation requests name that adapter as their `model`
(`adapter_name` of the version they are stamped with), so the stamp and the adapter that samples agree.

Memory stays bounded: the adapter before the previous one is unloaded (`/v1/unload_lora_adapter`) and its folder
deleted one push later (at most three adapter folders exist); the previous one stays, since requests sent just
before the push may still name it. vLLM's engine keeps
at most `--max-cpu-loras` adapters and evicts the least recently used. No pause is needed: an adapter is
loaded next to the one being sampled, not over it. A fresh folder per push avoids vLLM reusing prefix-cache
blocks computed with an older adapter of the same name and path.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import requests

from async_grpo.inference.client import auth_headers
from async_grpo.transports.weights.push import PushReport, WeightPush

logger = logging.getLogger(__name__)

ADAPTER_PREFIX = "policy-v"


def adapter_name(version: int) -> str:
    """The vLLM adapter name (the requests' `model`) of policy version `version`: `policy-v<version>`."""
    return f"{ADAPTER_PREFIX}{version}"


class LoRASyncError(RuntimeError):
    """vLLM refused or could not load an adapter; the message names the likely cause and the fix."""


class LoRAAdapterPusher:
    """Pushes the trainer's LoRA adapter to one vLLM server (a `push.WeightPush`).

    Args:
        save_adapter: writes the adapter files into the folder it is given and returns their bytes (e.g.
            `trainer.peft.PeftLearner.save_adapter`).
        server_url: vLLM base URL.
        folder: where adapters are written; must be readable by the server at the same path.
        timeout_s: timeout of each HTTP call (seconds).
        keep: adapters kept loaded (the current one and the ones before it; at least 2, see the module docstring).
        base_pusher: a full-weight pusher (`sync.WeightPusher`) of the trainer's base weights W, sent once after each
            `setup()` before the first adapter: the server's base must equal the trainer's, which a warm start, a
            resumed checkpoint, an attached server or a restarted server (its model folder) would break. None: the
            server's base is trusted.

    Attributes:
        last_report: the latest push's `PushReport`: its wire bytes are the adapter files' (plus the base weights'
            on the first push after a setup); no dense bytes.
    """

    def __init__(
        self,
        save_adapter: Callable[[Path], int],
        server_url: str,
        folder: str | Path,
        *,
        timeout_s: float = 300.0,
        keep: int = 2,
        base_pusher: WeightPush | None = None,
    ):
        self.save_adapter = save_adapter
        self.url = server_url.rstrip("/")
        self.folder = Path(folder).resolve()
        self.timeout_s = timeout_s
        self.keep = max(2, keep)
        self.loaded: list[tuple[str, Path]] = []  # (adapter name, folder), oldest first
        self.retired: list[Path] = []  # folders of unloaded or replaced adapters, deleted one push later
        self.pushes = 0
        self.last_report = PushReport()
        self.base_pusher = base_pusher
        self._base_pending = False

    def _post(self, route: str, body: dict) -> requests.Response:
        return requests.post(f"{self.url}{route}", json=body, timeout=self.timeout_s, headers=auth_headers())

    def setup(self) -> None:
        """Forget what a previous server held (after a restart it holds no adapter) and create the folder."""
        self.loaded = []
        self.folder.mkdir(parents=True, exist_ok=True)
        if self.base_pusher is not None:
            self.base_pusher.setup()
            self._base_pending = True

    def push(self, version: int) -> float:
        """Save the adapter and load it as `adapter_name(version)`; unload the one before the previous. Returns the
        seconds it took (save + load).

        Raises:
            LoRASyncError: the server has no runtime LoRA route (404: started without VLLM_ALLOW_RUNTIME_LORA_UPDATING
                / --enable-lora) or refused the adapter (e.g. its rank above --max-lora-rank).
            requests.RequestException: the server did not answer.
        """
        t0 = time.perf_counter()
        base_bytes = 0
        if self._base_pending:  # the base weights first, once per setup (see base_pusher)
            self.base_pusher.push(version)
            base_bytes, self._base_pending = self.base_pusher.last_report.wire_bytes, False
        name = adapter_name(version)
        self.pushes += 1
        path = self.folder / f"{name}-{self.pushes}"
        wire_bytes = base_bytes + int(self.save_adapter(path))
        inplace = any(n == name for n, _ in self.loaded)  # the same version again (a recovery or resume push)
        resp = self._load(name, path, inplace)
        if resp.status_code == 400 and "already been loaded" in resp.text:  # loaded by an earlier trainer process
            resp = self._load(name, path, True)
        if resp.status_code == 404 and _no_route(resp):
            raise LoRASyncError(
                f"vLLM at {self.url} has no /v1/load_lora_adapter route. Fix: start it with "
                "--enable-lora --max-lora-rank <r> and env VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (the "
                "launchers do when vllm_lora_sync is on)."
            )
        if resp.status_code != 200:
            raise LoRASyncError(
                f"vLLM refused adapter {name} from {path} ({resp.status_code}): {resp.text[:500]}. "
                "Fix: check that the server reads this folder at the same path and was started with "
                "--enable-lora and a --max-lora-rank >= lora_r."
            )
        for _, replaced in [(n, p) for n, p in self.loaded if n == name]:
            self._retire(replaced)
        self.loaded = [(n, p) for n, p in self.loaded if n != name] + [(name, path)]
        while len(self.loaded) > self.keep:
            old_name, old_path = self.loaded.pop(0)
            self._unload(old_name)
            self._retire(old_path)
        seconds = time.perf_counter() - t0
        self.last_report = PushReport(seconds=seconds, wire_bytes=wire_bytes)
        return seconds

    def _load(self, name: str, path: Path, inplace: bool) -> requests.Response:
        return self._post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path), "load_inplace": inplace})

    def _retire(self, path: Path) -> None:
        """Delete the folder of the adapter retired one push earlier. The newest retired folder stays one more
        push: a request still running on an unloaded adapter that vLLM's engine evicted reloads it from its path."""
        self.retired.append(path)
        while len(self.retired) > 1:
            shutil.rmtree(self.retired.pop(0), ignore_errors=True)

    def _unload(self, name: str) -> None:
        """Unload adapter `name` from the server (best effort: a failure is logged, never fatal)."""
        try:
            resp = self._post("/v1/unload_lora_adapter", {"lora_name": name})
            if resp.status_code != 200:
                logger.warning("could not unload LoRA adapter %s (%s): %s", name, resp.status_code, resp.text[:200])
        except requests.RequestException as err:
            logger.warning("could not unload LoRA adapter %s: %s", name, err)

    def close(self) -> None:
        """Close the base pusher's transfer group; the adapters stay loaded (the server may still sample them)."""
        if self.base_pusher is not None:
            self.base_pusher.close()


def _no_route(resp: requests.Response) -> bool:
    """True for FastAPI's answer to a route that does not exist (`{"detail": "Not Found"}`), as opposed to vLLM's
    404 for an adapter folder it cannot find."""
    try:
        return resp.json() == {"detail": "Not Found"}
    except ValueError:
        return False
