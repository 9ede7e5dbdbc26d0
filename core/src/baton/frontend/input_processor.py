"""Turn user prompts into EngineCoreRequests: chat templates, tokenisation, validation."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any, TypeAlias

from baton.errors import InvalidRequestError
from baton.model_info import ModelInfo
from baton.protocol import EngineCoreRequest
from baton.sampling_params import SamplingParams

#: A prompt: text, token ids, or {"prompt": text} / {"prompt_token_ids": [...]}.
PromptType: TypeAlias = str | Sequence[int] | Mapping[str, Any]
ChatMessages: TypeAlias = Sequence[Mapping[str, Any]]


class InputProcessor:
    def __init__(self, tokenizer: Any, info: ModelInfo) -> None:
        self.tokenizer = tokenizer
        self.info = info

    def render_chat(
        self, messages: ChatMessages, add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        """Apply the tokenizer's chat template and tokenise."""
        if not messages:
            raise InvalidRequestError(
                "messages must be a non-empty list of {'role', 'content'} dicts"
            )
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping) or "role" not in m:
                raise InvalidRequestError(
                    f"messages[{i}] must be a dict with 'role' and 'content', got {m!r}"
                )
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise InvalidRequestError(
                f"the tokenizer of {self.info.path} has no chat template: use generate() with a text prompt"
            )
        ids = self.tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=add_generation_prompt, tokenize=True, **kwargs
        )
        if isinstance(ids, Mapping):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self.tokenize(prompt["prompt"])
            raise InvalidRequestError(
                f"a prompt dict needs 'prompt' or 'prompt_token_ids', got keys {list(prompt)}"
            )
        if isinstance(prompt, Sequence) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise InvalidRequestError(
            f"a prompt is text, a list of token ids or a dict, got {type(prompt).__name__}"
        )

    def process(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
        user: str | None = None,
        cache_salt: str | None = None,
    ) -> EngineCoreRequest:
        """Validate and build the request for the engine core."""
        self.validate(prompt_token_ids, params)
        eos = self.info.eos_token_id
        extra_eos = self.info.eos_token_ids[1:]
        if extra_eos and not params.ignore_eos:  # further EOS ids of the model stop like EOS does
            params = params.clone(stop_token_ids=[*(params.stop_token_ids or ()), *extra_eos])
        return EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=params,
            eos_token_id=eos,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            priority=priority,
            user=user,
            cache_salt=cache_salt,
        )

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        n = len(prompt_token_ids)
        limit = self.info.max_model_len
        if n == 0:
            raise InvalidRequestError("the prompt is empty: give at least one token")
        if n >= limit:
            raise InvalidRequestError(
                f"the prompt has {n} tokens but model.max_model_len is {limit} (prompt + output): "
                "shorten the prompt or raise model.max_model_len"
            )
        if params.max_tokens is not None and n + params.max_tokens > limit:
            raise InvalidRequestError(
                f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) exceeds model.max_model_len "
                f"({limit}): lower max_tokens to at most {limit - n}"
            )
        vocab = self.info.vocab_size
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(
                f"prompt token id {bad} is outside the vocabulary [0, {vocab})"
            )
