"""The ``[server]`` config section: ``baton serve``'s settings, registered with baton's
``register_config_sections`` hook (``plugin.py``), so ``BATON_SERVER__*`` variables,
``--set server.port=...`` and ``LLM(port=...)`` reach it as any section's.

Each field's docstring is its documentation (docs/configuration.md is rendered from them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import pydantic
from pydantic import BaseModel, ByteSize, ConfigDict, Field

from baton.config import ServingSettings

if TYPE_CHECKING:
    from baton.config import BatonConfig


class ServerSection(BaseModel):
    """``baton serve``'s settings: the config's ``[server]`` table (``config.server``)."""

    # as baton-core's sections: an unknown key is reported by the start-up check
    # (baton.plugins.check) with the section's fields, not refused here
    model_config = ConfigDict(
        extra="allow", validate_assignment=True, use_attribute_docstrings=True
    )

    host: str = "127.0.0.1"
    """Address `baton serve` binds (a non-loopback address without api_key logs a warning)."""
    port: int = Field(8000, ge=0, le=65535)
    """Port `baton serve` binds (0 = a free one); checked before the model loads."""
    served_model_name: str | None = None
    """The model name clients use; default: model.name."""
    api_key: str | None = None
    """When set, /v1 requests must carry `Authorization: Bearer <api_key>` or (as Anthropic's
    clients send it) `x-api-key: <api_key>`; empty or blank is refused."""
    shutdown_timeout: float = Field(0.0, ge=0)
    """On shutdown (SIGTERM/SIGINT): seconds in-flight requests may take to finish before they
    are aborted; 0 aborts them at once. The default 0 is the library's (an engine stops at once);
    `baton serve` drains for 30 s when this is not set, and exits about a second after the
    timeout (counted from the signal), an engine in its own process (transport zmq, shm)
    included."""
    max_request_bytes: ByteSize = Field(ByteSize(8 * 1024**2), gt=0)
    """Largest HTTP request body `baton serve` accepts, e.g. "8MiB" (the default); a larger one
    gets a 413 and its connection is closed. 8 MiB holds a 128k-token prompt (~0.5 MB of text,
    ~1 MB as token ids or as escaped non-ASCII JSON) many times over, or 1M tokens of English
    text; the bound also caps the JSON parsing a request costs (a large body is decoded in
    pieces, one body at a time, so that it does not stop the event loop)."""
    header_timeout: float = Field(30.0, gt=0)
    """Seconds from the first byte of a request to the end of its headers; then a 408 and the
    connection is closed. Idle keep-alive connections (and new ones that send nothing) close
    after 5 s."""
    body_timeout: float = Field(60.0, gt=0)
    """Seconds to send a whole request body once its headers are in (not per read: 8 MiB in
    60 s is ~140 KB/s); then a 408 and the connection is closed."""
    preprocess_workers: int = Field(4, gt=0)
    """Threads that render chat templates and tokenize prompts off the event loop; with
    allow_client_chat_template, also the most client-template processes."""
    preprocess_timeout: float = Field(10.0, gt=0)
    """Seconds a request's chat template + tokenization may take, waiting for a worker
    included: over it, a 400 (the work took too long; raise this for huge prompts) or a 503 (no
    worker was free)."""
    allow_client_chat_template: bool = False
    """Accept a request's own Jinja chat template (`chat_template`, also inside
    `chat_template_kwargs`), rendered in a sandboxed process killed after preprocess_timeout;
    refused with a 400 when off."""
    tool_call_parser: str = "hermes"
    """How `baton serve` reads tool calls out of a chat answer (requests with `tools` and
    tool_choice "auto"): hermes (`<tool_call>{json}</tool_call>`), json (the whole answer is
    one `{"name", "arguments"}` object or a list of them), or a parser another distribution
    registers (baton-plugin-openai's `register_tool_parsers` hook)."""
    reasoning_parser: str | None = None
    """Split each chat answer's reasoning into `reasoning_content`: think (`<think>...</think>`)
    or a registered parser (`register_reasoning_parsers`); None: answers are left whole."""
    max_queued_requests: int | None = Field(None, gt=0)
    """Most generation requests `baton serve` holds before their first token (waiting to be
    scheduled or computing their prompt); one more gets a 429 with `Retry-After`. None: no bound."""
    cors_origins: list[str] = Field(default_factory=list)
    """Origins browsers may call `baton serve` from (CORS: preflight answered, headers added),
    e.g. ["https://app.example.com"], or ["*"] for any; empty: no CORS headers."""
    log_format: Literal["text", "json"] = "text"
    """`baton serve`'s log lines: text, or json (one JSON object a line, with the request id)."""
    lora_modules: dict[str, str] = Field(default_factory=dict)
    """LoRA adapters `baton serve` offers from the start, name -> PEFT folder (vLLM's
    --lora-modules name=path): each name is a model in /v1/models (its parent the served model)
    that a request's `model` selects. Needs lora.enable_lora."""
    allow_runtime_lora_updating: bool = False
    """Mount POST /v1/load_lora_adapter {lora_name, lora_path} and /v1/unload_lora_adapter
    {lora_name} (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING; here also
    BATON_SERVER__ALLOW_RUNTIME_LORA_UPDATING=true): anyone who can reach the API can then make
    the server read any folder it can see."""
    chat_template: str | None = None
    """A chat template `baton serve` uses instead of the tokenizer's (vLLM's --chat-template):
    a Jinja file's path, or the template itself (text with `{`, `}` or a newline); a path that
    does not exist is refused at start-up. A request's own `chat_template` still overrides it
    (allow_client_chat_template)."""
    response_store_max_bytes: ByteSize = Field(ByteSize(64 * 1024**2), ge=0)
    """Memory the Responses API's store may hold, e.g. "64MiB": responses created with
    `store: true` (the default), for `previous_response_id` and GET /v1/responses/{id};
    past it the oldest are dropped. 0: none are kept."""
    response_store_ttl: float = Field(3600.0, gt=0)
    """Seconds a stored response is kept (then `previous_response_id` naming it is a 404)."""
    files_dir: str | None = None
    """Folder of the Files and Batch APIs (/v1/files uploads, /v1/batches' state and results):
    a batch in progress there resumes when the server restarts, each request line answered
    once. One server at a time uses a folder (a second is refused at start-up). None: a
    temporary folder removed at exit (batches do not survive a restart)."""
    max_file_bytes: ByteSize = Field(ByteSize(200 * 1024**2), gt=0)
    """Largest file POST /v1/files accepts, e.g. "200MiB" (the default, OpenAI's batch input
    limit); a larger one gets a 413. Batch input files are read whole into memory."""
    batch_max_concurrency: int = Field(8, gt=0)
    """Most batch request lines (of all batches) in the engine at once: a batch never floods
    the engine's queue ahead of interactive requests."""
    batch_priority: int = Field(100, ge=0, le=2**63 - 1)
    """The priority batch lines run at (or later, if a line asks): with scheduler.policy
    "priority" (lower first) they wait behind interactive requests (priority 0 by default)."""
    playground: bool = True
    """Serve the chat playground at `/` (a static page whose requests go to /v1 like any client's,
    with the API key it asks for); off: `/` is a 404. The engine dashboard at /dashboard stays."""

    @pydantic.field_validator("api_key")
    @classmethod
    def _api_key_not_blank(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError(
                "an empty or blank API key would let any bearer token in: "
                "set a real key, or leave server.api_key unset for no authentication"
            )
        return value

    def check_config(self, config: BatonConfig) -> None:
        """The check across sections: adapters to offer need LoRA on."""
        if self.lora_modules and not config.lora.enable_lora:
            raise ValueError(
                f"server.lora_modules ({', '.join(self.lora_modules)}) needs "
                "lora.enable_lora = true (--enable-lora)"
            )

    def serving_settings(self) -> ServingSettings:
        """What the engine and the tracer read: the drain time and the served model name."""
        return ServingSettings(
            shutdown_timeout=self.shutdown_timeout, served_model_name=self.served_model_name
        )
