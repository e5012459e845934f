"""API keys: kept only as SHA-256 digests, compared in constant time, never logged.

Owns loading keys from `--api-key` (repeatable) and `--api-key-file` (one key a line, `#`
comments) and checking an `Authorization: Bearer <key>` (or `x-api-key`) header. Used by the
guard middleware in server/app.py; raises tokios.errors.AuthenticationError.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

from tokios.errors import AuthenticationError, InvalidRequestError


def key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def read_key_file(path: str | Path) -> list[str]:
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise InvalidRequestError(f"api_key_file: cannot read {str(path)!r}: {exc.strerror}",
                                  param="api_key_file") from exc
    return [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]


class ApiKeyChecker:
    """Holds digests only; `is_enabled` is False when no key was configured (open server)."""

    def __init__(self, keys: list[str] | tuple[str, ...] = ()):
        if any(not key.strip() for key in keys):
            raise InvalidRequestError("api_key must not be empty", param="api_key")
        self._key_digests = tuple(key_digest(key.strip()) for key in keys)

    @classmethod
    def from_sources(cls, keys: list[str] | None, key_file: str | None) -> ApiKeyChecker:
        all_keys = list(keys or [])
        if key_file:
            file_keys = read_key_file(key_file)
            if not file_keys:
                raise InvalidRequestError(f"api_key_file: {key_file!r} holds no key", param="api_key_file")
            all_keys += file_keys
        return cls(all_keys)

    @property
    def is_enabled(self) -> bool:
        return bool(self._key_digests)

    def is_valid(self, key: str) -> bool:
        candidate = key_digest(key)
        # Compare against every digest (no early exit) so timing says nothing about which matched.
        matches = [hmac.compare_digest(candidate, digest) for digest in self._key_digests]
        return any(matches)

    def check_headers(self, authorization: str | None, x_api_key: str | None) -> None:
        """Raises AuthenticationError unless a configured key is presented."""
        if not self.is_enabled:
            return
        key = None
        if authorization:
            scheme, _, value = authorization.partition(" ")
            if scheme.lower() == "bearer" and value.strip():
                key = value.strip()
        if key is None and x_api_key:
            key = x_api_key.strip()
        if key is None:
            raise AuthenticationError("Missing API key: send it as 'Authorization: Bearer <key>'.")
        if not self.is_valid(key):
            raise AuthenticationError("Invalid API key.")
