"""The cluster's sharing policy: which jobs run, and on how many workers.  Pure: the cluster's
capacity, the active jobs and the tenants' weights in; one ``Allocation`` per job out, each
with the reason a person reads.  The control plane's ``ClusterScheduler`` (api/cluster.py)
carries the allocations out; this module never touches Ray or the store.

Three policies (``RELAYTRAIN_QUEUE_POLICY``):

- ``fifo``: rigid shapes, one queue in arrival order; the head waits until it fits and nothing
  passes it (a plain batch queue);
- ``fair``: rigid shapes; the next job admitted is the head of the tenant furthest below its
  weighted share (its own jobs by ``scheduling.priority``, then arrival);
- ``elastic`` (the default): weighted max-min fair shares in worker slots.  Running jobs keep
  their floor (a fixed shape its workers, an elastic job ``elastic.min_workers``); every slot
  above the floors goes, one increment at a time, to the tenant with the least
  ``used / weight`` that can use it: first to admit its queued jobs, then to grow its elastic
  jobs up to ``elastic.max_workers``.  An elastic job above its new allocation is shrunk at a
  step boundary; one below it may grow.

In ``fair`` and ``elastic``, a queued job that still does not fit may preempt running jobs
whose spec says ``scheduling.preemptible``: those of its own tenant with a lower priority, or
those of a tenant that, without them, still uses more per weight than the queued job's tenant
does now (the swap raises the poorer tenant's lot, and can never be undone by the victim).  A fixed job that is not preemptible is
never touched; no job is ever below ``elastic.min_workers``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

POLICIES = ("fifo", "fair", "elastic")


@dataclass(frozen=True)
class JobDemand:
    """One active job, as the policy sees it."""

    id: str
    tenant: str
    order: float                        # submission time: FIFO within a priority
    min_workers: int                    # fewest workers it runs on (a fixed shape: its dp x pp)
    max_workers: int                    # most it can use (a fixed shape: its dp x pp)
    preferred: int = 0                  # what a rigid policy gives an elastic job (its dp x pp); 0: min_workers
    per_worker: float = 1.0             # slots (CPUs) one worker takes
    priority: int = 0                   # orders a tenant's own jobs (higher first)
    preemptible: bool = False
    running: int = 0                    # workers it holds now; 0: queued
    sizes: Optional[tuple[int, ...]] = None  # worker counts its planner can use (elastic); None: any

    @property
    def elastic(self) -> bool:
        return self.max_workers > self.min_workers

    @property
    def rigid_size(self) -> int:
        return self.preferred or self.min_workers


@dataclass(frozen=True)
class Allocation:
    workers: int                        # 0: queued (or preempted, back to the queue)
    action: str                         # queue | admit | keep | shrink | grow | preempt
    reason: str
    position: Optional[int] = None      # 1-based place in the queue, for a queued job


@dataclass
class _Plan:
    capacity: float
    jobs: dict[str, JobDemand]
    weights: dict[str, float]
    alloc: dict[str, int] = field(default_factory=dict)
    preempted: set[str] = field(default_factory=set)

    @property
    def used(self) -> float:
        return sum(self.alloc[j] * self.jobs[j].per_worker for j in self.alloc)

    @property
    def free(self) -> float:
        return self.capacity - self.used

    def tenant_used(self, tenant: str) -> float:
        return sum(n * self.jobs[j].per_worker for j, n in self.alloc.items() if self.jobs[j].tenant == tenant)

    def norm(self, tenant: str, extra: float = 0.0) -> float:
        return (self.tenant_used(tenant) + extra) / self.weights.get(tenant, 1.0)

    def fits(self, units: float) -> bool:
        return units <= self.free + 1e-9


def tenant_order(j: JobDemand) -> tuple:
    """A tenant's own jobs: higher priority first, then first come."""
    return (-j.priority, j.order, j.id)


