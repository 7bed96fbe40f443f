"""actors/ties.py without Ray: the copies of a tie end with one gradient, the sum over every
copy in stage order, bit for bit on every stage."""
from __future__ import annotations

import queue
import threading

import torch
from torch import nn

from actors.ties import TiedGrads


class Mailboxes:
    """The transport's tie messages between stage threads of one process."""

    def __init__(self):
        self.boxes: dict = {}
        self.lock = threading.Lock()

    def box(self, key) -> queue.Queue:
        with self.lock:
            return self.boxes.setdefault(key, queue.Queue())

    def of(self, stage: int):
        boxes = self

        class Transport:
            def send_to(self, to, step, kind, key, tensor):
                boxes.box((stage, to, step, kind, key)).put(tensor.clone())

            def recv_from(self, frm, step, kind, key, like):
                got = boxes.box((frm, stage, step, kind, key)).get(timeout=10)
                assert (tuple(got.shape), got.dtype) == like
                return got

            def finish_step(self):
                pass

        return Transport()


def test_a_tie_held_by_three_stages_and_twice_in_one_ends_with_the_sum_in_stage_order():
    torch.manual_seed(0)
    # layers 0..4; the tie "0.weight" ~ "2.weight" ~ "3.weight" ~ "4.weight": stage 1 holds two copies
    layers = {i: nn.Linear(3, 3, bias=False) for i in range(5)}
    bounds = [(0, 2), (2, 4), (4, 5)]
    tied = [("0.weight", "2.weight", "3.weight", "4.weight")]
    grads = {i: torch.randn(3, 3) for i in range(5)}
    grads[1] = None  # layer 1 is not tied
    for i, m in layers.items():
        m.weight.grad = None if grads[i] is None else grads[i].clone()
    stages = []
    for s, (lo, hi) in enumerate(bounds):
        stage = nn.Module()
        for i in range(lo, hi):
            stage.add_module(str(i), layers[i])
        stages.append(TiedGrads(tied, stage, bounds, s))
    mail = Mailboxes()
    threads = [threading.Thread(target=t.finish, args=(7, mail.of(s))) for s, t in enumerate(stages)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    expected = grads[0].clone() + (grads[2] + grads[3]) + grads[4]  # stage 0's, stage 1's, stage 2's
    for i in (0, 2, 3, 4):
        assert torch.equal(layers[i].weight.grad, expected), i
    assert layers[1].weight.grad is None


def test_two_stages_add_their_sums_in_pieces_and_agree_bit_for_bit(monkeypatch):
    import actors.ties

    monkeypatch.setattr(actors.ties, "PIECE_BYTES", 40)  # 10 float32 per piece: 7 pieces of a 64-element weight
    torch.manual_seed(1)
    layers = {0: nn.Linear(8, 8, bias=False), 1: nn.Linear(8, 8, bias=False)}
    g0, g1 = torch.randn(8, 8), torch.randn(8, 8)
    layers[0].weight.grad, layers[1].weight.grad = g0.clone(), g1.clone()
    bounds = [(0, 1), (1, 2)]
    stages = []
    for s in range(2):
        stage = nn.Module()
        stage.add_module(str(s), layers[s])
        stages.append(TiedGrads([("0.weight", "1.weight")], stage, bounds, s))
    mail = Mailboxes()
    threads = [threading.Thread(target=t.finish, args=(3, mail.of(s))) for s, t in enumerate(stages)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert torch.equal(layers[0].weight.grad, g0 + g1)
    assert torch.equal(layers[1].weight.grad, g0 + g1)
