"""The gateway's key store: client API keys and connector tokens in an embedded SQLite file.

Owns creation, lookup, listing and revocation. Talks to nothing but sqlite3; the gateway app
(gateway/app.py) verifies keys through it on every request, so `tokios keys revoke` takes effect
at once on a running gateway.

A secret looks like `tk-<key_id>.<random>` (client) or `tc-<key_id>.<random>` (connector). Only its
SHA-256 digest is stored; the key_id locates the row and the digests are compared with
hmac.compare_digest, so a lookup does not leak the secret through timing. Secrets are returned
once, by `create`, and are never logged.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

from tokios.errors import InvalidRequestError

KIND_CLIENT = "client"
KIND_CONNECTOR = "connector"
_KIND_TO_PREFIX = {KIND_CLIENT: "tk-", KIND_CONNECTOR: "tc-"}
# Compared against when the key_id is unknown, so a miss costs the same as a hit.
_DUMMY_DIGEST = hashlib.sha256(b"tokios-no-such-key").hexdigest()

_SCHEMA = """
CREATE TABLE IF NOT EXISTS keys (
    key_id TEXT PRIMARY KEY,
    kind TEXT NOT NULL CHECK (kind IN ('client', 'connector')),
    name TEXT NOT NULL,
    digest TEXT NOT NULL,
    models TEXT,
    max_requests_per_minute INTEGER,
    max_tokens_per_minute INTEGER,
    max_concurrent INTEGER,
    created_at REAL NOT NULL,
    revoked_at REAL
)
"""


def default_db_path() -> Path:
    env_path = os.environ.get("TOKIOS_GATEWAY_DB")
    if env_path:
        return Path(env_path)
    return Path.home() / ".local" / "share" / "tokios" / "gateway.db"


def digest_of(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


@dataclass(frozen=True)
class KeyRecord:
    key_id: str
    kind: str
    name: str
    models: tuple[str, ...] | None  # None: every model
    max_requests_per_minute: int | None
    max_tokens_per_minute: int | None
    max_concurrent: int | None
    created_at: float
    revoked_at: float | None

    @property
    def is_revoked(self) -> bool:
        return self.revoked_at is not None

    def can_use_model(self, model: str) -> bool:
        return self.models is None or model in self.models


def _positive_or_none(name: str, value: int | None) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidRequestError(f"{name} must be an integer >= 1 or unset, got {value!r}", param=name)
    return value


class KeyStore:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # One connection used from the event loop thread; autocommit so other processes
        # (`tokios keys revoke`) see and make changes at once.
        self._connection = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False)
        self._connection.execute("PRAGMA journal_mode=WAL")
        self._connection.execute("PRAGMA busy_timeout=5000")
        self._connection.execute(_SCHEMA)
        os.chmod(self.path, 0o600)

    def close(self) -> None:
        self._connection.close()

    def create(
        self,
        kind: str,
        name: str = "",
        *,
        models: list[str] | None = None,
        max_requests_per_minute: int | None = None,
        max_tokens_per_minute: int | None = None,
        max_concurrent: int | None = None,
    ) -> tuple[KeyRecord, str]:
        """A new key and its secret; the secret is not stored and cannot be shown again."""
        if kind not in _KIND_TO_PREFIX:
            raise InvalidRequestError(f"kind must be one of {sorted(_KIND_TO_PREFIX)}, got {kind!r}", param="kind")
        if models is not None and (not models or not all(isinstance(m, str) and m for m in models)):
            raise InvalidRequestError("models must be a non-empty list of model names or unset", param="models")
        limits = (
            _positive_or_none("max_requests_per_minute", max_requests_per_minute),
            _positive_or_none("max_tokens_per_minute", max_tokens_per_minute),
            _positive_or_none("max_concurrent", max_concurrent),
        )
        key_id = secrets.token_hex(6)
        secret = f"{_KIND_TO_PREFIX[kind]}{key_id}.{secrets.token_urlsafe(32)}"
        created_at = time.time()
        self._connection.execute(
            "INSERT INTO keys VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, NULL)",
            (key_id, kind, name, digest_of(secret), json.dumps(models) if models is not None else None,
             *limits, created_at),
        )
        return self.get(key_id), secret

    def get(self, key_id: str) -> KeyRecord | None:
        row = self._connection.execute(
            "SELECT key_id, kind, name, models, max_requests_per_minute, max_tokens_per_minute,"
            " max_concurrent, created_at, revoked_at FROM keys WHERE key_id = ?",
            (key_id,),
        ).fetchone()
        return _record_from_row(row) if row else None

    def verify(self, secret: str | None, kind: str) -> KeyRecord | None:
        """The live key whose secret this is, or None (unknown, wrong, revoked or other kind)."""
        if not secret or not secret.startswith(_KIND_TO_PREFIX.get(kind, "\0")):
            return None
        key_id = secret[3:].split(".", 1)[0]
        row = self._connection.execute(
            "SELECT digest FROM keys WHERE key_id = ? AND kind = ?", (key_id, kind)
        ).fetchone()
        stored_digest = row[0] if row else _DUMMY_DIGEST
        is_match = hmac.compare_digest(stored_digest, digest_of(secret))
        if not (row and is_match):
            return None
        record = self.get(key_id)
        return None if record is None or record.is_revoked else record

    def list(self) -> list[KeyRecord]:
        rows = self._connection.execute(
            "SELECT key_id, kind, name, models, max_requests_per_minute, max_tokens_per_minute,"
            " max_concurrent, created_at, revoked_at FROM keys ORDER BY created_at"
        ).fetchall()
        return [_record_from_row(row) for row in rows]

    def revoke(self, key_id: str) -> bool:
        """True when a live key was revoked; False when it is unknown or already revoked."""
        cursor = self._connection.execute(
            "UPDATE keys SET revoked_at = ? WHERE key_id = ? AND revoked_at IS NULL", (time.time(), key_id)
        )
        return cursor.rowcount == 1


def _record_from_row(row: tuple) -> KeyRecord:
    key_id, kind, name, models_json, rpm, tpm, max_concurrent, created_at, revoked_at = row
    models = tuple(json.loads(models_json)) if models_json is not None else None
    return KeyRecord(key_id, kind, name, models, rpm, tpm, max_concurrent, created_at, revoked_at)
