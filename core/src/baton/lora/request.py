"""``LoRARequest``: which adapter a request runs with (vLLM's ``vllm.lora.request.LoRARequest``)."""

from __future__ import annotations

from typing import Any

import msgspec

from baton.errors import InvalidRequestError


class LoRARequest(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """A PEFT adapter: a name for people, an id unique among the engine's adapters, its folder.

    ``LoRARequest("sql", 1, "/adapters/sql")``, positionally as in vLLM. The id (> 0) is what
    the engine keys adapters by (slots, the prefix cache's block hashes); the folder holds
    ``adapter_config.json`` and ``adapter_model.safetensors``.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path


def as_lora_request(value: Any, param: str = "lora_request") -> LoRARequest:
    """A checked LoRARequest from one, or from its fields as a list / tuple (what a utility call's
    arguments become on the wire). InvalidRequestError (``param``) for anything else."""
    if isinstance(value, list | tuple):
        try:
            value = msgspec.convert(list(value), LoRARequest)
        except msgspec.ValidationError as e:
            raise InvalidRequestError(f"{param}: {e}", param=param) from None
    if not isinstance(value, LoRARequest):
        raise InvalidRequestError(
            f"{param} must be a baton.lora.LoRARequest(name, id, path), got {type(value).__name__}",
            param=param,
        )
    name, lid, path = value.lora_name, value.lora_int_id, value.lora_path
    if not isinstance(name, str) or not name.strip():
        raise InvalidRequestError(f"{param}: the adapter needs a name, got {name!r}", param=param)
    if type(lid) is not int or lid <= 0:
        raise InvalidRequestError(
            f"{param} {name!r}: lora_int_id must be an int > 0 (unique per adapter), got {lid!r}",
            param=param,
        )
    if not isinstance(path, str) or not path:
        raise InvalidRequestError(
            f"{param} {name!r}: lora_path must name the adapter's folder", param=param
        )
    return value


def check_lora_request(
    value: Any, enabled: bool, param: str = "lora_request"
) -> LoRARequest | None:
    """A request's adapter, checked (None: none); refused when the engine has LoRA off."""
    if value is None:
        return None
    lora = as_lora_request(value, param)
    if not enabled:
        raise InvalidRequestError(
            f"{param} {lora.lora_name!r}: LoRA adapters are off; start the engine with "
            "lora.enable_lora = true (--enable-lora, LLM(enable_lora=True))",
            param=param,
        )
    return lora
