"""HTTP URIs a cluster run sends credentials or rollouts to (MLflow, an external reward service), parsed once.

A check and the client that later connects must agree on the host. `requests` (MLflow's HTTP client) and
`httpx` split a URI differently from `urllib.parse.urlsplit` in corner cases: `http://evil\\@mlflow:5000` is
host `mlflow` to `urlsplit` and host `evil` to `urllib3.util.parse_url`, which `requests` uses. So a URI is parsed
here with `urllib3.util.parse_url` (the parser of the client that sends the credentials), refused when anything
about it is ambiguous (userinfo, backslashes, whitespace, control or non-ASCII characters, a query or fragment,
dot segments, or a host that `urlsplit` reads differently), and rebuilt from its parts. The policy compares the
rebuilt URI, and the pods get the rebuilt URI, never the submitter's string.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from urllib3.exceptions import LocationParseError
from urllib3.util import parse_url

DEFAULT_PORTS = {"http": 80, "https": 443}
_HOST_RE = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*")
_SEGMENT_RE = re.compile(r"[A-Za-z0-9._~!$&'()*+,;=:-]+")


class UnsafeURI(ValueError):
    """A URI that is malformed or ambiguous; the message says why and how to write it."""


@dataclass(frozen=True)
class HttpURI:
    """An http(s) URI as the client will use it.

    Attributes:
        scheme: "http" or "https".
        host: lower-case DNS name, IPv4 address, or IPv6 address in brackets.
        port: the explicit port, else the scheme's default (80, 443).
        path: "" or "/seg/seg" (no trailing slash, no dot segments).
        explicit_port: whether the URI named its port (kept when rebuilding).
    """

    scheme: str
    host: str
    port: int
    path: str
    explicit_port: bool

    def __str__(self) -> str:
        port = f":{self.port}" if self.explicit_port else ""
        return f"{self.scheme}://{self.host}{port}{self.path}"

    def covers(self, other: HttpURI) -> bool:
        """True when `other` has this URI's scheme, host and port and lies at or under its path (by segment)."""
        return (self.scheme, self.host, self.port) == (other.scheme, other.host, other.port) and (
            other.path + "/"
        ).startswith(self.path + "/")


def _refuse(uri: str, why: str) -> UnsafeURI:
    return UnsafeURI(f"{uri!r} {why}. Fix: write it as http(s)://host[:port][/path], e.g. http://mlflow:5000.")


def parse_http_uri(uri: object) -> HttpURI:
    """Parse `uri` as the HTTP client will, refusing anything ambiguous (module docstring).

    Raises:
        UnsafeURI: not a string; whitespace, control, non-ASCII or backslash characters; not http(s); userinfo;
            a query or fragment; a bad host or port; dot segments or unusual characters in the path; or a host
            or port on which `urllib.parse.urlsplit` and `urllib3.util.parse_url` disagree.
    """
    if not isinstance(uri, str) or not uri:
        raise _refuse(str(uri), "is not a URI")
    if any(c.isspace() or not 0x20 < ord(c) < 0x7F for c in uri):
        raise _refuse(uri, "holds whitespace, control or non-ASCII characters")
    if "\\" in uri:
        raise _refuse(uri, "holds a backslash, which HTTP clients read differently")
    try:
        parts = parse_url(uri)
    except LocationParseError as err:
        raise _refuse(uri, f"cannot be parsed ({err})") from None
    scheme = (parts.scheme or "").lower()
    if scheme not in DEFAULT_PORTS:
        raise _refuse(uri, "is not an http or https URI")
    if parts.auth is not None or "@" in uri.split("://", 1)[-1].split("/", 1)[0]:
        raise _refuse(uri, "holds userinfo (user@ or user:password@): credentials come from the Secret")
    if parts.query is not None or parts.fragment is not None:
        raise _refuse(uri, "holds a query or fragment")
    host = (parts.host or "").lower()
    if host.startswith("["):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise _refuse(uri, f"has an invalid IPv6 host {host!r}") from None
    elif not _HOST_RE.fullmatch(host):
        raise _refuse(uri, f"has an invalid host {host!r}")
    raw_path = urlsplit(uri).path  # urllib3 removes dot segments; refuse them as written
    if any(s in (".", "..") for s in raw_path.split("/")):
        raise _refuse(uri, f"has dot segments in its path {raw_path!r}")
    path = parts.path or ""
    segments = [s for s in path.split("/")[1:]]
    if segments and segments[-1] == "":
        segments = segments[:-1]
    if any(not _SEGMENT_RE.fullmatch(s) or s in (".", "..") for s in segments) or "%" in path:
        raise _refuse(uri, f"has a path {path!r} with empty or dot segments or escaped characters")
    split = urlsplit(uri)
    try:
        split_port = split.port
    except ValueError:
        raise _refuse(uri, "has an invalid port") from None
    if (split.hostname or "") != host.strip("[]") or split_port != parts.port:
        raise _refuse(uri, "is read with different hosts by different URI parsers")
    port = parts.port if parts.port is not None else DEFAULT_PORTS[scheme]
    if not 0 < port < 65536:
        raise _refuse(uri, f"has port {port} outside 1-65535")
    return HttpURI(scheme, host, port, "".join(f"/{s}" for s in segments), parts.port is not None)


def canonical_http_uri(uri: object) -> str:
    """`str(parse_http_uri(uri))`: the URI rebuilt from its checked parts. Raises UnsafeURI."""
    return str(parse_http_uri(uri))


def uri_allowed(uri: object, allowed: list[str]) -> bool:
    """True when `uri` parses safely and an entry of `allowed` covers it (`HttpURI.covers`); False for an unsafe or
    malformed URI, and entries that do not parse never match."""
    try:
        target = parse_http_uri(uri)
    except UnsafeURI:
        return False
    for entry in allowed:
        try:
            if parse_http_uri(entry).covers(target):
                return True
        except UnsafeURI:
            continue
    return False
