"""API keys: only their SHA-256 digests are kept; the bootstrap keys come from `$TANDEM_API_KEYS`
(read here only) or a keys file, the operator keys from `$TANDEM_OPERATOR_KEYS`."""

from __future__ import annotations

import hashlib
import os

from tandem.platform.errors import TandemError


class AuthenticationError(TandemError):
    status_code = 401
    error_type = "authentication_error"


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def bootstrap_key_id(digest: str) -> str:
    """The id of a key from `TANDEM_API_KEYS` or the keys file (they have no stored record): a
    prefix of its digest, which reveals nothing of the secret."""
    return f"key_boot_{digest[:12]}"


def env_api_keys() -> str:
    """`$TANDEM_API_KEYS` ("key1=tenant1,key2=tenant2"; "" when unset): the one place it is read."""
    return os.environ.get("TANDEM_API_KEYS", "")


def env_operator_keys() -> str:
    """`$TANDEM_OPERATOR_KEYS` (operator API keys, comma-separated; "" when unset)."""
    return os.environ.get("TANDEM_OPERATOR_KEYS", "")


def parse_keys(spec: str) -> dict[str, str]:
    """ "k1=t1,k2=t2" (or one pair per line) -> {sha256(k): tenant}. Raises on malformed pairs."""
    hashed: dict[str, str] = {}
    for raw in spec.replace("\n", ",").split(","):
        pair = raw.strip()
        if not pair or pair.startswith("#"):
            continue
        key, sep, tenant = pair.partition("=")
        if not sep or not key.strip() or not tenant.strip():
            raise ValueError(f"API key entry {pair[:4]}... must look like KEY=TENANT")
        hashed[hash_key(key.strip())] = tenant.strip()
    return hashed


def bearer_digest(authorization: str | None, what: str) -> str:
    """The digest of the key in 'Bearer KEY'; 401 naming `what` when there is none."""
    if not authorization or not authorization.lower().startswith("bearer "):
        raise AuthenticationError(
            f"missing {what}: send 'Authorization: Bearer <{what}>'", code="invalid_api_key"
        )
    return hash_key(authorization[7:].strip())


def parse_operator_keys(spec: str) -> frozenset[str]:
    """ "k1,k2" (or one key per line) -> their sha256 digests."""
    return frozenset(hash_key(k.strip()) for k in spec.replace("\n", ",").split(",") if k.strip())
