"""Server settings, from the environment (prefix RELAYTRAIN_) or the command line."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Literal, Optional

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


def default_home() -> Path:
    from platformdirs import user_data_dir

    return Path(os.environ.get("RELAYTRAIN_HOME") or user_data_dir("relaytrain"))


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="RELAYTRAIN_", extra="ignore")

    host: str = Field("127.0.0.1", description="address to bind; anything but loopback needs API tokens")
    port: int = Field(8000, ge=0, le=65535)
    ray_address: Optional[str] = Field(None, description="an existing Ray cluster; unset: start a local one")
    db: Optional[str] = Field(None, description="job store URL (sqlite:///..., postgresql://...); unset: SQLite under home")
    home: Path = Field(default_factory=default_home, description="data folder: SQLite store, packages, checkpoints")
    api_tokens: str = Field("", description="'tenant:token,tenant2:token2'")
    tokens_file: Optional[Path] = Field(None, description="file of 'tenant:token' lines")
    max_body_bytes: int = Field(1 << 20, ge=1024, description="largest JSON request body")
    max_package_bytes: int = Field(100 << 20, ge=1024, description="largest uploaded code package")
    max_active_jobs_per_tenant: int = Field(32, ge=1, description="QUEUED, PENDING, RUNNING or RESHAPING jobs per tenant")
    reconcile_seconds: float = Field(10.0, gt=0, description="how often jobs are checked against their actors")
    cluster_max_cpus: Optional[float] = Field(
        None, description="CPUs an autoscaler can grow the cluster to; jobs are checked against this, not only now")
    cluster_max_gpus: Optional[float] = Field(None, description="GPUs an autoscaler can grow the cluster to")
    start_timeout_s: float = Field(120.0, gt=0, description="how long a job may wait for its workers to be placed")
    storage_wait_s: float = Field(300.0, ge=0, description="how long a job that restarts or resumes waits for its "
                                                           "checkpoint storage to answer before it fails")
    queue_policy: Literal["elastic", "fair", "fifo"] = Field(
        "elastic", description="how the cluster is shared (service/fairshare.py): elastic (weighted fair shares, "
                               "elastic jobs shrink and grow), fair (weighted fair shares, rigid shapes) or fifo")
    queue_seconds: float = Field(2.0, gt=0, description="how often the cluster scheduler looks at the queue")
    tenant_weights: str = Field("", description="'tenant:weight,...' (default 1 each); also 'tenant:token:weight' "
                                                "in the tokens")
    weights_file: Optional[Path] = Field(None, description="YAML or JSON mapping of tenant to weight")
    local_cpus: Optional[int] = Field(None, description="CPU slots of the local Ray this server starts")
    checkpoint_roots: str = Field("", description="absolute folders, separated by ':', where submitted jobs may write "
                                                  "local checkpoints besides the data folder (a shared mount)")

    @property
    def db_url(self) -> str:
        return self.db or f"sqlite:///{self.home / 'relaytrain.db'}"

    @property
    def packages_dir(self) -> Path:
        return self.home / "packages"
