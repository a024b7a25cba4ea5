"""HTTP clients for a vLLM server: async generation (`/v1/completions`) and the sync control plane.

Generation sends token ids and asks for token ids and processed sampling logprobs back, so the
trainer scores exactly the tokens vLLM sampled. The control plane (pause/resume, weight info) is
plain HTTP with timeouts; the weight-transfer handshake itself goes through vLLM's own
`HTTPVLLMWeightSyncClient`, extended only to stamp the policy version at finish.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import httpx
import requests
from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient

from async_grpo.inference.coalescing import RequestCoalescer


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


# An idle pooled connection is dropped after this many seconds: below the server's keep-alive (vLLM's
# VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s, uvicorn's default), so the client never reuses a connection at the moment the server
# closes it. At httpx's default (5 s, equal to the server's) that race answered a live server's request with
# ReadError(''), which marked the server lost and spent one of max_inference_restarts (seen once in ~300 steps).
KEEPALIVE_EXPIRY_S = 2.0
API_KEY_ENV = "VLLM_API_KEY"  # vLLM's own variable; the server requires it when set (see inference/auth.py)


def auth_headers(api_key: str | None = None) -> dict[str, str]:
    """`Authorization: Bearer <key>` for `api_key`, else for env VLLM_API_KEY; {} when neither is set."""
    key = api_key if api_key is not None else os.environ.get(API_KEY_ENV, "")
    return {"Authorization": f"Bearer {key}"} if key else {}


class GenerationError(RuntimeError):
    """vLLM answered a generation request with an error or a malformed body."""


class RejectedRequestError(GenerationError):
    """vLLM refused a generation request as invalid (HTTP 4xx, e.g. a prompt longer than its context)."""


@runtime_checkable
class GenerationClient(Protocol):
    """What a rollout needs from an inference server: sampled completions of a tokenized prompt.

    `AsyncVLLMClient` is the implementation; tests use scripted fakes.
    """

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
        extra_body: dict | None = None,
    ) -> list[Completion]:
        """Sample `n` completions of `prompt_ids` (P,), at most `max_tokens` tokens each; `extra_body`: further
        vLLM sampling parameters (only passed when there are some)."""

    async def aclose(self) -> None:
        """Release connections."""


class AsyncVLLMClient:
    """Async `/v1/completions` client over one pooled httpx connection set.

    Args:
        base_url: server URL, e.g. http://127.0.0.1:8000.
        model: served model name (the `--model` path by default), or a callable returning it, called when each
            request is sent (a LoRA adapter per policy version: `runner.peft_setup.request_model`).
        timeout_s: per-request timeout (seconds).
        api_key: bearer token; None reads env VLLM_API_KEY (unset: none).
        coalesce_window_s: > 0: requests with equal sampling parameters sent within this many seconds share one
            multi-prompt call (`inference.coalescing.RequestCoalescer`); 0 sends each alone.
        coalesce_max_seqs: a shared call is sent at once when its prompts ask for this many sequences together.
    """

    def __init__(
        self,
        base_url: str,
        model: str | Callable[[], str],
        timeout_s: float = 120.0,
        max_connections: int = 64,
        api_key: str | None = None,
        coalesce_window_s: float = 0.0,
        coalesce_max_seqs: int = 128,
    ):
        self.base_url = base_url.rstrip("/")
        self.model = model
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            headers=auth_headers(api_key),
            timeout=httpx.Timeout(timeout_s, connect=10.0),
            limits=httpx.Limits(max_connections=max_connections, keepalive_expiry=KEEPALIVE_EXPIRY_S),
        )
        self.coalescer = (
            RequestCoalescer(self.generate_batch, coalesce_window_s, coalesce_max_seqs, rejected=RejectedRequestError)
            if coalesce_window_s > 0
            else None
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
        extra_body: dict | None = None,
    ) -> list[Completion]:
        """Sample `n` completions of one tokenized prompt (P,); `extra_body` adds vLLM sampling parameters to the
        request (min_p, repetition_penalty, TRL's generation_kwargs). With `coalesce_window_s` > 0 an unseeded prompt
        may share one `/v1/completions` call with others sent within that window (`inference.coalescing`): it is
        then sent up to that many seconds later, so the caller's policy-version stamp, read before the call, stays a
        lower bound of the version that samples it (staleness is over-, never under-counted).

        Raises:
            RejectedRequestError: vLLM refused the prompt (HTTP 4xx).
            GenerationError: another non-200 answer or a body without token ids / logprobs.
            httpx.TimeoutException: the request exceeded timeout_s.
        """
        params = {
            "model": self.model() if callable(self.model) else self.model,
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
            params["seed"] = seed
        params.update(extra_body or {})
        if self.coalescer is None or seed is not None:  # a seeded request (evaluation, full_determinism) goes alone
            return (await self.generate_batch([prompt_ids], params))[0]
        return await self.coalescer.submit(prompt_ids, params, seqs=n)

    async def generate_batch(self, prompts: list[list[int]], params: dict) -> list[list[Completion]]:
        """One `/v1/completions` call for several tokenized prompts with the same sampling parameters.

        Args:
            prompts: B token-id prompts, each (P_b,).
            params: the request body's fields but `prompt` (model, n, max_tokens, logprobs, ...).

        Returns:
            B lists of n `Completion`s, in the order of `prompts` (vLLM numbers the choices prompt-major:
            index = b * n + j).

        Raises:
            RejectedRequestError: HTTP 4xx (the whole request refused).
            GenerationError: another non-200 answer, a malformed body, or not B x n choices.
            httpx.TimeoutException: the request exceeded timeout_s.
        """
        body = {**params, "prompt": prompts[0] if len(prompts) == 1 else prompts}
        resp = await self._http.post("/v1/completions", json=body)
        if resp.status_code != 200:
            error = RejectedRequestError if 400 <= resp.status_code < 500 else GenerationError
            raise error(f"vLLM /v1/completions returned {resp.status_code}: {resp.text[:500]}")
        completions = parse_completions(resp.json())
        n = int(params.get("n", 1))
        if len(completions) != len(prompts) * n:
            raise GenerationError(f"vLLM returned {len(completions)} choices for {len(prompts)} prompts x n={n}")
        return [completions[b * n : (b + 1) * n] for b in range(len(prompts))]

    async def aclose(self) -> None:
        """Cancel coalesced requests still waiting, then close the connection pool."""
        if self.coalescer is not None:
            await self.coalescer.aclose()
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
            raise GenerationError(
                "vLLM response lacks token_ids or logprobs; is this vLLM >= 0.10 with return_token_ids?"
            )
        if len(ids) != len(lp):
            raise GenerationError(f"vLLM returned {len(ids)} token ids but {len(lp)} logprobs")
        out.append(
            Completion(list(ids), [float(x) for x in lp], choice.get("text", ""), choice.get("finish_reason") or "stop")
        )
    return out


class VLLMControlClient:
    """Sync client for the dev-mode control plane (`VLLM_SERVER_DEV_MODE=1`).

    Args:
        base_url: server URL.
        timeout_s: per-call timeout (seconds).
        api_key: bearer token; None reads env VLLM_API_KEY (unset: none).
    """

    def __init__(self, base_url: str, timeout_s: float = 60.0, api_key: str | None = None):
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.headers = auth_headers(api_key)

    def _call(self, method: str, path: str, **kw) -> dict:
        resp = requests.request(method, f"{self.base_url}{path}", timeout=self.timeout_s, headers=self.headers, **kw)
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
    `next_version` before each push so the server reports the policy version it serves. vLLM's client
    sends no headers, so `_post` (its one HTTP call; a test pins its signature) adds the bearer token of
    env VLLM_API_KEY when set.
    """

    next_version: str | None = None

    def _post(self, path: str, json: dict | None = None) -> None:
        """POST `json` to `/<path>` with the bearer token; raises requests.HTTPError on a non-2xx answer."""
        response = requests.post(f"{self.base_url}/{path}", json=json, timeout=self.timeout, headers=auth_headers())
        response.raise_for_status()

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Finish the update, tagging it with `weight_version` or `next_version`."""
        super().finish_weight_update(weight_version if weight_version is not None else self.next_version)


@dataclass
class InferenceEndpoint:
    """The inference server a run generates with and pushes weights to.

    Attributes:
        url: base URL, e.g. http://127.0.0.1:8000.
        served_model: the model id requests name; None: ask the server (`/v1/models`) once it is ready.
        launched: True when this run started the server from the policy's model folder (it then serves exactly
            the trainer's starting weights); False for an attached server whose weights are unknown.
        wait_ready: blocks until the server answers (raises when it cannot); a no-op for an attached server.
        restart: brings a launched server back when it is down (blocks until healthy; the local backend's
            `VLLMServer.restart_if_down`); None for a server someone else runs (a Kubernetes Deployment restarts
            its pod): `recover` then waits for its `/health`.
        rediscover: for a replica found through DNS (a Kubernetes pod behind the headless Service): returns the URL
            of the pod that replaced it (an address no other replica uses), or None while there is none.
    """

    url: str
    served_model: str | None = None
    launched: bool = False
    wait_ready: Callable[[], None] = lambda: None
    restart: Callable[[], object] | None = None
    rediscover: Callable[[], str | None] | None = None

    def recover(self, timeout_s: float) -> None:
        """Block until the server answers `/health` again: restart it when this run launched it, else wait up to
        `timeout_s` seconds for whoever runs it.

        Raises:
            TimeoutError: an attached server did not answer within `timeout_s` seconds.
            VLLMStartupError: a restarted server did not come up.
        """
        if self.restart is not None:
            self.restart()
            return
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            candidates = [self.url] + ([u for u in [self.rediscover()] if u] if self.rediscover else [])
            for url in candidates:
                try:
                    if requests.get(f"{url}/health", timeout=5, headers=auth_headers()).status_code == 200:
                        self.url = url  # a replaced pod answers at its new address
                        return
                except requests.RequestException:
                    pass
            time.sleep(1.0)
        raise TimeoutError(
            f"the vLLM server at {self.url} did not answer /health within {timeout_s:.0f} s. Fix: "
            "check its pod or process and log, or raise vllm_recovery_timeout_s"
        )

    def model_name(self, timeout_s: float = 60.0) -> str:
        """`served_model`, or the server's first served model id (one HTTP call, `timeout_s` seconds)."""
        return self.served_model or VLLMControlClient(self.url, timeout_s=timeout_s).models()[0]
