"""Connecting this process to Ray, with Ray's token authentication.

Ray 2.60 turns token authentication on for a local ``ray.init()`` and for ``ray start --head``
whenever a token exists or ``RAY_AUTH_MODE=token`` is set (the KubeRay RayCluster's ``authOptions``
sets it on every pod). A Ray Client
(``ray://host:10001``) sends the token only when *this* process has ``RAY_AUTH_MODE=token``, and
takes it, in Ray's order, from ``RAY_AUTH_TOKEN``, else the file named by ``RAY_AUTH_TOKEN_PATH``,
else ``~/.ray/auth_token``; the default file is never sent to a named address unless the mode
says so. Ray reads and sends the token itself: this module only looks at where it would come from.

Refused, Ray Client retries for about 30 s and then raises a bare "ray client connection timeout".
So before ``ray.init`` this module asks the client server once (the PING that Ray Client's own
handshake starts with, through Ray's own channel, so with exactly the headers Ray would send): a
refusal is gRPC's ``UNAUTHENTICATED`` code, answered in milliseconds, and becomes a
``RayConnectError`` whose text says what was sent and what to set. An unreachable server is left
to ``ray.init`` and its retries (on Kubernetes the head may still be starting).

Addresses other than ``ray://`` go to ``ray.init`` unchanged.
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

from service import logtext

log = logging.getLogger("relaytrain.rayconnect")

CLIENT_SCHEME = "ray://"
PROBE_TIMEOUT_S = 3.0
CLIENT_ATTEMPTS = 2
# k8s/secret.yaml's placeholder: a token anyone can read in the repository is no authentication
PLACEHOLDER_MARK = "CHANGE-ME"


class RayConnectError(ConnectionError):
    """This process could not connect to Ray; ``str()`` is one sentence saying why and what to set."""


@dataclass(frozen=True)
class AuthConfig:
    """What this process would send: the mode, and where the token would come from."""

    mode: str                  # "token", "disabled", or "" (RAY_AUTH_MODE unset)
    source: Optional[str]      # where the token would be read, e.g. "RAY_AUTH_TOKEN"; None: nowhere
    problem: Optional[str] = None   # why that token cannot be used (unreadable, empty, placeholder)

    @property
    def sends_token(self) -> bool:
        return self.mode == "token" and self.source is not None and self.problem is None


def auth_config(environ: Optional[Mapping[str, str]] = None, home: Optional[Path] = None) -> AuthConfig:
    """Ray's token lookup, as data (nothing is kept but where the token is)."""
    env = os.environ if environ is None else environ
    mode = env.get("RAY_AUTH_MODE", "").strip().lower()
    if env.get("RAY_AUTH_TOKEN", "").strip():
        return AuthConfig(mode, "RAY_AUTH_TOKEN", _placeholder(env["RAY_AUTH_TOKEN"], "RAY_AUTH_TOKEN"))
    path_var = env.get("RAY_AUTH_TOKEN_PATH", "")
    if path_var:
        where = f"RAY_AUTH_TOKEN_PATH={path_var}"
        try:
            text = Path(path_var).read_text()
        except OSError as e:
            return AuthConfig(mode, where, f"RAY_AUTH_TOKEN_PATH={path_var} cannot be read ({e.strerror or e}); "
                                           "point it at a file holding the cluster's token")
        if not text.strip():
            return AuthConfig(mode, where, f"RAY_AUTH_TOKEN_PATH={path_var} is empty; "
                                           "point it at a file holding the cluster's token")
        return AuthConfig(mode, where, _placeholder(text, path_var))
    home = home or (Path(env["HOME"]) if env.get("HOME") else Path.home())
    default = home / ".ray" / "auth_token"
    try:
        text = default.read_text()
    except OSError:
        return AuthConfig(mode, None)
    if not text.strip():
        return AuthConfig(mode, None)
    return AuthConfig(mode, str(default), _placeholder(text, str(default)))


def _placeholder(token: str, where: str) -> Optional[str]:
    if PLACEHOLDER_MARK in token:
        return (f"the token in {where} is still the placeholder of k8s/secret.yaml; put a random one "
                "(openssl rand -hex 32) in Secret/relaytrain-ray-auth, key auth_token, and restart the Ray pods "
                "and the control plane")
    return None


