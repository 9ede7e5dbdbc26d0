"""A worker process of a multiprocess executor: one rank of a tensor x pipeline parallel group.

It is the target of the executor's ``WorkerGroup`` (baton.executor.group).
Start-up: join the group (heartbeat, this rank's end of the channel) -> build the
rank (``baton.executor.rank.Rank``: check the plugin set against the parent's,
join the torch.distributed group at the executor's TCPStore on 127.0.0.1, build
the Worker with the executor's runner factory and load this rank's shard) ->
READY. Then serve the calls in order (``baton.executor.wire``) until SHUTDOWN.

The worker exits when the executor closes the channel, when its parent
process is gone (a watchdog thread checks ``os.getppid()``, also while the main
thread is stuck in a collective), and on SHUTDOWN. The same thread writes the
rank's heartbeat (``baton.executor.heartbeat``), which the executor watches for
a stopped or frozen process.
"""

from __future__ import annotations

import logging
import time
import traceback

from baton.errors import BatonError
from baton.executor.member import MemberLink
from baton.executor.rank import Rank, RankBootstrap
from baton.executor.wire import Kind
from baton.process_exit import exit_now

log = logging.getLogger(__name__)


def worker_main(link: MemberLink, boot: RankBootstrap) -> None:
    """Entry point of a worker process (``WorkerGroup.start``'s target)."""
    cfg = boot.config
    logging.basicConfig(
        level=cfg.observability.log_level,
        format=f"%(asctime)s %(levelname)s worker{boot.rank} %(name)s: %(message)s",
    )
    member = link.join()
    try:
        rank = Rank(boot)
        member.ready(rank.ready())
    except BaseException as e:
        text = f"worker {boot.rank} failed to start: {type(e).__name__}: {e}"
        log.error("%s\n%s", text, "".join(traceback.format_exception(e)))
        try:
            member.reply_error(Kind.READY, 0, text)
            time.sleep(0.1)  # let the frame leave before the channel closes
        finally:
            member.close()
        raise SystemExit(1) from None
    try:
        rank.serve(member)
    except BatonError as e:  # the executor closed the channel or exited
        log.info("worker %d: channel closed (%s); exiting", boot.rank, e)
    finally:
        try:
            rank.close()
        finally:
            member.close()
    exit_now(0)
