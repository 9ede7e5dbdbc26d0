"""Stop checks: append a step's sampled tokens to a request and decide whether it is done.

Order per token: EOS (unless ``ignore_eos``) and then ``stop_token_ids``, both
only once ``min_tokens`` outputs exist; then the length caps (``max_tokens``,
``max_model_len``), which apply regardless. A grammar, if any, accepts the
tokens of an unfinished request and ends it when it is terminated. Stop
strings are detokenizer work and live in the frontend.
"""

from __future__ import annotations

from baton.request import Request, RequestStatus

_FINISHED = RequestStatus.FINISHED_STOPPED  # every status >= this one is finished
_STOPPED = RequestStatus.FINISHED_STOPPED
_LENGTH = RequestStatus.FINISHED_LENGTH_CAPPED
_ERROR = RequestStatus.FINISHED_ERROR


def append_and_check_stop(req: Request, new: list[int], max_model_len: int | None) -> list[int]:
    """Append ``new`` to ``req``, stopping at the first token that ends it; return the tokens kept.

    Sets ``req.status`` (and ``req.stop_reason`` / ``req.error``) when the request finishes.
    """
    tokens = req.all_token_ids
    sp = req.sampling_params
    for k, tok in enumerate(new):
        tokens.append(tok)
        num_out = len(tokens) - req.num_prompt_tokens
        if num_out >= sp.min_tokens:
            if tok == req.eos_token_id and not sp.ignore_eos:
                req.status = _STOPPED
            elif sp.stop_token_ids and tok in sp.stop_token_ids:
                req.status = _STOPPED
                req.stop_reason = tok
        if req.status < _FINISHED and (
            num_out >= req.max_tokens
            or (max_model_len is not None and len(tokens) >= max_model_len)
        ):
            req.status = _LENGTH
        if req.status >= _FINISHED:
            return new[: k + 1] if k + 1 < len(new) else new
    grammar = req.grammar
    if grammar is not None:
        if not grammar.accept_tokens(new):
            req.status = _ERROR
            req.error = (
                f"request {req.request_id!r}: sampled tokens {new} were rejected by its grammar"
            )
        elif grammar.is_terminated():
            req.status = _STOPPED
    return new
