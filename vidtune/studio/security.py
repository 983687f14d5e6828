"""What keeps the studio safe: paths confined to `--root`, the access token, and cross-site protection.

A request names files by paths relative to the root (an absolute path is accepted only when it lies inside it);
every path is resolved with its symbolic links followed before it is compared, so `..`, an absolute path elsewhere
or a link out of the root are refused alike. State-changing requests carry a per-server secret in a header that a
cross-site form or image cannot send, and must come from the studio's own origin.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import secrets
from pathlib import Path

from vidtune.errors import VidtuneError

CSRF_HEADER = "x-vidtune-studio"
TOKEN_COOKIE = "vidtune_studio_token"


class OutsideRoot(VidtuneError):
    """A path from a request that is not under the studio's root."""


def is_loopback(host: str) -> bool:
    """`host` (an address or `localhost`) is only reachable from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Root:
    """The folder the studio reads and writes under."""

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = Path(folder).expanduser().resolve()
        if not self.folder.is_dir():
            raise VidtuneError(f"--root {folder}: not a folder (looked for {self.folder}).\nWhat to do: give the "
                               "folder that holds your clips, configs and runs.")

    def path(self, text: str) -> Path:
        """`text` (relative to the root, or absolute inside it) as a resolved path inside the root."""
        if not isinstance(text, str) or "\x00" in text:
            raise OutsideRoot("A path must be text without NUL characters.")
        candidate = Path(text).expanduser()
        resolved = (candidate if candidate.is_absolute() else self.folder / candidate).resolve()
        if resolved != self.folder and not resolved.is_relative_to(self.folder):
            raise OutsideRoot(f"{text!r} is outside the studio's folder {self.folder}: only files under --root are "
                              "read or written.")
        return resolved

    def relative(self, path: Path) -> str:
        """`path` as the studio names it: relative to the root, with forward slashes ('.' for the root)."""
        return path.resolve().relative_to(self.folder).as_posix()

    def contains(self, path: Path) -> bool:
        resolved = path.resolve()
        return resolved == self.folder or resolved.is_relative_to(self.folder)


class Access:
    """Who may use the studio: with a token, every request must carry it (a `?token=` link sets a cookie); the CSRF
    secret guards every state-changing request."""

    def __init__(self, token: str | None) -> None:
        self.token = token
        self.csrf = secrets.token_urlsafe(24)

    def token_ok(self, given: str | None) -> bool:
        return self.token is None or (given is not None and hmac.compare_digest(given, self.token))

    def csrf_ok(self, given: str | None) -> bool:
        return given is not None and hmac.compare_digest(given, self.csrf)


def new_token() -> str:
    return secrets.token_urlsafe(18)
