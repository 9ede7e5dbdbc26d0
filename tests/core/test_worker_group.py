"""baton.executor.group.WorkerGroup, the public process group an executor is built from, with real
worker processes: the broadcast reaches the ranks it names and each call gets its own Future;
a worker that dies, reports an error or hangs fails the group once (pending calls raise
ExecutorError, the failure callbacks run once, later calls raise); a wait that times out leaves
the group healthy; a worker's call error (``Member.reply_call_error``) fails that call alone.
docs/writing-a-plugin.md's executor on the group alone is tested in test_docs_examples.py."""

from __future__ import annotations

import os
import pickle
import signal
import threading

import pytest

from baton.config import BatonConfig
from baton.errors import BatonError, ExecutorError, InvalidRequestError
from baton.executor.group import WorkerGroup
from baton.executor.member import READY, SHUTDOWN, MemberLink
from baton.executor.workers import pick_transport

pytestmark = pytest.mark.timeout(300)

ECHO, SILENT, BROKEN, REFUSED = 1, 2, 3, 4


def echo_worker(link: MemberLink, greeting: str) -> None:
    """ECHO: answer (rank, the payload); SILENT: never answer; BROKEN: report an error (the
    group fails); REFUSED: fail that call alone."""
    member = link.join()
    member.ready((link.rank, greeting))
    while True:
        try:
            msg = member.recv(timeout=0.5)
        except BatonError:  # the group closed the channel
            return
        if msg is None:
            continue
        if msg.kind == SHUTDOWN:
            member.close()
            return
        if msg.kind == ECHO:
            member.reply(ECHO, msg.call_id, [pickle.dumps((link.rank, bytes(msg.payload[0])))])
        elif msg.kind == BROKEN:
            member.reply_error(BROKEN, msg.call_id, f"worker {link.rank} is broken")
        elif msg.kind == REFUSED:
            member.reply_call_error(REFUSED, msg.call_id, "InvalidRequestError: not this one")


@pytest.fixture
def group():
    transport = pick_transport(BatonConfig.load(), "auto")
    g = WorkerGroup("echo", transport, 3, kind_names={ECHO: "echo", SILENT: "silent"})
    try:
        assert g.start(echo_worker, ["a", "b", "c"], timeout=120) == [(0, "a"), (1, "b"), (2, "c")]
        yield g
    finally:
        g.shutdown()
        assert all(not p.is_alive() for p in g.procs), "a worker outlived shutdown"


def test_broadcast_to_some_ranks_one_future_per_call(group: WorkerGroup) -> None:
    everyone = group.call(ECHO, [b"all"])
    two = group.call(ECHO, [b"two"], to=[0, 2])
    one = group.call(ECHO, [b"one"], to=[0, 1, 2], reply_from=1)
    assert two.result(30) == [(0, b"two"), (2, b"two")]
    assert everyone.result(30) == [(0, b"all"), (1, b"all"), (2, b"all")]
    assert one.result(30) == (1, b"one")  # reply_from: that rank's answer alone
    with pytest.raises(ExecutorError, match="reserved"):
        group.call(READY)
    group.check_health()


def test_a_wait_that_times_out_leaves_the_group_healthy(group: WorkerGroup) -> None:
    future = group.call(SILENT, to=[0])
    with pytest.raises(ExecutorError, match=r"timed out after 0\.2 s waiting for nothing"):
        group.wait(future, 0.2, "nothing")
    group.check_health()
    assert group.call(ECHO, [b"x"], reply_from=2).result(30) == (2, b"x")


def test_a_dead_worker_fails_pending_calls_and_the_group_once(group: WorkerGroup) -> None:
    told: list[BaseException] = []
    done = threading.Event()
    group.register_failure_callback(lambda e: (told.append(e), done.set()))
    pending = group.call(SILENT)
    chained = group.call(SILENT, chained=True)
    os.kill(group.pids()[1], signal.SIGKILL)
    assert done.wait(10), "the death was not noticed"
    for future in (pending, chained):
        with pytest.raises(ExecutorError, match=r"worker 1 \(pid \d+\) exited") as e:
            future.result(10)
        assert "engine" not in str(e.value)  # the transport's word for its peers, not ours
    assert "engine" not in str(told[0])
    with pytest.raises(ExecutorError, match="failed earlier"):
        group.call(ECHO, [b"late"])
    with pytest.raises(ExecutorError, match="exited"):
        group.check_health()
    group.fail(ExecutorError("a second failure"))  # the first one is kept, told once
    late: list[BaseException] = []
    group.register_failure_callback(late.append)  # registered after it: told at once
    assert len(told) == 1 and late == told


def test_a_call_error_fails_that_call_alone(group: WorkerGroup) -> None:
    failed: list[BaseException] = []
    group.register_failure_callback(failed.append)
    refused = group.call(REFUSED, to=[1])
    everyone = group.call(REFUSED)  # the first rank's error settles it; later answers dropped
    with pytest.raises(InvalidRequestError, match=r"^worker 1: not this one$"):
        refused.result(30)
    with pytest.raises(InvalidRequestError, match=r"^worker \d: not this one$"):
        everyone.result(30)
    group.check_health()
    assert group.call(ECHO, [b"on"]).result(30) == [(0, b"on"), (1, b"on"), (2, b"on")]
    assert not failed and group.latch.failure is None


def test_a_worker_error_fails_the_group(group: WorkerGroup) -> None:
    failed = threading.Event()
    group.register_failure_callback(lambda e: failed.set())
    future = group.call(BROKEN, to=[2])
    with pytest.raises(ExecutorError, match="worker 2 is broken"):
        future.result(30)
    # the group settles its pending calls first, then runs the callbacks on its reader thread:
    # the caller can see the error a moment before the callback has run
    assert failed.wait(5), "the failure callback did not run"


def test_an_unanswered_call_past_fail_after_is_a_hang(group: WorkerGroup) -> None:
    future = group.call(SILENT, to=[0], fail_after=0.3)
    with pytest.raises(ExecutorError, match=r"a silent call was not answered within 0\.3 s"):
        future.result(30)
    assert group.shutdown() and not group.shutdown()  # once
