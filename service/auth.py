"""API tokens: ``Authorization: Bearer <token>`` maps to a tenant.

Tokens come from RELAYTRAIN_API_TOKENS ("tenant:token,...") or a tokens file (one
"tenant:token" a line, '#' comments).  Lookups compare in constant time against every
known token; tokens are never logged.

A tenant's weight in the cluster's fair shares (service/fairshare.py) is 1 unless set: a third
field of its token entry ("tenant:token:weight"), RELAYTRAIN_TENANT_WEIGHTS ("tenant:weight,...")
or a weights file (RELAYTRAIN_WEIGHTS_FILE: a YAML or JSON mapping), later ones winning.
"""
from __future__ import annotations

import hmac
import ipaddress
import logging
import time
from pathlib import Path
from typing import Optional

LOCAL_TENANT = "local"


class TokenError(ValueError):
    pass


def _entries(text: str, source: str) -> list[tuple[str, str, Optional[float]]]:
    """(tenant, token, weight or None) per 'tenant:token[:weight]' entry."""
    out = []
    for n, item in enumerate(text.replace("\n", ",").split(","), 1):
        item = item.strip()
        if not item or item.startswith("#"):
            continue
        parts = [x.strip() for x in item.split(":")]
        weight = None
        if len(parts) == 3:
            weight = _weight(parts[2], parts[0], f"{source}: entry {n}")
            parts = parts[:2]
        if len(parts) != 2 or not parts[0] or not parts[1]:
            raise TokenError(f"{source}: entry {n} is not 'tenant:token' or 'tenant:token:weight'")
        tenant, token = parts
        if len(token) < 16:
            raise TokenError(f"{source}: the token of tenant {tenant!r} is shorter than 16 characters")
        out.append((tenant, token, weight))
    return out


def _weight(value, tenant: str, where: str) -> float:
    try:
        w = float(value)
    except (TypeError, ValueError):
        w = float("nan")
    if not w > 0 or w == float("inf"):
        raise TokenError(f"{where}: the weight of tenant {tenant!r} must be a positive number, not {value!r}")
    return w


def parse_tokens(text: str, source: str = "RELAYTRAIN_API_TOKENS", known: Optional[dict[str, str]] = None
                 ) -> dict[str, str]:
    """token -> tenant (with ``known``'s, from another source, checked against these)."""
    out = dict(known or {})
    for tenant, token, _ in _entries(text, source):
        if out.get(token, tenant) != tenant:  # the later tenant silently took it
            raise TokenError(f"{source}: tenants {out[token]!r} and {tenant!r} are given the same token; each "
                             "tenant needs a token of its own")
        out[token] = tenant
    return out


def load_tokens(env_value: str, tokens_file: Optional[Path]) -> dict[str, str]:
    tokens = parse_tokens(env_value) if env_value else {}
    if tokens_file:
        p = Path(tokens_file)
        if not p.is_file():
            raise TokenError(f"tokens file {p} does not exist")
        tokens = parse_tokens(p.read_text(), str(p), known=tokens)
    return tokens


def load_weights(tokens_env: str, tokens_file: Optional[Path], weights_env: str = "",
                 weights_file: Optional[Path] = None) -> dict[str, float]:
    """tenant -> weight, for the tenants given one (see the module's docstring).  A weights file
    may name only tenants that have tokens (or 'local' when the server has none)."""
    texts = [(tokens_env, "RELAYTRAIN_API_TOKENS")]
    if tokens_file and Path(tokens_file).is_file():
        texts.append((Path(tokens_file).read_text(), str(tokens_file)))
    weights, tenants = {}, set()
    for text, source in texts:
        for tenant, _, w in _entries(text, source) if text else []:
            tenants.add(tenant)
            if w is not None:
                weights[tenant] = w
    for n, item in enumerate(weights_env.split(",") if weights_env else [], 1):
        tenant, sep, value = item.strip().partition(":")
        if not sep or not tenant.strip():
            raise TokenError(f"RELAYTRAIN_TENANT_WEIGHTS: entry {n} is not 'tenant:weight'")
        known = tenants or {LOCAL_TENANT}
        if tenant.strip() not in known:  # a mistyped name got weight 1 without a word (a user trial)
            raise TokenError(f"RELAYTRAIN_TENANT_WEIGHTS names tenant {tenant.strip()!r} that no API token belongs "
                             f"to (known: {', '.join(sorted(known))}); fix the name or add its token")
        weights[tenant.strip()] = _weight(value.strip(), tenant.strip(), "RELAYTRAIN_TENANT_WEIGHTS")
    if weights_file:
        weights.update(_weights_file(Path(weights_file), tenants or {LOCAL_TENANT}))
    return weights


def _weights_file(p: Path, tenants: set[str]) -> dict[str, float]:
    import json

    import yaml

    if not p.is_file():
        raise TokenError(f"weights file {p} does not exist")
    try:
        data = json.loads(p.read_text()) if p.suffix == ".json" else yaml.safe_load(p.read_text())
    except (ValueError, yaml.YAMLError) as e:
        raise TokenError(f"weights file {p} is not valid {'JSON' if p.suffix == '.json' else 'YAML'}: {e}") from None
    if not isinstance(data, dict):
        raise TokenError(f"weights file {p} must map tenant names to weights, like 'team-a: 2'")
    unknown = sorted(str(t) for t in data if str(t) not in tenants)
    if unknown:
        raise TokenError(f"weights file {p} names tenant{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} "
                         f"that no API token belongs to (known: {', '.join(sorted(tenants))}); fix the name or add "
                         "its token")
    return {str(t): _weight(w, str(t), f"weights file {p}") for t, w in data.items()}


