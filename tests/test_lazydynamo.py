"""service/lazydynamo.py: an optimizer built by relaytrain does not import torch._dynamo (about 2 s
of CPU in every scheduler and worker), and code that does compile behaves as without it.
Each case runs in a fresh interpreter: this one may have imported torch._dynamo already."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

ROOT = __file__.rsplit("/tests/", 1)[0]


def run(code: str) -> dict:
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                       timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


TRAIN = """
    import json, sys, torch
    from service.loading import build_optimizer
    from service.spec import parse_spec

    def train(name, **kw):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)).double()
        spec = parse_spec({"name": "x", "model": {"kind": "mlp"}, "data": {"kind": "digits"},
                           "optimizer": {"name": name, "lr": 0.1, **kw},
                           "training": {"global_batch_size": 4, "microbatch_size": 4, "steps": 1}})
        opt = build_optimizer(spec, m.parameters())
        for i in range(3):
            m(torch.full((4, 8), 0.1 * i, dtype=torch.float64)).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
        opt.load_state_dict(opt.state_dict())
        return [p.detach().sum().item() for p in m.parameters()], type(opt).__name__

    out = {n: train(n, **kw) for n, kw in (("sgd", {"momentum": 0.9}), ("adam", {}), ("adamw", {}))}
    print(json.dumps({"dynamo": "torch._dynamo" in sys.modules, "out": out}))
"""


def test_building_and_stepping_an_optimizer_imports_no_dynamo():
    got = run(TRAIN)
    assert got["dynamo"] is False
    # the same numbers as torch's own optimizers in a process where torch._dynamo is imported
    want = run("    import torch._dynamo" + TRAIN)
    assert want["dynamo"] is True and got["out"] == want["out"]


COMPILED = """
    import json, sys, torch
    {defer}
    torch.manual_seed(0)
    opt_model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(opt_model.parameters(), lr=0.1)   # built before torch._dynamo is imported

    def step(x):
        y = opt_model(x).relu().sum()
        opt.zero_grad()                          # torch's disabled function: dynamo must not trace into it
        y.backward()
        opt.step()                               # its graph breaks
        return y * 2

    import torch._dynamo
    from torch._dynamo.utils import counters
    f = torch.compile(step, backend="eager")
    out = [f(torch.ones(2, 4)).item() for _ in range(3)] + [p.sum().item() for p in opt_model.parameters()]
    print(json.dumps({{"out": out, "breaks": {{k: dict(v) for k, v in counters.items() if "break" in k}},
                      "frames": counters["stats"]["unique_graphs"]}}))
"""


def test_compiled_code_sees_torchs_disabled_functions():
    """A torch.compile in user code after the stand-ins went in: the same graphs, graph breaks
    and results as in a process without them."""
    with_defer = run(COMPILED.format(defer="from service import lazydynamo; assert lazydynamo.defer() > 0"))
    plain = run(COMPILED.format(defer=""))
    assert with_defer == plain

