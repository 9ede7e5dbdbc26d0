"""A suffix trie bounded in depth, with path compression and occurrence counts.

Every string inserted (a suffix of some token sequence, at most ``max_depth``
tokens) adds one to the count of every node on its path, so a node's count is
the number of inserted strings that pass through it, and ``child.count /
node.count`` is the empirical probability of that child's token after the
node's string. A node's label is a slice of a token list it refers to
(``seq[start : start + depth - parent.depth]``), so a string that branches off
costs one node however long it is. A location in the trie is a pair
``(node, d)``: the string of depth ``d`` ending inside ``node``'s label
(``node.parent.depth < d <= node.depth``; the root is ``(root, 0)``).

Splitting a label puts a new head node above the old one, which keeps its
identity and its end depth, so a location held elsewhere stays right after
``normalize``.
"""

from __future__ import annotations

from collections.abc import Sequence


class Node:
    """One node: the label ending at depth ``depth``, its count and children."""

    __slots__ = ("best", "children", "count", "depth", "parent", "seq", "stale", "start")

    def __init__(
        self, parent: Node | None, depth: int, seq: Sequence[int], start: int, count: int
    ) -> None:
        self.parent = parent
        self.depth = depth
        self.seq = seq
        self.start = start
        self.count = count
        self.children: dict[int, Node] | None = None
        #: the child with the highest count (ties: the first to get there); recomputed if stale
        self.best: Node | None = None
        self.stale = False

    def token_at(self, d: int) -> int:
        """The label's token at depth ``d`` (``parent.depth < d <= depth``)."""
        assert self.parent is not None
        return self.seq[self.start + d - self.parent.depth - 1]

    def best_child(self) -> Node | None:
        """The most frequent continuation (None for a leaf)."""
        if self.stale:
            kids = self.children
            self.best = max(kids.values(), key=lambda n: n.count) if kids else None
            self.stale = False
        return self.best


def normalize(node: Node, d: int) -> Node:
    """The node whose label holds depth ``d``, starting from ``node`` or one of its heads."""
    parent = node.parent
    while parent is not None and d <= parent.depth:
        node, parent = parent, parent.parent
    return node


def _common(a: Sequence[int], ai: int, b: Sequence[int], bi: int, n: int) -> int:
    """Length of the common prefix of ``a[ai:ai+n]`` and ``b[bi:bi+n]``."""
    if a[ai : ai + n] == b[bi : bi + n]:
        return n
    c = 0
    while c < n and a[ai + c] == b[bi + c]:
        c += 1
    return c


class SuffixTree:
    """The trie; ``insert``/``remove`` take whole strings, ``RequestTree`` grows them."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.root = Node(None, 0, (), 0, 0)
        self.num_nodes = 1

    # ------------------------------------------------------------------ building blocks

    def add_leaf(self, parent: Node, seq: Sequence[int], start: int, depth: int) -> Node:
        """A new child of ``parent`` with count 1, labelled ``seq[start : start + depth -
        parent.depth]``."""
        leaf = Node(parent, depth, seq, start, 1)
        if parent.children is None:
            parent.children = {}
        parent.children[seq[start]] = leaf
        if parent.best is None and not parent.stale:
            parent.best = leaf
        self.num_nodes += 1
        return leaf

    @staticmethod
    def bump(parent: Node, child: Node) -> None:
        """One more string passes through ``child``."""
        child.count += 1
        best = parent.best
        if best is not child and not parent.stale and (best is None or child.count > best.count):
            parent.best = child

    def split(self, node: Node, d: int, below: int) -> Node:
        """Cut ``node``'s label after depth ``d`` (inside it): a new head takes the part up to
        ``d`` and ``node``'s count; ``node`` keeps the rest with count ``below``."""
        parent = node.parent
        assert parent is not None and parent.depth < d < node.depth
        head = Node(parent, d, node.seq, node.start, node.count)
        assert parent.children is not None
        parent.children[node.seq[node.start]] = head
        if parent.best is node:
            parent.best = head
        node.start += d - parent.depth
        node.parent = head
        node.count = below
        head.children = {node.seq[node.start]: node}
        head.best = node
        self.num_nodes += 1
        return head

    # ------------------------------------------------------------------ whole strings

    def insert(self, seq: Sequence[int], i: int, k: int) -> None:
        """Add the string ``seq[i : i + k]`` (``k <= max_depth``); ``seq`` must not change."""
        node = self.root
        node.count += 1
        d = 0
        while d < k:
            child = node.children.get(seq[i + d]) if node.children else None
            if child is None:
                self.add_leaf(node, seq, i + d, k)
                return
            self.bump(node, child)
            span = child.depth - d
            c = _common(child.seq, child.start, seq, i + d, min(span, k - d))
            if c < span:  # the string leaves the label, or ends inside it
                head = self.split(child, d + c, child.count - 1)
                if d + c < k:
                    self.add_leaf(head, seq, i + d + c, k)
                return
            d, node = child.depth, child

    def remove(self, seq: Sequence[int], i: int, k: int) -> None:
        """Take back a string ``insert`` added; nodes left with count 0 are dropped (a
        location inside one sees ``count == 0``)."""
        node = self.root
        node.count -= 1
        d = 0
        detached = False
        while d < k:
            assert node.children is not None
            child = node.children[seq[i + d]]
            child.count -= 1
            if detached:  # below a dropped node: this string's path alone
                self.num_nodes -= 1
            else:
                if child.count == 0:
                    del node.children[seq[i + d]]
                    self.num_nodes -= 1
                    detached = True
                if node.best is child:
                    node.stale = True
            d, node = child.depth, child

    # ------------------------------------------------------------------ reading

    def walk(self, seq: Sequence[int], i: int, k: int) -> Node | None:
        """The node holding ``seq[i : i + k]``'s end, known to be in the trie (only the first
        token of each label is looked at); None if it is not."""
        node, d = self.root, 0
        while d < k:
            child = node.children.get(seq[i + d]) if node.children else None
            if child is None:
                return None
            if child.depth >= k:
                return child
            d, node = child.depth, child
        return node

    def find(self, seq: Sequence[int], i: int, k: int) -> Node | None:
        """The node holding ``seq[i : i + k]``'s end, every token compared; None if absent."""
        node, d = self.root, 0
        while d < k:
            child = node.children.get(seq[i + d]) if node.children else None
            if child is None:
                return None
            n = min(child.depth, k) - d
            if _common(child.seq, child.start, seq, i + d, n) < n:
                return None
            d, node = d + n, child
        return node

    def draft(
        self, node: Node, d: int, limit: int, min_prob: float, own: int = 0
    ) -> tuple[list[int], float]:
        """Grow a draft from location ``(node, d)``: the most frequent continuation while the
        product of ``child.count / node.count`` stays at least ``min_prob``, at most ``limit``
        tokens. ``own`` occurrences without a continuation (the asking request's own) are left
        out of the first count. Returns the tokens and their summed probabilities (the
        expected number accepted)."""
        out: list[int] = []
        prob, score = 1.0, 0.0
        while len(out) < limit:
            if d < node.depth:  # inside a label: its next token is the only continuation
                d += 1
                out.append(node.token_at(d))
                score += prob
                continue
            child = node.best_child()
            if child is None:
                break
            total = node.count - own
            own = 0
            if total <= 0:
                break
            prob *= child.count / total
            if prob < min_prob:
                break
            node, d = child, d + 1
            out.append(child.seq[child.start])
            score += prob
        return out, score
