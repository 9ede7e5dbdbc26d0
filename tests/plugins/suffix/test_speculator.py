"""The suffix speculator's tries and drafts: counts, the longest match, the probability cut-off,
the adaptive length, learning from finished requests and the eviction bound."""

from __future__ import annotations

import random

import pytest

from baton.config import BatonConfig
from baton.errors import ConfigError
from baton.request import Request
from baton.sampling_params import SamplingParams
from baton_suffix.cursor import Cursor
from baton_suffix.request_tree import RequestTree
from baton_suffix.speculator import SuffixSpeculator
from baton_suffix.tree import Node, SuffixTree, normalize


def req(tokens: list[int], rid: str = "r", prompt: int | None = None) -> Request:
    r = Request(rid, list(tokens), SamplingParams(max_tokens=64))
    if prompt is not None:  # the first `prompt` tokens are the prompt, the rest output
        r = Request(rid, list(tokens[:prompt]), SamplingParams(max_tokens=64))
        r.all_token_ids.extend(tokens[prompt:])
    return r


def occurrences(seqs: list[list[int]], depth: int) -> dict[tuple[int, ...], int]:
    """Every string of at most ``depth`` tokens in ``seqs`` -> how often it occurs."""
    out: dict[tuple[int, ...], int] = {}
    for s in seqs:
        for i in range(len(s)):
            for k in range(1, min(depth, len(s) - i) + 1):
                out[tuple(s[i : i + k])] = out.get(tuple(s[i : i + k]), 0) + 1
    return out


def count_at(tree: RequestTree, node: Node, d: int) -> int:
    """Occurrences of the string at ``(node, d)``: the node's count less the growing suffixes
    that end inside its label above ``d``."""
    return node.count - sum(1 for n, e in tree.growing if e < d and normalize(n, e) is node)


# ---------------------------------------------------------------------- the tries


@pytest.mark.parametrize("seed", range(4))
def test_a_request_trie_counts_every_string_as_tokens_arrive(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(40):
        depth, alphabet, n = rng.randint(2, 8), rng.randint(1, 4), rng.randint(1, 50)
        tokens = [rng.randrange(alphabet) for _ in range(n)]
        tree = RequestTree(depth)
        seen = 0
        while seen < n:  # in chunks, as steps bring them
            upto = min(n, seen + rng.randint(1, 12))
            tree.extend(tokens[seen:upto])
            seen = upto
            for string, count in occurrences([tokens[:seen]], depth).items():
                node = tree.tree.find(list(string), 0, len(string))
                assert node is not None, string
                assert count_at(tree, node, len(string)) == count, (tokens[:seen], string)
        assert tree.tree.find([alphabet], 0, 1) is None


def test_the_global_trie_counts_inserted_and_forgets_removed_strings() -> None:
    rng = random.Random(7)
    for _ in range(40):
        depth = rng.randint(2, 8)
        tree, live = SuffixTree(depth), []
        outputs = [[rng.randrange(3) for _ in range(rng.randint(1, 15))] for _ in range(6)]
        for out in outputs:
            for i in range(len(out)):
                tree.insert(out, i, min(depth, len(out) - i))
            live.append(out)
            if len(live) > 3:
                old = live.pop(0)
                for i in range(len(old)):
                    tree.remove(old, i, min(depth, len(old) - i))
            counts = occurrences(live, depth)
            for string, count in counts.items():
                node = tree.find(list(string), 0, len(string))
                assert node is not None and node.count == count, string
            gone = occurrences(outputs, depth).keys() - counts.keys()
            assert all(tree.find(list(s), 0, len(s)) is None for s in gone)


def test_a_cursor_holds_the_longest_suffix_the_global_trie_has() -> None:
    rng = random.Random(3)
    for _ in range(40):
        depth = rng.randint(2, 8)
        tree, live, version = SuffixTree(depth), [], 0
        tokens: list[int] = []
        cursor = Cursor(tree)
        for _ in range(25):
            if rng.random() < 0.3:
                out = [rng.randrange(3) for _ in range(rng.randint(1, 12))]
                for i in range(len(out)):
                    tree.insert(out, i, min(depth, len(out) - i))
                live.append(out)
                version += 1
            tokens.extend(rng.randrange(3) for _ in range(rng.randint(1, 4)))
            cursor.sync(tree, tokens, version)
            longest = 0
            for m in range(1, min(depth - 1, len(tokens)) + 1):
                pat = tokens[-m:]
                if not any(o[i : i + m] == pat for o in live for i in range(len(o))):
                    break
                longest = m
            assert cursor.d == longest


# ---------------------------------------------------------------------- drafts


def test_the_longest_match_wins() -> None:
    spec = SuffixSpeculator()
    # "1 2" was followed by 9 and by 8; the longer match "9 1 2" was followed by 8
    assert spec.propose(req([1, 2, 9, 1, 2, 8, 5, 9, 1, 2]), 1) == [8]
    # the whole earlier run follows a long match
    spec = SuffixSpeculator()
    assert spec.propose(req([1, 2, 3, 4, 5, 6, 1, 2, 3]), 3) == [4, 5, 6]
    assert SuffixSpeculator().propose(req([1, 2, 3, 4, 5, 6]), 3) == []


def test_the_most_frequent_continuation_is_drafted() -> None:
    # after "7": 1 twice, 2 once (the "7" at the end has no continuation yet: p = 2/3); no
    # longer suffix occurred before
    spec = SuffixSpeculator(min_token_prob=0.6)
    assert spec.propose(req([7, 1, 0, 7, 2, 3, 7, 1, 4, 7]), 1) == [1]
    assert (
        SuffixSpeculator(min_token_prob=0.7).propose(req([7, 1, 0, 7, 2, 3, 7, 1, 4, 7]), 1) == []
    )


def test_a_draft_stops_where_its_probability_falls_below_min_token_prob() -> None:
    # after "5": 1, 2, 3 and 4 once each: p = 1/4 (ties: the first seen)
    tokens = [5, 1, 0, 5, 2, 6, 5, 3, 7, 5, 4, 8, 5]
    assert SuffixSpeculator(min_token_prob=0.3).propose(req(tokens), 1) == []
    assert SuffixSpeculator(min_token_prob=0.25).propose(req(tokens), 1) == [1]
    # what followed "5 1" is certain: the product stays at 1/4
    draft = SuffixSpeculator(min_token_prob=0.25, max_spec_factor=3).propose(req(tokens), 3)
    assert draft == [1, 0, 5]
    # two uncertain steps: p(1 | 9) = 3/4, then p(2 | 9 1) = 2/3, a product of 1/2
    chain = [9, 1, 2, 9, 1, 2, 9, 1, 3, 9, 4, 0, 9]
    assert SuffixSpeculator(min_token_prob=0.5, max_spec_factor=2).propose(req(chain), 2) == [1, 2]
    assert SuffixSpeculator(min_token_prob=0.6, max_spec_factor=2).propose(req(chain), 2) == [1]


def test_the_draft_length_follows_the_match_length() -> None:
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 0]
    # the repeat so far matches 2 tokens: a factor 1 allows 2 drafts, a factor 2 allows 4
    assert SuffixSpeculator(max_spec_factor=1).propose(req([*tokens, 1, 2]), 8) == [3, 4]
    assert SuffixSpeculator(max_spec_factor=2).propose(req([*tokens, 1, 2]), 8) == [3, 4, 5, 6]
    assert SuffixSpeculator(max_spec_factor=0.5).propose(req([*tokens, 1, 2]), 8) == [3]
    # and never more than asked for
    assert SuffixSpeculator(max_spec_factor=9).propose(req([*tokens, 1, 2]), 3) == [3, 4, 5]


