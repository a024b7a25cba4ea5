"""Container image references, parsed as the registry does (`docker-image-py`, a port of distribution/reference).

The platform policy allows images by exact reference or by prefix. Comparing strings lets a reference through
that the container runtime reads differently (a trailing newline after a digest, a registry whose name merely
starts with the allowed one: `reg.corp.evil.com/x` against `reg.corp`). So a reference is parsed into registry,
repository path, tag and digest, must print back to exactly the string given (fully qualified, nothing trailing),
and a prefix matches by registry and whole path segments.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from docker_image.digest import InvalidDigest
from docker_image.reference import InvalidReference, Reference

DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}")


class BadImageReference(ValueError):
    """An image reference that does not parse, or is not written in its fully qualified form."""


@dataclass(frozen=True)
class ImageRef:
    """A parsed image reference.

    Attributes:
        registry: the registry host (and port), lower-cased, e.g. "ghcr.io".
        path: the repository path, e.g. "async-grpo/trainer".
        tag: the tag, or None.
        digest: "sha256:<64 hex>", or None.
    """

    registry: str
    path: str
    tag: str | None
    digest: str | None

    @property
    def pinned(self) -> bool:
        """True when the reference carries a sha256 digest."""
        return self.digest is not None and DIGEST_RE.fullmatch(self.digest) is not None


def parse_image_ref(ref: object) -> ImageRef:
    """Parse a fully qualified reference `registry/path[:tag][@sha256:digest]`.

    Raises:
        BadImageReference: not a string, not a valid reference, or not written in the form it parses to (a short
            name like `ubuntu`, upper case, trailing characters); the message names the fix.
    """
    if not isinstance(ref, str):
        raise BadImageReference(f"image {ref!r} is not a string. Fix: give registry/path[:tag]@sha256:<digest>.")
    try:
        parsed = Reference.parse_normalized_named(ref)
    except (InvalidReference, InvalidDigest) as err:
        raise BadImageReference(
            f"image {ref!r} is not a valid reference ({err or type(err).__name__}). Fix: give "
            "registry/path[:tag]@sha256:<digest>."
        ) from None
    if parsed.string() != ref:
        raise BadImageReference(
            f"image {ref!r} is not written in full (it reads as {parsed.string()!r}). Fix: give "
            "the fully qualified reference, with nothing before or after it."
        )
    return ImageRef(parsed.domain().lower(), parsed.path(), parsed["tag"], parsed["digest"])


def prefix_covers(prefix: str, ref: ImageRef) -> bool:
    """True when the policy prefix `registry[/path...][/]` names `ref`'s registry and a leading run of whole path
    segments of it (`ghcr.io/async-grpo/` covers `ghcr.io/async-grpo/trainer`, not `ghcr.io/async-grpo-x/t`)."""
    registry, _, path = prefix.strip("/").partition("/")
    if registry.lower() != ref.registry:
        return False
    return not path or ref.path == path or ref.path.startswith(path + "/")
