"""The web chat page's files: the page itself (static/, its icon included) and the browser libraries it loads.

The page renders replies as markdown with highlighted code. Model output is untrusted, so the
rendered HTML goes through a sanitizer before it reaches the document. The three libraries
(marked, DOMPurify, highlight.js) are npm packages pinned in static/package.json and
package-lock.json; scripts/setup installs them with `npm ci` into static/node_modules, and the
server serves the few files the page needs under /static/vendor/ from there, so the page works
without internet. Nothing here is pasted-in library code.
"""

from __future__ import annotations

import logging
from pathlib import Path

from starlette.exceptions import HTTPException
from starlette.staticfiles import StaticFiles
from starlette.types import Scope

logger = logging.getLogger("tokios.server")

STATIC_DIR = Path(__file__).parent / "static"
FAVICON_FILE = STATIC_DIR / "favicon.svg"  # linked by the page, and served at /favicon.ico too
NODE_MODULES_DIR = STATIC_DIR / "node_modules"
INSTALL_COMMAND = f"npm ci --prefix {STATIC_DIR}"

# The name the page asks for under /static/vendor/ -> the file inside node_modules.
VENDOR_NAME_TO_FILE = {
    "marked.js": "marked/lib/marked.umd.js",
    "purify.js": "dompurify/dist/purify.min.js",
    "highlight.js": "@highlightjs/cdn-assets/highlight.min.js",
    "highlight-light.css": "@highlightjs/cdn-assets/styles/github.min.css",
    "highlight-dark.css": "@highlightjs/cdn-assets/styles/github-dark.min.css",
}


def vendor_file(name: str) -> Path | None:
    """The installed file behind /static/vendor/NAME, or None for a name the page does not use
    or a library that is not installed."""
    relative = VENDOR_NAME_TO_FILE.get(name)
    if relative is None:
        return None
    path = NODE_MODULES_DIR / relative
    return path if path.is_file() else None


def missing_vendor_files() -> list[str]:
    return [name for name in VENDOR_NAME_TO_FILE if vendor_file(name) is None]


def warn_if_vendor_files_missing() -> None:
    """One warning at start when the page would fall back to plain text (no markdown, no highlighting)."""
    missing = missing_vendor_files()
    if missing:
        logger.warning("web page: %s not installed, so replies show as plain text; run ./scripts/setup "
                       "(or %s)", ", ".join(missing), INSTALL_COMMAND)


# The page loads its own scripts and styles from this server and nothing else: no inline script,
# no other origin, no frames. A sanitizer bug would still find nothing to load or run.
CONTENT_SECURITY_POLICY = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                           "object-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


class PageFiles(StaticFiles):
    """static/ without its npm folder and manifests: the libraries are served by name only
    (/static/vendor/NAME), never node_modules as a tree."""

    async def get_response(self, path: str, scope: Scope):
        if path.split("/", 1)[0] in ("node_modules", "package.json", "package-lock.json"):
            raise HTTPException(404)
        return await super().get_response(path, scope)
