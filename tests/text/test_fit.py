"""Text that fits a width: ids elided in the middle, items packed whole, columns dropped."""

from __future__ import annotations

from stepscope.text.fit import (
    MIN_ID_WIDTH,
    Column,
    clip,
    elide_middle,
    first_fitting,
    fit_columns,
    pack,
)


def test_an_id_keeps_its_start_and_its_end() -> None:
    assert elide_middle("demo-20261201-210247", 20) == "demo-20261201-210247"
    assert elide_middle("demo-20261201-210247", 14) == "demo-2…-210247"
    assert elide_middle("demo-20261201-210247", 13) == "demo-2…210247"


def test_clip_marks_the_cut() -> None:
    assert clip("abcdef", 6) == "abcdef"
    assert clip("abcdefg", 6) == "abcde…"


def test_pack_never_splits_an_item() -> None:
    items = ["scheduling unknown", "runtime 97.2%", "program 82.7%", "product 80.4%"]
    assert pack(items, 40, indent="  ") == [
        "scheduling unknown, runtime 97.2%",
        "  program 82.7%, product 80.4%",
    ]
    assert first_fitting(items, 40) == "scheduling unknown, runtime 97.2%"
    assert first_fitting(["a very long first item"], 10) == "a very lo…"


def test_columns_are_dropped_in_their_order_then_the_id_elided() -> None:
    job = Column("job", ["pretrain-llama3-70b-20261201-210247"], elide=True)
    status = Column("status", ["finished"])
    ranks = Column("ranks", ["8"], drop_order=0)
    mfu = Column("MFU", ["47.6%"], drop_order=1)

    wide = fit_columns([job, status, ranks, mfu], 120)
    narrow = fit_columns([job, status, ranks, mfu], 34)
    tight = fit_columns([job, status, ranks, mfu], 20)

    assert [c.header for c in wide] == ["job", "status", "ranks", "MFU"]
    assert wide[0].cells == ["pretrain-llama3-70b-20261201-210247"]
    # the id counted at a third of the width: the ranks go first, MFU stays, and the id
    # takes the width left
    assert [c.header for c in narrow] == ["job", "status", "MFU"]
    assert narrow[0].cells == ["pretrain…1-210247"]
    assert sum(c.width for c in narrow) + 2 * (len(narrow) - 1) <= 34
    assert [c.header for c in tight] == ["job", "status"]
    assert tight[0].cells == ["pretr…210247"]
    assert tight[0].width == MIN_ID_WIDTH
