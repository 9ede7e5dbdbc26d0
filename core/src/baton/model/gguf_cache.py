"""The GGUF conversion cache: a GGUF file dequantised once into a safetensors Hugging Face folder.

The conversion is written to a temporary sibling folder and renamed into place, so a crash never
leaves half a model behind; the folder's MARKER records the file it came from (path, size, mtime
and a fingerprint of its bytes), so the same bytes at another path keep the folder and other
bytes replace it.
"""

from __future__ import annotations

import contextlib
import hashlib
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

from baton.errors import ModelLoadError

log = logging.getLogger(__name__)

#: The first four bytes of every GGUF file.
GGUF_MAGIC = b"GGUF"
#: Magic, version (uint32), tensor count and metadata count (uint64 each).
GGUF_HEADER_SIZE = 24
#: Written last into a converted folder; says where it came from.
MARKER = "baton-converted.json"


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
