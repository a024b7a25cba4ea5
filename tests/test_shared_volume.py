"""`async_grpo.shared_volume`: what a tenant can plant on the shared volume (links in a path or inside a tree, links to
a secret outside the root, `..`, FIFOs, hard links, a pre-made run folder, a link swapped in after a check) is refused
with an error naming the path, and nothing is read through it; ordinary trees are copied whole."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from async_grpo import shared_volume
from async_grpo.shared_volume import (
    UnsafeVolumePath,
    copy_tree,
    list_dir,
    make_run_dir,
    private_dir,
    read_bytes,
    read_text,
    remove_tree,
)

SECRET = b"token-of-the-pods-service-account"


@pytest.fixture
def volume(tmp_path) -> Path:
    """A fake workspace volume holding one run's final model (two files, one nested)."""
    root = tmp_path / "workspace"
    model = root / "run-1" / "final-model"
    (model / "tokenizer").mkdir(parents=True)
    (model / "config.json").write_text('{"model_type": "tiny"}')
    (model / "model.safetensors").write_bytes(bytes(range(256)) * 4096)
    (model / "tokenizer" / "vocab.txt").write_text("a\nb\n")
    os.chmod(model / "config.json", 0o640)
    return root


@pytest.fixture
def secret(tmp_path) -> Path:
    """A credential outside the volume (as /var/run/secrets/.../token is)."""
    path = tmp_path / "secrets" / "token"
    path.parent.mkdir()
    path.write_bytes(SECRET)
    return path


def _all_bytes(folder: Path, *, but: Path | None = None) -> bytes:
    """Every regular file's bytes under `folder` (links not followed), but the file `but`."""
    return b"".join(
        p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file() and not p.is_symlink() and p != but
    )


# ---------------------------------------------------------------------------------------------- the happy path
def test_a_copy_holds_every_file_with_its_content_mode_and_time(volume, tmp_path):
    src = volume / "run-1" / "final-model"
    dst = copy_tree(src, tmp_path / "copy", root=volume)
    assert dst == tmp_path / "copy"
    got = sorted(str(p.relative_to(dst)) for p in dst.rglob("*"))
    assert got == ["config.json", "model.safetensors", "tokenizer", "tokenizer/vocab.txt"]
    for rel in ("config.json", "model.safetensors", "tokenizer/vocab.txt"):
        assert (dst / rel).read_bytes() == (src / rel).read_bytes()
    assert stat.S_IMODE((dst / "config.json").stat().st_mode) == 0o640
    assert (dst / "config.json").stat().st_mtime_ns == (src / "config.json").stat().st_mtime_ns


def test_a_copy_may_fill_an_empty_private_folder_but_never_a_full_one(volume, tmp_path):
    (tmp_path / "empty").mkdir()
    copy_tree(volume / "run-1" / "final-model", tmp_path / "empty", root=volume)
    assert (tmp_path / "empty" / "config.json").is_file()
    with pytest.raises(FileExistsError):
        copy_tree(volume / "run-1" / "final-model", tmp_path / "empty", root=volume)


def test_read_and_list_on_the_volume(volume):
    model = volume / "run-1" / "final-model"
    assert read_text(model / "config.json", root=volume) == '{"model_type": "tiny"}'
    assert read_bytes(model / "tokenizer" / "vocab.txt", root=volume) == b"a\nb\n"
    assert list_dir(model, root=volume) == ["config.json", "model.safetensors", "tokenizer"]
    assert list_dir(volume, root=volume) == ["run-1"]
    with pytest.raises(UnsafeVolumePath, match="more than 10"):
        read_bytes(model / "config.json", root=volume, max_bytes=10)
    with pytest.raises(FileNotFoundError):
        read_bytes(model / "missing.json", root=volume)


def test_a_root_reached_through_a_link_of_the_callers_own_is_fine(volume, tmp_path):
    """The root is the caller's (macOS's /tmp is a link): only what lies below it must hold no link."""
    alias = tmp_path / "alias"
    alias.symlink_to(volume)
    assert read_bytes(alias / "run-1" / "final-model" / "tokenizer" / "vocab.txt", root=alias) == b"a\nb\n"


# ---------------------------------------------------------------------------------------------- links
def test_a_link_inside_the_tree_is_refused_and_nothing_is_copied(volume, secret, tmp_path):
    """Finding 5's shape: a link to a credential planted in the model folder."""
    planted = volume / "run-1" / "final-model" / "tokenizer" / "special_tokens.json"
    planted.symlink_to(secret)
    with pytest.raises(UnsafeVolumePath) as err:
        copy_tree(volume / "run-1" / "final-model", tmp_path / "copy", root=volume)
    assert str(planted) in str(err.value) and "symbolic link" in str(err.value) and "Fix:" in str(err.value)
    assert err.value.path == str(planted)
    assert not (tmp_path / "copy").exists()  # the partial copy is removed
    assert SECRET not in _all_bytes(tmp_path, but=secret)


