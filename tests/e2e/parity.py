"""Reference generation with Hugging Face transformers and the near-tie rule for greedy parity."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from baton import LLM, SamplingParams

#: 16 prompts of mixed lengths (a few tokens to ~250); some share long prefixes.
_BASE = (
    "Background notes: The committee met on Tuesday to review the quarterly budget and agreed to postpone the "
    "decision on new equipment. Rainfall in the valley has been below average for three consecutive years, which "
    "has affected local farmers. The old bridge across the river was built in 1890 and was closed to cars after an "
    "inspection last spring. "
)
PROMPTS = [
    "Hi",
    "The capital of France is",
    "Write a haiku about the sea.",
    "List three prime numbers:",
    _BASE + "Question: what happened to the bridge?",
    _BASE + "Question: how was the rainfall?",
    _BASE * 2 + "Summarise the notes in one sentence.",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a village at the edge of a forest, there lived",
    "Translate to French: The cat sleeps on the warm windowsill.",
    "Explain photosynthesis to a child in two sentences.",
    "1, 2, 3, 4, 5, 6, 7,",
    "Q: What is 12 times 12?\nA:",
    "The quick brown fox jumps over the lazy dog. " * 5,
    "Dear team, I am writing to let you know that",
    "Pros and cons of remote work: Pros:",
]


#: hf_greedy's answers in this process: several tests compare against the same reference
#: (the default model's 16 prompts take transformers ~30 s on 2 cores).
_greedy_cache: dict[tuple[str, tuple[tuple[int, ...], ...], int], list[list[int]]] = {}


def hf_greedy(model_dir: Path, prompt_ids: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' own greedy decoding (float32, EOS ignored), computed once per process."""
    key = (str(Path(model_dir).resolve()), tuple(map(tuple, prompt_ids)), max_new_tokens)
    if key not in _greedy_cache:
        _greedy_cache[key] = _hf_greedy(model_dir, prompt_ids, max_new_tokens)
    return [list(r) for r in _greedy_cache[key]]


def engine_greedy(
    model_dir: Path,
    prompt_ids: list[list[int]],
    max_new_tokens: int,
    *,
    passes: int = 1,
    preempt: bool = False,
    started: Callable[[LLM], None] | None = None,
    **config: Any,
) -> list[list[list[int]]]:
    """baton's greedy tokens (EOS ignored) of ``passes`` runs of the prompts in one engine built
    with ``config``: a later pass must start from cached prefixes; with ``preempt``, some request
    must have been preempted. ``started(llm)`` runs once the engine is up (before the runs)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True)
    out = []
    with LLM(model=str(model_dir), **config) as llm:
        if started is not None:
            started(llm)
        for _ in range(passes):
            res = llm.generate(
                [{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False
            )
            out.append([o.outputs[0].token_ids for o in res])
            cached = sum(o.num_cached_tokens for o in res)
            preempted = sum(o.metrics.num_preemptions for o in res)
        assert passes == 1 or cached > 0, "the second pass should start from cached prefixes"
        if preempt:
            assert preempted > 0, "the small KV cache should preempt requests"
    return out


def _hf_greedy(
    model_dir: Path, prompt_ids: list[list[int]], max_new_tokens: int
) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    model.generation_config.eos_token_id = None
    gc = copy.deepcopy(model.generation_config)
    gc.do_sample, gc.eos_token_id, gc.temperature, gc.top_p, gc.top_k = (
        False,
        None,
        None,
        None,
        None,
    )
    gc.pad_token_id = 0
    # one left-padded batch: transformers' fp32 greedy output is batch-invariant here (see ../shared/bench)
    width = max(len(p) for p in prompt_ids)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompt_ids])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids])
    with torch.inference_mode():
        o = model.generate(
            ids,
            attention_mask=mask,
            generation_config=gc,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
        )
    return [row[width:].tolist() for row in o]


def top2_gap(model_dir: Path, context: list[int]) -> float:
    """The gap between the two largest next-token logits after ``context``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.inference_mode():
        logits = model(torch.tensor([context])).logits[0, -1]
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def assert_parity(
    model_dir: Path,
    prompt_ids: list[list[int]],
    ours: list[list[int]],
    ref: list[list[int]],
    exact_prefix: int = 32,
    tie_gap: float = 1e-4,
) -> None:
    """Equal tokens; a divergence is allowed only after ``exact_prefix`` tokens and only at a near-tie."""
    for i, (p, a, b) in enumerate(zip(prompt_ids, ours, ref, strict=True)):
        assert len(a) == len(b), f"prompt {i}: {len(a)} tokens vs {len(b)}"
        if a == b:
            continue
        k = next(j for j, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
        assert k >= exact_prefix, (
            f"prompt {i}: diverges at token {k} (< {exact_prefix}): {a[: k + 1]} vs {b[: k + 1]}"
        )
        gap = top2_gap(model_dir, p + b[:k])
        assert gap < tie_gap, (
            f"prompt {i}: diverges at token {k} where the top-2 logit gap is {gap:.2e} (not a near-tie)"
        )
