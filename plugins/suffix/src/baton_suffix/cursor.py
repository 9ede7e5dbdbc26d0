"""Where a request's latest tokens are in the global trie (matching statistics).

A cursor holds the longest suffix of the request's tokens that the trie has, as a
location. A new token extends it if the trie has the longer string; otherwise
its first tokens are dropped, one at a time, until it does (the trie holds every
suffix of what it holds, so a shorter match is found by looking at each label's
first token only). When the trie changes (a request finished, one was evicted)
the cursor starts again from the last ``max_depth - 1`` tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

from baton_suffix.tree import Node, SuffixTree, normalize


class Cursor:
    """A request's place in the global trie."""

    __slots__ = ("d", "node", "upto", "version")

    def __init__(self, tree: SuffixTree) -> None:
        self.node, self.d = tree.root, 0
        self.upto = 0  # tokens[:upto] are taken in
        self.version = -1  # the trie's version they were taken in against

    def sync(self, tree: SuffixTree, tokens: Sequence[int], version: int) -> None:
        """Take in the tokens that arrived since the last call."""
        n = len(tokens)
        keep = tree.max_depth - 1  # longest match kept, so a continuation has room
        self.node = normalize(self.node, self.d)
        if version != self.version or self.node.count == 0 or n - self.upto > keep:
            self.node, self.d, self.version = tree.root, 0, version
            self.upto = max(0, n - keep)
        for p in range(self.upto, n):
            self._advance(tree, tokens, p, keep)
        self.upto = n

    def location(self, tree: SuffixTree, tokens: Sequence[int], cap: int) -> tuple[Node, int]:
        """The longest match at most ``cap`` tokens long."""
        if self.d <= cap:
            return normalize(self.node, self.d), self.d
        node = tree.walk(tokens, len(tokens) - cap, cap)
        return (node, cap) if node is not None else (tree.root, 0)

    def _advance(self, tree: SuffixTree, tokens: Sequence[int], p: int, keep: int) -> None:
        t, node, d = tokens[p], normalize(self.node, self.d), self.d
        while True:
            if d < keep:
                if d < node.depth:
                    if node.token_at(d + 1) == t:
                        self.node, self.d = node, d + 1
                        return
                else:
                    child = node.children.get(t) if node.children else None
                    if child is not None:
                        self.node, self.d = child, d + 1
                        return
            if d == 0:
                self.node, self.d = tree.root, 0
                return
            d -= 1  # drop the match's first token
            found = tree.walk(tokens, p - d, d)
            node, d = (found, d) if found is not None else (tree.root, 0)
