"""Reading, copying, listing and creating on a tenant-writable folder (the shared workspace volume) without trusting it.

On a cluster every run's pods mount the same workspace volume read-write (`docs/security.md`, "The shared volume"),
so any file or folder on it may have been planted by another tenant, or swapped while a step works on it. A step
that followed a planted symbolic link `final-model/x -> /var/run/secrets/kubernetes.io/serviceaccount/token` while
copying would put its own ServiceAccount token into a KFP artifact anyone may download. Every read, copy, listing,
creation and deletion that a process holding credentials makes on such a folder goes through this module, which:

- keeps every path inside the volume root its caller names (`root`: a folder the platform chose, such as the
  workspace mount; it is resolved once, so a link in the platform's own path to it is allowed). A path that names
  `..` or lies outside the root is refused;
- never follows a symbolic link below the root: each component is opened with `O_NOFOLLOW` relative to its parent's
  descriptor (`dir_fd`), and a tree is walked by descriptors, so a link swapped in after a check is refused, not
  followed (there is no check-then-use window);
- reads only regular files with one name: the type and the link count are checked on the open descriptor
  (`fstat`). FIFOs (opened non-blocking, so one cannot hang the step), character and block devices and sockets are
  refused, and so is a regular file with `st_nlink > 1`: its other name may lie outside the root. (A hard link cannot
  cross filesystems, so it cannot reach a Secret's tmpfs or `/proc`; on the volume itself it could name another
  run's file. The files the platform copies, written once by `save_pretrained` or `datasets`, have one name.)
- creates folders exclusively (`make_run_dir`, `copy_tree`'s destination): one a tenant made first is refused, not
  reused, unless the caller says reuse is legitimate, and then only a real folder reached without links;
- gives the platform a folder of its own (`private_dir`: `tempfile.mkdtemp`, mode 0700, under TMPDIR, the pod's own
  disk) for what it must trust, such as a downloaded champion or a model before it is uploaded.

Every refusal is an `UnsafeVolumePath` (a ValueError) whose message names the path and the fix. Copies keep the
permission bits (`& 0o777`, the owner always keeping read and write) and the modification times; owners, set-id
bits and extended attributes are not copied.

What this does not guarantee: the content of a file. Anything on a shared read-write volume may be rewritten by
another tenant after the platform wrote or copied it; only a step-private copy (`private_dir`) is the platform's.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

__all__ = [
    "MAX_DEPTH",
    "UnsafeVolumePath",
    "copy_tree",
    "list_dir",
    "make_run_dir",
    "private_dir",
    "read_bytes",
    "read_text",
    "remove_tree",
]

MAX_DEPTH = 64  # folders a copied tree may nest (a planted tree nested deeper is refused, not recursed into)
_CHUNK = 1 << 20  # bytes per read when the kernel cannot copy file to file (sendfile)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_LINK_FIX = (
    "replace the link with the file or folder itself (a copy), or remove it; the platform never follows links on the "
    "shared volume"
)


class UnsafeVolumePath(ValueError):
    """A path on the shared volume the platform refuses to read, copy, list or create through.

    Attributes:
        path: the path refused (as the caller named it, joined with the entry met inside a tree).
        problem: what is wrong with it ("is a symbolic link to /etc/x", "is a FIFO", ...).
    """

    def __init__(self, path: str | os.PathLike, problem: str, fix: str = _LINK_FIX):
        self.path = os.fspath(path)
        self.problem = problem
        super().__init__(f"{self.path} {problem}: refused on the shared volume. Fix: {fix}.")


# ---------------------------------------------------------------------------------------------- walking by descriptors
def _below_root(path: str | os.PathLike, root: str | os.PathLike) -> tuple[str, list[str]]:
    """(the root's real path, the components of `path` below the root); refuses `..`, NUL and paths outside it."""
    raw, base = os.fspath(path), os.fspath(root)
    if "\x00" in raw or "\x00" in base:
        raise UnsafeVolumePath(repr(raw), "holds a NUL character", "name the path without it")
    if ".." in PurePosixPath(raw).parts:
        raise UnsafeVolumePath(raw, "names '..'", "name the path from the volume root down, without '..'")
    full = os.path.abspath(raw)  # no '..' left: this only joins the working folder and drops '.' and '//'
    real_root = os.path.realpath(base)
    for start in (os.path.abspath(base), real_root):
        if full == start:
            return real_root, []
        if full.startswith(start.rstrip("/") + "/"):
            return real_root, full[len(start) :].strip("/").split("/")
    raise UnsafeVolumePath(raw, f"lies outside the volume root {base}", f"name a path under {base}")


def _kind(mode: int) -> str:
    """A file type in words."""
    for test, words in (
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return words
    return "a special file"


def _refusal(dir_fd: int, name: str, shown: str, wanted: str) -> OSError | UnsafeVolumePath:
    """The error for the entry `name` of `dir_fd` (shown as `shown`) that could not be opened as `wanted`."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), shown)
    if stat.S_ISLNK(st.st_mode):
        try:
            target = os.readlink(name, dir_fd=dir_fd)
        except OSError:
            target = "?"
        return UnsafeVolumePath(shown, f"is a symbolic link (to {target})")
    if wanted == "a folder" and stat.S_ISREG(st.st_mode):
        return NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), shown)
    if wanted != "a folder" and stat.S_ISDIR(st.st_mode):
        return IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), shown)
    return UnsafeVolumePath(
        shown, f"is {_kind(st.st_mode)}, not {wanted}", f"put {wanted} there; the platform reads no special files"
    )


def _open_dir_at(dir_fd: int, name: str, shown: str) -> int:
    """A descriptor of the folder `name` in `dir_fd`, never through a link."""
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENOENT):
            raise _refusal(dir_fd, name, shown, "a folder") from None
        raise


def _open_path(parts: list[str], real_root: str, shown: str, *, create: bool = False) -> int:
    """A descriptor (the caller closes it) of the folder `real_root/parts...`, each component opened with O_NOFOLLOW
    from its parent's descriptor; `create`: a missing component is made first (mkdir relative to its parent), and
    a missing root too (the root is the caller's own path: a laptop's new output folder)."""
    if create:
        os.makedirs(real_root, exist_ok=True)
    fd = os.open(real_root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # the root itself is the caller's
    try:
        for i, name in enumerate(parts):
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, dir_fd=fd)
            child = _open_dir_at(fd, name, _shown(shown, parts, i))
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextlib.contextmanager
def _walk_to(parts: list[str], real_root: str, shown: str) -> Iterator[int]:
    """`_open_path` as a context: the descriptor is closed at the end of the block."""
    fd = _open_path(parts, real_root, shown)
    try:
        yield fd
    finally:
        os.close(fd)


def _shown(shown: str, parts: list[str], i: int) -> str:
    """The caller's path cut after component i of `parts` (for messages)."""
    cut = len(parts) - 1 - i
    path = PurePosixPath(shown)
    for _ in range(cut):
        path = path.parent
    return str(path)


@contextlib.contextmanager
def _parent_of(path: str | os.PathLike, root: str | os.PathLike) -> Iterator[tuple[int, str]]:
    """(a descriptor of `path`'s parent, reached without links, and the last component's name)."""
    real_root, parts = _below_root(path, root)
    if not parts:
        raise UnsafeVolumePath(path, "is the volume root itself", "name a file or folder under it")
    with _walk_to(parts[:-1], real_root, str(PurePosixPath(os.fspath(path)).parent)) as fd:
        yield fd, parts[-1]


def _open_file_at(dir_fd: int, name: str, shown: str) -> tuple[int, os.stat_result]:
    """(a read descriptor, its fstat) of the regular file `name` in `dir_fd`: no link, no special file, one name."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), shown) from None
    if not stat.S_ISREG(st.st_mode):  # never open a device, FIFO or socket at all
        raise _refusal(dir_fd, name, shown, "a regular file")
    try:
        fd = os.open(name, _FILE_FLAGS, dir_fd=dir_fd)
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.ENXIO, errno.ENOENT):  # swapped since the stat: still never followed
            raise _refusal(dir_fd, name, shown, "a regular file") from None
        raise
    st = os.fstat(fd)  # what was opened, whatever the name means now
    problem = None
    if not stat.S_ISREG(st.st_mode):
        problem = UnsafeVolumePath(shown, f"is {_kind(st.st_mode)}, not a regular file", "put a regular file there")
    elif st.st_nlink > 1:
        problem = UnsafeVolumePath(
            shown,
            f"is a hard link ({st.st_nlink} names; another may lie outside the volume root)",
            "replace it with a copy of the file (cp, not ln)",
        )
    if problem is not None:
        os.close(fd)
        raise problem
    return fd, st


# ---------------------------------------------------------------------------------------------- reading and listing
def read_bytes(path: str | os.PathLike, *, root: str | os.PathLike, max_bytes: int | None = None) -> bytes:
    """The bytes of the regular file `path` on the volume under `root`, reached and opened without following links.

    Args:
        path: the file (absolute, or relative to the working folder), under `root`.
        root: the volume root the path must stay inside (the workspace mount, a run's folder); resolved once.
        max_bytes: refuse a file larger than this many bytes (None: any size). Use it for small files (markers,
            configs), so a planted huge file cannot exhaust memory.

    Returns:
        The file's bytes.

    Raises:
        UnsafeVolumePath: `path` names `..` or lies outside `root`; a component is a symbolic link; the file is a
            FIFO, socket, device or folder, a hard link (`st_nlink > 1`), or larger than `max_bytes`.
        FileNotFoundError: `path` or a folder on the way does not exist.
        NotADirectoryError: a component on the way is a regular file.
    """
    with _parent_of(path, root) as (dir_fd, name):
        fd, st = _open_file_at(dir_fd, name, os.fspath(path))
    with os.fdopen(fd, "rb") as handle:
        if max_bytes is not None and st.st_size > max_bytes:
            raise UnsafeVolumePath(path, f"holds {st.st_size} bytes, more than {max_bytes}", "keep the file small")
        data = handle.read() if max_bytes is None else handle.read(max_bytes + 1)
    if max_bytes is not None and len(data) > max_bytes:
        raise UnsafeVolumePath(path, f"grew past {max_bytes} bytes while read", "keep the file small")
    return data


def read_text(
    path: str | os.PathLike, *, root: str | os.PathLike, encoding: str = "utf-8", max_bytes: int | None = None
) -> str:
    """`read_bytes(path, root=root, max_bytes=max_bytes)` decoded with `encoding`.

    Args:
        path: the file, under `root`.
        root: the volume root the path must stay inside.
        encoding: the text encoding.
        max_bytes: refuse a file larger than this many bytes (None: any size).

    Returns:
        The file's text.

    Raises:
        UnsafeVolumePath, FileNotFoundError, NotADirectoryError: as `read_bytes`.
        UnicodeDecodeError: the bytes are not `encoding`.
    """
    return read_bytes(path, root=root, max_bytes=max_bytes).decode(encoding)


def list_dir(path: str | os.PathLike, *, root: str | os.PathLike) -> list[str]:
    """The entry names of the folder `path` under `root` (sorted), the folder reached without following links.

    The names are listed, not checked: open each through this module (`read_bytes`, `copy_tree`), which refuses a
    link or special file among them.

    Args:
        path: the folder, under `root` (`root` itself lists the root).
        root: the volume root the path must stay inside.

    Returns:
        The names in the folder, sorted, without `.` and `..`.

    Raises:
        UnsafeVolumePath: `path` names `..` or lies outside `root`; it or a component is a symbolic link or a special
            file.
        FileNotFoundError: the folder does not exist.
        NotADirectoryError: `path` or a component is a regular file.
    """
    real_root, parts = _below_root(path, root)
    with _walk_to(parts, real_root, os.fspath(path)) as fd:
        return sorted(os.listdir(fd))


# ---------------------------------------------------------------------------------------------- creating and copying
def make_run_dir(path: str | os.PathLike, *, root: str | os.PathLike, exist_ok: bool = False) -> Path:
    """Create the folder `path` under `root`: missing parents are created, every existing one must be a real folder
    reached without links, and the folder itself is created exclusively.

    Reuse (`exist_ok=True`) is for callers whose folder may legitimately exist already (a laptop run called again
    with the same name); the existing folder must then be a real folder, not a link. Its owner is not checked: every
    pod of the namespace runs as the same UID (1000), so ownership would tell nothing about who made it. On the
    pipeline's path the run folder's name holds the KFP run id and is created exclusively, so a folder a tenant
    planted under that name is refused.

    Args:
        path: the folder to create, under `root`.
        root: the volume root the path must stay inside (created when missing: it is the caller's own path).
        exist_ok: accept an existing real folder instead of refusing it.

    Returns:
        `path` as an absolute Path. The guarantee holds at creation: anything opened later by this path (a trainer
        writing into it) opens it by name again.

    Raises:
        UnsafeVolumePath: `path` names `..`, lies outside `root` or is the root; a component is a symbolic link or
            a special file; the folder exists and `exist_ok` is false (the message says a tenant may have made it).
        NotADirectoryError: a component is a regular file.
    """
    real_root, parts = _below_root(path, root)
    shown = os.fspath(path)
    if not parts:
        raise UnsafeVolumePath(path, "is the volume root itself", "name a folder under it")
    parent = _open_path(parts[:-1], real_root, str(PurePosixPath(shown).parent), create=True)
    try:
        try:
            os.mkdir(parts[-1], dir_fd=parent)
        except FileExistsError:
            if stat.S_ISLNK(os.stat(parts[-1], dir_fd=parent, follow_symlinks=False).st_mode):
                raise _refusal(parent, parts[-1], shown, "a folder") from None
            if not exist_ok:
                raise UnsafeVolumePath(
                    shown,
                    "already exists, and this run's folder must be new (another tenant may have made it)",
                    "submit the run again (a new KFP run gets a new folder), or remove the folder",
                ) from None
        os.close(_open_dir_at(parent, parts[-1], shown))  # a real folder, not a link
    finally:
        os.close(parent)
    return Path(os.path.abspath(shown))


def copy_tree(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    root: str | os.PathLike,
    dst_root: str | os.PathLike | None = None,
) -> Path:
    """Copy the folder `src` (on the volume under `root`) to the new folder `dst`, never following a link: the safe
    replacement of `shutil.copytree` for a tenant-writable folder.

    The tree is walked by descriptors: each folder opened with O_NOFOLLOW from its parent, each file opened with
    O_NOFOLLOW and checked on its descriptor (a regular file with one name). A symbolic link anywhere (in `src`'s
    path below `root` or inside the tree), a FIFO, socket or device, a hard link, or a tree nested deeper than
    MAX_DEPTH folders stops the copy before anything is read through it, and the partial `dst` is removed, so
    nothing a link pointed at is ever copied. Files are copied up to the size they had when opened.

    Args:
        src: the folder to copy, under `root` (it may be `root` itself).
        dst: the folder to create. Without `dst_root` it is the caller's own (a `private_dir`, a KFP output
            artifact's path): its parent must exist, and it must not exist or be an empty real folder. With
            `dst_root` it lies on a shared volume: reached from `dst_root` without links (missing parents are
            created) and created exclusively.
        root: the volume root `src` must stay inside.
        dst_root: the volume root `dst` must stay inside, when `dst` is on a shared volume (created when missing);
            None: `dst` is private.

    Returns:
        `dst` as an absolute Path.

    Raises:
        UnsafeVolumePath: a path names `..` or lies outside its root; a link, special file or hard link in `src`;
            `src` deeper than MAX_DEPTH; `dst` on a shared volume exists already, or a link on its way.
        FileNotFoundError: `src` (or `dst`'s parent, when private) does not exist.
        FileExistsError: a private `dst` exists and is not an empty folder.
        NotADirectoryError: `src` or a component is a regular file.
    """
    shown_dst = os.fspath(dst)
    real_root, parts = _below_root(src, root)
    with _walk_to(parts, real_root, os.fspath(src)) as src_fd:
        src_mode = os.fstat(src_fd).st_mode
        if dst_root is None:
            full = os.path.abspath(shown_dst)
            parent_fd = os.open(os.path.dirname(full), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            name = os.path.basename(full)
        else:
            real_dst_root, dst_parts = _below_root(dst, dst_root)
            if not dst_parts:
                raise UnsafeVolumePath(dst, "is the volume root itself", "name a new folder under it")
            shown_parent = str(PurePosixPath(shown_dst).parent)
            parent_fd = _open_path(dst_parts[:-1], real_dst_root, shown_parent, create=True)
            name = dst_parts[-1]
        try:
            _make_dst(parent_fd, name, shown_dst, private=dst_root is None)
            try:
                dst_fd = _open_dir_at(parent_fd, name, shown_dst)
                try:
                    _copy_dir(src_fd, dst_fd, os.fspath(src), 0)
                    os.fchmod(dst_fd, (src_mode & 0o777) | 0o700)
                finally:
                    os.close(dst_fd)
            except BaseException:
                shutil.rmtree(name, ignore_errors=True, dir_fd=parent_fd)  # by descriptor: never follows a link
                raise
        finally:
            os.close(parent_fd)
    return Path(os.path.abspath(shown_dst))


def _make_dst(parent_fd: int, name: str, shown: str, *, private: bool) -> None:
    """Create the copy's top folder: exclusively, or (private) accept an empty real folder already there."""
    try:
        os.mkdir(name, 0o700, dir_fd=parent_fd)
        return
    except FileExistsError:
        if not private:
            raise UnsafeVolumePath(
                shown, "already exists on the shared volume (another tenant may have made it)", "use a new folder"
            ) from None
    fd = _open_dir_at(parent_fd, name, shown)
    try:
        if os.listdir(fd):
            raise FileExistsError(errno.EEXIST, "the copy's destination exists and is not empty", shown)
    finally:
        os.close(fd)


def _copy_dir(src_fd: int, dst_fd: int, shown: str, depth: int) -> None:
    """Copy the entries of folder `src_fd` into the empty folder `dst_fd`, recursively, refusing anything unsafe."""
    if depth >= MAX_DEPTH:
        raise UnsafeVolumePath(shown, f"is nested deeper than {MAX_DEPTH} folders", "flatten the tree")
    for name in sorted(os.listdir(src_fd)):
        entry = os.path.join(shown, name)
        try:
            st = os.stat(name, dir_fd=src_fd, follow_symlinks=False)
        except FileNotFoundError:
            raise FileNotFoundError(errno.ENOENT, "removed while copied", entry) from None
        if stat.S_ISDIR(st.st_mode):
            child = _open_dir_at(src_fd, name, entry)  # a link swapped in since the stat: refused, not followed
            try:
                os.mkdir(name, 0o700, dir_fd=dst_fd)
                out = os.open(name, _DIR_FLAGS, dir_fd=dst_fd)
                try:
                    _copy_dir(child, out, entry, depth + 1)
                    os.fchmod(out, (os.fstat(child).st_mode & 0o777) | 0o700)
                    os.utime(out, ns=(st.st_atime_ns, st.st_mtime_ns))
                finally:
                    os.close(out)
            finally:
                os.close(child)
        elif stat.S_ISREG(st.st_mode):
            _copy_file(src_fd, name, dst_fd, entry)
        else:
            raise _refusal(src_fd, name, entry, "a regular file or folder")


def _copy_file(src_fd: int, name: str, dst_fd: int, shown: str) -> None:
    """Copy the regular file `name` of `src_fd` (checked on its descriptor) to a new file of `dst_fd`."""
    fd, st = _open_file_at(src_fd, name, shown)
    try:
        out = os.open(name, _NEW_FILE_FLAGS, 0o600, dir_fd=dst_fd)
        try:
            _copy_bytes(fd, out, st.st_size)
            os.fchmod(out, (st.st_mode & 0o777) | 0o600)
            os.utime(out, ns=(st.st_atime_ns, st.st_mtime_ns))
        finally:
            os.close(out)
    finally:
        os.close(fd)


def _copy_bytes(src: int, dst: int, size: int) -> None:
    """Copy `size` bytes (fewer if the file shrank) from descriptor `src` to `dst`: sendfile, else read and write."""
    done = 0
    try:
        while done < size:
            sent = os.sendfile(dst, src, done, min(size - done, 1 << 30))
            if sent == 0:
                return
            done += sent
        return
    except OSError as err:
        if done or err.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise
    while done < size:
        chunk = os.pread(src, min(_CHUNK, size - done), done)
        if not chunk:
            return
        view = memoryview(chunk)
        while view:
            view = view[os.write(dst, view) :]
        done += len(chunk)


def remove_tree(path: str | os.PathLike, *, root: str | os.PathLike) -> bool:
    """Delete the folder `path` under `root` and everything in it, reached without links and removed by descriptor
    (`shutil.rmtree` with `dir_fd`, which never follows a link inside the tree: a link is removed, not its target).

    Args:
        path: the folder, under `root`.
        root: the volume root the path must stay inside.

    Returns:
        True when the folder was removed, False when it did not exist.

    Raises:
        UnsafeVolumePath: `path` names `..`, lies outside `root` or is the root; it or a component on the way is a
            symbolic link (so a planted link never makes the platform delete another folder) or not a folder.
        NotADirectoryError: a component on the way is a regular file.
    """
    try:
        with _parent_of(path, root) as (dir_fd, name):
            try:
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                return False
            if not stat.S_ISDIR(st.st_mode):
                raise _refusal(dir_fd, name, os.fspath(path), "a folder")
            shutil.rmtree(name, dir_fd=dir_fd)
            return True
    except FileNotFoundError:  # a parent is missing: nothing to remove
        return False


def private_dir(prefix: str = "step", *, volume_root: str | os.PathLike | None = None) -> Path:
    """A new folder only this process's user may use (`tempfile.mkdtemp`, mode 0700) under TMPDIR (on a cluster the
    pod's own /tmp, never the shared volume), for what the platform must trust: a downloaded champion, a model
    before its upload. The caller removes it (`shutil.rmtree`) when done; a pod's disk goes with the pod.

    Args:
        prefix: a word in the folder's name (`async-grpo-<prefix>-XXXXXXXX`).
        volume_root: the shared volume's root, when known: a TMPDIR pointing inside it is refused.

    Returns:
        The folder's absolute Path.

    Raises:
        UnsafeVolumePath: the folder would lie on the shared volume (TMPDIR points there).
    """
    base = os.path.realpath(tempfile.gettempdir())
    if volume_root is not None:
        volume = os.path.realpath(os.fspath(volume_root))
        if base == volume or base.startswith(volume.rstrip("/") + "/"):
            raise UnsafeVolumePath(base, "is on the shared volume", "point TMPDIR at the pod's own disk (/tmp)")
    return Path(tempfile.mkdtemp(prefix=f"async-grpo-{prefix}-", dir=base))
