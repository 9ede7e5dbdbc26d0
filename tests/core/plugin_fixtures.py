"""Helpers that build real plugin distributions (a module + a .dist-info) in a temp folder."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path


def make_dist(
    root: Path,
    dist: str,
    module: str,
    source: str,
    entry_name: str | None = None,
    version: str = "0.1.0",
) -> Path:
    """Write ``module.py`` and ``<dist>-<version>.dist-info`` with a ``baton`` entry point under root."""
    root.mkdir(parents=True, exist_ok=True)
    (root / f"{module}.py").write_text(textwrap.dedent(source))
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[baton]\n{entry_name or module} = {module}\n")
    return root


def add_to_path(root: Path) -> None:
    sys.path.insert(0, str(root))