_TOKEN_HOW = ("RAY_AUTH_TOKEN=<the cluster's token> (or RAY_AUTH_TOKEN_PATH=<a file holding it>) in the "
              "environment of this process; `ray get-auth-token` on the head prints it, and on Kubernetes it "
              "is key auth_token of Secret/relaytrain-ray-auth")


def unusable_token_message(address: str, cfg: AuthConfig) -> Optional[str]:
    """Why this process, in token mode, cannot send a token at all (checked before any connection)."""
    if cfg.mode != "token":
        return None
    if cfg.source is None:
        return (f"cannot connect to Ray at {address}: RAY_AUTH_MODE=token but no Ray token was found "
                "(RAY_AUTH_TOKEN and RAY_AUTH_TOKEN_PATH are unset and ~/.ray/auth_token does not exist); "
                "set " + _TOKEN_HOW)
    if cfg.problem:
        return f"cannot connect to Ray at {address}: {cfg.problem}"
    return None


def _answers(address: str, timeout: float = 3.0) -> None:
    """Something listens at a named GCS address ``HOST:PORT``, or a ``RayConnectError`` at once:
    ``ray.init`` to a port where nothing listens retried for more than ten minutes without a word."""
    import socket

    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        return  # not HOST:PORT: Ray says what it makes of it
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as e:
        raise RayConnectError(f"cannot connect to Ray at {address}: nothing answers there ({e.strerror or e}); "
                              "is its head running (`ray status` on it), and is this its GCS address, "
                              "HOST:6379 by default?") from None


def named_address_message(address: str, e: BaseException, cfg: AuthConfig) -> str:
    """Why ``ray.init(address=HOST:PORT)`` failed, in one sentence: after about 35 s of Ray's own
    gcs_client lines, serve ended with a 60-line traceback when that Ray wanted a token this
    process did not send (a user trial: Ray 2.60's ``ray start`` turns token auth on whenever
    ~/.ray/auth_token exists, and a driver sends it to a named address only in token mode)."""
    first = logtext.first_line(e, type(e).__name__)
    said = f"cannot connect to Ray at {address} ({first})"
    if cfg.mode == "token":
        return said + ("; is a Ray running there, and is the token this process sends (from "
                       f"{cfg.source}) that cluster's? `ray get-auth-token` on its head prints it")
    why = " (RAY_AUTH_MODE is 'disabled' here)" if cfg.mode == "disabled" else ""
    return (said + f"; if that Ray requires token authentication (Ray 2.60 turns it on when `ray start` finds "
            f"~/.ray/auth_token or RAY_AUTH_MODE=token), this process sent no token{why}: set RAY_AUTH_MODE=token "
            "and " + _TOKEN_HOW)


def refusal_message(address: str, cfg: AuthConfig) -> str:
    """The sentence for a client server that answered UNAUTHENTICATED."""
    head = f"Ray at {address} refused the connection: it requires token authentication and "
    if cfg.sends_token:
        return (head + f"rejected the token this process sent (from {cfg.source}); set RAY_AUTH_TOKEN "
                "(or RAY_AUTH_TOKEN_PATH) to the cluster's token: `ray get-auth-token` on the head prints it, "
                "and on Kubernetes it is key auth_token of Secret/relaytrain-ray-auth")
    why = ""
    if cfg.mode == "disabled":
        why = " (RAY_AUTH_MODE is 'disabled' here)"
    elif cfg.source is not None:
        why = f" (a token is in {cfg.source}, but Ray sends it only with RAY_AUTH_MODE=token)"
    return head + f"no token was sent{why}; set RAY_AUTH_MODE=token and " + _TOKEN_HOW


def probe(address: str, timeout: float = PROBE_TIMEOUT_S) -> str:
    """Ask a Ray Client server once: "ok", "unauthenticated", or "unreachable" (not up, not a
    Ray Client server, or no answer within ``timeout``). Uses Ray's own channel, so it carries
    exactly the authentication (and TLS, RAY_USE_TLS) that Ray Client would."""
    import grpc
    from ray._private.grpc_utils import init_grpc_channel
    from ray.core.generated import ray_client_pb2, ray_client_pb2_grpc

    channel = init_grpc_channel(address[len(CLIENT_SCHEME):] if address.startswith(CLIENT_SCHEME) else address)
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout)
        ray_client_pb2_grpc.RayletDriverStub(channel).ClusterInfo(
            ray_client_pb2.ClusterInfoRequest(type=ray_client_pb2.ClusterInfoType.PING), timeout=timeout)
        return "ok"
    except grpc.FutureTimeoutError:
        return "unreachable"
    except grpc.RpcError as e:
        return "unauthenticated" if e.code() == grpc.StatusCode.UNAUTHENTICATED else "unreachable"
    finally:
        channel.close()


