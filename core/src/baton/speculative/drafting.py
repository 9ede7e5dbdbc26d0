"""The kernel's side of speculative decoding: when to ask the speculator, how many drafts,
and the acceptance figures.

The scheduler asks ``Drafts.propose`` for a running request about to decode one
token; it schedules the drafts with that token, and after the step tells
``verified`` how many the model kept. A request with a grammar keeps only the
drafts its grammar allows in a row (``baton.structured.drafts``; the step then
masks each verification position with its own bitmask row). Drafting is skipped
for a whole step when more requests run than ``speculative.disable_by_batch_size``.
With ``speculative.adaptive`` a request drafts one token more than it last had
accepted (at most ``num_tokens``), and after ``PAUSE_AFTER`` verifications in a
row that accepted nothing it stops drafting for a number of steps that doubles
each time (up to ``MAX_PAUSE``), so text that does not repeat costs little.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from baton.config import SpeculativeSection
from baton.errors import PluginError
from baton.interfaces import Speculator
from baton.metrics.spec import SpecTally
from baton.request import Request
from baton.structured.drafts import grammar_prefix

log = logging.getLogger(__name__)

#: Verifications in a row that accepted nothing before a request pauses drafting.
PAUSE_AFTER = 3
#: Steps of the first pause; each later pause doubles, up to MAX_PAUSE.
FIRST_PAUSE = 4
MAX_PAUSE = 64


@dataclass
class _RequestState:
    limit: int  # most drafts next time
    misses: int = 0  # verifications in a row that accepted nothing
    pause: int = 0  # length of the next pause
    paused_until: int = 0  # the step drafting resumes


class Drafts:
    """Draft bookkeeping for one scheduler."""

    def __init__(self, speculator: Speculator, section: SpeculativeSection) -> None:
        self.speculator = speculator
        self.num_tokens = section.num_tokens
        self.disable_by_batch_size = section.disable_by_batch_size
        self.adaptive = section.adaptive
        self._state: dict[str, _RequestState] = {}
        self._step = 0
        #: acceptance figures of the current step (``take_step_counters``) and since the start
        self.step_counters = self._tally()
        self.total = self._tally()

    def step_allows(self, num_running: int) -> bool:
        """Whether this step drafts at all (called once per schedule)."""
        self._step += 1
        cap = self.disable_by_batch_size
        return cap is None or num_running <= cap

    def propose(self, req: Request, room: int) -> list[int]:
        """Drafts for ``req`` (at most ``room``, which the caller bounds by the step's budget,
        ``max_tokens`` and ``max_model_len``), cut to what its grammar allows if it has one;
        [] when it should decode one token."""
        if room <= 0:
            return []
        st = self._state.get(req.request_id)
        if st is None:
            st = self._state[req.request_id] = _RequestState(limit=self.num_tokens)
        if st.paused_until > self._step:
            return []
        k = min(room, st.limit if self.adaptive else self.num_tokens)
        tokens = self.speculator.propose(req, k)
        if len(tokens) > k:
            raise PluginError(
                f"speculator {type(self.speculator).__name__} proposed {len(tokens)} tokens "
                f"for request {req.request_id!r}, more than the {k} asked for"
            )
        drafts = [int(t) for t in tokens]
        if drafts and req.grammar is not None:
            try:
                drafts = grammar_prefix(req.grammar, drafts)
            except Exception as e:  # drafts are optional: the bitmask fill reports a broken matcher
                log.warning("request %s: no drafts, its grammar raised: %r", req.request_id, e)
                return []
        return drafts

    def verified(self, req: Request, num_proposed: int, num_accepted: int) -> None:
        """The model kept ``num_accepted`` of ``num_proposed`` drafts of ``req``."""
        self.step_counters.verified(num_proposed, num_accepted)
        self.total.verified(num_proposed, num_accepted)
        st = self._state.get(req.request_id)
        if st is not None and self.adaptive:
            st.limit = min(self.num_tokens, num_accepted + 1)
            if num_accepted:
                st.misses, st.pause = 0, 0
            else:
                st.misses += 1
                if st.misses >= PAUSE_AFTER:
                    st.pause = min(MAX_PAUSE, st.pause * 2 if st.pause else FIRST_PAUSE)
                    st.paused_until = self._step + st.pause
                    st.misses = 0
        self.speculator.observe(req, num_proposed, num_accepted)

    def finished(self, req: Request) -> None:
        """``req`` left the scheduler: the speculator forgets it (if it ever saw it)."""
        if self._state.pop(req.request_id, None) is not None:
            self.speculator.finished(req)

    def take_step_counters(self) -> SpecTally:
        """This step's figures, reset for the next."""
        c = self.step_counters
        self.step_counters = self._tally()
        return c

    def _tally(self) -> SpecTally:
        # a position for every draft a step may verify, accepted or not
        return SpecTally(accepted_per_position=[0] * self.num_tokens)
