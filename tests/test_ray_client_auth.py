"""The Kubernetes path for real, on this machine: Ray with token authentication and a Ray Client
server (`ray start --head --block`, started and stopped here, with its own temp dir, ports and
token file), and `relaytrain serve --ray-address ray://...` as a subprocess. With the token a job
submitted over REST ends equal to the one-process loop; without it the server exits at once with
the reason. Also the token lookup and the messages, without Ray.

The user's own ~/.ray/auth_token is never read or written: every process started here has HOME
pointed at a folder of the test."""
from __future__ import annotations

import io
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import torch

from service import rayconnect
from service.rayconnect import AuthConfig, auth_config, refusal_message, unusable_token_message
from service.spec import parse_spec
from tests import reference

ROOT = Path(__file__).resolve().parents[1]
API_TOKEN = "alice-token-0123456789"
ADDRESS = "ray://127.0.0.1:10001"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(home: Path, **extra: str) -> dict:
    """This process's environment without any Ray address or auth setting (the session's
    ray.init sets RAY_AUTH_MODE here), HOME in the test's folder, and ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("RAY_AUTH_") and k not in ("RAY_ADDRESS", "RAY_ENABLE_K8S_TOKEN_AUTH")}
    return {**env, "HOME": str(home), "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": str(ROOT), **extra}


class TokenCluster:
    """A one-node Ray with token authentication and a Ray Client server, all of it the
    children of one `ray start --block` that SIGTERM stops."""

    def __init__(self, root: Path):
        self.root = root
        self.temp_dir = Path(tempfile.mkdtemp(prefix="rta-", dir="/tmp"))  # short: Ray's socket paths
        self.home = root / "home"
        self.home.mkdir()
        self.token_file = root / "ray-token"
        self.token_file.write_text(secrets.token_hex(32))
        self.env = clean_env(self.home, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(self.token_file),
                             RAY_raylet_start_wait_time_s="120")  # other Rays may load this machine
        self.proc = None

    def start(self, timeout: float = 150, attempts: int = 2) -> "TokenCluster":
        """Until its Ray Client port answers; a `ray start` that gives up is tried once more."""
        for attempt in range(1, attempts + 1):
            self.client_port, self.gcs_port = free_port(), free_port()
            self.address = f"ray://127.0.0.1:{self.client_port}"
            log_path = self.root / f"ray-start-{attempt}.log"
            self.temp_dir.mkdir(exist_ok=True)
            self.log = open(log_path, "w")
            self.proc = subprocess.Popen(
                [shutil.which("ray", path=os.path.dirname(sys.executable)), "start", "--head", "--block",
                 "--disable-usage-stats", f"--port={self.gcs_port}", f"--ray-client-server-port={self.client_port}",
                 "--num-cpus=2", "--object-store-memory=200000000", "--node-ip-address=127.0.0.1",
                 "--include-dashboard=false", f"--dashboard-port={free_port()}",
                 f"--dashboard-agent-listen-port={free_port()}", f"--temp-dir={self.temp_dir}"],
                env=self.env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
            deadline = time.monotonic() + timeout
            while self.proc.poll() is None and time.monotonic() < deadline:
                with socket.socket() as s:
                    s.settimeout(1)
                    if s.connect_ex(("127.0.0.1", self.client_port)) == 0:
                        self.warm_up()
                        return self
                time.sleep(0.5)
            self.stop()
            if attempt == attempts:
                raise RuntimeError(f"ray start --head did not come up:\n{log_path.read_text()}")

    def warm_up(self, attempts: int = 4) -> None:
        """One throwaway Ray Client connection. Ray 2.60's Ray Client proxy fails to start its first
        per-client server on a fresh head about a third of the time (measured here, with or without
        token authentication), and the client hears of it only after ~40 s (relaytrain then connects
        again, see rayconnect.init): spend that first start here, and when the proxy logs at once that
        it failed, drop the connection and make another, so that the tests' servers get a working one."""
        proxy_log = self.temp_dir / "session_latest" / "logs" / "ray_client_server.err"

        def failures() -> int:
            return proxy_log.read_text().count("SpecificServer startup failed") if proxy_log.exists() else 0

        code = f"import ray; ray.init({self.address!r}); print('connected')"
        for _ in range(attempts):
            before = failures()
            client = subprocess.Popen([sys.executable, "-c", code], env=self.env, stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL, text=True)
            while client.poll() is None and failures() == before:
                time.sleep(0.2)
            if client.poll() is None:
                client.kill()
            if "connected" in client.communicate()[0]:
                return
        raise RuntimeError(f"no Ray Client connection to {self.address} in {attempts} attempts:\n"
                           + (proxy_log.read_text() if proxy_log.exists() else "(no proxy log)"))

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # `ray start --block` stops every process it started,
            try:                                    # but gracefully one by one: 30 s measured here
                self.proc.wait(3)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        if self.proc is not None:
            self.log.close()
        # anything left (a worker in its own session) carries this cluster's token path: only ours
        for pid in os.listdir("/proc"):
            try:
                if pid.isdigit() and str(self.token_file).encode() in Path(f"/proc/{pid}/environ").read_bytes():
                    os.kill(int(pid), signal.SIGKILL)
            except OSError:
                pass
        # keep Ray's logs beside the test's other files (the temp dir only holds sockets and logs)
        if (self.temp_dir / "session_latest").exists():
            shutil.copytree(self.temp_dir / "session_latest" / "logs", self.root / "ray-logs", dirs_exist_ok=True,
                            ignore_dangling_symlinks=True)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = TokenCluster(tmp_path_factory.mktemp("token-ray"))
    try:
        yield c.start()
    finally:
        c.stop()


