"""Several vLLM replicas behind one run: which replica serves the next generation request, and which are live.

A run generates with `vllm_replicas` servers (N local processes, or the N pods of the vLLM Deployment behind its
headless Service). `ReplicaSet` holds their state; `BalancedClient` (a `GenerationClient`) sends each request to the
live replica with the fewest requests in flight, and when a replica fails at the transport level (its process or
pod is gone) it marks that replica lost and sends the same request to another one, so a dead replica costs no
group. Only when no replica is left does the error reach the orchestrator, which then parks groups until the
runner recovers the servers (`runner.recovery`). Weight pushes reach every live replica
(`transports.weights.replicas.ReplicaPusher`); a lost replica is brought back in the background and rejoins at the
next push, once it holds the current weights.

Replica states:
    available: serves requests and receives every push.
    syncing: a weight push to it is in progress; requests prefer other replicas (it would only queue them).
    lost: failed; excluded from requests and pushes until it is recovered.
    recovering: a background recovery (restart, or waiting for its pod) is running.
    ready: recovered and answering, but behind: it rejoins at the next push, with the full current weights.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx

from async_grpo.inference.client import AsyncVLLMClient, Completion, InferenceEndpoint

logger = logging.getLogger(__name__)

TRANSPORT_ERRORS = (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)
"""httpx errors that mean the server process is gone (the request never got an HTTP answer)."""


@dataclass
class Replica:
    """One vLLM server of the run.

    Attributes:
        index: position in the replica set (0-based; names its metrics `inference/replica_<index>/*`).
        endpoint: its URL, how to wait for it and how to bring it back.
        state: available, syncing, lost, recovering or ready (see the module docstring).
        in_flight: generation requests sent to it and not yet answered.
        requests: generation requests it answered (cumulative).
        restarts: recoveries of this replica so far.
        reason: why it was last marked lost.
    """

    index: int
    endpoint: InferenceEndpoint
    state: str = "available"
    in_flight: int = 0
    requests: int = 0
    restarts: int = 0
    reason: str = ""
    thread: threading.Thread | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        """The replica's base URL (may change when a Kubernetes pod is replaced)."""
        return self.endpoint.url


