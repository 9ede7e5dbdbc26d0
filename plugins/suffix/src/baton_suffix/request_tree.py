"""The suffix trie of one request's own tokens, grown as its tokens arrive.

Every suffix of the sequence, cut at ``max_depth`` tokens, is in the trie. The
suffixes that started in the last ``max_depth - 1`` positions are still growing:
each keeps its location and takes the next token when it arrives (O(max_depth)
per token). A prompt longer than ``max_depth`` goes in as whole strings first.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from baton_suffix.tree import Node, SuffixTree, normalize


class RequestTree:
    """The trie over ``tokens``, a copy of the request's prompt and output so far."""

    def __init__(self, max_depth: int) -> None:
        self.tree = SuffixTree(max_depth)
        self.tokens: list[int] = []
        #: the growing suffixes, longest first: [node, depth]
        self.growing: deque[list] = deque()  # type: ignore[type-arg]

    def extend(self, new: Sequence[int]) -> None:
        """Take the tokens that followed ``tokens``."""
        tokens, depth = self.tokens, self.tree.max_depth
        first = len(tokens)
        tokens.extend(new)
        n = len(tokens)
        if first == 0 and n > depth:  # a prompt: the suffixes that are already whole
            for i in range(n - depth + 1):
                self.tree.insert(tokens, i, depth)
            first = n - depth + 1
        for p in range(first, n):
            self._step(p)

    def match(self, cap: int) -> tuple[Node, int] | None:
        """The longest suffix of ``tokens``, at most ``cap`` long, that occurred before with a
        token after it: its location, or None."""
        for node, d in self.growing:
            if d > cap or (d == node.depth and node.children is None):
                continue  # too long, or at the end of a leaf: nothing followed it
            node = normalize(node, d)
            if d < node.depth or node.children:
                return node, d
        return None

    # ------------------------------------------------------------------ growing

    def _step(self, p: int) -> None:
        """Token ``tokens[p]`` arrived: every growing suffix takes it, and one starts."""
        tokens, tree, growing = self.tokens, self.tree, self.growing
        t = tokens[p]
        for loc in growing:
            node, d = loc
            if d == node.depth and node.count == 1 and node.children is None:
                # a leaf this suffix alone reached (the common case): its label grows in place
                node.seq, node.start, node.depth = tokens, p - (d - node.parent.depth), d + 1
                loc[1] = d + 1
            else:
                loc[0], loc[1] = self._grow(normalize(node, d), d, p, t)
        if growing and growing[0][1] == tree.max_depth:
            growing.popleft()  # whole: only the longest can get there
        tree.root.count += 1
        growing.append(list(self._grow(tree.root, 0, p, t)))

    def _grow(self, node: Node, d: int, p: int, t: int) -> tuple[Node, int]:
        """The location of the suffix at ``(node, d)`` once it takes token ``t`` (position p)."""
        tree = self.tree
        if d < node.depth:  # inside a label
            if node.token_at(d + 1) == t:
                return node, d + 1
            head = tree.split(node, d, node.count - self._ending_in(node, d))
            return tree.add_leaf(head, self.tokens, p, d + 1), d + 1
        child = node.children.get(t) if node.children else None
        if child is None:
            return tree.add_leaf(node, self.tokens, p, d + 1), d + 1
        tree.bump(node, child)
        return child, d + 1

    def _ending_in(self, node: Node, d: int) -> int:
        """How many growing suffixes end inside ``node``'s label at depth ``d`` or above
        (they count in ``node`` but not in what follows ``d``)."""
        assert node.parent is not None
        top = node.parent.depth
        return sum(1 for n, e in self.growing if top < e <= d and normalize(n, e) is node)
