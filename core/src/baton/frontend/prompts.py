"""Turn user prompts into EngineCoreRequests: chat templates, tokenisation, validation.

``InputProcessor`` does the work (internal); ``PromptMethods`` is its public face on ``LLM``
and ``AsyncLLM``: what a server needs to tokenize and render chats with the engine's checks.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any, TypeAlias

from baton.errors import ContextLengthError, InvalidRequestError
from baton.frontend.bad_words import bad_words_token_ids
from baton.lora.request import LoRARequest
from baton.model_info import ModelInfo
from baton.protocol import EngineCoreRequest
from baton.sampling_params import SamplingParams, show_value
from baton.scheduling_info import SchedulingInfo, as_scheduling_info
from baton.validation import as_token_ids, check_context_length, check_request, check_text

#: A prompt: text, token ids, or {"prompt": text} / {"prompt_token_ids": [...]}.
PromptType: TypeAlias = str | Sequence[int] | Mapping[str, Any]
ChatMessages: TypeAlias = Sequence[Mapping[str, Any]]


#: apply_chat_template's own options, which baton sets itself: refused in chat_template_kwargs
#: (anything else there is a template variable, e.g. enable_thinking).
RESERVED_CHAT_TEMPLATE_KWARGS: dict[str, str] = {
    "conversation": "the messages are the conversation",
    "conversations": "the messages are the conversation",
    "messages": "the messages are the conversation",
    "chat_template": "give a template with the chat_template argument",
    "add_generation_prompt": "give it with the add_generation_prompt argument",
    "tokenize": "baton tokenises the rendered chat itself",
    "return_tensors": "baton tokenises the rendered chat itself",
    "return_dict": "baton tokenises the rendered chat itself",
    "return_assistant_tokens_mask": "baton tokenises the rendered chat itself",
    "padding": "baton tokenises the rendered chat itself",
    "truncation": "baton tokenises the rendered chat itself",
    "max_length": "baton tokenises the rendered chat itself",
    "tokenizer_kwargs": "baton tokenises the rendered chat itself",
    "sanitize_control_tokens": "baton tokenises the rendered chat itself",
}


#: A text longer than this many characters per token of model.max_model_len is first counted
#: by a prefix: far past the limit, tokenizing all of it (seconds per MB, on a thread that
#: cannot be stopped) only to refuse it would be wasted.
PREFIX_CHARS_PER_TOKEN = 32


class InputProcessor:
    def __init__(self, tokenizer: Any, info: ModelInfo) -> None:
        self.tokenizer = tokenizer
        self.info = info

    def render_chat(
        self,
        messages: ChatMessages,
        add_generation_prompt: bool = True,
        *,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> list[int]:
        """Render the chat template (``chat_template`` replaces the tokenizer's) and tokenise.

        ``chat_template_kwargs`` (and ``kwargs``) are template variables; apply_chat_template's
        own options are refused. Any error the template raises is an InvalidRequestError.
        """
        self.check_messages(messages)
        variables = {
            **self.template_variables(chat_template_kwargs),
            **self.template_variables(kwargs),
        }
        if chat_template is None and getattr(self.tokenizer, "chat_template", None) is None:
            raise InvalidRequestError(
                f"the tokenizer of {self.info.path} has no chat template: use generate() with a "
                "text prompt",
                param="messages",
            )
        if chat_template is not None and not isinstance(chat_template, str):
            raise InvalidRequestError(
                f"chat_template must be a string, got {type(chat_template).__name__}",
                param="chat_template",
            )
        try:
            # transformers (5.x: utils/chat_template_utils.py, _cached_compile_jinja_template)
            # compiles every template, the tokenizer's or this one, in Jinja's
            # ImmutableSandboxedEnvironment: it can read its inputs but not reach Python
            # internals. It bounds neither time nor memory, so an untrusted template needs more.
            text = self.tokenizer.apply_chat_template(
                [dict(m) for m in messages],
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                **variables,
            )
        # the template is code run on the request's data: whatever it raises is the request's fault
        except Exception as e:
            param = "chat_template" if chat_template is not None else "messages"
            raise InvalidRequestError(
                f"the chat template failed: {type(e).__name__}: {_cut(str(e))}",
                param=param,
            ) from None
        if not isinstance(text, str):
            raise InvalidRequestError(
                f"the chat template rendered {type(text).__name__}, not text", param="messages"
            )
        return self.encode_rendered_chat(text)

    def encode_rendered_chat(self, text: str) -> list[int]:
        """The token ids of a rendered chat (errors name param "messages")."""
        # as apply_chat_template does: the template wrote the special tokens itself
        return self.encode(
            text, add_special_tokens=False, what="the rendered chat", param="messages"
        )

    def check_messages(self, messages: ChatMessages) -> None:
        """InvalidRequestError (param "messages") unless ``messages`` is a non-empty list of
        dicts with a 'role', whose strings are valid UTF-8: what a chat template may be given."""
        if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
            raise InvalidRequestError(
                "messages must be a non-empty list of {'role', 'content'} dicts", param="messages"
            )
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping) or "role" not in m:
                raise InvalidRequestError(
                    f"messages[{i}] must be a dict with 'role' and 'content', got {show_value(m)}",
                    param="messages",
                )
            for key, value in m.items():
                if isinstance(value, str):
                    check_text(value, f"messages[{i}].{key}", param="messages")

    def template_variables(self, kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
        """``kwargs`` (chat_template_kwargs) as template variables; apply_chat_template's own
        options are refused (InvalidRequestError, param "chat_template_kwargs")."""
        if kwargs is None:
            return {}
        if not isinstance(kwargs, Mapping):
            raise InvalidRequestError(
                f"chat_template_kwargs must be a dict, got {type(kwargs).__name__}",
                param="chat_template_kwargs",
            )
        for key in kwargs:
            if not isinstance(key, str):
                raise InvalidRequestError(
                    f"chat_template_kwargs keys must be strings, got {show_value(key)}",
                    param="chat_template_kwargs",
                )
            why = RESERVED_CHAT_TEMPLATE_KWARGS.get(key)
            if why is not None:
                raise InvalidRequestError(
                    f"chat_template_kwargs: {key!r} is an option of apply_chat_template, not a "
                    f"template variable ({why}); remove it. Template variables such as "
                    "enable_thinking pass.",
                    param="chat_template_kwargs",
                )
        return dict(kwargs)

    def encode(
        self,
        text: str,
        *,
        add_special_tokens: bool,
        what: str = "the prompt",
        param: str = "prompt",
    ) -> list[int]:
        """The token ids of ``text``, which must be valid UTF-8 (InvalidRequestError).

        A text longer than PREFIX_CHARS_PER_TOKEN characters per token of model.max_model_len
        is first counted by a prefix (cut at a space): when that alone has more than twice the
        limit in tokens (plus 64, so that where the cut falls cannot matter), it is refused
        with a ContextLengthError without being tokenized whole. A text that fits is far
        shorter, and its ids are those of ``tokenizer.encode``.
        """
        check_text(text, what, param=param)
        limit = self.info.max_model_len
        chars = PREFIX_CHARS_PER_TOKEN * limit
        if len(text) > chars:
            cut = text.rfind(" ", chars // 2, chars)
            prefix = text[: cut if cut > 0 else chars]
            counted = len(self.tokenizer.encode(prefix, add_special_tokens=False))
            if counted > 2 * limit + 64:
                raise ContextLengthError(
                    f"{what} has more than {counted} tokens (in its first {len(prefix)} of "
                    f"{len(text)} characters) but model.max_model_len is {limit} (prompt + "
                    "output): shorten it or raise model.max_model_len",
                    param=param,
                )
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def tokenize(
        self, prompt: PromptType, *, add_special_tokens: bool = True
    ) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of a prompt: text, token ids, or a dict of either.

        ``add_special_tokens``: whether a text gets the tokenizer's special tokens (BOS)."""
        if isinstance(prompt, str):
            return prompt, self.encode(prompt, add_special_tokens=add_special_tokens)
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                text = prompt.get("prompt")
                if text is not None and not isinstance(text, str):
                    raise InvalidRequestError(
                        f"a prompt dict's 'prompt' must be text, got {type(text).__name__}",
                        param="prompt",
                    )
                return text, self._token_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self.tokenize(prompt["prompt"], add_special_tokens=add_special_tokens)
            raise InvalidRequestError(
                f"a prompt dict needs 'prompt' or 'prompt_token_ids', got keys {list(prompt)}",
                param="prompt",
            )
        if isinstance(prompt, Sequence | bytes | bytearray | memoryview):
            return None, self._token_ids(prompt)
        raise InvalidRequestError(
            f"a prompt is text, a list of token ids or a dict, got {type(prompt).__name__}",
            param="prompt",
        )

    def _token_ids(self, value: Any) -> list[int]:
        """as_token_ids, but a list longer than model.max_model_len is refused by its length
        first: checking a million ids one by one only to refuse them would be wasted."""
        if isinstance(value, list | tuple):
            check_context_length(len(value), None, self.info.max_model_len)
        return as_token_ids(value)

    def process(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        scheduling: SchedulingInfo,
        arrival_time: float | None = None,
        user: str | None = None,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> EngineCoreRequest:
        """Build the request for the engine core from one ``validate`` accepted (and the
        SchedulingInfo it returned); it is not checked again here (the engine core checks
        what it receives: a client may have no frontend)."""
        eos = self.info.eos_token_id
        extra_eos = self.info.eos_token_ids[1:]
        if extra_eos and not params.ignore_eos:  # further EOS ids of the model stop like EOS does
            params = params.clone(stop_token_ids=[*(params.stop_token_ids or ()), *extra_eos])
        if params.bad_words and params.bad_words_token_ids is None:
            params = params.clone(
                bad_words_token_ids=bad_words_token_ids(self.tokenizer, params.bad_words)
            )
        return EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=params,
            eos_token_id=eos,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            priority=scheduling.priority,
            user=user,
            cache_salt=cache_salt,
            # only the priority: the field a client that predates scheduling sends
            scheduling=None
            if scheduling == SchedulingInfo(priority=scheduling.priority)
            else scheduling,
            lora_request=lora_request,
            kv_transfer_params=params.kv_transfer_params,
        )

    def validate(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        user: str | None = None,
        cache_salt: str | None = None,
        scheduling: SchedulingInfo | Mapping[str, Any] | None = None,
    ) -> SchedulingInfo:
        """baton.validation.check_request against this processor's model.

        Returns the request's SchedulingInfo: ``scheduling`` with ``priority`` merged in.
        """
        info = as_scheduling_info(scheduling, priority)
        check_request(
            prompt_token_ids,
            params,
            self.info,
            priority=info.priority,
            user=user,
            cache_salt=cache_salt,
            scheduling=info,
        )
        return info


class PromptMethods:
    """The engine's tokenization and chat rendering, with its checks: methods of ``LLM`` and
    ``AsyncLLM`` (each sets ``tokenizer`` and ``input_processor``). They raise
    InvalidRequestError (a ContextLengthError for a prompt far over model.max_model_len)
    naming the bad param, as a request with the same prompt would; none touches the engine,
    so a server may run them on worker threads."""

    tokenizer: Any
    input_processor: InputProcessor

    def get_tokenizer(self) -> Any:
        """The model's tokenizer (a Hugging Face tokenizer), as vLLM's ``get_tokenizer``."""
        return self.tokenizer

    def tokenize(self, prompt: PromptType, *, add_special_tokens: bool = True) -> list[int]:
        """The token ids of a prompt (text, token ids, or {"prompt": ...} /
        {"prompt_token_ids": ...}), checked as ``generate`` checks them: a text must be valid
        UTF-8, an id list is refused by its length first. ``add_special_tokens``: whether a
        text gets the tokenizer's special tokens (BOS)."""
        return self.input_processor.tokenize(prompt, add_special_tokens=add_special_tokens)[1]

    def render_chat(
        self, messages: ChatMessages, add_generation_prompt: bool = True, **options: Any
    ) -> list[int]:
        """The prompt token ids of a conversation: the chat template rendered, then tokenized
        without further special tokens. ``options``: ``chat_template`` (replaces the
        tokenizer's), ``chat_template_kwargs`` (template variables, e.g. enable_thinking) and
        further keywords (template variables too)."""
        return self.input_processor.render_chat(messages, add_generation_prompt, **options)

    def tokenize_rendered_chat(self, text: str) -> list[int]:
        """The token ids of a chat rendered elsewhere (a template the caller ran itself, e.g.
        in a sandbox): no special tokens added (the template wrote them), the checks and
        messages of ``render_chat``."""
        return self.input_processor.encode_rendered_chat(text)

    def check_messages(self, messages: ChatMessages) -> None:
        """InvalidRequestError (param "messages") unless ``messages`` is what a chat template
        may be given: a non-empty list of dicts with a 'role', whose strings are valid UTF-8."""
        self.input_processor.check_messages(messages)

    def chat_template_variables(
        self, chat_template_kwargs: Mapping[str, Any] | None
    ) -> dict[str, Any]:
        """``chat_template_kwargs`` as template variables (enable_thinking, ...); options of
        apply_chat_template itself are refused (InvalidRequestError, param
        "chat_template_kwargs"), as ``render_chat`` refuses them."""
        return self.input_processor.template_variables(chat_template_kwargs)


def _cut(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