class ReplicaSet:
    """The run's vLLM replicas and their states (thread-safe: the orchestrator's event loop and the trainer's thread
    both use it).

    Args:
        endpoints: one per replica, in order; at least one.

    Raises:
        ValueError: no endpoints.
    """

    def __init__(self, endpoints: list[InferenceEndpoint]):
        if not endpoints:
            raise ValueError("a replica set needs at least one vLLM endpoint")
        self.replicas = [Replica(i, e) for i, e in enumerate(endpoints)]
        self.lock = threading.Lock()
        self.rerouted = 0  # requests sent again to another replica after theirs failed
        # vLLM's own speed (issue 9: generation/tokens_per_s is the step's tokens over the step's wall time):
        # seconds with at least one request in flight, and the tokens those requests generated
        self.generating_s = 0.0
        self.generated_tokens = 0
        self._busy_since: float | None = None
        self._rate_mark = (0.0, 0)  # (generating_s, generated_tokens) at the previous metrics() call

    @classmethod
    def of(cls, endpoints: InferenceEndpoint | list[InferenceEndpoint]) -> ReplicaSet:
        """A set from one endpoint or a list of them."""
        return cls(endpoints if isinstance(endpoints, list) else [endpoints])

    def __len__(self) -> int:
        return len(self.replicas)

    @property
    def url(self) -> str:
        """The first replica's URL (what single-server messages name)."""
        return self.replicas[0].url

    @property
    def urls(self) -> str:
        """Every replica's URL, comma-separated (for messages)."""
        return ", ".join(r.url for r in self.replicas)

    def in_state(self, *states: str) -> list[Replica]:
        """The replicas currently in one of `states`."""
        with self.lock:
            return [r for r in self.replicas if r.state in states]

    def live(self) -> list[Replica]:
        """Replicas that serve requests (available or syncing)."""
        return self.in_state("available", "syncing")

    def pick(self) -> Replica | None:
        """The replica for the next request: the available one with the fewest requests in flight (ties: the lowest
        index), else a syncing one (its request waits out the push), else None (no replica is live). Counts the
        request as in flight; the caller must call `done` once it is answered."""
        with self.lock:
            for states in (("available",), ("syncing",)):
                candidates = [r for r in self.replicas if r.state in states]
                if candidates:
                    chosen = min(candidates, key=lambda r: (r.in_flight, r.index))
                    if self._busy_since is None:
                        self._busy_since = time.monotonic()
                    chosen.in_flight += 1
                    return chosen
        return None

    def done(self, replica: Replica, *, answered: bool, tokens: int = 0) -> None:
        """A request sent to `replica` ended (`answered`: it got an HTTP answer, with `tokens` generated tokens)."""
        with self.lock:
            replica.in_flight -= 1
            replica.requests += int(answered)
            self.generated_tokens += tokens
            if self._busy_since is not None and not any(r.in_flight for r in self.replicas):
                self.generating_s += time.monotonic() - self._busy_since
                self._busy_since = None

    def mark_lost(self, replica: Replica, reason: str) -> None:
        """Exclude `replica` from requests and pushes (idempotent; logged once per loss)."""
        with self.lock:
            if replica.state in ("available", "syncing", "ready"):
                replica.state, replica.reason = "lost", reason
                logger.warning("vLLM replica %d at %s lost: %s", replica.index, replica.url, reason)

    def set_state(self, replica: Replica, state: str) -> None:
        """Move `replica` to `state` (the pusher and the recoveries drive these transitions)."""
        with self.lock:
            replica.state = state

    def metrics(self) -> dict[str, float]:
        """Per-replica gauges and counters: `inference/replica_<i>/available` (1 or 0), `.../in_flight`,
        `.../requests` (cumulative), `.../restarts`; plus `inference/live_replicas`, `inference/rerouted_requests`,
        `inference/generating_s` (cumulative seconds with at least one generation request in flight) and
        `generation/vllm_tokens_per_s` (tokens generated per second of that time since the previous call: vLLM's
        own speed, where `generation/tokens_per_s` divides by the step's wall time).
        """
        with self.lock:
            busy = self.generating_s + (time.monotonic() - self._busy_since if self._busy_since is not None else 0.0)
            busy0, tokens0 = self._rate_mark
            self._rate_mark = (busy, self.generated_tokens)
            out = {
                "inference/live_replicas": float(sum(r.state in ("available", "syncing") for r in self.replicas)),
                "inference/rerouted_requests": float(self.rerouted),
                "inference/generating_s": busy,
                "generation/vllm_tokens_per_s": (self.generated_tokens - tokens0) / max(busy - busy0, 1e-9),
            }
            if len(self.replicas) > 1:
                for r in self.replicas:
                    prefix = f"inference/replica_{r.index}/"
                    out.update(
                        {
                            prefix + "available": float(r.state in ("available", "syncing")),
                            prefix + "in_flight": float(r.in_flight),
                            prefix + "requests": float(r.requests),
                            prefix + "restarts": float(r.restarts),
                        }
                    )
        return out


class BalancedClient:
    """A `GenerationClient` over a `ReplicaSet`: least-in-flight balancing, and failover to another replica when
    the chosen one is gone. Build it inside the event loop that uses it.

    Args:
        replicas: the run's replica set.
        model: served model id (the same on every replica).
        timeout_s: per-request timeout (seconds).
        coalesce_window_s: each replica's `AsyncVLLMClient.coalesce_window_s` (seconds; 0: every request alone).
    """

    def __init__(self, replicas: ReplicaSet, model: str, timeout_s: float = 120.0, coalesce_window_s: float = 0.0):
        self.replicas = replicas
        self.model = model
        self.timeout_s = timeout_s
        self.coalesce_window_s = coalesce_window_s
        self._clients: dict[tuple[int, str], AsyncVLLMClient] = {}

    def _client(self, replica: Replica) -> AsyncVLLMClient:
        key = (replica.index, replica.url)  # a replaced pod has a new URL: a new connection pool
        if key not in self._clients:
            self._clients[key] = AsyncVLLMClient(
                replica.url, self.model, timeout_s=self.timeout_s, coalesce_window_s=self.coalesce_window_s
            )
        return self._clients[key]

    async def generate(self, prompt_ids: list[int], **kwargs) -> list[Completion]:
        """`AsyncVLLMClient.generate` on the least-loaded live replica; on a transport error the replica is marked
        lost and the request goes to another live one.

        Raises:
            httpx.ConnectError (or the last transport error): no replica is live; the orchestrator then parks the
                group until the runner recovers the servers.
            GenerationError, httpx.TimeoutException: as `AsyncVLLMClient.generate` (not retried elsewhere).
        """
        last: Exception | None = None
        for _attempt in range(len(self.replicas) + 1):
            replica = self.replicas.pick()
            if replica is None:
                break
            answered, tokens = False, 0
            try:
                out = await self._client(replica).generate(prompt_ids, **kwargs)
                answered, tokens = True, sum(len(c.token_ids) for c in out)
                return out
            except TRANSPORT_ERRORS as err:
                last = err
                self.replicas.mark_lost(replica, f"a generation request failed: {err!r}")
                with self.replicas.lock:
                    self.replicas.rerouted += 1
            finally:
                self.replicas.done(replica, answered=answered, tokens=tokens)
        if last is not None:
            raise last
        raise httpx.ConnectError(f"no live vLLM replica (of {len(self.replicas)}: {self.replicas.urls})")

    async def aclose(self) -> None:
        """Close every replica's connection pool."""
        for client in self._clients.values():
            await client.aclose()
        self._clients.clear()


