"""baton.processes: how engine and worker processes start (forkserver or spawn)."""

from __future__ import annotations

import multiprocessing
import os

import psutil
import pytest

from baton import processes
from baton.errors import ConfigError


def _report(queue: multiprocessing.Queue, key: str) -> None:  # type: ignore[type-arg]
    queue.put((os.environ.get(key), psutil.Process().name(), os.getppid()))


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_a_started_process_has_the_current_environment_and_its_name(method, monkeypatch):
    monkeypatch.setenv(processes.START_METHOD_ENV, method)
    ctx = processes.context()
    for value in ("first", "second"):  # the second after the forkserver started
        monkeypatch.setenv("BATON_TEST_PROCESSES", value)
        queue = ctx.Queue()
        p = processes.start(_report, (queue, "BATON_TEST_PROCESSES"), name="baton-test-proc")
        seen, name, ppid = queue.get(timeout=120)
        p.join(30)
        assert p.exitcode == 0
        assert seen == value and name == "baton-test-proc"
        if method == "spawn":
            assert ppid == os.getpid()
        else:  # forked by the forkserver, which is our child and a helper
            server = psutil.Process(ppid)
            assert server.ppid() == os.getpid() and processes.is_helper(server)
            assert not processes.is_helper(psutil.Process(p.pid)) if p.is_alive() else True


def test_the_start_method_is_checked(monkeypatch):
    monkeypatch.setenv(processes.START_METHOD_ENV, "fork")
    with pytest.raises(ConfigError, match=r"BATON_START_METHOD='fork'.*forkserver or spawn"):
        processes.context()
    monkeypatch.delenv(processes.START_METHOD_ENV)
    assert processes.start_method() in ("forkserver", "spawn")


def test_alive():
    assert processes.alive(os.getpid())
    p = multiprocessing.get_context("spawn").Process(target=os.getpid)
    p.start()
    p.join(60)
    assert not processes.alive(p.pid)