def test_a_link_to_a_folder_inside_the_tree_is_refused(volume, secret, tmp_path):
    (volume / "run-1" / "final-model" / "secrets").symlink_to(secret.parent)
    with pytest.raises(UnsafeVolumePath, match="secrets is a symbolic link"):
        copy_tree(volume / "run-1" / "final-model", tmp_path / "copy", root=volume)
    assert not (tmp_path / "copy").exists()


def test_a_link_in_the_path_is_refused(volume, tmp_path):
    """The run folder replaced by a link (to another folder holding a `final-model`) is never followed."""
    elsewhere = tmp_path / "elsewhere"
    (volume / "run-1").rename(elsewhere)
    (volume / "run-1").symlink_to(elsewhere)
    for call in (
        lambda: copy_tree(volume / "run-1" / "final-model", tmp_path / "copy", root=volume),
        lambda: read_bytes(volume / "run-1" / "final-model" / "config.json", root=volume),
        lambda: list_dir(volume / "run-1" / "final-model", root=volume),
        lambda: make_run_dir(volume / "run-1" / "staging", root=volume),
        lambda: remove_tree(volume / "run-1" / "final-model", root=volume),
    ):
        with pytest.raises(UnsafeVolumePath, match=f"{volume / 'run-1'} is a symbolic link"):
            call()
    assert (elsewhere / "final-model" / "config.json").is_file()  # not removed through the link
    assert not (elsewhere / "staging").exists()


def test_a_link_as_the_file_read_is_refused(volume, secret):
    (volume / "token").symlink_to(secret)
    with pytest.raises(UnsafeVolumePath, match="token is a symbolic link"):
        read_bytes(volume / "token", root=volume)


def test_the_secret_itself_and_dotdot_escapes_are_outside_the_root(volume, secret):
    with pytest.raises(UnsafeVolumePath, match="outside the volume root"):
        read_bytes(secret, root=volume)
    escape = volume / "run-1" / ".." / ".." / "secrets" / "token"
    with pytest.raises(UnsafeVolumePath, match="names '..'"):
        read_bytes(escape, root=volume)
    with pytest.raises(UnsafeVolumePath, match="names '..'"):
        copy_tree(volume / "run-1" / "..", volume.parent / "copy", root=volume)
    with pytest.raises(UnsafeVolumePath, match="outside the volume root"):
        make_run_dir(volume.parent / "workspacex" / "run", root=volume)


def test_a_link_swapped_in_after_the_check_is_still_not_followed(volume, secret, tmp_path, monkeypatch):
    """The race: the entry is a real file at its last check, a link to the secret when opened. O_NOFOLLOW refuses
    it (the walk's stat and the file's own check both pass; the swap comes right before the open)."""
    model = volume / "run-1" / "final-model"
    real_stat = os.stat
    checks = []

    def swapping_stat(path, *args, **kwargs):
        result = real_stat(path, *args, **kwargs)
        if path == "config.json" and kwargs.get("dir_fd") is not None:
            checks.append(stat.S_ISREG(result.st_mode))
            if len(checks) == 2:  # the check right before the open
                (model / "config.json").unlink()
                (model / "config.json").symlink_to(secret)
        return result

    monkeypatch.setattr(shared_volume.os, "stat", swapping_stat)
    with pytest.raises(UnsafeVolumePath, match="config.json is a symbolic link"):
        copy_tree(model, tmp_path / "copy", root=volume)
    assert checks[:2] == [True, True]  # both checks saw a regular file: the open itself refused the link
    assert not (tmp_path / "copy").exists()


def test_a_folder_swapped_for_a_link_after_the_check_is_not_followed(volume, secret, tmp_path, monkeypatch):
    model = volume / "run-1" / "final-model"
    real_stat = os.stat

    def swapping_stat(path, *args, **kwargs):
        result = real_stat(path, *args, **kwargs)
        if path == "tokenizer" and kwargs.get("dir_fd") is not None and not (model / "tokenizer").is_symlink():
            (model / "tokenizer").rename(tmp_path / "moved")
            (model / "tokenizer").symlink_to(secret.parent)
        return result

    monkeypatch.setattr(shared_volume.os, "stat", swapping_stat)
    with pytest.raises(UnsafeVolumePath, match="tokenizer is a symbolic link"):
        copy_tree(model, tmp_path / "copy", root=volume)
    assert SECRET not in _all_bytes(tmp_path / "workspace")


