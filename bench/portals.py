"""What portals save: bytes moved per step and step time of a U-Net-like model whose two nested
skips cross stages, with portals (relaytrain.skip: each skip goes straight from the stage that
stashes it to the stage that pops it) against the same network written without them (each skip
concatenated onto the activation and carried through every stage in between, as a model must be
written for a pipeline that has no skips).

    .venv/bin/python bench/portals.py [--widths 256 1024] [--ms 4 8] [--steps 6]

9 layers: in -> Down(w) -> Down(w/2) -> bottleneck -> Up(w/2) -> Up(w) -> head, cut at pp = 3
into [0-2] [3-5] [6-8] (the outer skip, w wide, from stage 0 to stage 2; the inner, w/2, from
stage 1 to stage 2), 1F1B, collective transport, microbatches of 32 digits.  Bytes are what
the workers received from each other per step (the metrics rows' ``received_bytes``: forward
activations, their gradients, skips and skip gradients), summed over the stages; the step time
is the median ``step_time_s`` after the first step.  Writes bench/results/portals.{txt,json}.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402


def unet_portals(width: int = 256):
    """The tests' U-Net-like model (tests/fixtures/userpkg/models.py: Down and Up with relaytrain.skip)."""
    from relaytrain.skip import Namespace
    from tests.fixtures.userpkg.models import _skip_layers

    Down, Up = _skip_layers()
    outer, inner = Namespace("outer"), Namespace("inner")
    w = width
    return [lambda: nn.Linear(64, w), nn.ReLU, lambda: Down(w).isolate(outer), lambda: Down(w // 2).isolate(inner),
            lambda: nn.Linear(w // 4, w // 4), nn.Tanh, lambda: Up(w // 2).isolate(inner),
            lambda: Up(w).isolate(outer), lambda: nn.Linear(w, 10)]


class _Carry(nn.Module):
    """Runs ``inner`` on the first ``head`` features and carries the rest through."""

    def __init__(self, inner: nn.Module, head: int):
        super().__init__()
        self.inner, self.head = inner, head

    def forward(self, x):
        return torch.cat([self.inner(x[:, :self.head]), x[:, self.head:]], 1)


class _CarryDown(nn.Module):
    """Down, with its skip appended to the activation: [h | carried] -> [down(y) | y | carried]."""

    def __init__(self, w):
        super().__init__()
        self.w, self.inner, self.down = w, nn.Linear(w, w), nn.Linear(w, w // 2)

    def forward(self, x):
        y = torch.relu(self.inner(x[:, :self.w]))
        return torch.cat([self.down(y), y, x[:, self.w:]], 1)


class _CarryUp(nn.Module):
    """Up, taking its skip from the activation: [h | skip | carried] -> [relu(up(h) + skip) | carried]."""

    def __init__(self, w):
        super().__init__()
        self.w, self.up = w, nn.Linear(w // 2, w)

    def forward(self, x):
        h, skip = x[:, :self.w // 2], x[:, self.w // 2:self.w // 2 + self.w]
        return torch.cat([torch.relu(self.up(h) + skip), x[:, self.w // 2 + self.w:]], 1)


def unet_carried(width: int = 256):
    w = width
    return [lambda: nn.Linear(64, w), nn.ReLU, lambda: _CarryDown(w), lambda: _CarryDown(w // 2),
            lambda: _Carry(nn.Linear(w // 4, w // 4), w // 4), lambda: _Carry(nn.Tanh(), w // 4),
            lambda: _CarryUp(w // 2), lambda: _CarryUp(w), lambda: nn.Linear(w, 10)]


def spec_of(how: str, width: int, m: int, steps: int):
    from service.spec import parse_spec

    return parse_spec({
        "name": f"bench-portals-{how}-{width}-m{m}",
        "model": {"builder": f"bench.portals:unet_{how}", "args": {"width": width}},
        "data": {"kind": "digits"},
        "optimizer": {"name": "sgd", "lr": 0.01},
        "training": {"global_batch_size": 32 * m, "microbatch_size": 32, "steps": steps, "seed": 0},
        "parallelism": {"dp": 1, "pp": 3, "schedule": "1f1b", "partition": [3, 3, 3]},
    })


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--widths", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--ms", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    import ray

    from actors.runner import run_job

    ray.init(address="local", num_cpus=16, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    t0, load0, rows = time.time(), os.getloadavg(), []
    for width in args.widths:
        for m in args.ms:
            for how in ("portals", "carried"):
                with tempfile.TemporaryDirectory() as out:
                    final = run_job(spec=spec_of(how, width, m, args.steps), out=out, progress=False, record=False,
                                    spec_dir=str(ROOT))
                last = final["metrics"][-1]["received_bytes"]
                kinds: dict = {}
                for stage in last:
                    for k, v in stage.items():
                        kinds[k] = kinds.get(k, 0) + v
                rows.append({"width": width, "M": m, "how": how, "bytes": sum(kinds.values()), "by_kind": kinds,
                             "per_stage": [sum(s.values()) for s in last],
                             "step_ms": statistics.median(r["step_time_s"] for r in final["metrics"][1:]) * 1e3})
                print(rows[-1], flush=True)
    lines = [f"U-Net-like MLP, 9 layers at pp = 3 ([0-2] [3-5] [6-8]), 1F1B, collective, microbatch 32; "
             f"{args.steps - 1} steps timed; load {load0} -> {os.getloadavg()}; {time.time() - t0:.0f} s", "",
             "| width | M | portals: KiB received per step (stage 0 / 1 / 2) | carried | carried over portals | "
             "step ms, portals | step ms, carried |", "|---|---|---|---|---|---|---|"]
    for width in args.widths:
        for m in args.ms:
            p, c = (next(r for r in rows if (r["width"], r["M"], r["how"]) == (width, m, h)) for h in ("portals", "carried"))
            lines.append(f"| {width} | {m} | {p['bytes'] / 1024:.0f} ({' / '.join(f'{b / 1024:.0f}' for b in p['per_stage'])}) "
                         f"| {c['bytes'] / 1024:.0f} ({' / '.join(f'{b / 1024:.0f}' for b in c['per_stage'])}) | "
                         f"{c['bytes'] / p['bytes']:.2f}x | {p['step_ms']:.1f} | {c['step_ms']:.1f} |")
    text = "\n".join(lines)
    print(text)
    (ROOT / "bench" / "results" / "portals.txt").write_text(text + "\n")
    (ROOT / "bench" / "results" / "portals.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