_log = logging.getLogger("uvicorn.error")  # the server's own log


class _Watch:
    """Files looked at once a second at most (or at once after ``reread``): ``changed()`` says
    whether any of them changed (modified, replaced, created or removed) since it last looked."""

    def __init__(self, *files: Optional[Path]) -> None:
        self.files = [Path(f) for f in files if f]
        self._stamp, self._looked = self._stat(), time.monotonic()

    def _stat(self) -> tuple:
        def one(f: Path):
            try:
                st = f.stat()
            except OSError:
                return None
            return st.st_mtime_ns, st.st_size, st.st_ino
        return tuple(one(f) for f in self.files)

    def reread(self) -> None:
        self._looked, self._stamp = 0.0, ("asked",)

    def changed(self) -> bool:
        now = time.monotonic()
        if not self.files or now - self._looked < 1.0:
            return False
        self._looked = now
        stamp = self._stat()
        if stamp == self._stamp:
            return False
        self._stamp = stamp
        return True


class Weights:
    """The tenants' weights in the fair shares (``load_weights``), read again when the tokens
    file or the weights file changes (looked at once a second at most, or at once after
    :meth:`reread`, SIGHUP): a weight changes by editing a file, without a restart (the server
    read them only at its start).  Files that no longer parse, or name an unknown tenant, are not
    taken: the weights before stay, and the server's log says why."""

    def __init__(self, tokens_env: str = "", tokens_file: Optional[Path] = None, weights_env: str = "",
                 weights_file: Optional[Path] = None) -> None:
        self._args = (tokens_env, tokens_file, weights_env, weights_file)
        self._weights = load_weights(*self._args)
        self._watch = _Watch(tokens_file, weights_file)

    def reread(self) -> None:
        self._watch.reread()

    def current(self) -> dict[str, float]:
        if self._watch.changed():
            try:
                weights = load_weights(*self._args)
            except (TokenError, OSError) as e:
                _log.warning("relaytrain serve: the tenants' weights changed but were not taken (%s); the weights "
                             "before stay in force", e)
            else:
                if weights != self._weights:
                    _log.warning("relaytrain serve: tenants' weights read again: %s (before: %s)",
                                 _said(weights), _said(self._weights))
                self._weights = weights
        return self._weights


def _said(weights: dict[str, float]) -> str:
    return ", ".join(f"{t} {w:g}" for t, w in sorted(weights.items())) or "every tenant 1"


class Authenticator:
    """Bearer tokens to tenants.  With ``tokens_file``, the file is read again when it changes
    (looked at once a second at most, or at once after :meth:`reread`): a token is rotated or
    revoked by editing the file, without a restart (the server read it only at its start: a user
    trial).  A file that no longer parses, or names no tenant, is not taken (the tokens before
    stay, and the server's log says why): an emptied file never opens the server to everyone."""

    def __init__(self, tokens: dict[str, str], tokens_env: str = "", tokens_file: Optional[Path] = None):
        self._set(tokens)
        self._env, self._file = tokens_env, Path(tokens_file) if tokens_file else None
        self._watch = _Watch(self._file)

    def _set(self, tokens: dict[str, str]) -> None:
        self._tokens = [(t.encode(), tenant) for t, tenant in tokens.items()]

    def reread(self) -> None:
        """Look at the tokens file at the next request (SIGHUP)."""
        self._watch.reread()

    def _refresh(self) -> None:
        if not self._watch.changed():
            return
        try:
            tokens = load_tokens(self._env, self._file)
        except (TokenError, OSError) as e:
            _log.warning("relaytrain serve: the tokens file changed but was not taken (%s); the tokens before it "
                         "stay in force", e)
            return
        if not tokens:
            _log.warning("relaytrain serve: the tokens file %s now names no tenant; the tokens before it stay in "
                         "force (a server with tokens does not open to everyone)", self._file)
            return
        before = {tenant for _, tenant in self._tokens}
        self._set(tokens)
        _log.warning("relaytrain serve: tokens read again from %s: %d tokens of %d tenants (added: %s; removed: %s)",
                     self._file, len(tokens), len(set(tokens.values())),
                     ", ".join(sorted(set(tokens.values()) - before)) or "none",
                     ", ".join(sorted(before - set(tokens.values()))) or "none")

    @property
    def enabled(self) -> bool:
        return bool(self._tokens)

    def tenant_for(self, header: Optional[str]) -> Optional[str]:
        """The tenant of a bearer header, or None.  Without tokens everyone is 'local'."""
        self._refresh()
        if not self._tokens:
            return LOCAL_TENANT
        scheme, _, token = (header or "").strip().partition(" ")
        given = token.strip().encode()
        if scheme.lower() != "bearer" or not given:  # auth schemes are case-insensitive (RFC 7235)
            return None
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
