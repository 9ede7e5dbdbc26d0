"""The engine's ``save_sharded_state`` utility and the check of a sharded-state model folder
(``baton.model.sharded_state`` writes and reads the files)."""

from __future__ import annotations

from pathlib import Path

from baton.config import ExecutorSection, ModelSection
from baton.errors import ExecutorError, InvalidRequestError
from baton.interfaces import Executor
from baton.model.loader import model_folder


def save_sharded_state(
    m: ModelSection,
    ex: ExecutorSection,
    enable_lora: bool,
    executor: Executor,
    sleep_level: int,
    path: str,
    pattern: str | None = None,
    max_size: int | None = None,
) -> None:
    """Refuse what cannot be saved (InvalidRequestError naming it), then have every worker
    write its shard into ``path`` and copy the folder's config and tokenizer files there.
    ``m`` / ``ex``: the engine's model and executor sections; ``enable_lora``: lora's switch."""
    from baton.model.sharded_state import write_folder_files  # torch, as start_profile's

    if not isinstance(path, str) or not path:
        raise InvalidRequestError(f"save_sharded_state path {path!r}: give a folder", param="path")
    if ex.pipeline_parallel_size > 1:
        raise InvalidRequestError(
            f"save_sharded_state with pipeline_parallel_size={ex.pipeline_parallel_size}: "
            "not supported yet; save from an engine with pipeline_parallel_size = 1"
        )
    if enable_lora:
        raise InvalidRequestError(
            "save_sharded_state with lora.enable_lora = true: the LoRA wrappers do not load "
            "back as plain weights; start the engine without LoRA to save"
        )
    if sleep_level:
        raise InvalidRequestError("the engine is asleep: call wake_up() before saving")
    source = model_folder(m)
    dest = Path(path).expanduser().resolve()
    if dest == source.resolve():
        raise InvalidRequestError(
            f"save_sharded_state path {path!r} is the model's own folder: pick another"
        )
    outcomes = executor.collective_rpc("save_sharded_state", (str(dest), pattern, max_size))
    if not all(isinstance(o, list) for o in outcomes):
        raise ExecutorError(f"save_sharded_state: a worker answered {outcomes!r}")
    write_folder_files(source, dest, ex.tensor_parallel_size, ex.pipeline_parallel_size, m.dtype)


def check_sharded_folder(m: ModelSection, ex: ExecutorSection) -> None:
    """ConfigError unless the model folder is a sharded state of the engine's TP x PP layout."""
    from baton.model.sharded_state import check_marker  # torch, as start_profile's

    check_marker(model_folder(m), ex.tensor_parallel_size, ex.pipeline_parallel_size)