def test_a_finished_output_is_learnt_and_a_repeat_gets_long_drafts() -> None:
    spec = SuffixSpeculator()
    prompt = [100, 101, 102]
    output = list(range(200, 240))
    first = req([*prompt, *output], "a", prompt=len(prompt))
    assert spec.propose(first, 5) == []  # nothing repeats within it
    spec.finished(first)
    assert len(spec.cached) == 1
    # another request with the same prompt: once its output starts like the first one's,
    # the drafts grow with the match up to what was asked for
    second = req(prompt, "b", prompt=len(prompt))
    assert spec.propose(second, 5) == []  # prompts are not in the global trie
    lengths = []
    for t in output[:8]:
        second.all_token_ids.append(t)
        draft = list(spec.propose(second, 5))
        got = len(second.all_token_ids) - len(prompt)
        assert draft == output[got : got + len(draft)]
        lengths.append(len(draft))
    assert lengths == [1, 2, 3, 4, 5, 5, 5, 5]


def test_the_global_trie_keeps_max_cached_requests_outputs() -> None:
    spec = SuffixSpeculator(max_cached_requests=2)
    outputs = [[10 * i + j for j in range(1, 8)] for i in range(1, 5)]
    for i, out in enumerate(outputs):
        spec.finished(req([0, *out], f"r{i}", prompt=1))
    assert [list(o) for o in spec.cached] == outputs[2:]
    # the evicted outputs are gone from the trie, the kept ones are there
    assert spec.global_tree.find(outputs[0], 0, 3) is None
    assert spec.global_tree.find(outputs[1], 0, 3) is None
    assert spec.global_tree.find(outputs[3], 0, 3) is not None
    assert spec.propose(req([0, 11, 12, 13], "x"), 3) == []  # an evicted one
    assert spec.propose(req([0, 41, 42, 43], "y"), 3) == [44, 45, 46]
    assert SuffixSpeculator(max_cached_requests=0).cached == spec.cached.__class__()


def test_nothing_is_cached_with_max_cached_requests_0() -> None:
    spec = SuffixSpeculator(max_cached_requests=0)
    spec.finished(req([0, 1, 2, 3], "a", prompt=1))
    assert not spec.cached
    assert spec.global_tree.root.children is None


def test_finished_forgets_the_request() -> None:
    spec = SuffixSpeculator(max_cached_requests=0)
    r = req([1, 2, 3, 1, 2])
    assert spec.propose(r, 1) == [3]
    spec.finished(r)
    assert spec.propose(req([4, 5, 1, 2]), 1) == []


# ---------------------------------------------------------------------- settings


def test_settings_reach_the_speculator() -> None:
    from baton.plugins.registry import get_registry

    config = BatonConfig.load(
        speculative={"method": "suffix", "suffix": {"max_depth": 16, "min_token_prob": 0.5}}
    )
    entry = get_registry().get("speculator", "suffix")
    spec = entry.create(config, entry.settings(config))
    assert (spec.max_depth, spec.min_token_prob, spec.max_cached_requests) == (16, 0.5, 1000)


@pytest.mark.parametrize(
    "bad",
    [
        {"max_depth": 1},
        {"max_cached_requests": -1},
        {"max_spec_factor": 0},
        {"min_token_prob": 1.5},
        {"max_dept": 8},
    ],
)
def test_bad_settings_are_refused(bad: dict) -> None:
    config = BatonConfig.load(speculative={"method": "suffix", "suffix": bad})
    with pytest.raises(ConfigError, match=next(iter(bad))):
        config.plugin_settings("speculative", "suffix", None)
