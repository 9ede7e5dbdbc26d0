"""Proposals per second of the suffix speculator, as the engine calls it: one ``propose`` per
decoding step of a request, the accepted drafts plus one token appended in between.

    python plugins/bench/scripts/bench_propose.py [--requests 200] [--prompt 1000] [--output 256]

Requests of an agent-like workload: a prompt drawn from a small vocabulary with repeated
spans, and an answer that copies spans of the prompt and of earlier answers. Their outputs fill
the global trie as they finish (up to max_cached_requests). Reports proposals per second
(tree upkeep included), the mean draft length and the cost of taking in a prompt.
"""

from __future__ import annotations

import argparse
import random
import time

from baton.request import Request
from baton.sampling_params import SamplingParams
from baton_suffix.speculator import SuffixSpeculator


def make_text(rng: random.Random, n: int, sources: list[list[int]]) -> list[int]:
    """``n`` tokens: fresh ones, and spans copied from ``sources``."""
    out: list[int] = []
    while len(out) < n:
        src = rng.choice(sources) if sources and rng.random() < 0.6 else None
        if src and len(src) > 8:
            i = rng.randrange(len(src) - 8)
            out.extend(src[i : i + rng.randint(8, 40)])
        else:
            out.extend(rng.randrange(32000) for _ in range(rng.randint(4, 20)))
    return out[:n]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--prompt", type=int, default=1000)
    ap.add_argument("--output", type=int, default=256)
    ap.add_argument("--num-tokens", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    spec = SuffixSpeculator()
    answers: list[list[int]] = []
    calls = drafted = accepted = 0
    busy = first = 0.0
    for r in range(args.requests):
        prompt = make_text(rng, args.prompt, answers[-20:])
        answer = make_text(rng, args.output, [prompt, *answers[-20:]])
        req = Request(f"r{r}", list(prompt), SamplingParams(max_tokens=args.output))
        req.all_token_ids.append(answer[0])
        pos, started = 1, True
        while pos < len(answer):
            t0 = time.perf_counter()
            draft = list(spec.propose(req, args.num_tokens))
            dt = time.perf_counter() - t0
            busy += dt
            if started:
                first += dt
                started = False
            calls += 1
            drafted += len(draft)
            ok = 0
            while ok < len(draft) and pos + ok < len(answer) and draft[ok] == answer[pos + ok]:
                ok += 1
            accepted += ok
            t0 = time.perf_counter()
            spec.observe(req, len(draft), ok)
            busy += time.perf_counter() - t0
            new = answer[pos : pos + ok + 1]
            req.all_token_ids.extend(new)
            pos += len(new)
        t0 = time.perf_counter()
        spec.finished(req)
        busy += time.perf_counter() - t0
        answers.append(answer)
    print(
        f"{calls} proposals in {busy:.2f} s: {calls / busy:,.0f} proposals/s "
        f"({busy / calls * 1e6:.0f} us each, finished() and prompt intake included); "
        f"first proposal of a request (takes in its {args.prompt}-token prompt): "
        f"{first / args.requests * 1e3:.2f} ms; mean draft {drafted / calls:.2f} tokens, "
        f"{accepted / max(drafted, 1):.0%} accepted; global trie: {len(spec.cached)} outputs, "
        f"{spec.global_tree.num_nodes:,} nodes"
    )


if __name__ == "__main__":
    main()
