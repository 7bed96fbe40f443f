"""Measured step timelines: what each worker did when, as data, a check and an SVG swimlane.

A worker reports, for each step, ``(action, start, end)`` per action it ran (wall-clock
seconds around the action's compute; waiting for a neighbour's activation or gradient is
outside the box, so it shows as idle).  The scheduler keeps the newest steps in memory and
hands one now and then (at most one a second, and the last before the job's state changes)
to the job store, which keeps a ring of the newest :data:`RING` per job.  Everything here is
pure: plain data in, plain data (or SVG text) out, tested without Ray.

The stored entry (:func:`record`)::

    {"step": 37, "start": 1763.2, "dp": 2, "pp": 2, "schedule": "1f1b", "chunks": 1,
     "microbatches_per_replica": 2, "nodes": {"w0.0": "3f2a...", ...},
     "workers": {"w0.0": [["0F0", 0.0, 0.0041], ...], ...}}

(times relative to the step's first action).  An action is named like ``3B2``: virtual stage
(model chunk) 3, kind, global microbatch 2; the kinds are F (forward), B (backward; in the
split schedules zb_h1 and zbv only the input gradient), W (the weight gradient of a split
schedule) and E (a forward of the evaluation after the step, not planned).  ``chunks`` is the
model chunks per worker (``parallelism.stages_per_worker``: interleaved_1f1b and zbv place
several on each worker, so a worker's lane holds several virtual stages).  :func:`view` turns it into the JSON of
``GET /v1/jobs/{id}/timeline``; :func:`render_svg` into the swimlane picture the web page,
``GET /v1/jobs/{id}/timeline.svg`` and ``relaytrain timeline --out`` show.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence
from xml.sax.saxutils import escape, quoteattr

from service import replicas as rp
from service import schedules

RING = 16         # timelines kept per job in the store (the newest written)
EVERY_S = 1.0     # at most one timeline written per this many seconds, plus the last before a state change

_WORKER_RE = re.compile(r"^w(\d+)\.(\d+)$")


def record(step: int, shape: dict, workers: dict[str, Iterable]) -> dict:
    """The compact entry of one committed step: ``workers`` maps ``w<dp>.<pp>`` to the
    worker's ``(action, start, end)`` list; ``shape`` is the scheduler's shape dict (its
    ``chunks`` or ``stages_per_worker``; when absent the schedule's default, :func:`chunks_of`)."""
    t_min = min((float(t0) for acts in workers.values() for _, t0, _ in acts), default=0.0)
    return {"step": int(step), "start": t_min, "dp": shape.get("dp"), "pp": shape.get("pp"),
            "schedule": shape.get("schedule"), "chunks": chunks_of(shape),
            "microbatches_per_replica": shape.get("microbatches_per_replica"),
            **({"replicas": list(shape["replicas"]), "stage_costs": list(shape.get("stage_costs") or [])}
               if shape.get("replicas") else {}),
            **({"tp": int(shape["tp"])} if (shape.get("tp") or 1) > 1 else {}),
            **({"weight_group": weight_group_of(shape)} if weight_group_of(shape) > 1 else {}),
            **({"sends_early": True} if shape.get("sends_early") else {}),  # see schedules.sends_early
            **({"last_sent_early": True} if shape.get("last_sent_early") else {}),  # schedules.simulate's last_early
            "nodes": dict(shape.get("workers") or {}),
            "portals": [list(q) for q in shape.get("portals") or []],
            "workers": {w: [[str(a), round(float(t0) - t_min, 6), round(float(t1) - t_min, 6)] for a, t0, t1 in acts]
                        for w, acts in workers.items()}}


def parse_worker(name: str) -> tuple[int, int]:
    m = _WORKER_RE.match(name)
    if not m:
        raise ValueError(f"not a worker name: {name!r} (write it like 'w0.1')")
    return int(m.group(1)), int(m.group(2))


def chunks_of(entry: dict) -> int:
    """Model chunks per worker of a shape dict or an entry: its ``chunks`` (or the shape's
    ``stages_per_worker``), else the schedule's default (as service/spec.py: 2 for
    interleaved_1f1b and zbv, 1 for the others)."""
    v = entry.get("chunks") or entry.get("stages_per_worker")
    return int(v) if v else 2 if entry.get("schedule") in schedules.CHUNKED else 1


def weight_group_of(entry: dict) -> int:
    """The W's grouped per microbatch count of a shape dict or an entry (``parallelism.weight_group``; 1 if absent)."""
    return int(entry.get("weight_group") or 1)


def planned_order(schedule: str, pp: int, microbatches_per_replica: int, dp_rank: int, pp_rank: int,
                  chunks: int = 1, replicas: Sequence[int] = (), stage_costs: Sequence[float] = (),
                  tp: int = 1, weight_group: int = 1) -> list[str]:
    """The actions worker (dp_rank, pp_rank) runs, in the plan's order (virtual stage ids: a
    chunked schedule's worker runs several), with global microbatch ids (replica r runs
    microbatches ``[r*m, (r+1)*m)``).  With ``replicas`` (workers per stage), ``pp_rank`` is
    the worker's slot in its pipeline (service/replicas.py), its order planned with ``stage_costs``;
    with ``tp`` > 1 it is the slot ``stage * tp + TP rank`` (every rank runs its stage's order)."""
    m = microbatches_per_replica
    if replicas:
        order = rp.plan(schedule, replicas, m, rp.relative(stage_costs)).order[pp_rank]
    else:
        order = schedules.build(schedule, pp, m, chunks, weight_group).order[pp_rank // tp]
    return [f"{a.stage}{a.kind}{a.mb + dp_rank * m}" for a in order]


def width_of(entry: dict) -> int:
    """Workers of one pipeline of a shape dict or an entry: sum(replicas), or pp x tp."""
    return sum(entry.get("replicas") or ()) or entry["pp"] * (entry.get("tp") or 1)


def stage_of_slot(entry: dict, slot: int) -> tuple[int, int]:
    """(stage, its replica or TP rank) of a pipeline's worker ``slot`` in a shape dict or an entry."""
    if entry.get("replicas"):
        return rp.stage_of(entry["replicas"], slot)
    return divmod(slot, entry.get("tp") or 1)


def check(entry: dict) -> list[str]:
    """What is wrong with a measured timeline, as sentences (empty: nothing): a lane missing or
    extra, a worker whose actions are not the plan's in the plan's order, a box that ends
    before it starts, two boxes of one worker that overlap."""
    problems = []
    dp, pp = entry["dp"], entry["pp"]
    want = {f"w{r}.{s}" for r in range(dp) for s in range(width_of(entry))}
    got = set(entry["workers"])
    if got != want:
        problems.append(f"lanes {sorted(got)} are not the {dp}x{pp} shape's {sorted(want)}")
    for w in sorted(got & want):
        r, s = parse_worker(w)
        acts = entry["workers"][w]
        order = [a for a, _, _ in acts if schedules.Action.parse(a).kind != "E"]  # the evaluation's are not planned
        plan = planned_order(entry["schedule"], pp, entry["microbatches_per_replica"], r, s, chunks_of(entry),
                             entry.get("replicas") or (), entry.get("stage_costs") or (), entry.get("tp") or 1,
                             weight_group_of(entry))
        if order != plan:
            problems.append(f"{w} ran {' '.join(order)}; the plan is {' '.join(plan)}")
        for a, t0, t1 in acts:
            if t1 < t0:
                problems.append(f"{w} {a} ends before it starts ({t0:.6f} > {t1:.6f})")
        for (a, _, end_a), (b, start_b, _) in zip(acts, acts[1:]):
            if start_b < end_a:
                problems.append(f"{w} {b} starts at {start_b:.6f}, before {a} ends at {end_a:.6f}")
    return problems


def plan_utilization(schedule: str, pp: int, microbatches_per_replica: int, backward_cost: float = 2,
                     chunks: int = 1, early: bool = False, weight_group: int = 1, last: bool = False) -> float:
    """The plan's ideal utilization (busy area / total area), backward = 2 x forward as in the
    ``bubble_plan`` metric and ``relaytrain schedule`` (split schedules: B and W each half of it);
    ``early``: as run with each input gradient sent before the weight gradients (``schedules.sends_early``);
    ``last``: only each worker's last backward of the step so (``schedules.simulate``'s ``last_early``)."""
    plan = schedules.build(schedule, pp, microbatches_per_replica, chunks, weight_group)
    return float(schedules.simulate(schedules.sends_early(plan) if early else plan, backward_cost,
                                    last_early=last).utilization)


def view(entry: dict, available: Iterable[int] = (), job: Optional[str] = None) -> dict:
    """The JSON of ``GET /v1/jobs/{id}/timeline``: one lane per worker in (dp, pp) order, each
    box with its start and end (seconds from the step's first action), the measured
    utilization (per replica: busy time / (stages x its span), averaged) beside the plan's."""
    lanes = []
    for w in sorted(entry["workers"], key=parse_worker):
        r, s = parse_worker(w)
        boxes = []
        for a, t0, t1 in entry["workers"][w]:
            act = schedules.Action.parse(a)
            boxes.append({"action": a, "kind": act.kind, "mb": act.mb, "start": t0, "end": t1})
        train = [b for b in boxes if b["kind"] != "E"]  # the step's own; "E": the evaluation after it
        stage, rank = stage_of_slot(entry, s)
        lanes.append({"worker": w, "dp_rank": r, "pp_rank": stage, "slot": s,
                      **({"tp_rank": rank} if (entry.get("tp") or 1) > 1 else {}),
                      "node": (entry.get("nodes") or {}).get(w),
                      "busy_s": sum(b["end"] - b["start"] for b in train), "actions": boxes})
    per_replica: dict[int, list[dict]] = {}
    for lane in lanes:
        per_replica.setdefault(lane["dp_rank"], []).append(lane)
    utils = []
    for replica in per_replica.values():
        boxes = [b for lane in replica for b in lane["actions"] if b["kind"] != "E"]
        if not boxes:
            continue
        span = max(b["end"] for b in boxes) - min(b["start"] for b in boxes)
        utils.append(sum(lane["busy_s"] for lane in replica) / (width_of(entry) * span) if span > 0 else 1.0)
    span = max((b["end"] for lane in lanes for b in lane["actions"]), default=0.0)
    try:
        if entry.get("replicas"):
            plan = 1.0 - float(rp.plan(entry["schedule"], entry["replicas"], entry["microbatches_per_replica"],
                                       rp.relative(entry.get("stage_costs"))).bubble)
        else:
            plan = plan_utilization(entry["schedule"], entry["pp"], entry["microbatches_per_replica"],
                                    chunks=chunks_of(entry), early=bool(entry.get("sends_early")),
                                    weight_group=weight_group_of(entry), last=bool(entry.get("last_sent_early")))
    except (ValueError, TypeError):
        plan = None
    return {"job": job, "step": entry["step"], "available": sorted(set(available) | {entry["step"]}),
            "portals": _portals(entry, lanes),
            "dp": entry["dp"], "pp": entry["pp"], "schedule": entry["schedule"], "chunks": chunks_of(entry),
            **({"weight_group": weight_group_of(entry)} if weight_group_of(entry) > 1 else {}),
            **({"replicas": entry["replicas"]} if entry.get("replicas") else {}),
            **({"tp": entry["tp"]} if entry.get("tp") else {}),
            "microbatches_per_replica": entry["microbatches_per_replica"], "start": entry.get("start"),
            "span_s": span, "utilization": sum(utils) / len(utils) if utils else None,
            "utilization_plan": plan, "sends_early": bool(entry.get("sends_early")),
            "last_sent_early": bool(entry.get("last_sent_early")), "lanes": lanes}


def _portals(entry: dict, lanes: list[dict]) -> list[dict]:
    """Each skip tensor that went from one worker to another (relaytrain.skip): from the end of
    the forward that stashed it (chunk ``src``) to the start of the forward that popped it
    (chunk ``dst``), microbatch by microbatch."""
    where = {b["action"]: (lane["worker"], b) for lane in lanes if not lane.get("tp_rank")  # TP rank 0's
             for b in lane["actions"] if b["kind"] == "F"}
    out = []
    for src, dst, name in entry.get("portals") or []:
        for a, (worker, b) in where.items():
            act = schedules.Action.parse(a)
            if act.stage != src:
                continue
            to = where.get(f"{dst}F{act.mb}")
            if to is not None and to[0] != worker:
                out.append({"skip": name, "mb": act.mb, "from": worker, "to": to[0], "start": b["end"],
                            "end": to[1]["start"]})
    return sorted(out, key=lambda q: (q["start"], q["skip"]))


def steps_text(steps: list[int]) -> str:
    """``[3, 4, 5, 9]`` -> ``'3-5, 9'``."""
    out, steps = [], sorted(steps)
    i = 0
    while i < len(steps):
        j = i
        while j + 1 < len(steps) and steps[j + 1] == steps[j] + 1:
            j += 1
        out.append(str(steps[i]) if i == j else f"{steps[i]}-{steps[j]}")
        i = j + 1
    return ", ".join(out)


# ---------------------------------------------------------------- the picture

EVAL_COLOUR = "#3f3f46"
PALETTE = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948",
           "#b07aa1", "#ff9da7", "#9c755f", "#86bcb6", "#8cd17d", "#d37295"]


def colour(mb: int, kind: str) -> str:
    """Microbatch ``mb``'s colour: forward in its light shade, backward (B) in its dark one, a
    split schedule's weight gradient (W) in its plain hue between them (drawn hatched)."""
    base = PALETTE[mb % len(PALETTE)]
    r, g, b = (int(base[i:i + 2], 16) for i in (1, 3, 5))
    if kind == "E":  # an evaluation's forward: one grey, whatever the microbatch
        return EVAL_COLOUR
    if kind == "W":  # the palette's own shade
        return base
    if kind == "F":  # toward white
        r, g, b = (int(c + (255 - c) * 0.35) for c in (r, g, b))
    else:            # toward black
        r, g, b = (int(c * 0.78) for c in (r, g, b))
    return f"#{r:02x}{g:02x}{b:02x}"


def _ms(seconds: float) -> str:
    ms = seconds * 1000
    return f"{ms:.0f} ms" if ms >= 100 else f"{ms:.1f} ms" if ms >= 1 else f"{ms:.2f} ms"


def _tick_step(span_ms: float, target: int = 8) -> float:
    raw = max(span_ms, 1e-6) / target
    mag = 10 ** math.floor(math.log10(raw))
    for k in (1, 2, 2.5, 5, 10):
        if raw <= k * mag:
            return k * mag
    return 10 * mag


def _pct(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.1%}"


@dataclass(frozen=True)
class _Layout:
    """Where things go in the swimlane: pixel sizes of the margins and lanes, and the time scale."""

    width: int
    lanes: int
    span: float        # seconds the plot spans: the step's span, never 0
    left: int = 150    # lane labels to the left of this, the plot to the right
    right: int = 16
    top: int = 58      # the title and the utilization line above this
    lane_h: int = 30
    gap: int = 8       # between lanes

    @property
    def plot_w(self) -> int:
        return self.width - self.left - self.right

    @property
    def sx(self) -> float:
        """Pixels per second."""
        return self.plot_w / self.span

    @property
    def bottom(self) -> int:
        """Just below the last lane: the time axis' labels go here."""
        return self.lane_y(self.lanes)

    @property
    def height(self) -> int:
        return self.bottom + 44

    def lane_y(self, i: int) -> int:
        return self.top + i * (self.lane_h + self.gap)

    def x(self, t: float) -> float:
        return round(self.left + t * self.sx, 2)


def render_svg(v: dict, width: int = 960, title: Optional[str] = None) -> str:
    """The swimlane of :func:`view`'s ``v`` as a standalone SVG document: a lane per worker
    (labelled ``w<dp>.<pp>`` and its node), a box per action at its measured start and end,
    coloured by microbatch (forward light, backward dark, weight gradient between them and
    striped), idle time hatched.  Elements carry
    ``data-lane``, ``data-action`` and ``data-idle`` so pages and tests can find them."""
    lay = _Layout(width, len(v["lanes"]), v["span_s"] or 1e-9)
    out = [*_svg_open(v, lay), *_headline(v, lay, title), *_time_axis(lay)]
    split = v.get("schedule") in schedules.SPLIT
    for i, lane in enumerate(v["lanes"]):
        out += _lane(lane, lay.lane_y(i), lay, split)
    out += _portal_lines(v, lay)
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _portal_lines(v: dict, lay: _Layout) -> list[str]:
    """A dashed line per skip tensor sent between workers: from the bottom of the stasher's lane
    where its forward ended to the top of the popper's lane where its forward began."""
    row = {lane["worker"]: i for i, lane in enumerate(v["lanes"])}
    out = []
    for q in v.get("portals") or []:
        y0, y1 = lay.lane_y(row[q["from"]]), lay.lane_y(row[q["to"]])
        if y1 > y0:
            y0 += lay.lane_h
        else:
            y1 += lay.lane_h
        tip = f'skip {q["skip"]!r} of microbatch {q["mb"]}: {q["from"]} -> {q["to"]}'
        out.append(f'<line class="portal" data-skip={quoteattr(q["skip"])} data-mb="{q["mb"]}" '
                   f'x1="{lay.x(q["start"])}" y1="{y0}" x2="{lay.x(q["end"])}" y2="{y1}" stroke="#7b2cbf" '
                   f'stroke-width="1.5" stroke-dasharray="4 3"><title>{escape(tip)}</title></line>')
    return out


def _svg_open(v: dict, lay: _Layout) -> list[str]:
    """The root element (its ``data-*`` say the step, lanes, utilizations and steps kept), the
    idle hatching pattern, the weight gradient's stripes and the white background."""
    available = " ".join(str(s) for s in v.get("available", []))
    return [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="swimlane" width="{lay.width}" height="{lay.height}" '
        f'viewBox="0 0 {lay.width} {lay.height}" data-step="{v["step"]}" data-lanes="{lay.lanes}" '
        f'data-utilization="{v["utilization"] if v["utilization"] is not None else ""}" '
        f'data-utilization-plan="{v["utilization_plan"] if v["utilization_plan"] is not None else ""}" '
        f'data-sends-early="{"1" if v.get("sends_early") else ""}" '
        f'data-last-sent-early="{"1" if v.get("last_sent_early") else ""}" '
        f'data-weight-group="{v.get("weight_group") or 1}" '
        f'data-available="{available}" font-family="system-ui, -apple-system, Segoe UI, Helvetica, Arial, sans-serif">',
        "<defs>",
        '<pattern id="rt-idle" width="6" height="6" patternUnits="userSpaceOnUse" patternTransform="rotate(45)">'
        '<rect width="6" height="6" fill="#f6f7f9"/><line x1="0" y1="0" x2="0" y2="6" stroke="#d5d9e0" '
        'stroke-width="2"/></pattern>',
        '<pattern id="rt-weight" width="5" height="5" patternUnits="userSpaceOnUse" patternTransform="rotate(-45)">'
        '<line x1="0" y1="0" x2="0" y2="5" stroke="#ffffff" stroke-opacity="0.45" stroke-width="2"/></pattern>',
        "</defs>",
        f'<rect width="{lay.width}" height="{lay.height}" fill="#ffffff"/>',
    ]


def _headline(v: dict, lay: _Layout, title: Optional[str]) -> list[str]:
    """Two lines above the lanes: ``title`` (default: job, step and shape), then the measured
    and planned utilization and the step's span."""
    chunks, group = v.get("chunks") or 1, v.get("weight_group") or 1
    head = title or (f"{v['job'] + '  ' if v.get('job') else ''}step {v['step']}  ·  {rp.shape_label_of(v)} "
                     f"{v['schedule']}{f' ({chunks} chunks per worker)' if chunks > 1 else ''}"
                     f"{f', W in groups of {group}' if group > 1 else ''}, "
                     f"{v['microbatches_per_replica']} microbatches per replica")
    cost = "B = W = forward" if v["schedule"] in schedules.SPLIT else "backward = 2 x forward"
    util = (f"measured utilization {_pct(v['utilization'])}  ·  plan {_pct(v['utilization_plan'])} "
            f"({cost})  ·  step span {_ms(v['span_s'])}")
    return [f'<text x="{lay.left}" y="22" font-size="14" font-weight="600" fill="#1f2933">{escape(head)}</text>',
            f'<text x="{lay.left}" y="42" font-size="12" fill="#52606d" class="utilization">{escape(util)}</text>']


def _time_axis(lay: _Layout) -> list[str]:
    """A grid line at each round number of milliseconds across all lanes, its label below the
    lanes, and the axis' caption."""
    out = []
    step_ms = _tick_step(lay.span * 1000)
    axis_y = lay.bottom + 4
    t = 0.0
    while t <= lay.span * 1000 + 1e-9:
        gx = lay.x(t / 1000)
        out.append(f'<line x1="{gx}" y1="{lay.top - 4}" x2="{gx}" y2="{axis_y}" stroke="#eceff3" stroke-width="1"/>')
        label = f"{t:g}" if step_ms >= 1 else f"{t:.2f}"
        out.append(f'<text x="{gx}" y="{axis_y + 14}" font-size="10" fill="#7b8794" text-anchor="middle">{label}</text>')
        t += step_ms
    out.append(f'<text x="{lay.left + lay.plot_w}" y="{axis_y + 30}" font-size="10" fill="#7b8794" text-anchor="end">'
               f'ms since the step\'s first action</text>')
    return out


def _lane(lane: dict, y: int, lay: _Layout, split: bool = False) -> list[str]:
    """One worker's lane at height ``y``: its labels, its idle gaps, its action boxes."""
    node = lane.get("node") or ""
    busy = lane["busy_s"] / lay.span if lay.span > 0 else 0.0
    out = [f'<g class="lane" data-lane={quoteattr(lane["worker"])} data-node={quoteattr(node)} '
           f'data-actions="{len(lane["actions"])}">',
           f'<text x="10" y="{y + 13}" font-size="13" font-weight="600" fill="#1f2933">'
           f'{escape(lane["worker"])}</text>',
           f'<text x="10" y="{y + 26}" font-size="10" fill="#7b8794">'
           f'{escape(("node " + node[:8]) if node else "node ?")} · busy {busy:.0%}</text>']
    out += _idle_marks(lane["actions"], y, lay)
    for b in lane["actions"]:
        out += _action_box(lane["worker"], b, y, lay, split)
    out.append("</g>")
    return out


def _idle_marks(actions: list[dict], y: int, lay: _Layout) -> list[str]:
    """A hatched rectangle over each gap between a lane's boxes, within the step's span."""
    out = []
    cursor = 0.0
    for b in actions + [{"start": lay.span, "end": lay.span}]:
        if b["start"] > cursor:
            out.append(f'<rect class="idle" data-idle="1" x="{lay.x(cursor)}" y="{y}" '
                       f'width="{max(0.0, round((b["start"] - cursor) * lay.sx, 2))}" height="{lay.lane_h}" '
                       f'fill="url(#rt-idle)"><title>idle {_ms(b["start"] - cursor)}</title></rect>')
        cursor = max(cursor, b["end"])
    return out


_WHAT = {"F": "forward of microbatch", "B": "backward of microbatch", "E": "eval forward of eval microbatch",
         "W": "weight-gradient backward of microbatch"}


def _action_box(worker: str, b: dict, y: int, lay: _Layout, split: bool = False) -> list[str]:
    """The box of one action ``b`` of :func:`view`'s lane, with a tooltip (``split``: B is the
    input-gradient half of a split schedule's backward), striped when a weight gradient (W),
    and its name written inside when it fits."""
    bx, bw = lay.x(b["start"]), max(1.0, round((b["end"] - b["start"]) * lay.sx, 2))
    what = "input-gradient backward of microbatch" if split and b["kind"] == "B" else _WHAT.get(b["kind"], b["kind"])
    tip = (f'{worker} {b["action"]} ({what} {b["mb"]}): {_ms(b["end"] - b["start"])}, '
           f'from +{_ms(b["start"])}')
    out = [f'<rect class="action" data-action={quoteattr(b["action"])} data-mb="{b["mb"]}" '
           f'data-kind="{b["kind"]}" data-start="{b["start"]}" data-end="{b["end"]}" x="{bx}" y="{y}" '
           f'width="{bw}" height="{lay.lane_h}" rx="3" fill="{colour(b["mb"], b["kind"])}" stroke="#ffffff" '
           f'stroke-width="1"><title>{escape(tip)}</title></rect>']
    if b["kind"] == "W":  # stripes over the hue: the weight gradient apart from B at a glance
        out.append(f'<rect class="weight-stripes" x="{bx}" y="{y}" width="{bw}" height="{lay.lane_h}" rx="3" '
                   f'fill="url(#rt-weight)" pointer-events="none"/>')
    if bw >= 7 * len(b["action"]) + 4:
        ink = "#1f2933" if b["kind"] in ("F", "W") else "#ffffff"
        out.append(f'<text x="{round(bx + bw / 2, 2)}" y="{y + lay.lane_h / 2 + 4}" font-size="11" '
                   f'text-anchor="middle" fill="{ink}" pointer-events="none">{escape(b["action"])}</text>')
    return out


def summary(v: dict) -> str:
    """The timeline as text (``relaytrain timeline`` without ``--out``)."""
    lines = [f"step {v['step']}  shape {rp.shape_label_of(v)} {v['schedule']}, {v['microbatches_per_replica']} microbatches "
             f"per replica  span {_ms(v['span_s'])}  measured utilization {_pct(v['utilization'])}, "
             f"plan {_pct(v['utilization_plan'])}"]
    for lane in v["lanes"]:
        node = (lane.get("node") or "?")[:8]
        acts = " ".join(f"{b['action']}@{b['start'] * 1000:.1f}+{(b['end'] - b['start']) * 1000:.1f}"
                        for b in lane["actions"])
        lines.append(f"{lane['worker']:<6} node {node}  busy {_ms(lane['busy_s'])}  {acts}")
    lines.append(f"steps kept: {steps_text(v.get('available', []))}  (ms: action@start+duration)")
    return "\n".join(lines)

