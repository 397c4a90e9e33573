"""Sphinx configuration of the trio_cuda documentation."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from trio_cuda import __version__  # noqa: E402

project = "trio_cuda"
author = "the trio_cuda authors"
copyright = "the trio_cuda authors"  # noqa: A001
version = release = __version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.viewcode",
]

# The build needs no network: no intersphinx.
# Markdown files (design records in docs/design/) are not Sphinx sources.
exclude_patterns = ["_build", "**/*.md", "Thumbs.db", ".DS_Store", "make_pictures.py"]
source_suffix = {".rst": "restructuredtext"}
root_doc = "index"

autodoc_default_options = {
    "members": True,
    "undoc-members": True,
    "member-order": "bysource",
    "show-inheritance": True,
}
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
autoclass_content = "both"

default_role = "py:obj"
pygments_style = "sphinx"
html_theme = "alabaster"
html_title = f"trio_cuda {release}"
html_static_path: list[str] = ["_static"]