def replica_urls(url: str, replicas: int, timeout_s: float, resolve=socket.getaddrinfo) -> list[str]:
    """The base URLs of an attached run's `replicas` vLLM servers.

    `url` is either a comma-separated list of exactly `replicas` URLs, or one URL whose host name resolves to the
    replicas' addresses (the Kubernetes headless Service of the vLLM Deployment: one A record per ready pod); it is
    resolved until `replicas` distinct addresses answer, for at most `timeout_s` seconds.

    Returns:
        `replicas` base URLs without a trailing slash, sorted by address.

    Raises:
        ValueError: a list whose length is not `replicas`.
        TimeoutError: fewer than `replicas` addresses after `timeout_s` seconds (the message names the fix).
    """
    urls = [u.strip().rstrip("/") for u in url.split(",") if u.strip()]
    if len(urls) > 1 or replicas == 1:
        if len(urls) != replicas:
            raise ValueError(
                f"vllm_url lists {len(urls)} servers but vllm_replicas={replicas}. Fix: list exactly "
                "vllm_replicas URLs, or give one host name that resolves to every replica"
            )
        return urls
    parts = urlsplit(urls[0])
    deadline = time.monotonic() + timeout_s
    while True:
        addresses = _addresses(parts.hostname or "", parts.port or 80, resolve)
        if len(addresses) >= replicas:
            return [f"{parts.scheme}://{_host(a)}:{parts.port or 80}" for a in sorted(addresses)[:replicas]]
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"{parts.hostname} resolves to {len(addresses)} address(es) {sorted(addresses)}, not "
                f"vllm_replicas={replicas}, after {timeout_s:.0f} s. Fix: check the vLLM pods (kubectl "
                "get pods) or lower vllm_replicas"
            )
        time.sleep(2.0)


def _addresses(host: str, port: int, resolve) -> set[str]:
    try:
        return {info[4][0] for info in resolve(host, port, type=socket.SOCK_STREAM)}
    except OSError:
        return set()


def _host(address: str) -> str:
    return f"[{address}]" if ":" in address else address


def attached_endpoints(
    url: str, replicas: int, timeout_s: float, resolve=socket.getaddrinfo
) -> list[InferenceEndpoint]:
    """Endpoints for servers this run attaches to (`vllm_url`; see `replica_urls`). Replicas found through DNS can
    rediscover a replaced pod (`InferenceEndpoint.rediscover`).

    Raises:
        ValueError, TimeoutError: as `replica_urls`.
    """
    urls = replica_urls(url, replicas, timeout_s, resolve)
    endpoints = [InferenceEndpoint(u) for u in urls]
    if replicas > 1 and "," not in url:
        for endpoint in endpoints:
            endpoint.rediscover = lambda me=endpoint: rediscover(url, me, endpoints, resolve)
    return endpoints


def rediscover(
    url: str, endpoint: InferenceEndpoint, endpoints: list[InferenceEndpoint], resolve=socket.getaddrinfo
) -> str | None:
    """A replaced pod's new URL: an address that `url`'s host name resolves to now and that no endpoint other than
    `endpoint` uses (None while there is none)."""
    parts = urlsplit(url.split(",")[0].strip())
    taken = {urlsplit(e.url).hostname for e in endpoints if e is not endpoint}
    fresh = sorted(a for a in _addresses(parts.hostname or "", parts.port or 80, resolve) if a not in taken)
    return f"{parts.scheme}://{_host(fresh[0])}:{parts.port or 80}" if fresh else None
