"""API tokens: ``Authorization: Bearer <token>`` maps to a tenant.

Tokens come from RELAYTRAIN_API_TOKENS ("tenant:token,...") or a tokens file (one
"tenant:token" a line, '#' comments).  Lookups compare in constant time against every
known token; tokens are never logged.
"""
from __future__ import annotations

import hmac
import ipaddress
from pathlib import Path
from typing import Optional

LOCAL_TENANT = "local"


class TokenError(ValueError):
    pass


def parse_tokens(text: str, source: str = "RELAYTRAIN_API_TOKENS") -> dict[str, str]:
    """token -> tenant."""
    out: dict[str, str] = {}
    for n, item in enumerate(text.replace("\n", ",").split(","), 1):
        item = item.strip()
        if not item or item.startswith("#"):
            continue
        tenant, sep, token = item.partition(":")
        tenant, token = tenant.strip(), token.strip()
        if not sep or not tenant or not token:
            raise TokenError(f"{source}: entry {n} is not 'tenant:token'")
        if len(token) < 16:
            raise TokenError(f"{source}: the token of tenant {tenant!r} is shorter than 16 characters")
        out[token] = tenant
    return out


def load_tokens(env_value: str, tokens_file: Optional[Path]) -> dict[str, str]:
    tokens = parse_tokens(env_value) if env_value else {}
    if tokens_file:
        p = Path(tokens_file)
        if not p.is_file():
            raise TokenError(f"tokens file {p} does not exist")
        tokens.update(parse_tokens(p.read_text(), str(p)))
    return tokens


class Authenticator:
    def __init__(self, tokens: dict[str, str]):
        self._tokens = [(t.encode(), tenant) for t, tenant in tokens.items()]

    @property
    def enabled(self) -> bool:
        return bool(self._tokens)

    def tenant_for(self, header: Optional[str]) -> Optional[str]:
        """The tenant of a bearer header, or None.  Without tokens everyone is 'local'."""
        if not self._tokens:
            return LOCAL_TENANT
        if not header or not header.startswith("Bearer "):
            return None
        given = header[len("Bearer "):].strip().encode()
        found = None
        for token, tenant in self._tokens:  # no early exit: time does not depend on which matched
            if hmac.compare_digest(token, given):
                found = tenant
        return found


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
