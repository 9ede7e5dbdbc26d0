"""What a client may ask an engine core outside the step loop: the utility methods' names with
the types of their results, and the checks a frontend makes before sending one."""

from __future__ import annotations

from typing import Any

from baton.errors import InvalidRequestError
from baton.model_info import ModelInfo
from baton.protocol import SchedulerStats, WorkerMemory

#: Methods a client may call through a UTILITY request, with the type of their result.
UTILITY_METHODS: dict[str, Any] = {
    "reset_prefix_cache": bool,
    "get_stats": SchedulerStats,
    "check_health": None,
    "get_model_info": ModelInfo,
    "get_num_blocks": int,
    "list_requests": list[str],
    "sleep": None,
    "wake_up": None,
    "is_sleeping": bool,
    "get_memory_usage": list[WorkerMemory],
    "start_profile": None,
    "stop_profile": list[str],
    "collective_rpc": list[Any],
    "save_sharded_state": None,
    "add_lora": bool,
    "remove_lora": bool,
    "list_loras": list[int],
    "pin_lora": bool,
}


def check_sleep_level(level: object) -> None:
    """Refuse a sleep level other than 1 or 2 (InvalidRequestError with ``param`` "level")."""
    if type(level) is not int or level not in (1, 2):
        raise InvalidRequestError(
            f"sleep level {level!r}: use 1 (free the KV cache, keep the weights in host "
            "memory) or 2 (free the weights too)",
            param="level",
        )
