"""Multi-turn chat workloads (``multiturn-workload/v1``): sessions of several turns, each turn's
prompt the whole conversation so far.

A session's first turn is a chat rendered with the model's chat template (its default system
prompt, a user message of background notes and a question: ``first_prompt_tokens`` long). Each
later turn is sent as the previous turn's prompt, the model's answer to it and the turn's own
``token_ids``: the end of the answer's message, the next user message and the generation prompt,
cut from the template's own rendering, so the conversation grows by exactly what the model said
and a prefix cache (or a KV tier) can serve everything but the new message. The answers are the
engine's, so the prompts of turns after the first are built while replaying
(``next_prompt``); the file holds what does not depend on them.

Deterministic for a tokenizer and a ``seed`` (``random.Random(seed)``), as the chat workloads
of ../shared/bench are; ``write_multiturn`` / ``load_multiturn`` store it as JSON.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from baton.errors import BatonError

FORMAT = "multiturn-workload/v1"

#: What a session's notes are about (one per session, round robin after a shuffle).
TOPICS = [
    "our community garden",
    "the town's new cycling lanes",
    "a small bakery's first year",
    "the school science fair",
    "a weekend hiking club",
    "the library's renovation",
    "a family trip to the coast",
    "a neighbourhood recycling scheme",
    "the office move to a new building",
    "a volunteer fire brigade",
    "a local choir's spring concert",
    "the river clean-up project",
]

#: Background sentences; a session's notes are a seeded choice of them.
NOTES = [
    "The committee met on Tuesday to review the quarterly budget and agreed to postpone the "
    "decision on new equipment.",
    "Rainfall in the valley has been below average for three consecutive years, which has "
    "affected local farmers.",
    "The library recently extended its opening hours and added a quiet study room on the second "
    "floor.",
    "Our team uses a weekly planning meeting, a shared task board, and short daily check-ins to "
    "coordinate work.",
    "Many small businesses in the town rely on tourism during the summer months and struggle "
    "during winter.",
    "A recent survey found that most commuters would cycle more often if there were safer bike "
    "lanes.",
    "The software release was delayed by a week because of a bug in the payment module that "
    "affected refunds.",
    "Students in the program spend one semester abroad and complete a research project in their "
    "final year.",
    "The old bridge across the river was built in 1890 and was closed to cars after an "
    "inspection last spring.",
    "The clinic offers free health screenings on the first Saturday of every month for residents "
    "over sixty.",
    "Our garden gets about six hours of direct sunlight, mostly in the afternoon, and the soil "
    "is slightly sandy.",
    "The company plans to open two new offices next year and expects to hire about forty "
    "additional engineers.",
    "The city council approved a plan to plant five thousand trees along major roads over the "
    "next decade.",
    "The train from the airport to the city center runs every fifteen minutes and takes about "
    "half an hour.",
    "Volunteers meet every second Sunday at nine and bring their own gloves, tools and water "
    "bottles.",
    "The group's treasurer reported that membership fees cover only about half of the yearly "
    "costs.",
    "Last year the event drew around three hundred visitors, twice as many as the year before.",
    "Parking near the site is limited, so most people arrive by bus or on foot.",
    "The local newspaper ran a short article about the project and several readers wrote in to "
    "offer help.",
    "A storm in March damaged part of the fence, and repairs took almost a month to finish.",
    "The organisers want to keep the event free but are considering a small donation box at the "
    "entrance.",
    "Two of the founding members moved away this year, and new volunteers took over their tasks.",
    "The weather forecast for the weekend predicts light rain in the morning and sunshine later "
    "in the day.",
    "A grant from the regional council paid for new signs, benches and a storage shed.",
    "Children from the primary school visit twice a term and help with small, supervised tasks.",
    "The group keeps a shared notebook where everyone writes down what they did and what is "
    "left to do.",
    "Some neighbours have complained about noise early on Saturday mornings.",
    "The next general meeting is planned for the end of the month in the community hall.",
]

#: A session's first question, after its notes.
QUESTIONS = [
    "What are the three most important problems in these notes, and what would you do first?",
    "Can you turn these notes into a short plan for the next three months?",
    "Which of these points should I mention in a short speech at the next meeting?",
    "What questions should I ask the group before we decide anything?",
    "Summarise these notes for someone who has just joined the group.",
]

#: The user's messages after the first turn.
FOLLOW_UPS = [
    "Thanks. Can you say more about the second point?",
    "That helps. How would you explain this to a ten-year-old?",
    "Could you make that shorter, in two sentences at most?",
    "What could go wrong with that plan, and how would we notice?",
    "Who should be in charge of each part of it?",
    "Good. Now write it as a short email to the group.",
    "Which of these steps costs the most money?",
    "How long would all of this take, roughly?",
    "Is there anything in my notes you think I left out?",
    "Can you put that in a numbered list?",
    "What would you do differently if we had twice the budget?",
    "Please suggest a title for this plan.",
]

#: A stand-in answer used to find where an answer sits in the template's rendering.
_MARK = "\u2063ANSWER\u2063"


class Turn(msgspec.Struct, kw_only=True):
    """One turn of a session: the user's message and the tokens it adds to the conversation."""

    user: str
    #: Appended after the conversation so far (the previous prompt and the model's answer to it):
    #: at turn 1 the whole rendered prompt; later the end of the answer's message, this user
    #: message and the generation prompt.
    token_ids: list[int]
    max_new_tokens: int


class Session(msgspec.Struct, kw_only=True):
    id: str
    turns: list[Turn]


class MultiTurnWorkload(msgspec.Struct, kw_only=True):
    """A ``multiturn-workload/v1`` file (extra fields are ignored)."""

    format: str
    sessions: list[Session]
    name: str = ""
    seed: int | None = None
    tokenizer_vocab_sha256_16: str = ""
    sampling: dict[str, Any] = msgspec.field(default_factory=dict)
    summary: dict[str, Any] = msgspec.field(default_factory=dict)


