"""``transfer_cpus``: p2pkv's transfer threads run on the cores it names (real threads, real affinity)."""

from __future__ import annotations

import logging
import os
import threading
import time
from types import SimpleNamespace

import pytest

from p2pkv.config import load_config
from p2pkv.prefill.write_engine import WriteEngine
from p2pkv.transfer_threads import parse_cpus, pin_thread, start_transfer_thread


@pytest.mark.parametrize(("text", "cpus"), [
    ("", set()), ("3", {3}), ("0,2", {0, 2}), ("4-7", {4, 5, 6, 7}), (" 0 , 4-5 ", {0, 4, 5}), ("2,2-3", {2, 3}),
])
def test_parse_cpus_reads_taskset_lists(text: str, cpus: set[int]) -> None:
    assert parse_cpus(text) == cpus


@pytest.mark.parametrize("text", ["a", "3-1", "1-", "-2", "1.5", "70000", "0-70000"])
def test_parse_cpus_refuses_what_is_not_a_core_list(text: str) -> None:
    with pytest.raises(ValueError, match=r"core number|range"):
        parse_cpus(text)


def test_the_setting_reaches_the_config_from_the_environment_too() -> None:
    assert load_config(None, environ={"P2PKV_TRANSFER_CPUS": "1"}).transfer_cpus == "1"
    assert load_config(None, environ={}).transfer_cpus == ""


def _affinity_in_thread(target) -> set[int]:  # type: ignore[no-untyped-def]
    seen: list[set[int]] = []

    def run() -> None:
        target()
        seen.append(os.sched_getaffinity(0))

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return seen[0]


def test_a_transfer_thread_runs_on_the_named_cores_and_the_engine_thread_keeps_its_own() -> None:
    mine = os.sched_getaffinity(0)
    core = max(mine)
    assert _affinity_in_thread(lambda: start_transfer_thread("DRAM", 0, frozenset({core}))) == {core}
    assert os.sched_getaffinity(0) == mine  # only the calling thread moved
    assert _affinity_in_thread(lambda: pin_thread(frozenset())) == mine  # none named: inherited, unchanged


def test_cores_no_thread_may_use_leave_the_thread_where_it_was(caplog: pytest.LogCaptureFixture) -> None:
    mine = os.sched_getaffinity(0)
    absent = frozenset({max(os.cpu_count() or 1, 4095) + 1})
    with caplog.at_level(logging.WARNING, logger="p2pkv.transfer_threads"):
        assert _affinity_in_thread(lambda: pin_thread(absent)) == mine
    assert "none of these cores can run this thread" in caplog.text


def test_the_write_thread_runs_its_start_hook_first() -> None:
    core = min(os.sched_getaffinity(0))
    engine = WriteEngine(SimpleNamespace(progress=lambda: None), None,  # type: ignore[arg-type]
                         on_start=lambda: pin_thread(frozenset({core})))
    try:
        thread = engine.thread
        deadline = time.monotonic() + 5
        while os.sched_getaffinity(thread.native_id) != {core} and time.monotonic() < deadline:
            time.sleep(0.01)
        assert os.sched_getaffinity(thread.native_id) == {core}
    finally:
        engine.close()