def check_client(address: str) -> AuthConfig:
    """Fail fast, with the reason, when a Ray Client server would refuse this process."""
    cfg = auth_config()
    problem = unusable_token_message(address, cfg)
    if problem:
        raise RayConnectError(problem)
    if probe(address) == "unauthenticated":
        raise RayConnectError(refusal_message(address, cfg))
    return cfg


# Ray puts the folder a driver starts in on every worker's import path, ahead of the installed
# packages: a user's actors.py or service.py there took the place of relaytrain's own packages
# in every job's processes (their jobs failed: "No module named 'actors.scheduler'"). The driver
# starts Ray from the folder that holds relaytrain's packages instead.
ENGINE_ROOT = str(Path(__file__).resolve().parents[1])


@contextlib.contextmanager
def _from_engine_root():
    here = os.getcwd()
    os.chdir(ENGINE_ROOT)
    try:
        yield
    finally:
        os.chdir(here)


def init(address: Optional[str], **init_kwargs) -> None:
    """``ray.init(address=address, **init_kwargs)`` as relaytrain's drivers connect (from
    ``ENGINE_ROOT``); for a ``ray://`` address, checked first and its failures explained (a
    ``RayConnectError``)."""
    with _keeping_sigterm():
        _init(address, **init_kwargs)


@contextlib.contextmanager
def _keeping_sigterm():
    """``ray.init`` in the main thread sets a SIGTERM handler that calls ``sys.exit``: in
    ``relaytrain serve`` that replaced uvicorn's (a graceful shutdown) with two tracebacks and
    exit 15 on every Kubernetes rollout. A handler the process had set is put back; where
    there was none, Ray's stays (``relaytrain run``'s cleanup runs on that ``SystemExit``)."""
    main = threading.current_thread() is threading.main_thread()
    before = signal.getsignal(signal.SIGTERM) if main else None
    try:
        yield
    finally:
        if main and callable(before):
            signal.signal(signal.SIGTERM, before)


def _init(address: Optional[str], **init_kwargs) -> None:
    import ray

    if not (address and address.startswith(CLIENT_SCHEME)):
        if address not in (None, "auto", "local"):
            _answers(address)
        try:
            with _from_engine_root():
                ray.init(address=address, **init_kwargs)
        except ConnectionError as e:
            if address in (None, "auto", "local") or isinstance(e, RayConnectError):
                raise
            raise RayConnectError(named_address_message(address, e, auth_config())) from None
        return
    cfg = check_client(address)
    for attempt in range(1, CLIENT_ATTEMPTS + 1):
        try:
            ray.init(address=address, **init_kwargs)
            break
        except ConnectionAbortedError as e:
            # The proxy behind the port could not start this client's own server. Ray 2.60 fails
            # the first one on a fresh head about a third of the time (measured here, with or
            # without token authentication) and says so only after ~40 s; a new connection gets a
            # new server.
            if attempt == CLIENT_ATTEMPTS:
                raise RayConnectError(f"cannot connect to Ray at {address}: its Ray Client server could not "
                                      f"start a server for this client, {attempt} times ({e})") from e
            log.warning("Ray Client at %s could not start a server for this client; connecting again", address)
            ray.shutdown()
        except ConnectionError as e:
            if probe(address) == "unauthenticated":  # it was not up yet when check_client asked
                raise RayConnectError(refusal_message(address, cfg)) from None
            raise RayConnectError(
                f"cannot connect to Ray at {address}: {e}; check that the head's Ray Client server is up "
                "(ray start --ray-client-server-port) and that this host reaches that port") from e
    log.info("connected to Ray at %s (token authentication: %s)", address,
             f"token from {cfg.source}" if cfg.sends_token else "none sent")