def next_prompt(prompt: Sequence[int], answer: Sequence[int], turn: Turn) -> list[int]:
    """The prompt of the turn after ``prompt``: it, the model's ``answer`` and ``turn``'s tokens."""
    return [*prompt, *answer, *turn.token_ids]


def multiturn(
    tokenizer: Any,
    *,
    sessions: int = 8,
    turns: int = 2,
    seed: int = 0,
    first_prompt_tokens: int = 350,
    max_new_tokens: tuple[int, int] = (32, 48),
) -> MultiTurnWorkload:
    """``sessions`` conversations of ``turns`` turns (see the module docstring); ``tokenizer``: a
    Hugging Face tokenizer with a chat template (``AsyncLLM.tokenizer``, ``LLM.get_tokenizer()``)."""
    if sessions < 1 or turns < 1:
        raise BatonError(
            f"a multi-turn workload needs sessions >= 1 and turns >= 1, got {sessions} and {turns}"
        )
    if first_prompt_tokens < 32:
        raise BatonError(f"first_prompt_tokens {first_prompt_tokens}: give at least 32")
    lo, hi = max_new_tokens
    if not 1 <= lo <= hi:
        raise BatonError(f"max_new_tokens range {max_new_tokens}: give 1 <= low <= high")
    rng = random.Random(seed)
    topics = TOPICS[:]
    rng.shuffle(topics)
    out = []
    for s in range(sessions):
        first = _first_message(tokenizer, rng, topics[s % len(topics)], first_prompt_tokens)
        messages: list[dict[str, str]] = [{"role": "user", "content": first}]
        session_turns = [
            Turn(
                user=first,
                token_ids=_render(tokenizer, messages),
                max_new_tokens=rng.randint(lo, hi),
            )
        ]
        follow_ups = rng.sample(FOLLOW_UPS, k=min(turns - 1, len(FOLLOW_UPS)))
        for t in range(1, turns):
            user = follow_ups[(t - 1) % len(follow_ups)]
            session_turns.append(
                Turn(
                    user=user,
                    token_ids=_continuation(tokenizer, messages, user),
                    max_new_tokens=rng.randint(lo, hi),
                )
            )
            messages = [
                *messages,
                {"role": "assistant", "content": "..."},
                {"role": "user", "content": user},
            ]
        out.append(Session(id=f"session-{s:03d}", turns=session_turns))
    return MultiTurnWorkload(
        format=FORMAT,
        name=f"multiturn-s{sessions}-t{turns}-seed{seed}",
        seed=seed,
        tokenizer_vocab_sha256_16=vocab_fingerprint(tokenizer),
        sampling={"temperature": 0.0, "greedy": True, "ignore_eos": True},
        summary=summary(out),
        sessions=out,
    )


def _first_message(tokenizer: Any, rng: random.Random, topic: str, target: int) -> str:
    """Notes on ``topic`` and a question, as many notes as keep the rendered prompt near
    ``target`` tokens (the first note that reaches it is the last)."""
    question = rng.choice(QUESTIONS)
    notes: list[str] = []
    pool: list[str] = []

    def message() -> str:
        return f"Here are my notes on {topic}.\n\n" + " ".join(notes) + f"\n\n{question}"

    while len(_render(tokenizer, [{"role": "user", "content": message()}])) < target:
        if not pool:
            pool = NOTES[:]
            rng.shuffle(pool)
        notes.append(pool.pop())
    return message()


def _render(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _continuation(tokenizer: Any, messages: list[dict[str, str]], user: str) -> list[int]:
    """The tokens after an answer to ``messages``: the template's end of the answer's message,
    ``user``'s message and the generation prompt (what the template renders after the answer)."""
    conv = [*messages, {"role": "assistant", "content": _MARK}, {"role": "user", "content": user}]
    text = tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    if text.count(_MARK) != 1:
        raise BatonError(
            "the tokenizer's chat template does not render an assistant message's content as "
            "given: a multi-turn workload needs one that does"
        )
    return list(tokenizer(text.split(_MARK, 1)[1], add_special_tokens=False)["input_ids"])


def vocab_fingerprint(tokenizer: Any) -> str:
    """The tokenizer's vocabulary digest, as ../shared/bench's workloads record it."""
    vocab = json.dumps(sorted(tokenizer.get_vocab().items())).encode()
    return hashlib.sha256(vocab).hexdigest()[:16]


def summary(sessions: Sequence[Session]) -> dict[str, Any]:
    first = [len(s.turns[0].token_ids) for s in sessions]
    return {
        "sessions": len(sessions),
        "turns": sum(len(s.turns) for s in sessions),
        "first_prompt_tokens_min": min(first),
        "first_prompt_tokens_max": max(first),
        "output_tokens": sum(t.max_new_tokens for s in sessions for t in s.turns),
    }


def write_multiturn(workload: MultiTurnWorkload, path: str | os.PathLike[str]) -> None:
    Path(path).write_bytes(msgspec.json.format(msgspec.json.encode(workload), indent=1) + b"\n")


def load_multiturn(path: str | os.PathLike[str]) -> MultiTurnWorkload:
    wl = msgspec.json.decode(Path(path).read_bytes(), type=MultiTurnWorkload)
    if wl.format != FORMAT:
        raise BatonError(
            f"{path}: format {wl.format!r} is not {FORMAT!r} (write one with baton bench multiturn --save-workload)"
        )
    if not wl.sessions or any(not s.turns for s in wl.sessions):
        raise BatonError(f"{path}: every session needs at least one turn")
    return wl
