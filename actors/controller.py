"""JobController: one job's loop.  It owns the job's state and is the only place that changes
it: ``run`` asks ``_step`` for the next state (actors/jobstates.py) until one is terminal,
and ``_enter`` shows each one.  How a job can get to FAILED: read ``_advance`` and ``_step``.

It decides nothing about shapes itself: the elastic policy (service/elastic_policy.py, pure)
says Keep, Reshape, Wait or Fail from what the controller sees; the worker group carries out
calls, the reshaper moves state, the state keeper holds the copies, the record reports."""
from __future__ import annotations

import dataclasses
import statistics
import threading
import time
import traceback
from typing import Callable, Optional

from actors import codepkg, evaluation, layerfacts
from actors.cluster import NodeWatch, largest_node_memory
from actors.failures import JobCancelled, JobFailure, LostWorkerFailure, WorkerLost, cell_name
from actors.jobstates import (Cancelled, Failed, Finishing, Preempted, Reshaping, Restarting, Running, Starting, State,
                              Succeeded)
from actors.record import JobRecord, metrics_row, weight_split_message
from actors.reshape import Move, Reshaped, Reshaper
from actors.statekeeper import StateKeeper
from actors.workergroup import WorkerGroup
from service import elastic_policy as policy
from service import checkpoint, partition, planner, schedules
from service.recipe import lr_at
from service.spec import JobSpec, SpecError


