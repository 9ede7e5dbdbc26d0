"""LoRA adapters: ``LoRARequest`` names one for a request; ``baton.lora.adapter`` reads PEFT
folders; ``baton.lora.registry`` is the engine core's book of loaded adapters and
``baton.lora.model`` the adapted layers in the model runner.

``LLM(model=..., enable_lora=True).generate(prompts, params, lora_request=LoRARequest("sql", 1,
"/path/to/adapter"))``; see docs/lora.md.
"""

from baton.lora.request import LoRARequest, as_lora_request, check_lora_request

__all__ = ["LoRARequest", "as_lora_request", "check_lora_request"]
