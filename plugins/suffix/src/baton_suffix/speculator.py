"""The ``suffix`` speculator: suffix decoding (Oliinyk et al., "SuffixDecoding: Extreme
Speculative Decoding for Emerging AI Applications").

Two tries of suffixes, bounded in depth, propose drafts: one per request over its
own prompt and output (grown as tokens arrive, dropped when it finishes), and a
global one over the outputs of the last ``max_cached_requests`` finished requests
(oldest evicted first). For each, the longest suffix of the request's tokens
found there is the match; the draft follows the most frequent continuation while
the product of its empirical probabilities stays at least ``min_token_prob``,
and is at most ``max_spec_factor`` times the match length long (a longer match,
a surer guess). Of the two drafts, the one with the higher expected number of
accepted tokens (its summed probabilities) is proposed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from baton.request import Request
from baton_suffix.cursor import Cursor
from baton_suffix.request_tree import RequestTree
from baton_suffix.tree import SuffixTree


class _RequestState:
    __slots__ = ("cursor", "tree")

    def __init__(self, max_depth: int, global_tree: SuffixTree) -> None:
        self.tree = RequestTree(max_depth)
        self.cursor = Cursor(global_tree)


class SuffixSpeculator:
    """Suffix decoding over each request's own tokens and recent requests' outputs."""

    def __init__(
        self,
        max_depth: int = 64,
        max_cached_requests: int = 1000,
        max_spec_factor: float = 1.0,
        min_token_prob: float = 0.1,
    ) -> None:
        self.max_depth = max_depth
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.global_tree = SuffixTree(max_depth)
        #: outputs in the global trie, oldest first
        self.cached: deque[list[int]] = deque()
        self._version = 0  # bumped when the global trie changes
        self._states: dict[str, _RequestState] = {}

    # ------------------------------------------------------------------ the protocol

    def propose(self, request: Request, max_tokens: int) -> Sequence[int]:
        state = self._state(request)
        tokens = state.tree.tokens
        # a match at most this long leaves the trie room for a whole draft after it
        cap = max(1, self.max_depth - max_tokens)
        best: list[int] = []
        best_score = 0.0
        found = state.tree.match(cap)
        if found is not None:
            node, d = found
            best, best_score = state.tree.tree.draft(
                node, d, self._limit(d, max_tokens), self.min_token_prob, own=1
            )
        if self.cached:
            state.cursor.sync(self.global_tree, tokens, self._version)
            node, d = state.cursor.location(self.global_tree, tokens, cap)
            if d:
                draft, score = self.global_tree.draft(
                    node, d, self._limit(d, max_tokens), self.min_token_prob
                )
                if (score, len(draft)) > (best_score, len(best)):
                    best, best_score = draft, score
        return best

    def observe(self, request: Request, num_proposed: int, num_accepted: int) -> None:
        pass  # accepted tokens arrive in request.all_token_ids and are taken in by propose

    def finished(self, request: Request) -> None:
        self._states.pop(request.request_id, None)
        if self.max_cached_requests == 0:
            return
        output = list(request.all_token_ids[request.num_prompt_tokens :])
        if output:
            self.remember(output)

    # ------------------------------------------------------------------ the global trie

    def remember(self, output: list[int]) -> None:
        """Put a finished request's output in the global trie, evicting the oldest beyond
        ``max_cached_requests``."""
        self._suffixes(output, self.global_tree.insert)
        self.cached.append(output)
        while len(self.cached) > self.max_cached_requests:
            self._suffixes(self.cached.popleft(), self.global_tree.remove)
        self._version += 1

    def _suffixes(self, output: list[int], apply) -> None:  # type: ignore[no-untyped-def]
        n, depth = len(output), self.max_depth
        for i in range(n):
            apply(output, i, min(depth, n - i))

    # ------------------------------------------------------------------ helpers

    def _limit(self, match_len: int, max_tokens: int) -> int:
        """The draft length a match allows: ``max_spec_factor * match_len``, at most
        ``max_tokens``."""
        return min(max_tokens, int(self.max_spec_factor * match_len))

    def _state(self, request: Request) -> _RequestState:
        """The request's state with its tokens taken in (afresh for an unknown id, or if its
        tokens are not a continuation of those seen)."""
        tokens = request.all_token_ids
        state = self._states.get(request.request_id)
        if state is None or len(tokens) < len(state.tree.tokens):
            state = self._states[request.request_id] = _RequestState(
                self.max_depth, self.global_tree
            )
        seen = len(state.tree.tokens)
        if len(tokens) > seen:
            state.tree.extend(tokens[seen:])
        return state