class JobController:
    drain_recheck_s = 3.0  # a job training on draining nodes looks for a slot to move to this often

    def __init__(self, job_id: str, spec: JobSpec, search: list[str], record: JobRecord, group: WorkerGroup,
                 keeper: StateKeeper, *, model_out: dict, save_index: Callable[[dict], None],
                 watch: Optional[NodeWatch] = None, reshaper: Callable[..., Reshaper] = Reshaper,
                 cap: Optional[int] = None, traced: Optional[layerfacts.Layers] = None, restarts_used: int = 0,
                 finish_asked: Optional[str] = None):
        self.job_id, self.spec, self.search = job_id, spec, search
        self.record, self.group, self.keeper = record, group, keeper
        self.model_out, self.save_index = model_out, save_index  # where the final model's shards go
        self.elastic = spec.elastic.enabled
        self.layers: Optional[layerfacts.Layers] = None
        self.traced = traced                         # the model's trace, when who started the job made it
        self.make_reshaper = reshaper
        self.reshaper: Optional[Reshaper] = None
        self.watch = watch                           # the cluster as the scheduler sees it (elastic jobs)
        self.installed: Optional[Reshaped] = None   # a reshape whose first committed step is awaited
        self.reshapes = 0
        self.grow_after = 0.0                        # no growth attempt before this (monotonic)
        self.declined_at: set = set()                # the free slot counts grow_declined events were written for
        self.join_more_every_s = 2.0                 # while a growth's workers start: a look for more free slots
        self.join_more_after = 0.0
        self.joining_since = 0.0                     # when workers for a growth were last started (time.time())
        self.final_attempts = 0
        self.final: Optional[dict] = None            # the final model's index (service/shards.py)
        self.cancelled = getattr(group, "cancelled", None) or threading.Event()  # one event: the group waits on it too
        self.cap = cap                               # workers the cluster scheduler allots (elastic; None: any)
        self.cap_reason = ""
        self.preempt_reason: Optional[str] = None    # the cluster scheduler asked it to give its slots back
        self.last = spec.training.steps              # it ends after this many committed steps (sooner: finish_early)
        self.finish_asked = finish_asked             # who asked it to end early, keeping the model as trained so far
        self.usable: Optional[list[int]] = None      # worker counts its planner uses whole (elastic)
        self.queued: Optional[tuple] = None          # (step, its calls, when the step before ended): sent early
        self.may_queue: Optional[Callable[[int], bool]] = None  # a further say on sending a step early (bench)
        self.restarts_used = restarts_used           # of restarts.max, by the job's earlier schedulers and this one
        self.restarted_at: Optional[float] = None    # a restart's loss (time.time()), until its first commit
        self.waiting_for: Optional[str] = None         # the reason of the last waiting event
        self.drains_seen: set = set()                # draining nodes the job trains on (no slot to move to)
        self.drain_stay = (0.0, -1)                  # no move off them before (this monotonic time, nor at this step)
        self.kept: dict = {}                         # a restart's live workers, by cell, until it installs the shape
        self.restart_deadline = 0.0                  # a restart's new workers are tried until then (monotonic)
        self.split_tried: dict = {}                  # a trial of the backward's splits: mode -> its steps' times
        self.split: Optional[str] = None             # its choice, sent with each step call (_split_trial)

    # ---------------------------------------------------------------- the cluster scheduler's orders

    def allot(self, workers: int, reason: str) -> bool:
        """The cluster scheduler allots ``workers``: above them the job shrinks at the next step
        boundary, below them it may grow.  True when that changed the allotment."""
        changed = workers != self.cap
        self.cap, self.cap_reason = workers, reason
        if changed and self.elastic:
            self.grow_after = 0.0
        return changed

    def preempt(self, reason: str) -> None:
        """Stop at the next step boundary after a checkpoint, back to the queue."""
        self.preempt_reason = reason

    def finish_early(self, who: str) -> None:
        """End after the step under way (after the next one when none is): the model as
        trained so far is written out as after the spec's last step, that step is evaluated
        when the spec has an evaluation, and the job SUCCEEDS."""
        self.finish_asked = who

    def run(self) -> None:
        state: State = Starting()
        self._enter(state)
        while not state.is_terminal:
            state = self._advance(state)
            self._enter(state)

    def _advance(self, state: State) -> State:
        try:
            return self._step(state)
        except JobCancelled as e:
            return Cancelled(str(e))
        except (JobFailure, SpecError) as e:
            return Failed(str(e), {"detail": getattr(e, "detail", "")})
        except Exception as e:  # a bug or an unexpected Ray error: still say why
            return Failed(f"the scheduler raised {type(e).__name__}: {e}", {"detail": traceback.format_exc()})

    def _step(self, state: State) -> State:
        if self.cancelled.is_set():
            return Cancelled(f"job cancelled after {self.record.step} committed steps")
        if isinstance(state, Starting):
            return self._start(state)
        if isinstance(state, Running):
            return self._run_step(state.step)
        if isinstance(state, Reshaping):
            return self._reshape(state)
        if isinstance(state, Finishing):
            return self._finish()
        raise AssertionError(f"no transition from {state}")

    def _enter(self, state: State) -> None:
        """Show ``state``: the job's state, and for an end its event after what the actors printed."""
        if state.is_terminal:
            if isinstance(state, Cancelled):  # a checkpoint already under way is kept
                self.keeper.finish_writing()
            self.record.log_output(self.group.drain_output())
            self.record.event(state.kind, state.message, **state.fields)
            if isinstance(state, Preempted):  # back in the queue with no workers: no shape is placed
                self._unplace()
            self.record.set_state(state.job_state, state.message if isinstance(state, Failed) else None)
        else:
            self.record.set_state(state.job_state)

    def _unplace(self) -> None:
        """A preempted job's row keeps no placed shape (the cluster's view and policy count the
        workers of a row's shape: they counted the old one while it was queued and again once it
        was admitted, until its new shape: ``using 4, starting -2`` of 4 slots, a user trial),
        only what the policy needs (the worker counts it can use) and what it ran as."""
        old = self.record.shape or {}
        self.record.set_shape({**({"usable_workers": old["usable_workers"]} if old.get("usable_workers") else {}),
                               **({"ran_as": {k: old[k] for k in ("dp", "pp", "tp", "replicas") if k in old}} if old.get("dp") else {})})

    # ---------------------------------------------------------------- starting

    def _ship_code(self) -> None:
        """The job's code package, when relaytrain ships it (actors/codepkg.py): read, kept for
        the workers, unpacked here and first in ``search`` (the trace runs in it)."""
        shipped = getattr(self.group, "shipped", None)
        if shipped is None or shipped.folder is not None:
            return
        try:
            folder = shipped.ready()
        except codepkg.PackageMissing as e:
            raise JobFailure(str(e)) from None
        except Exception as e:
            raise JobFailure(f"the job's code package {shipped.uri} could not be unpacked: {type(e).__name__}: {e}") from None
        self.search = [folder, *[d for d in self.search if d != folder]]

    def _start(self, state: Starting) -> State:
        early, self.kept = self.kept, {}  # a restart's live workers (see _restart)
        if self.layers is None:
            self.record.event("started", f"job {self.job_id} started")
            self._ship_code()
            self.group.gpus = self.group.gpus_per_worker()
            if not self.elastic and not self.group.workers:  # its workers start while the model is traced
                p = self.spec.parallelism
                early = self.group.spawn([(r, s) for r in range(p.dp) for s in range(p.pipeline_workers)])
            if self.traced is not None and self.traced.facts.gpu == (self.group.gpus > 0):
                self.layers = self.traced  # `relaytrain run` traced it before it started anything
            else:
                self.layers = layerfacts.learn_for_job(self.spec, self.search, gpu=self.group.gpus > 0,
                                                       cancelled=self.cancelled.is_set,
                                                       cwd=getattr(getattr(self.group, "shipped", None), "folder", None),
                                                       worker=next(iter(early.values()), None) if early else None)
            self.group.skips = list(self.layers.skips)
            self.reshaper = self.make_reshaper(self.group, self.keeper, self.layers.facts.layers, set(self.layers.stateless))
            if self.elastic:
                self.usable = policy.usable_sizes(self.spec, self.layers.facts)
        if self.elastic:
            self.watch = self.watch or NodeWatch()
            self.watch.start()
            sit = self._situation(kept=0, exclude=set(), forced=True, since=state.waited_since)
            d = policy.decide(sit, self.spec, self.layers.facts)
            if isinstance(d, (policy.Wait, policy.Fail)):
                return self._wait(d, state.waited_since, lambda since: Starting(since), sit)
            shape, why = d.shape, d.reason
        else:
            shape, why = self._fixed_shape(early)
            misfit = planner.too_big_for_any_node(self.layers.facts, shape, largest_node_memory())
            if misfit:  # before the workers build their stages (a 4 TB stage failed there, in the allocator)
                self.group.stop_others(early.values())
                raise SpecError(misfit)
        copy = self.keeper.resume_copy()
        start = copy["step"] if copy else 0
        if copy:  # another model's checkpoint loads by name what matches: refused, saying what differs
            try:
                checkpoint.check_fits(copy["path"], self.layers.state, own_job=self.job_id)
            except ValueError as e:
                self.group.stop_others(early.values())
                raise SpecError(str(e)) from None
        try:
            self.reshaper.install(shape, why, early, start, self.layers.boundary(shape), copy=copy, donors={})
        except JobFailure as e:  # (a user's error stops it at once)
            if not (isinstance(state, Restarting) and e.lost) or time.monotonic() > self.restart_deadline:
                self.group.stop_others(early.values())
                raise
            # a new worker placed on the lost node before Ray marked it dead (~15 s; then Ray places
            # the node's bundle again): try again, with the live workers that are still live
            who = _listed([cell_name(c) for c in sorted(e.lost)])
            self.record.event("worker_lost", f"the restart's new worker {who} was lost while it started (its node "
                              f"may be going: Ray places the job's slot again once it marks the node dead); trying "
                              f"again until {self.group.start_timeout:.0f} s after the loss", detail=e.detail,
                              workers=sorted(cell_name(c) for c in e.lost))
            self.kept = self.group.keep_survivors([])
            time.sleep(1.0)
            return Restarting()
        except BaseException:
            self.group.stop_others(early.values())
            raise
        self._announce(shape, why)
        if copy:
            self.record.go_back(start)
            self.record.event("resumed", f"resumed from {copy['path']} at step {start}", checkpoint=copy["path"],
                              step=start)
        return Running(start)

    def _fixed_shape(self, early: dict) -> tuple:
        """A fixed-shape job's shape: the spec's, or with ``parallelism.replicas: auto`` the
        planner's fastest use of each pipeline's workers (workers started early for cells the
        chosen shape lacks are stopped)."""
        p, facts = self.spec.parallelism, self.layers.facts
        model = dict(schedule=p.schedule, transport=p.transport, optimizer=self.spec.optimizer.name)
        if p.replicas == "auto":
            mem = self.spec.resources.memory_per_worker_mb
            try:
                shape, why = planner.choose_replicas(facts, p.dp, p.pp, self.spec.microbatches,
                                                     memory_bytes=mem * 2**20 if mem else None, **model)
            except ValueError as e:
                raise SpecError(str(e)) from None
            for c in [c for c in early if c not in shape.cells]:
                self.group.stop_others([early.pop(c)])
            return shape, why
        sizes = partition.choose(p.partition, facts.layers, p.virtual_stages, facts.seconds if self.layers.profiled else None)
        return planner.model_shape(facts, p.dp, p.pp, self.spec.microbatches, partition_rule=list(sizes),
                                   chunks=p.chunks, replicas=p.replica_counts, tp=p.tp, weight_group=p.weight_group,
                                   **model), "the spec's shape"

    def _situation(self, *, kept: int, exclude: set, forced: bool, since: Optional[float] = None,
                   joined: int = 0, fresh: bool = True) -> policy.Situation:
        """``fresh``: the cluster asked now (GCS calls), else the watch's view of the last second."""
        view = self.watch.refresh() if fresh else self.watch.view
        suspect = self.reshaper.suspect(view.alive)
        free = view.free_slots(self.spec.resources.cpus_per_worker, self.group.gpus, exclude | suspect,
                               group=self.spec.parallelism.tp)
        cur = self.group.shape.key if self.group.shape and not forced else None
        return policy.Situation(kept=kept, free=free, current=cur, forced=forced, joined=joined,
                                previous=self.group.shape,
                                waited_s=time.monotonic() - since if since else 0.0, cap=self.cap,
                                steps_left=self.last - self.record.step,
                                step_s=self.group.shape.step_s if cur else None,
                                measured_s=self._measured_step_s() if cur else None)

    def _measured_step_s(self) -> Optional[float]:
        """The median seconds of the current shape's last (up to 9) committed steps, its first
        after a reshape or restart left out (it holds the workers' warm-up)."""
        rows = []
        for r in reversed(self.record.metrics[-10:]):
            if r.get("recovery_s") is not None or r.get("reshapes") != self.reshapes:
                break
            if r.get("step_time_s"):
                rows.append(r["step_time_s"])
        return statistics.median(rows) if len(rows) >= 3 else None

    def _wait(self, d, since: Optional[float], again: Callable[[float], State], sit: policy.Situation,
              move: Optional[Move] = None) -> State:
        if isinstance(d, policy.Fail):
            drained = (f" (the job had trained on node{'s' if len(self.drains_seen) > 1 else ''} "
                       f"{', '.join(n[:12] for n in sorted(self.drains_seen))} after it announced it was draining: "
                       "no other slot came free before it went)") if self.drains_seen else ""
            return Failed(d.reason + drained)
        if since is None or d.reason != self.waiting_for:  # (again when what it waits for changed: not stale)
            self.waiting_for = d.reason
            self.record.event("waiting", d.reason, **self._survey_fields(sit, move))
        time.sleep(1.0)
        return again(since or time.monotonic())

    def _survey_fields(self, sit: policy.Situation, move: Optional[Move]) -> dict:
        """What a ``waiting`` event records of the survey behind it: the slots counted (the job's
        kept workers and the free ones), and during a reshape the nodes left out (those that lost
        workers, and those suspected of being down) and the job's live workers it could not keep
        (stuck in their step, or in a tensor-parallel group that lost a member): they still hold
        their slots."""
        out = dict(slots=sit.slots, kept=sit.kept, free=sit.free)
        if move is not None:
            g = self.group
            whole = g.whole_groups(move.keep)
            out.update(excluded=sorted(n[:12] for n in move.exclude if n),
                       suspect=sorted(n[:12] for n in self.reshaper.suspect(self.watch.view.alive)),
                       held=sorted(cell_name(c) for c in {**move.keep, **move.donors} if c not in whole))
        return out

    def _announce(self, shape: planner.Shape, why: str) -> None:
        self.record.announce_shape(shape, why, self.spec, gpus=self.group.gpus, workers=self.group.describe(),
                                   costs=list(self.layers.facts.seconds) if self.layers.profiled else None,
                                   usable=self.usable, skips=self.layers.skips)

    # ---------------------------------------------------------------- steps

    def _run_step(self, step: int) -> State:
        if step >= self.last:
            return Finishing()
        early = self.queued is not None and self.queued[0] == step  # sent while the step before ran
        if self.preempt_reason is not None and not early and not self.finish_asked:  # (a step sent runs first;
            # a job told to finish frees its slots after one more step, with its model)
            return self._preempted(step)
        if self.elastic:
            move = self._at_boundary(step)
            if move is not None:
                return Reshaping(move=move)
        if early:
            _, refs, t0 = self.queued
        else:
            t0, refs = time.time(), self.group.call_all("run_step", step, self.split)
        self.queued = None
        if self._may_queue(step + 1):  # the workers start it as they end this one (and commit this one then)
            self.queued = (step + 1, self.group.call_all("run_step", step + 1, self.split), None)
        try:
            stats = self.group.gather(refs, step, self.group.timeout)
        except WorkerLost as lost:
            return self._lost(step, refs, lost)
        except LostWorkerFailure as lost:  # a fixed-shape job
            return self._restart(lost, [refs] + ([self.queued[1]] if self.queued else []))
        if self.queued is not None:
            self.queued = (*self.queued[:2], time.time())
        elif self.finish_asked:  # asked before or during it, and no later step was sent: this step is the
            self.last = min(self.last, step + 1)  # last, and its evaluation the final one
        if self.elastic and self.spec.elastic.snapshot_every_steps and not self.keeper.snapshot_landed():
            failure = JobFailure(f"the off-node copy of step {self.keeper.wanted} could not be fetched from "
                                 "the workers (a node is going)")
            return self._lost(step, refs, WorkerLost(failure, set(), time.time()))
        wall = time.time() - t0
        eval_loss, lost = evaluation.run(self.group, self.record, self.spec, step, stats, last=self.last)
        if early:
            stats[next(iter(stats))]["queued_early"] = True
        self._commit(step, stats, wall, eval_loss)  # the step stands even if its evaluation was lost
        return self._lost(step, lost.refs, lost) if lost else Running(step + 1)

    def _split_trial(self, step: int, stats: dict, wall: float) -> None:
        """The steps of a trial of the backward's two splits (actors/stage.py ``_keep_split_whole``:
        chunks whose Linears hold too little of their weight-gradient work): each step's time
        counts for the split it ran; after the last, the faster is chosen (``schedules.choose_split``),
        sent with every later step call, and a ``weight_split`` event says which and why."""
        trials = {f"w{r}.{s}": st.pop("split_trial") for (r, s), st in sorted(stats.items()) if st.get("split_trial")}
        if not trials:
            return
        first = next(iter(trials.values()))
        at = len(schedules.SPLIT_TRIAL) - 1 - first["left"]  # the step's place in the trial
        if at == 0:  # a new trial (a new shape, a restart)
            self.split_tried, self.split = {}, None
        if at >= schedules.SPLIT_WARM:
            self.split_tried.setdefault(first["mode"], []).append(wall)
        if first["left"] == 0:
            self.split = schedules.choose_split(self.split_tried)
            own, theirs = min(self.split_tried["own"]), min(self.split_tried["torch"])
            chunks = {w: t["chunks"] for w, t in trials.items()}
            self.record.event("weight_split", weight_split_message(self.split, own, theirs, trials), step=step + 1,
                              kept=self.split, own_s=round(own, 4), torch_s=round(theirs, 4), chunks=chunks,
                              cover={w: t["cover"] for w, t in trials.items()})

    def _may_queue(self, step: int) -> bool:
        """Send step ``step`` before the step before it has ended?  On a fixed-shape job, when
        nothing is due between the two: no checkpoint, evaluation or snapshot of the step
        before, no preemption or cancellation asked for.  The call carries the commit of the
        step before (the worker applies its update as it starts), so the workers never wait
        for this scheduler between steps.  An elastic job keeps the round trip: a reshape or
        a lost worker must find every worker at a committed step."""
        return (not self.elastic and step < self.last and self.preempt_reason is None and not self.finish_asked
                and not self.cancelled.is_set() and not self.keeper.due(step, self.spec)
                and not evaluation.due(self.spec, step, self.last) and (self.may_queue is None or self.may_queue(step)))

    def _preempted(self, step: int) -> State:
        """Give the slots back: a checkpoint of the committed steps, then back to the queue."""
        try:
            path = self.keeper.checkpoint_now(step, self.spec, self.record, self.job_id) if step else None
        except JobFailure as e:  # keep training; the cluster scheduler may ask again
            self.record.event("preempt_failed", f"not preempted: {e}; training goes on", reason=self.preempt_reason)
            self.preempt_reason = None
            return Running(step)
        if not step:  # nothing trained yet: no checkpoint, it starts from the beginning again
            why = self.preempt_reason.replace(", to resume from its checkpoint", "")
            return Preempted(f"preempted before its first step ({why}); it starts from step 0 again when "
                             "admitted", {"step": 0, "checkpoint": None})
        return Preempted(f"preempted after {step} committed steps ({self.preempt_reason}); it resumes from {path}",
                         {"step": step, "checkpoint": path})

    def _lost(self, step: int, refs: dict, lost: WorkerLost) -> State:
        abort_s = time.time() - lost.time
        t = time.time()
        move = self.reshaper.after_loss(refs, lost)
        move.phases.update(abort_s=abort_s, survey_s=time.time() - t, began_at=lost.time)  # training stopped then
        # named after the survey: the first error to come back is often a survivor's (its peer
        # went), and the event named that survivor as the worker lost
        names = [cell_name(c) for c in move.lost]
        what = (f"lost {', '.join(self.group.said(c) for c in move.lost)} during step {step + 1} (the first error: "
                f"{lost.failure})" if names else f"{lost.failure} during step {step + 1}")
        self.record.event("worker_lost", f"{what}; reshaping", detail=lost.failure.detail, step=step + 1,
                          workers=names)
        return Reshaping(move=move)

    def _restart(self, lost: LostWorkerFailure, calls: list[dict]) -> State:
        """A fixed-shape job lost a worker: while restarts.max allows and it has a checkpoint of
        its own, the live workers are kept, new ones take the lost workers' places (their
        placement group's bundles), and every worker goes back to the newest checkpoint, the
        steps since then run again; else it fails saying what would have kept it going.
        ``calls``: the failed step's calls (and the next step's, sent early)."""
        most = self.spec.restarts.max
        if not most:
            raise lost
        self.queued = None
        # a checkpoint under way when the worker went: complete, or said not completed (not a storage failure)
        self.keeper.finish_writing(lost=f"a worker was lost while it was written ({lost.bare})")
        d, newest = checkpoint.restart_decision(self.spec, self.keeper.checkpoint_root, self.job_id,
                                                used=self.restarts_used, committed=self.record.step,
                                                reason=str(lost.bare), origin=self.keeper.origin)
        if not d.restart:
            raise JobFailure(d.message, detail=lost.detail)
        self.restarts_used += 1
        before = sorted(self.group.workers)
        self.kept = self.group.keep_survivors(calls)
        kept, new = [cell_name(c) for c in sorted(self.kept)], [cell_name(c) for c in before if c not in self.kept]
        said = (f"; {_listed(kept)} {'is' if len(kept) == 1 else 'are'} kept and "
                f"{'a new worker takes the place' if len(new) == 1 else 'new workers take the places'} of {_listed(new)}"
                if kept else "; every worker starts again")
        self.record.event("restarted", d.message + said, **d.fields, checkpoint=str(newest), kept=kept, replaced=new,
                          detail=lost.detail)
        self.restarted_at = lost.time
        self.restart_deadline = time.monotonic() + self.group.start_timeout
        self.keeper.resume = str(newest)
        return Restarting()

    def _commit(self, step: int, stats: dict, wall: float, eval_loss: Optional[float] = None) -> None:
        spec, rec, shape = self.spec, self.record, self.group.shape
        rec.log_output({c: st.pop("output", []) for c, st in stats.items()})
        row = metrics_row(step, stats, wall, batch=spec.training.global_batch_size, dp=shape.dp, pp=shape.pp,
                          replicas=shape.replicas, stage_costs=shape.stage_costs, tp=shape.tp,
                          schedule=spec.parallelism.schedule, microbatches=spec.microbatches, chunks=shape.chunks,
                          reshapes=self.reshapes, snapshot_s=self.keeper.snapshot_s, rerun=step + 1 <= rec.high,
                          lr=lr_at(spec, step + 1), weight_group=spec.parallelism.weight_group)
        if eval_loss is not None:
            row["eval_loss"] = eval_loss
        if self.restarted_at is not None:  # the first step after a restart: from the loss to this commit
            row["recovery_s"], self.restarted_at = time.time() - self.restarted_at, None
        if self.installed:  # a reshape's first step: from its detection to this commit, in the row as stored
            row["recovery_s"] = time.time() - self.installed.detected  # (added after it was: REST lacked it)
        rec.check_finite(row)
        self._split_trial(step, stats, wall)
        rec.commit(row, {f"w{r}.{s}": st.pop("timeline") for (r, s), st in sorted(stats.items())})
        if self.installed:
            self._reshaped(step + 1, row["recovery_s"])
        self.keeper.after_commit(step + 1, spec, rec, self.job_id)

    def _finish(self) -> State:
        steps = self.last
        try:
            self.final = self.keeper.write_final(steps, self.model_out)
        except JobFailure:
            self.final_attempts += 1
            if not self.elastic or self.final_attempts == 3:
                raise
            # a worker went after the last commit: re-place the state, then copy it out
            alive = dict(self.group.workers)
            self.reshaper.drop_dead(alive)
            return Reshaping(move=Move("a worker was lost after the last step", keep=alive, donors=alive,
                                       exclude=set(), forced=True))
        self.save_index(self.final)
        early = steps < self.spec.training.steps
        if early:
            self.keeper.finish_writing()  # a checkpoint under way lands (its event before the end), as on a cancel
            self.record.end_at(steps)
        last = next((r["loss"] for r in reversed(self.record.metrics) if r["loss"] is not None and r["step"] <= steps),
                    None)
        loss = f", last loss {last:.6g}" if last is not None else ""
        if early:
            return Succeeded(f"job finished early, as {self.finish_asked} asked: {steps} of "
                             f"{self.spec.training.steps} steps{loss}", {"step": steps, "early": True})
        return Succeeded(f"job finished: {steps} steps{loss}")

    # ---------------------------------------------------------------- elasticity

    def _at_boundary(self, step: int) -> Optional[Move]:
        """Between steps: move off draining nodes, or grow onto workers started for it."""
        view = self.watch.view
        stay_s, stay_step = self.drain_stay
        drain = self.reshaper.off_draining(view) if time.monotonic() >= stay_s and step != stay_step else None
        return drain or self._shrink() or (None if self.finish_asked else self._grow(view))  # no growth for a last step

    def _shrink(self) -> Optional[Move]:
        """Above the cluster scheduler's allotment: keep that many workers (whole replicas
        first, so the least state moves) and stop the others."""
        g = self.group
        if self.cap is None or len(g.workers) <= self.cap:
            return None
        if g.joining is not None:  # (no longer joining first: their TP groups' placement groups go too)
            handles, g.joining = g.joining.handles, None
            g.stop_others(handles)
        keep = dict(sorted(g.workers.items())[:self.cap])
        return Move(f"the cluster scheduler: {self.cap_reason}", keep=keep, donors=dict(g.workers),
                    exclude=set(), forced=True)

    def _grow(self, view) -> Optional[Move]:
        g, now = self.group, time.monotonic()
        if g.joining is not None:
            detected, extra = g.joining.detected, g.joined()
            if extra:
                k = len(extra)
                return Move(f"{k} more worker slot{'s' if k > 1 else ''} joined", keep={**g.workers, **extra},
                            donors=dict(g.workers), exclude=set(), forced=False, detected=detected)
            if extra is not None:  # some could not start in time: try again later
                self.grow_after = now + 30
            elif now >= self.join_more_after:
                self.join_more_after = now + self.join_more_every_s
                self._join_more(len(g.workers) + len(g.joining.handles))
            return None
        if now < self.grow_after:
            return None
        sit = self._situation(kept=len(g.workers), exclude=set(), forced=False)
        d = policy.decide(sit, self.spec, self.layers.facts)
        if isinstance(d, policy.Reshape):
            g.start_joining(d.more_workers(len(g.workers)))
            self._started_joining()
        elif d.reason != "no free slot":
            self.grow_after = now + 5  # re-plan when the cluster changes, not every step
            if d.reason not in policy.EXPECTED_KEEPS and sit.free not in self.declined_at:
                # free slots the job does not take, said once for each number of them (a job that
                # stayed at 1x3 beside a node that joined said nothing: a user trial)
                self.declined_at.add(sit.free)
                n = sit.free
                self.record.event("grow_declined", f"{n:g} free worker slot{'' if n == 1 else 's'} not taken: "
                                  f"{d.reason}", free_slots=n, reason=d.reason, step=self.record.step)
        return None

    def _join_more(self, counted: int) -> None:
        """While a growth's workers start: slots that came free since (the nodes of a scale-up
        come seconds apart) get workers of their own now, not once these are up, so that the
        job grows once, onto all of them, a worker's start (~4 s) sooner.  ``counted``: the
        job's workers and those starting, which hold their slots already."""
        if self.watch.view.time < self.joining_since + min(1.0, self.join_more_every_s):
            return  # a view from before the workers starting took their slots would count those slots twice
        sit = self._situation(kept=counted, exclude=set(), forced=False, fresh=False)  # no GCS call mid-training
        d = policy.decide(sit, self.spec, self.layers.facts)
        if isinstance(d, policy.Reshape) and d.shape.workers > counted:
            self.group.add_joining(d.shape.workers - counted)
            self._started_joining()

    def _started_joining(self) -> None:
        self.joining_since = time.time()
        self.join_more_after = time.monotonic() + self.join_more_every_s

    def _reshape(self, state: Reshaping) -> State:
        move, g = state.move, self.group
        t = time.time()
        move.phases.setdefault("began_at", t)  # training stopped here (a loss: at its detection)
        if move.committed is None:
            self.reshaper.choose_copy(move, self.record.step)
        joined = len([c for c in move.keep if c not in g.workers]) if not move.forced else 0
        if move.forced:
            g.take_joined(move.keep)
        sit = self._situation(kept=len(g.whole_groups(move.keep)), exclude=move.exclude, forced=move.forced,
                              since=state.waited_since, joined=joined)
        d = policy.decide(sit, self.spec, self.layers.facts)
        up = move.exclude & self.watch.view.alive - self.reshaper.suspect(self.watch.view.alive)
        if isinstance(d, (policy.Wait, policy.Fail)) and up:
            # the nodes that lost workers are left out so that a loss does not wait on them, but
            # rather than wait for others (or fail), their free slots count once they are known
            # up: another worker there answered, or Ray still lists them alive after SUSPECT_S
            # (a worker process died, e.g. killed for memory, on a node it had to itself)
            move.exclude = move.exclude - up
            sit = self._situation(kept=sit.kept, exclude=move.exclude, forced=move.forced,
                                  since=state.waited_since, joined=joined)
            d = policy.decide(sit, self.spec, self.layers.facts)
        if isinstance(d, (policy.Wait, policy.Fail)) and move.forced and not move.draining and self._release(move, sit):
            return Reshaping(move=move, attempt=state.attempt, waited_since=state.waited_since)
        if move.draining and isinstance(d, (policy.Wait, policy.Fail)):
            return self._train_on_draining(move, d)
        if isinstance(d, (policy.Wait, policy.Fail)):
            return self._wait(d, state.waited_since, lambda since: Reshaping(move=move, attempt=state.attempt,
                                                                           waited_since=since), sit, move)
        if isinstance(d, policy.Keep):  # the growth no longer pays
            g.stop_others([h for c, h in move.keep.items() if c not in g.workers])
            return Running(self.record.step)
        if not move.forced and d.shape.workers > len(move.keep):
            # more slots came free while the growth's workers started: start the rest in the
            # background too (started here, training would pause for a worker's start, ~5 s)
            g.start_joining(d.shape.workers - len(move.keep), up=tuple(h for c, h in move.keep.items()
                                                                       if c not in g.workers), detected=move.detected)
            self._started_joining()
            return Running(self.record.step)
        move.phases["plan_s"] = move.phases.get("plan_s", 0.0) + time.time() - t
        try:
            self.installed = self.reshaper.carry_out(move, d.shape, d.reason, self.layers.boundary(d.shape))
        except JobFailure as e:
            dead = self.reshaper.drop_dead(move.keep) | self.reshaper.drop_dead(move.donors)
            if state.attempt == 2 or not dead:
                raise
            self.record.event("worker_lost", f"{e} while reshaping; planning again", detail=e.detail)
            again = Move(move.reason, keep=move.keep, donors={}, exclude=move.exclude,
                         forced=True, detected=move.detected, phases=move.phases)
            return Reshaping(move=again, attempt=state.attempt + 1)
        self.reshapes += 1
        self.drains_seen -= set(move.draining)
        self._announce(d.shape, d.reason)
        if move.steps_lost:  # the rows of the lost steps stay; their re-runs come again, marked rerun
            self.record.go_back(move.committed)
        return Running(move.committed)

    def _release(self, move: Move, sit: policy.Situation) -> bool:
        """A reshape after a loss that would wait for slots its own live workers hold (ones it
        cannot keep: stuck in their step, or in a tensor-parallel group that lost a member), when
        those slots would let it go on: their state comes to the scheduler and they are stopped
        (``Reshaper.release_held``).  True when it did so (the reshape then plans again)."""
        if not move.after_loss or move.release_tried:
            return False
        g = self.group
        held = self.reshaper.held(move)
        if not held:
            return False
        freed = g.slots_freed(held, self.reshaper.dead(move), self.reshaper.taken_in(move))
        view = self.watch.view
        free = {n: dict(r) for n, r in view.free.items()}
        for node, cpus in freed.items():
            res = free.setdefault(node, {})
            res["CPU"] = res.get("CPU", 0.0) + cpus
            if g.gpus:
                res["GPU"] = res.get("GPU", 0.0) + cpus / self.spec.resources.cpus_per_worker * g.gpus
        more = dataclasses.replace(view, free=free).free_slots(
            self.spec.resources.cpus_per_worker, g.gpus, move.exclude | self.reshaper.suspect(view.alive),
            group=self.spec.parallelism.tp)
        if isinstance(policy.decide(dataclasses.replace(sit, free=more), self.spec, self.layers.facts),
                      (policy.Wait, policy.Fail)):
            return False
        names = sorted(cell_name(c) for c in held)
        stuck = sorted(cell_name(c) for c in held if c not in move.keep)  # (the move changes below)
        broken = sorted(set(names) - set(stuck))
        done = self.reshaper.release_held(move, self.record.step)
        if done is None:  # an export failed, and without them the move would go back further: wait as before
            return False
        why = "; ".join(x for x in (f"{_listed(stuck)} still in the aborted step" if stuck else "",
                                    f"{_listed(broken)} in a tensor-parallel group not whole any more" if broken else "")
                        if x)
        took = (f"first the scheduler took the state only {'it' if len(held) == 1 else 'they'} held of step "
                f"{done['step']} ({done['pieces']} layer piece{'s' if done['pieces'] != 1 else ''})"
                if done["pieces"] else f"{'it' if len(held) == 1 else 'they'} held no state the reshape lacked")
        failed = (f"; {_listed([cell_name(c) for c in done['failed']])} could not give "
                  f"{'its' if len(done['failed']) == 1 else 'their'} state, which comes from a copy"
                  if done["failed"] else "")
        self.record.event("released", f"stopped {_listed(names)} ({why}) to free "
                          f"{'its' if len(held) == 1 else 'their'} slots for the reshape; {took}{failed}",
                          workers=names, step=done["step"], pieces=done["pieces"])
        deadline = time.monotonic() + 5.0  # Ray frees the slots within about a second: plan once they show
        while time.monotonic() < deadline:
            again = self._situation(kept=len(g.whole_groups(move.keep)), exclude=move.exclude, forced=True)
            if not isinstance(policy.decide(again, self.spec, self.layers.facts), (policy.Wait, policy.Fail)):
                break
            time.sleep(0.2)
        return True

    def _train_on_draining(self, move: Move, d) -> State:
        """Nowhere to move off draining nodes: their workers train on until a slot frees up
        (tried again every few seconds) or the node goes (a loss, then).  The first time, a
        checkpoint when the job writes them, so that a node going early costs only the steps
        after it."""
        g, step = self.group, self.record.step
        g.stop_others([h for c, h in move.keep.items() if c not in g.workers])  # workers taken from a growth
        self.drain_stay = (time.monotonic() + self.drain_recheck_s, step)  # at least a step, then look again
        new = set(move.draining) - self.drains_seen
        if new:
            self.drains_seen |= new
            saved = ""
            if self.keeper.checkpoint_root and step:
                try:
                    path = self.keeper.checkpoint_now(step, self.spec, self.record, self.job_id)
                    saved = f"; checkpoint of step {step}: {path}"
                except JobFailure as e:
                    saved = f"; the checkpoint of step {step} failed: {e}"
            self.record.event("draining_stay", f"{move.reason}, and no free slot to move its workers to "
                              f"({d.reason}): training goes on there until a slot frees up or the node goes{saved}",
                              nodes=list(move.draining), step=step)
        return Running(step)

    def _reshaped(self, committed: int, seconds: float) -> None:
        """The first step of a new shape committed: record the reshape with its cost."""
        r, self.installed, self.declined_at = self.installed, None, set()
        self.record.reshaped(r, committed, seconds)


def _listed(names: list) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
