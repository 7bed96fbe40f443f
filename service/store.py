"""The durable job store: SQLite by default, PostgreSQL by URL, through SQLAlchemy Core.

Holds jobs (spec, state, progress, error), their events, their per-step metrics and the
measured timelines of a few recent steps, so a job's history outlives its actors, the API
server and the cluster.  Metrics are keyed by (job, step): a step recorded twice is recorded
once (a re-run replaces it).  Timelines are a ring: each job keeps the newest few written (``put_timeline``).
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Iterable, Optional

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError

from service.settings import Settings
from service.states import JobState

SCHEMA_VERSION = 1  # new tables are created at start and older code ignores them: no bump
metadata = sa.MetaData()

jobs = sa.Table(
    "jobs", metadata,
    sa.Column("id", sa.String(80), primary_key=True),
    sa.Column("tenant", sa.String(128), nullable=False, index=True),
    sa.Column("name", sa.String(63), nullable=False),
    sa.Column("spec", sa.JSON, nullable=False),
    sa.Column("state", sa.String(16), nullable=False, index=True),
    sa.Column("created_at", sa.Float, nullable=False, index=True),
    sa.Column("started_at", sa.Float),
    sa.Column("ended_at", sa.Float),
    sa.Column("step", sa.Integer, nullable=False, default=0),
    sa.Column("steps", sa.Integer, nullable=False),
    sa.Column("loss", sa.Float),
    sa.Column("samples_per_s", sa.Float),
    sa.Column("shape", sa.JSON),
    sa.Column("error", sa.Text),
    sa.Column("idempotency_key", sa.String(255)),
    sa.Column("model_path", sa.Text),
    sa.UniqueConstraint("tenant", "idempotency_key", name="uq_jobs_tenant_idempotency"),
)

events = sa.Table(
    "events", metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("job_id", sa.String(80), sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False, index=True),
    sa.Column("time", sa.Float, nullable=False),
    sa.Column("type", sa.String(32), nullable=False),
    sa.Column("message", sa.Text, nullable=False),
    sa.Column("data", sa.JSON),
)

metrics = sa.Table(
    "metrics", metadata,
    sa.Column("job_id", sa.String(80), sa.ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True),
    sa.Column("step", sa.Integer, primary_key=True),
    sa.Column("data", sa.JSON, nullable=False),
)

logs = sa.Table(
    "logs", metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("job_id", sa.String(80), sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False, index=True),
    sa.Column("time", sa.Float, nullable=False),
    sa.Column("source", sa.String(64), nullable=False),   # "w<dp>.<pp>" or "scheduler"
    sa.Column("stream", sa.String(8), nullable=False),    # "stdout" or "stderr"
    sa.Column("line", sa.Text, nullable=False),
)
LOG_KEEP = 20000  # lines of output kept per job: the newest

timelines = sa.Table(
    "timelines", metadata,
    sa.Column("job_id", sa.String(80), sa.ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True),
    sa.Column("step", sa.Integer, primary_key=True),
    sa.Column("written_at", sa.Float, nullable=False),
    sa.Column("data", sa.JSON, nullable=False),
)

packages = sa.Table(
    "packages", metadata,
    sa.Column("sha256", sa.String(64), primary_key=True),
    sa.Column("tenant", sa.String(128), primary_key=True),
    sa.Column("size", sa.Integer, nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
)

artifacts = sa.Table(
    "artifacts", metadata,
    sa.Column("job_id", sa.String(80), sa.ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True),
    sa.Column("name", sa.String(64), primary_key=True),
    sa.Column("data", sa.LargeBinary, nullable=False),
)

meta = sa.Table(
    "relaytrain_meta", metadata,
    sa.Column("key", sa.String(64), primary_key=True),
    sa.Column("value", sa.String(255), nullable=False),
)

JOB_FIELDS = [c.name for c in jobs.columns]


def _normalise(url: str) -> str:
    if url.startswith("postgres://"):
        url = "postgresql://" + url[len("postgres://"):]
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg://" + url[len("postgresql://"):]
    return url


class Store:
    def __init__(self, url: Optional[str] = None):
        self.url = _normalise(url or Settings().db_url)  # SQLite under RELAYTRAIN_HOME
        kwargs: dict[str, Any] = {"future": True}
        if self.url.startswith("sqlite"):
            kwargs["connect_args"] = {"check_same_thread": False, "timeout": 30}
        else:
            kwargs["pool_pre_ping"] = True
        try:
            self.engine = sa.create_engine(self.url, **kwargs)
        except ModuleNotFoundError as e:
            raise RuntimeError(f"the job store URL needs the {e.name} driver: pip install 'relaytrain[postgres]'"
                               if "postgres" in self.url else f"the job store URL needs {e.name}: {e}") from None
        if self.url.startswith("sqlite"):
            db_file = self.engine.url.database
            if db_file and db_file != ":memory:" and not db_file.startswith("file:"):
                Path(db_file).expanduser().parent.mkdir(parents=True, exist_ok=True)  # a fresh machine's home

            @sa.event.listens_for(self.engine, "connect")
            def _pragmas(conn, _record):
                cur = conn.cursor()
                cur.execute("PRAGMA journal_mode=WAL")
                cur.execute("PRAGMA foreign_keys=ON")
                cur.execute("PRAGMA synchronous=NORMAL")
                cur.close()
        self.migrate()

    def migrate(self) -> None:
        """Create the schema, or bring an older one up to this version."""
        metadata.create_all(self.engine)
        with self.engine.begin() as c:
            row = c.execute(sa.select(meta.c.value).where(meta.c.key == "schema_version")).first()
            if row is None:
                c.execute(meta.insert().values(key="schema_version", value=str(SCHEMA_VERSION)))
            elif int(row.value) > SCHEMA_VERSION:
                raise RuntimeError(f"the job store at {self.url} has schema {row.value}, newer than this "
                                   f"relaytrain ({SCHEMA_VERSION}); upgrade relaytrain")

    def ping(self) -> bool:
        with self.engine.connect() as c:
            c.execute(sa.text("SELECT 1"))
        return True

    # ---------------------------------------------------------------- jobs

    def create_job(self, job_id: str, tenant: str, spec: dict, idempotency_key: Optional[str] = None,
                   state: JobState = JobState.PENDING, first_events: list[dict] = ()) -> tuple[dict, bool]:
        """Insert a job (PENDING, or QUEUED for the cluster scheduler) and its ``first_events``
        in one transaction (no reader sees the job without them: a ``resume_from`` event read by
        a cluster scheduler that admits the job at once); returns (job, created).  With an
        idempotency key already used by this tenant, returns that job and created=False."""
        row = {"id": job_id, "tenant": tenant, "name": spec["name"], "spec": spec, "state": state.value,
               "created_at": time.time(), "step": 0, "steps": spec["training"]["steps"],
               "idempotency_key": idempotency_key}
        try:
            with self.engine.begin() as c:
                c.execute(jobs.insert().values(**row))
                if first_events:
                    c.execute(events.insert(), self._event_rows(job_id, first_events))
            return self.get_job(job_id), True
        except IntegrityError:  # two requests with one key raced: the first one won
            found = self.find_by_idempotency_key(tenant, idempotency_key) if idempotency_key else None
            if found is None:
                raise
            return found, False

    def find_by_idempotency_key(self, tenant: str, key: str) -> Optional[dict]:
        with self.engine.connect() as c:
            row = c.execute(sa.select(jobs).where(jobs.c.tenant == tenant, jobs.c.idempotency_key == key)).first()
        return dict(row._mapping) if row else None

    def get_job(self, job_id: str, tenant: Optional[str] = None) -> Optional[dict]:
        q = sa.select(jobs).where(jobs.c.id == job_id)
        if tenant is not None:
            q = q.where(jobs.c.tenant == tenant)
        with self.engine.connect() as c:
            row = c.execute(q).first()
        return dict(row._mapping) if row else None

    def list_jobs(self, tenant: Optional[str] = None, states: Iterable[str] = (), limit: int = 50,
                  offset: int = 0) -> tuple[list[dict], int]:
        q = sa.select(jobs)
        n = sa.select(sa.func.count()).select_from(jobs)
        if tenant is not None:
            q, n = q.where(jobs.c.tenant == tenant), n.where(jobs.c.tenant == tenant)
        states = list(states)
        if states:
            q, n = q.where(jobs.c.state.in_(states)), n.where(jobs.c.state.in_(states))
        q = q.order_by(jobs.c.created_at.desc(), jobs.c.id.desc()).limit(limit).offset(offset)
        with self.engine.connect() as c:
            return [dict(r._mapping) for r in c.execute(q)], int(c.execute(n).scalar_one())

    def delete_job(self, job_id: str, tenant: Optional[str] = None) -> Optional[str]:
        """Delete an ended job and everything the store holds of it (events, metrics, logs,
        timelines, model files), in one transaction.  Returns None when there is no such job,
        its state when it is still active (nothing deleted), and "" once it is deleted."""
        ended = [s.value for s in JobState if s.is_terminal]
        with self.engine.begin() as c:
            q = sa.select(jobs.c.state).where(jobs.c.id == job_id)
            if tenant is not None:
                q = q.where(jobs.c.tenant == tenant)
            state = c.execute(q).scalar_one_or_none()
            if state is None or state not in ended:
                return state
            for t in (events, metrics, logs, timelines, artifacts):
                c.execute(t.delete().where(t.c.job_id == job_id))
            c.execute(jobs.delete().where(jobs.c.id == job_id, jobs.c.state.in_(ended)))
        return ""

    def update_job(self, job_id: str, **fields) -> None:
        with self.engine.begin() as c:
            c.execute(jobs.update().where(jobs.c.id == job_id).values(**fields))

    def set_state(self, job_id: str, state: JobState, error: Optional[str] = None, only_if_active: bool = True) -> bool:
        """Move a job to ``state``; a job already ended keeps its end (returns False)."""
        values: dict[str, Any] = {"state": state.value}
        if state is JobState.RUNNING:  # the first time only: a reshape or a restart does not start it again
            values["started_at"] = sa.func.coalesce(jobs.c.started_at, time.time())
        if state.is_terminal:
            values["ended_at"] = time.time()
        if error is not None:
            values["error"] = error
        q = jobs.update().where(jobs.c.id == job_id)
        if only_if_active:
            q = q.where(jobs.c.state.notin_([s.value for s in JobState if s.is_terminal]))
        with self.engine.begin() as c:
            return c.execute(q.values(**values)).rowcount > 0

    def active_by_tenant(self) -> dict[str, int]:
        """Active (not ended) jobs per tenant."""
        active = [s.value for s in JobState if not s.is_terminal]
        with self.engine.connect() as c:
            rows = c.execute(sa.select(jobs.c.tenant, sa.func.count()).where(jobs.c.state.in_(active))
                             .group_by(jobs.c.tenant)).all()
        return {t: int(n) for t, n in rows}

    def count_active(self, tenant: str) -> int:
        active = [s.value for s in JobState if not s.is_terminal]
        with self.engine.connect() as c:
            return int(c.execute(sa.select(sa.func.count()).select_from(jobs).where(
                jobs.c.tenant == tenant, jobs.c.state.in_(active))).scalar_one())

    def count_events(self, kind: str) -> int:
        """Events of this type over every job (e.g. 'reshape')."""
        with self.engine.connect() as c:
            return int(c.execute(sa.select(sa.func.count()).select_from(events).where(events.c.type == kind)).scalar_one())

    def events_of(self, job_id: str, kinds: Iterable[str]) -> list[dict]:
        """A job's events of these types, oldest first (e.g. its restarts and checkpoints)."""
        q = (sa.select(events).where(events.c.job_id == job_id, events.c.type.in_(list(kinds)))
             .order_by(events.c.id))
        with self.engine.connect() as c:
            return [{"id": r.id, "time": r.time, "type": r.type, "message": r.message, **(r.data or {})}
                    for r in c.execute(q)]

    def resumed_by(self, job_id: str) -> list[str]:
        """The active jobs that started from a checkpoint of ``job_id`` (``resume_from``): until
        they write their own, a restart takes them back there."""
        active = [s.value for s in JobState if not s.is_terminal]
        q = (sa.select(events.c.job_id, events.c.data).join(jobs, jobs.c.id == events.c.job_id)
             .where(events.c.type == "resume_from", jobs.c.state.in_(active)))
        with self.engine.connect() as c:
            return sorted({r.job_id for r in c.execute(q) if (r.data or {}).get("job") == job_id})

    def durability(self, job_ids: list[str]) -> dict[str, dict]:
        """Per job: ``restarts`` (its restarted events), ``checkpoint``, the newest written
        (``{"step", "path", "time"}``, or None), and ``waiting``: what it waits for when its
        newest ``waiting`` event came after its newest shape (else None)."""
        out = {j: {"restarts": 0, "checkpoint": None, "waiting": None} for j in job_ids}
        if not job_ids:
            return out
        mine = events.c.job_id.in_(job_ids)
        with self.engine.connect() as c:
            for job_id, n in c.execute(sa.select(events.c.job_id, sa.func.count()).where(
                    mine, events.c.type == "restarted").group_by(events.c.job_id)):
                out[job_id]["restarts"] = int(n)
            newest = sa.select(sa.func.max(events.c.id)).where(mine, events.c.type == "checkpoint").group_by(
                events.c.job_id)
            for r in c.execute(sa.select(events).where(events.c.id.in_(newest))):
                data = r.data if isinstance(r.data, dict) else json.loads(r.data or "{}")
                out[r.job_id]["checkpoint"] = {"step": data.get("step"), "path": data.get("path"), "time": r.time}
            newest = sa.select(sa.func.max(events.c.id)).where(mine, events.c.type.in_(["waiting", "shape"])).group_by(
                events.c.job_id)
            for r in c.execute(sa.select(events.c.job_id, events.c.type, events.c.message).where(
                    events.c.id.in_(newest))):
                if r.type == "waiting":
                    out[r.job_id]["waiting"] = r.message
        return out

    def count_by_state(self) -> dict[str, int]:
        with self.engine.connect() as c:
            rows = c.execute(sa.select(jobs.c.state, sa.func.count()).group_by(jobs.c.state)).all()
        return {s: int(n) for s, n in rows}

    # ---------------------------------------------------------------- artifacts

    def put_artifact(self, job_id: str, name: str, data: bytes) -> None:
        """A job's output file (the trained model), kept in the store so every API replica,
        wherever it runs, can serve it."""
        with self.engine.begin() as c:
            c.execute(artifacts.delete().where(artifacts.c.job_id == job_id, artifacts.c.name == name))
            c.execute(artifacts.insert().values(job_id=job_id, name=name, data=data))

    def get_artifact(self, job_id: str, name: str) -> Optional[bytes]:
        with self.engine.connect() as c:
            return c.execute(sa.select(artifacts.c.data).where(artifacts.c.job_id == job_id,
                                                               artifacts.c.name == name)).scalar()

    def list_artifacts(self, job_id: str, prefix: str = "") -> list[dict]:
        """The job's artifacts whose names start with ``prefix`` (case-sensitive, taken literally),
        by name, as ``{"name", "bytes"}``: sizes from the database, without reading the blobs."""
        q = sa.select(artifacts.c.name, sa.func.length(artifacts.c.data).label("bytes")).where(
            artifacts.c.job_id == job_id)
        if prefix:  # not LIKE: SQLite's is case-insensitive and '_' and '%' are wildcards
            q = q.where(sa.func.substr(artifacts.c.name, 1, len(prefix)) == prefix)
        with self.engine.connect() as c:
            rows = [{"name": r.name, "bytes": int(r.bytes)} for r in c.execute(q)]
        return sorted(rows, key=lambda r: r["name"])  # by code point, whatever the database's collation

    # ---------------------------------------------------------------- packages

    def add_package(self, sha: str, tenant: str, size: int) -> None:
        with self.engine.begin() as c:
            if c.execute(sa.select(packages.c.sha256).where(packages.c.sha256 == sha,
                                                           packages.c.tenant == tenant)).first() is None:
                c.execute(packages.insert().values(sha256=sha, tenant=tenant, size=size, created_at=time.time()))

    def has_package(self, sha: str, tenant: str) -> bool:
        with self.engine.connect() as c:
            return c.execute(sa.select(packages.c.sha256).where(packages.c.sha256 == sha,
                                                                packages.c.tenant == tenant)).first() is not None

    # ---------------------------------------------------------------- progress

    def add_events(self, job_id: str, rows: list[dict]) -> None:
        if not rows:
            return
        with self.engine.begin() as c:
            c.execute(events.insert(), self._event_rows(job_id, rows))

    @staticmethod
    def _event_rows(job_id: str, rows: list[dict]) -> list[dict]:
        return [{"job_id": job_id, "time": r.get("time", time.time()), "type": r["type"], "message": r["message"],
                 "data": {k: v for k, v in r.items() if k not in ("time", "type", "message")} or None}
                for r in rows]

    def add_metrics(self, job_id: str, rows: list[dict]) -> None:
        """Record committed steps and the job's progress fields from the newest one.  A step
        already recorded keeps its row, unless the new row is a re-run (``rerun``: the step ran
        again after the state went back to an older copy, or after a restart): then the re-run's
        row replaces it, so each step has one row, the one its parameters came from."""
        if not rows:
            return
        with self.engine.begin() as c:
            have = set(c.execute(sa.select(metrics.c.step).where(
                metrics.c.job_id == job_id, metrics.c.step.in_([r["step"] for r in rows]))).scalars())
            new = [{"job_id": job_id, "step": r["step"], "data": r} for r in rows if r["step"] not in have]
            if new:
                c.execute(metrics.insert(), new)
            for r in rows:
                if r["step"] in have and r.get("rerun"):
                    c.execute(metrics.update().where(metrics.c.job_id == job_id, metrics.c.step == r["step"])
                              .values(data=r))
            last = max(rows, key=lambda r: r["step"])
            c.execute(jobs.update().where(jobs.c.id == job_id).values(
                step=sa.func.max(jobs.c.step, last["step"]) if self.url.startswith("sqlite")
                else sa.func.greatest(jobs.c.step, last["step"]),
                loss=last["loss"], samples_per_s=last["samples_per_s"]))

    def end_metrics_at(self, job_id: str, step: int) -> None:
        """The job ended after ``step`` (asked to finish early): rows of later steps, committed
        before a restart went back to an older checkpoint, go, and its progress is that step's."""
        with self.engine.begin() as c:
            c.execute(metrics.delete().where(metrics.c.job_id == job_id, metrics.c.step > step))
            c.execute(timelines.delete().where(timelines.c.job_id == job_id, timelines.c.step > step))
            row = c.execute(sa.select(metrics.c.data).where(metrics.c.job_id == job_id, metrics.c.step == step)).scalar()
            c.execute(jobs.update().where(jobs.c.id == job_id).values(
                step=step, **({"loss": row.get("loss"), "samples_per_s": row.get("samples_per_s")} if row else {})))

    def get_events(self, job_id: str, after: int = 0, limit: int = 1000) -> list[dict]:
        q = sa.select(events).where(events.c.job_id == job_id, events.c.id > after).order_by(events.c.id).limit(limit)
        with self.engine.connect() as c:
            return [{"id": r.id, "time": r.time, "type": r.type, "message": r.message, **(r.data or {})}
                    for r in c.execute(q)]

    def get_metrics(self, job_id: str, after_step: int = 0, limit: int = 10000) -> list[dict]:
        q = (sa.select(metrics.c.data).where(metrics.c.job_id == job_id, metrics.c.step > after_step)
             .order_by(metrics.c.step).limit(limit))
        with self.engine.connect() as c:
            return [json.loads(d) if isinstance(d, str) else d for d in c.execute(q).scalars()]

    def add_logs(self, job_id: str, rows: list[dict], keep: int = LOG_KEEP) -> None:
        """Record lines the job's actors printed ({time, source, stream, line}); only the
        newest ``keep`` lines of a job are kept."""
        if not rows:
            return
        with self.engine.begin() as c:
            c.execute(logs.insert(), [{"job_id": job_id, **{k: r[k] for k in ("time", "source", "stream", "line")}}
                                      for r in rows])
            edge = c.execute(sa.select(logs.c.id).where(logs.c.job_id == job_id).order_by(logs.c.id.desc())
                             .offset(keep).limit(1)).scalar()
            if edge is not None:
                c.execute(logs.delete().where(logs.c.job_id == job_id, logs.c.id <= edge))

    def get_logs(self, job_id: str, after: int = 0, limit: int = 100000, tail: bool = False) -> list[dict]:
        """Lines after id ``after``, oldest first: the first ``limit`` of them, or the last with ``tail``."""
        q = sa.select(logs).where(logs.c.job_id == job_id, logs.c.id > after)
        q = q.order_by(logs.c.id.desc() if tail else logs.c.id).limit(limit)
        with self.engine.connect() as c:
            rows = [{"id": r.id, "time": r.time, "source": r.source, "stream": r.stream, "line": r.line}
                    for r in c.execute(q)]
        return rows[::-1] if tail else rows

    # ---------------------------------------------------------------- timelines

    def put_timeline(self, job_id: str, entry: dict, keep: int = 16) -> None:
        """Keep ``entry`` (a measured step timeline, ``entry["step"]`` its step) and drop the
        job's older ones beyond the newest ``keep`` written: a ring, one transaction."""
        with self.engine.begin() as c:
            c.execute(timelines.delete().where(timelines.c.job_id == job_id, timelines.c.step == entry["step"]))
            c.execute(timelines.insert().values(job_id=job_id, step=entry["step"], written_at=time.time(), data=entry))
            old = list(c.execute(sa.select(timelines.c.step).where(timelines.c.job_id == job_id)
                                 .order_by(timelines.c.written_at.desc(), timelines.c.step.desc())
                                 .offset(keep)).scalars())
            if old:
                c.execute(timelines.delete().where(timelines.c.job_id == job_id, timelines.c.step.in_(old)))

    def timeline_steps(self, job_id: str) -> list[int]:
        with self.engine.connect() as c:
            return sorted(c.execute(sa.select(timelines.c.step).where(timelines.c.job_id == job_id)).scalars())

    def get_timeline(self, job_id: str, step: Optional[int] = None) -> Optional[dict]:
        """The timeline of ``step``, or the newest written when step is None."""
        q = sa.select(timelines.c.data).where(timelines.c.job_id == job_id)
        q = q.where(timelines.c.step == step) if step is not None else q.order_by(timelines.c.written_at.desc(),
                                                                                  timelines.c.step.desc()).limit(1)
        with self.engine.connect() as c:
            d = c.execute(q).scalar()
        return json.loads(d) if isinstance(d, str) else d
