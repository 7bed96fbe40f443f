"""Shared fixtures: one local Ray for the whole session (ray.init costs seconds)."""
from __future__ import annotations

import os

import pytest

import tempfile

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# the embedded job store of `relaytrain run` and the server's data: a folder of this session
os.environ["RELAYTRAIN_HOME"] = tempfile.mkdtemp(prefix="relaytrain-home-")
FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")

# S3 of the checkpoint tests (tests/s3server.py): AWS_ENDPOINT_URL names a free loopback port,
# where the `s3_server` fixture starts a moto server on first use, and the credentials are fake.
# Set now, before any Ray starts, so Ray's workers inherit them; always set, overriding any
# real AWS_* of the environment: tests never touch real storage.
from tests import s3server  # noqa: E402

s3server.configure_env()
s3_server, s3_bucket, s3_auth_server = s3server.s3_server, s3server.s3_bucket, s3server.s3_auth_server  # fixtures


def restart_session_ray():
    """The session's local Ray: 8 logical CPU slots on this 2-core machine, so 2x2 and 1x4 fit."""
    import ray

    ray.init(address="local", num_cpus=8, include_dashboard=False, logging_level="WARNING",
             namespace="relaytrain-tests")
    return ray


@pytest.fixture(scope="session")
def ray_session():
    import ray

    restart_session_ray()
    yield ray
    ray.shutdown()