# ---------------------------------------------------------------------------------------------- special files
def test_a_fifo_is_refused_without_blocking(volume, tmp_path):
    fifo = volume / "run-1" / "final-model" / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(UnsafeVolumePath, match="pipe is a FIFO"):
        copy_tree(volume / "run-1" / "final-model", tmp_path / "copy", root=volume)
    with pytest.raises(UnsafeVolumePath, match="pipe is a FIFO"):
        read_bytes(fifo, root=volume)
    with pytest.raises(UnsafeVolumePath, match="pipe is a FIFO"):
        list_dir(fifo, root=volume)


def test_a_socket_is_refused(volume, tmp_path):
    import socket

    path = tmp_path / "s"  # AF_UNIX paths are short: bind here, then move the socket onto the volume
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(path))
        path.rename(volume / "run-1" / "final-model" / "sock")
        with pytest.raises(UnsafeVolumePath, match="sock is a socket"):
            copy_tree(volume / "run-1" / "final-model", tmp_path / "copy", root=volume)


def test_a_hard_link_is_refused(volume, tmp_path):
    """A second name may lie outside the root (on the same filesystem: another run's file)."""
    other = volume / "other-run-file"
    other.write_bytes(b"another run's data")
    os.link(other, volume / "run-1" / "final-model" / "extra.bin")
    with pytest.raises(UnsafeVolumePath, match="extra.bin is a hard link"):
        copy_tree(volume / "run-1" / "final-model", tmp_path / "copy", root=volume)
    with pytest.raises(UnsafeVolumePath, match="hard link"):
        read_bytes(other, root=volume)


def test_a_tree_nested_too_deep_is_refused(volume, tmp_path):
    deep = volume / "run-1" / "final-model"
    for _ in range(shared_volume.MAX_DEPTH + 1):
        deep = deep / "d"
    deep.mkdir(parents=True)
    with pytest.raises(UnsafeVolumePath, match="deeper than"):
        copy_tree(volume / "run-1" / "final-model", tmp_path / "copy", root=volume)


# ---------------------------------------------------------------------------------------------- creating
def test_a_run_folder_is_created_exclusively(volume):
    made = make_run_dir(volume / "run-2" / "warm-start", root=volume)
    assert made.is_dir() and not made.is_symlink()
    with pytest.raises(UnsafeVolumePath, match="already exists"):
        make_run_dir(volume / "run-2" / "warm-start", root=volume)  # a tenant's pre-made folder
    assert make_run_dir(volume / "run-2" / "warm-start", root=volume, exist_ok=True) == made  # reuse, when legitimate
    with pytest.raises(UnsafeVolumePath, match="volume root itself"):
        make_run_dir(volume, root=volume)


def test_reuse_never_accepts_a_link(volume, tmp_path):
    (volume / "run-3").symlink_to(tmp_path)
    with pytest.raises(UnsafeVolumePath, match="run-3 is a symbolic link"):
        make_run_dir(volume / "run-3", root=volume, exist_ok=True)


def test_a_copy_onto_the_volume_is_new_and_never_written_through_a_link(volume, tmp_path, secret):
    src = volume / "run-1" / "final-model"
    dst = copy_tree(src, volume / "run-4" / "warm-start" / "m-v1", root=volume, dst_root=volume)
    assert read_bytes(dst / "config.json", root=volume) == (src / "config.json").read_bytes()
    with pytest.raises(UnsafeVolumePath, match="already exists"):  # planted before the copy: refused, not reused
        copy_tree(src, dst, root=volume, dst_root=volume)
    (volume / "run-5").symlink_to(secret.parent)
    with pytest.raises(UnsafeVolumePath, match="run-5 is a symbolic link"):
        copy_tree(src, volume / "run-5" / "staging", root=volume, dst_root=volume)
    assert sorted(os.listdir(secret.parent)) == ["token"]


def test_remove_tree_removes_links_inside_and_never_their_targets(volume, secret):
    staging = volume / "run-1" / "staging"
    staging.mkdir()
    (staging / "token").symlink_to(secret)
    assert remove_tree(staging, root=volume) is True
    assert not staging.exists() and secret.read_bytes() == SECRET
    assert remove_tree(staging, root=volume) is False
    assert remove_tree(volume / "no-such-run" / "staging", root=volume) is False


def test_a_private_folder_is_the_processs_own_and_off_the_volume(volume, monkeypatch):
    folder = private_dir("test")
    try:
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700 and folder.name.startswith("async-grpo-test-")
    finally:
        folder.rmdir()
    monkeypatch.setenv("TMPDIR", str(volume))
    monkeypatch.setattr("tempfile.tempdir", None)
    with pytest.raises(UnsafeVolumePath, match="is on the shared volume"):
        private_dir("test", volume_root=volume)
