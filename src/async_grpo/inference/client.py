"""HTTP clients for a vLLM server: async generation (`/v1/completions`) and the sync control plane.

Generation sends token ids and asks for token ids and processed sampling logprobs back, so the
trainer scores exactly the tokens vLLM sampled. The control plane (pause/resume, weight info) is
plain HTTP with timeouts; the weight-transfer handshake itself goes through vLLM's own
`HTTPVLLMWeightSyncClient`, extended only to stamp the policy version at finish.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx
import requests
from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient


@dataclass
class Completion:
    """One sampled completion.

    Attributes:
        token_ids: (T,) sampled token ids.
        logprobs: (T,) sampling logprob (nats) of each token, from `--logprobs-mode processed_logprobs`.
        text: decoded text.
        finish_reason: "stop", "length" or "abort".
    """

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str


class GenerationError(RuntimeError):
    """vLLM answered a generation request with an error or a malformed body."""


class AsyncVLLMClient:
    """Async `/v1/completions` client over one pooled httpx connection set.

    Args:
        base_url: server URL, e.g. http://127.0.0.1:8000.
        model: served model name (the `--model` path by default).
        timeout_s: per-request timeout (seconds).
    """

    def __init__(self, base_url: str, model: str, timeout_s: float = 120.0, max_connections: int = 64):
        self.base_url = base_url.rstrip("/")
        self.model = model
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=httpx.Timeout(timeout_s, connect=10.0),
            limits=httpx.Limits(max_connections=max_connections),
        )

    async def generate(
        self,
        prompt_ids: list[int],
        *,
        n: int,
        max_tokens: int,
        temperature: float,
        top_p: float = 1.0,
        top_k: int = -1,
        seed: int | None = None,
    ) -> list[Completion]:
        """Sample `n` completions of one tokenized prompt.

        Raises:
            GenerationError: non-200 answer or a body without token ids / logprobs.
            httpx.TimeoutException: the request exceeded timeout_s.
        """
        body = {
            "model": self.model,
            "prompt": prompt_ids,
            "n": n,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k,
            "logprobs": 0,
            "return_token_ids": True,
            "skip_special_tokens": True,
        }
        if seed is not None:
            body["seed"] = seed
        resp = await self._http.post("/v1/completions", json=body)
        if resp.status_code != 200:
            raise GenerationError(f"vLLM /v1/completions returned {resp.status_code}: {resp.text[:500]}")
        return parse_completions(resp.json())

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self._http.aclose()


def parse_completions(payload: dict) -> list[Completion]:
    """Parse a `/v1/completions` JSON body into `Completion`s, ordered by choice index.

    Raises:
        GenerationError: a choice lacks `token_ids` or `logprobs.token_logprobs`, or their lengths differ.
    """
    out = []
    for choice in sorted(payload.get("choices", []), key=lambda c: c["index"]):
        ids = choice.get("token_ids")
        lp = (choice.get("logprobs") or {}).get("token_logprobs")
        if ids is None or lp is None:
            raise GenerationError("vLLM response lacks token_ids or logprobs; is this vLLM >= 0.10 with return_token_ids?")
        if len(ids) != len(lp):
            raise GenerationError(f"vLLM returned {len(ids)} token ids but {len(lp)} logprobs")
        out.append(Completion(list(ids), [float(x) for x in lp], choice.get("text", ""), choice.get("finish_reason") or "stop"))
    return out


class VLLMControlClient:
    """Sync client for the dev-mode control plane (`VLLM_SERVER_DEV_MODE=1`).

    Args:
        base_url: server URL.
        timeout_s: per-call timeout (seconds).
    """

    def __init__(self, base_url: str, timeout_s: float = 60.0):
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s

    def _call(self, method: str, path: str, **kw) -> dict:
        resp = requests.request(method, f"{self.base_url}{path}", timeout=self.timeout_s, **kw)
        resp.raise_for_status()
        return resp.json() if resp.content else {}

    def pause(self, mode: str = "keep") -> None:
        """Pause generation. `keep` freezes in-flight requests; they continue after resume."""
        self._call("POST", "/pause", params={"mode": mode})

    def resume(self) -> None:
        """Resume generation."""
        self._call("POST", "/resume")

    def world_size(self) -> int:
        """Number of inference workers (TP x PP x DP) that join the weight-transfer group."""
        return int(self._call("GET", "/get_world_size")["world_size"])

    def weight_version(self) -> str | None:
        """The weight version the server reports (set at finish_weight_update)."""
        return self._call("GET", "/weight_info").get("weight_version")

    def models(self) -> list[str]:
        """Served model ids."""
        return [m["id"] for m in self._call("GET", "/v1/models")["data"]]


class VersionedWeightSyncClient(HTTPVLLMWeightSyncClient):
    """vLLM's HTTP weight-sync client that stamps `next_version` at `finish_weight_update`.

    vLLM's trainer engines call `finish_weight_update()` without a version; the trainer sets
    `next_version` before each push so the server reports the policy version it serves.
    """

    next_version: str | None = None

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Finish the update, tagging it with `weight_version` or `next_version`."""
        super().finish_weight_update(weight_version if weight_version is not None else self.next_version)