def serve(cluster: TokenCluster, home: Path, env: dict) -> tuple[subprocess.Popen, str, Path]:
    port = free_port()
    log = home / f"serve-{port}.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "api.cli", "serve", "--port", str(port), "--ray-address", cluster.address],
        # reconcile every second: over Ray Client the first job's scheduler takes 7-8 s to come up
        # (the head imports actors.scheduler), and reconcile must leave a job that is starting alone
        env={**env, "RELAYTRAIN_HOME": str(home), "RELAYTRAIN_API_TOKENS": f"alice:{API_TOKEN}",
             "RELAYTRAIN_RECONCILE_SECONDS": "1"},
        stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=home)
    return proc, f"http://127.0.0.1:{port}", log


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def test_serve_over_ray_client_with_the_token_trains_like_one_process(cluster, tmp_path):
    # the token as on Kubernetes: RAY_AUTH_MODE=token and the Secret's token (here a file)
    proc, url, log = serve(cluster, tmp_path, clean_env(cluster.home, RAY_AUTH_MODE="token",
                                                        RAY_AUTH_TOKEN_PATH=str(cluster.token_file)))
    try:
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {API_TOKEN}"}, timeout=30) as c:
            deadline = time.monotonic() + 60
            while True:
                assert proc.poll() is None, log.read_text()
                try:
                    if c.get("/readyz").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.3)
            spec = {"name": "over-ray-client", "model": {"kind": "mlp", "args": {"hidden": 32, "layers": 2}},
                    "data": {"kind": "digits"}, "optimizer": {"name": "adam", "lr": 0.003},
                    "training": {"global_batch_size": 32, "microbatch_size": 8, "steps": 6, "seed": 4},
                    "parallelism": {"dp": 1, "pp": 2}}
            r = c.post("/v1/jobs", json=spec)
            assert r.status_code == 201, r.text
            job_id = r.json()["id"]
            deadline = time.monotonic() + 90
            while (job := c.get(f"/v1/jobs/{job_id}").json())["state"] not in ("SUCCEEDED", "FAILED", "CANCELLED"):
                assert time.monotonic() < deadline, job
                time.sleep(0.3)
            assert job["state"] == "SUCCEEDED", job["error"]
            got = torch.load(io.BytesIO(c.get(f"/v1/jobs/{job_id}/model").content))
            rows = c.get(f"/v1/jobs/{job_id}/metrics").json()
        want, losses = reference.train(parse_spec(spec))
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=2e-5)
        assert [row["loss"] for row in rows] == pytest.approx(losses, rel=1e-4)
    finally:
        stop(proc)


def test_serve_without_the_token_exits_at_once_saying_what_to_set(cluster, tmp_path):
    t0 = time.monotonic()
    proc, _, log = serve(cluster, tmp_path, clean_env(cluster.home))  # no RAY_AUTH_MODE, no token
    try:
        proc.wait(60)  # Ray Client alone retries for ~30 s, then says "ray client connection timeout"
    finally:
        stop(proc)
    elapsed = time.monotonic() - t0
    out = log.read_text()
    assert proc.returncode != 0, out
    assert (f"Ray at {cluster.address} refused the connection: it requires token authentication and no "
            "token was sent; set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN=") in out, out
    assert "ray client connection timeout" not in out
    assert "Traceback" not in out, out  # one line that says what to set, not a stack
    # the process's start (imports) is most of it; Ray Client's own timeout alone is ~30 s
    assert elapsed < 25, f"took {elapsed:.1f} s:\n{out}"


