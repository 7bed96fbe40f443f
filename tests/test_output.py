"""What actors print is kept for the job's log (actors/output.py), without Ray."""
from __future__ import annotations

import io

from actors.output import OutputTap, _Tee


def tapped(**kw):
    tap = OutputTap(**kw)
    out, err = io.StringIO(), io.StringIO()
    return tap, out, err, _Tee(out, tap, "stdout"), _Tee(err, tap, "stderr")


def test_lines_are_kept_and_still_written_through():
    tap, out, err, o, e = tapped()
    print("hello", file=o)
    o.write("par")
    o.write("tial\nand more")
    print("careful", file=e)
    assert out.getvalue() == "hello\npartial\nand more" and err.getvalue() == "careful\n"
    assert [(s, line) for _, s, line in tap.take()] == [("stdout", "hello"), ("stdout", "partial"),
                                                         ("stderr", "careful")]
    assert tap.take() == []  # taken once
    o.write("\n")  # the partial line ends
    assert [line for *_, line in tap.take()] == ["and more"]


def test_a_flood_keeps_the_newest_lines_and_says_how_many_went():
    tap, out, _, o, _ = tapped(max_kept=3, max_line=10)
    for i in range(8):
        print(f"line {i}", file=o)
    print("x" * 25, file=o)
    got = [line for *_, line in tap.take()]
    assert got == ["[relaytrain: 6 earlier lines were dropped: more than 3 waited to be read]",
                   "line 6", "line 7", "x" * 10]
    assert out.getvalue().count("\n") == 9  # the original stream saw everything


def test_the_tee_is_a_stream():
    tap, out, _, o, _ = tapped()
    assert o.write("abc") == 3
    o.flush()
    assert o.getvalue() == "abc"  # anything else is the original stream's


def test_a_long_line_written_in_pieces_is_one_line_cut_to_its_head():
    tap, _, _, o, _ = tapped(max_line=10)
    for piece in ("y" * 6, "y" * 6, "y" * 20, "z\n", "next\n"):
        o.write(piece)
    assert [line for *_, line in tap.take()] == ["y" * 10, "next"]


def test_rays_marker_lines_are_not_the_users():
    tap, out, _, o, _ = tapped()
    print(":actor_name:relaytrain:job:w0.1", file=o)
    print("mine", file=o)
    assert [line for *_, line in tap.take()] == ["mine"]
    assert out.getvalue().startswith(":actor_name:")  # Ray's log monitor still sees it