def allocate(capacity: float, jobs: list[JobDemand], weights: Optional[dict[str, float]] = None,
             policy: str = "elastic") -> dict[str, Allocation]:
    """One allocation per job (see the module's docstring)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown queue policy {policy!r}; one of {', '.join(POLICIES)}")
    weights = {t: w for t, w in (weights or {}).items()}
    for j in jobs:
        weights.setdefault(j.tenant, 1.0)
    p = _Plan(capacity, {j.id: j for j in jobs}, weights)
    if policy == "fifo":
        _fifo(p)
    else:
        _fair(p, elastic=policy == "elastic")
        _preempt(p, elastic=policy == "elastic")
    return _explain(p, policy)


# ---------------------------------------------------------------- the policies

def _fifo(p: _Plan) -> None:
    """Running jobs keep what they hold; the queue is admitted in arrival order, and stops at
    the first job that does not fit."""
    for j in p.jobs.values():
        p.alloc[j.id] = j.running
    for j in sorted((j for j in p.jobs.values() if not j.running), key=lambda j: (j.order, j.id)):
        if not p.fits(j.rigid_size * j.per_worker):
            break
        p.alloc[j.id] = j.rigid_size


def _floor(j: JobDemand, elastic: bool) -> int:
    if not j.running:
        return 0
    if not elastic or not j.elastic:
        return j.running                 # a rigid job keeps what it holds
    return j.min_workers


def _fair(p: _Plan, elastic: bool) -> None:
    """Water-filling over tenants: the next increment goes to the tenant with the least
    used / weight that can take one; within a tenant, admissions before growth."""
    for j in p.jobs.values():
        p.alloc[j.id] = _floor(j, elastic)
    while True:
        best = None
        for t in sorted({j.tenant for j in p.jobs.values()}):
            step = next((c for c in _increments(p, t, elastic)
                         if p.fits((c[1] - p.alloc[c[0].id]) * c[0].per_worker)), None)
            if step is not None and (best is None or (p.norm(t), t) < best[0]):
                best = ((p.norm(t), t), step)
        if best is None:
            return
        job, n = best[1]
        p.alloc[job.id] = n


def _increments(p: _Plan, tenant: str, elastic: bool) -> list[tuple[JobDemand, int]]:
    """The tenant's possible next (job, new worker count)s, in its order of preference: admit
    the first of its queued jobs (priority, then arrival), then grow its running ones by their smallest
    usable step.  A queued job that does not fit yet does not stop an elastic job's growth:
    growth above a floor is given back whenever the queue needs it."""
    mine = sorted((j for j in p.jobs.values() if j.tenant == tenant and j.id not in p.preempted), key=tenant_order)
    head = next((j for j in mine if p.alloc[j.id] == 0), None)  # FIFO within a tenant: only its head
    out = [(head, head.min_workers if elastic else head.rigid_size)] if head else []
    if elastic:
        for j in mine:
            nxt = _next_size(j, p.alloc[j.id]) if p.alloc[j.id] else None
            if nxt is not None:
                out.append((j, nxt))
    return out


def _next_size(j: JobDemand, have: int) -> Optional[int]:
    if not j.elastic or have >= j.max_workers:
        return None
    sizes = j.sizes or tuple(range(j.min_workers, j.max_workers + 1))
    up = [s for s in sizes if have < s <= j.max_workers]
    return min(up) if up else None


def _preempt(p: _Plan, elastic: bool) -> None:
    """A queued job that still does not fit may take the slots of preemptible running jobs
    (see the module's docstring)."""
    heads: dict[str, JobDemand] = {}     # FIFO within a tenant: only its first queued job may preempt
    for j in sorted((j for j in p.jobs.values() if not j.running and p.alloc[j.id] == 0), key=tenant_order):
        heads.setdefault(j.tenant, j)
    for q in sorted(heads.values(), key=lambda j: (p.norm(j.tenant), tenant_order(j))):
        size = q.min_workers if elastic else q.rigid_size
        units = size * q.per_worker
        if p.fits(units):
            continue                     # it fits, yet the fair pass left it queued: not for lack of room
        victims = sorted((j for j in p.jobs.values() if j.running and j.preemptible and p.alloc[j.id] > 0
                          and j.id not in p.preempted and _may_preempt(p, q, j)),
                         key=lambda j: (j.priority, -j.order))
        take, freed = [], p.free
        for v in victims:
            if freed + 1e-9 >= units:
                break
            take.append(v)
            freed += p.alloc[v.id] * v.per_worker
        if freed + 1e-9 < units:
            continue
        for v in take:
            p.alloc[v.id] = 0
            p.preempted.add(v.id)
        p.alloc[q.id] = size


def _may_preempt(p: _Plan, q: JobDemand, v: JobDemand) -> bool:
    """Within a tenant, a lower priority gives way.  Between tenants, only a swap that raises
    the poorer tenant's lot (max-min): the victim's tenant, without the victim, must still use
    more per weight than the queued job's tenant does now.  So a tenant is never emptied for a
    smaller one, and the victim can never take the slots back."""
    if v.tenant == q.tenant:
        return v.priority < q.priority
    return p.norm(v.tenant, -p.alloc[v.id] * v.per_worker) > p.norm(q.tenant)


# ---------------------------------------------------------------- reasons

def _explain(p: _Plan, policy: str) -> dict[str, Allocation]:
    out: dict[str, Allocation] = {}
    gainers = sorted((j for j in p.jobs.values() if p.alloc[j.id] > j.running),
                     key=lambda j: (p.norm(j.tenant), tenant_order(j)))
    queued = [j for j in p.jobs.values() if p.alloc[j.id] == 0]
    queued.sort(key=lambda j: (j.order, j.id) if policy == "fifo" else (p.norm(j.tenant), tenant_order(j)))
    total_w = sum(p.weights[t] for t in {j.tenant for j in p.jobs.values()}) or 1.0
    for j in p.jobs.values():
        n, have = p.alloc[j.id], j.running
        share = p.capacity * p.weights[j.tenant] / total_w
        if n == 0:
            pos = queued.index(j) + 1
            if j.id in p.preempted:
                out[j.id] = Allocation(0, "preempt", f"preempted: its {have * j.per_worker:g} slot{_s(have)} go to "
                                                     f"{_who(p, gainers, j)}; back in the queue at place {pos}, to "
                                                     "resume from its checkpoint", pos)
            else:
                out[j.id] = Allocation(0, "queue", _queued_reason(p, j, pos, share, policy), pos)
        elif have == 0:
            out[j.id] = Allocation(n, "admit", f"admitted on {n} worker{_s(n)}; tenant {j.tenant} uses "
                                               f"{p.tenant_used(j.tenant):g} of the {p.capacity:g} slots "
                                               f"(weighted share {share:.3g})")
        elif n < have:
            out[j.id] = Allocation(n, "shrink", f"shrink from {have} to {n} workers to give {have - n} "
                                                f"slot{_s(have - n)} to {_who(p, gainers, j)}")
        elif n > have:
            out[j.id] = Allocation(n, "grow", f"may grow from {have} to {n} workers: "
                                              f"{(n - have) * j.per_worker:g} slot{_s(n - have)} free for it")
        else:
            out[j.id] = Allocation(n, "keep", f"keeps {n} worker{_s(n)}")
    return out


def _queued_reason(p: _Plan, j: JobDemand, pos: int, share: float, policy: str) -> str:
    size = j.min_workers if policy == "elastic" else j.rigid_size
    need = size * j.per_worker
    ahead = pos - 1
    text = f"waiting for {need:g} CPU slot{_s(need)} ({size} worker{_s(size)}); {ahead} job{_s(ahead)} ahead"
    if policy != "fifo" and p.tenant_used(j.tenant) + need > share + 1e-9 and p.free + 1e-9 < need:
        if need > share + 1e-9:  # it said "uses 0 of its share of 2.67" beside an elastic job grown to 4 (a user trial)
            text += (f"; it needs more than tenant {j.tenant}'s weighted share of {share:.3g} slots, so other "
                     f"tenants' jobs do not shrink or give way for it: it starts when {need:g} slots are free")
        else:
            text += f"; tenant {j.tenant} already uses {p.tenant_used(j.tenant):g} of its weighted share of {share:.3g}"
    return text


def _who(p: _Plan, gainers: list[JobDemand], j: JobDemand) -> str:
    others = [g for g in gainers if g.id != j.id]
    if not others:
        return "other jobs"
    g = others[0]
    more = f" and {len(others) - 1} more" if len(others) > 1 else ""
    return f"job {g.id} of tenant {g.tenant}{more}"


def _s(n: float) -> str:
    return "" if n == 1 else "s"