def test_serve_at_the_gcs_address_without_the_token_says_what_to_set(cluster, tmp_path):
    """`serve --ray-address HOST:PORT` (the GCS, not Ray Client) of a Ray that requires a token,
    from a process in no token mode: about 35 s of Ray's gcs_client lines, then a 60-line
    traceback (a user trial).  Now one sentence saying what to set; and an address where nothing
    listens is said at once (ray.init retried it for more than ten minutes)."""
    env = {**clean_env(cluster.home), "RELAYTRAIN_HOME": str(tmp_path)}
    gcs = f"127.0.0.1:{cluster.gcs_port}"
    p = subprocess.run([sys.executable, "-m", "api.cli", "serve", "--port", str(free_port()), "--ray-address", gcs],
                       env=env, capture_output=True, text=True, timeout=180, cwd=tmp_path)
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 2 and last.startswith(f"relaytrain serve: cannot connect to Ray at {gcs} ("), p.stderr
    assert last.endswith("this process sent no token: set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN=<the cluster's "
                         "token> (or RAY_AUTH_TOKEN_PATH=<a file holding it>) in the environment of this process; "
                         "`ray get-auth-token` on the head prints it, and on Kubernetes it is key auth_token of "
                         "Secret/relaytrain-ray-auth"), last
    assert "Traceback" not in p.stderr
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "api.cli", "serve", "--port", str(free_port()), "--ray-address",
                        f"127.0.0.1:{free_port()}"], env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert p.returncode == 2 and "nothing answers there (Connection refused)" in p.stderr, p.stderr
    assert time.monotonic() - t0 < 20


def test_a_wrong_token_is_named_as_such(cluster, tmp_path):
    wrong = tmp_path / "wrong-token"
    wrong.write_text(secrets.token_hex(32))
    code = ("from service import rayconnect\n"
            f"try:\n    rayconnect.check_client({cluster.address!r})\n"
            "except rayconnect.RayConnectError as e:\n    print(e)\nelse:\n    print('accepted')\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT,
                       env=clean_env(cluster.home, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(wrong)))
    assert (f"Ray at {cluster.address} refused the connection: it requires token authentication and rejected "
            f"the token this process sent (from RAY_AUTH_TOKEN_PATH={wrong})") in p.stdout, p.stdout + p.stderr
    assert wrong.read_text() not in p.stdout + p.stderr  # the token itself is never printed


# ---- the token lookup and the messages, without Ray


def test_token_lookup_follows_rays_order(tmp_path):
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("home-token-0123456789abcdef")
    path = tmp_path / "file-token"
    path.write_text("file-token-0123456789abcdef\n")
    env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "env-token-0123456789", "RAY_AUTH_TOKEN_PATH": str(path)}
    assert auth_config(env, tmp_path) == AuthConfig("token", "RAY_AUTH_TOKEN")
    del env["RAY_AUTH_TOKEN"]
    assert auth_config(env, tmp_path) == AuthConfig("token", f"RAY_AUTH_TOKEN_PATH={path}")
    del env["RAY_AUTH_TOKEN_PATH"]
    assert auth_config(env, tmp_path) == AuthConfig("token", str(tmp_path / ".ray" / "auth_token"))
    assert auth_config({}, tmp_path / "nowhere") == AuthConfig("", None)
    assert auth_config({"RAY_AUTH_MODE": "Disabled"}, tmp_path / "nowhere").mode == "disabled"


def test_a_token_that_cannot_be_sent_is_refused_before_connecting(tmp_path, monkeypatch):
    def message(env):
        return unusable_token_message(ADDRESS, auth_config(env, tmp_path))

    assert "RAY_AUTH_MODE=token but no Ray token was found" in message({"RAY_AUTH_MODE": "token"})
    assert message({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(tmp_path / "nope")}) == (
        f"cannot connect to Ray at {ADDRESS}: RAY_AUTH_TOKEN_PATH={tmp_path / 'nope'} cannot be read "
        "(No such file or directory); point it at a file holding the cluster's token")
    (tmp_path / "empty").write_text("\n")
    assert "is empty" in message({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(tmp_path / "empty")})
    # k8s/secret.yaml's placeholder is public: a cluster "secured" with it is not
    placeholder = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "CHANGE-ME-ray-auth-token"}
    assert "still the placeholder of k8s/secret.yaml" in message(placeholder)
    assert message({}) is None and message({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "x" * 32}) is None
    for var in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(rayconnect.RayConnectError, match="no Ray token was found"):
        rayconnect.check_client(ADDRESS)  # at once: nothing listens at ADDRESS, and nothing is asked


def test_a_refusal_says_what_was_sent(tmp_path):
    assert refusal_message(ADDRESS, AuthConfig("", None)).startswith(
        f"Ray at {ADDRESS} refused the connection: it requires token authentication and no token was sent; "
        "set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN=<the cluster's token> (or RAY_AUTH_TOKEN_PATH=")
    assert "(RAY_AUTH_MODE is 'disabled' here)" in refusal_message(ADDRESS, AuthConfig("disabled", None))
    assert ("(a token is in RAY_AUTH_TOKEN, but Ray sends it only with RAY_AUTH_MODE=token)"
            in refusal_message(ADDRESS, AuthConfig("", "RAY_AUTH_TOKEN")))
    assert "rejected the token this process sent (from RAY_AUTH_TOKEN)" in refusal_message(
        ADDRESS, AuthConfig("token", "RAY_AUTH_TOKEN"))
