"""A real S3 for tests: moto's standalone server (``python -m moto.server``) on a loopback port,
a subprocess started on first use and stopped at the end of the session. Code under test
talks to it over HTTP through s3fs/botocore exactly as to any S3; nothing is mocked in-process.

:func:`configure_env` runs when tests/conftest.py is imported, before any Ray starts, so that the
server, the tests and Ray's workers all agree on the endpoint and credentials, which (as in
production) come from the environment only.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from typing import Optional


ENDPOINT: Optional[str] = None  # set by configure_env
REGION = "us-east-1"


def free_port() -> int:
    """A loopback port nothing listens on now (another process could still take it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def configure_env() -> str:
    """Point S3 of this test session at the moto server's endpoint (a free loopback port),
    with fake credentials. Always set, even where real AWS_* settings exist: tests never
    touch real storage. Idempotent (conftest may be imported twice)."""
    global ENDPOINT
    if ENDPOINT is None:
        ENDPOINT = f"http://127.0.0.1:{free_port()}"
        for name in ("AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_PROFILE", "AWS_REGION", "AWS_ENDPOINT_URL_S3"):
            os.environ.pop(name, None)
        os.environ.update({
            "AWS_ENDPOINT_URL": ENDPOINT,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": REGION,
            "AWS_EC2_METADATA_DISABLED": "true",  # never ask an instance metadata service for credentials
            "AWS_CONFIG_FILE": os.devnull,  # nor a developer's ~/.aws
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        })
    return ENDPOINT


class MotoServer:
    """One ``python -m moto.server`` subprocess on ``endpoint`` (http://127.0.0.1:PORT)."""

    def __init__(self, endpoint: Optional[str] = None):
        self.endpoint = endpoint or f"http://127.0.0.1:{free_port()}"
        self.port = int(self.endpoint.rsplit(":", 1)[1])
        self.proc: Optional[subprocess.Popen] = None
        self.log = tempfile.NamedTemporaryFile(prefix="moto-server-", suffix=".log", delete=False)

    def start(self, timeout: float = 60.0) -> "MotoServer":
        env = {k: v for k, v in os.environ.items() if k != "INITIAL_NO_AUTH_ACTION_COUNT"}
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the moto server on {self.endpoint} exited with {self.proc.returncode} "
                                   f"(port taken?):\n{self._log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.endpoint}/moto-api/data.json", timeout=2):
                    return self
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the moto server on {self.endpoint} did not answer in {timeout:.0f}s:\n"
                                   f"{self._log_tail()}")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None
        self.log.close()
        try:
            os.unlink(self.log.name)
        except OSError:
            pass

    def _log_tail(self) -> str:
        self.log.flush()
        with open(self.log.name, errors="replace") as f:
            return f.read()[-3000:]

    def client(self, service: str = "s3", key: str = "testing", secret: str = "testing"):
        """A boto3 client of this server (for set-up and for looking at what tests wrote)."""
        import boto3

        return boto3.client(service, endpoint_url=self.endpoint, region_name=REGION,
                            aws_access_key_id=key, aws_secret_access_key=secret)

    def create_bucket(self, name: Optional[str] = None) -> str:
        name = name or f"ckpt-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        """Every object key in ``bucket`` under ``prefix``, sorted."""
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return sorted(o["Key"] for page in pages for o in page.get("Contents", []))

    def require_auth(self) -> dict[str, tuple[str, str]]:
        """From now on, refuse any request not signed by a key of moto's IAM, and check its
        permissions; returns such keys (id, secret): ``"allowed"`` everything on S3, ``"denied"``
        nothing. Moto's ``INITIAL_NO_AUTH_ACTION_COUNT``, set at run time through its
        ``/moto-api/reset-auth``."""
        iam = self.client("iam")
        keys = {}
        for kind in ("allowed", "denied"):
            user = f"ckpt-{kind}-{uuid.uuid4().hex[:8]}"
            iam.create_user(UserName=user)
            if kind == "allowed":
                iam.put_user_policy(UserName=user, PolicyName="s3-all", PolicyDocument=json.dumps({
                    "Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))
            key = iam.create_access_key(UserName=user)["AccessKey"]
            keys[kind] = (key["AccessKeyId"], key["SecretAccessKey"])
        req = urllib.request.Request(f"{self.endpoint}/moto-api/reset-auth", data=b"0", method="POST",
                                     headers={"Content-Type": "text/plain"})  # not a form: moto reads the body
        with urllib.request.urlopen(req, timeout=5):
            pass
        return keys
