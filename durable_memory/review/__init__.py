"""`dmem serve`: the review page, where each user sees, edits and decides on their memory.

Why this stack: Starlette (a small ASGI toolkit a backend can run as is, behind uvicorn, or
mount inside its own ASGI app behind its own auth), Jinja2 templates with autoescaping (every
value is hostile input, escaped by default) and one small static script: pages are rendered on
the server, so there is no Node build step, nothing to bundle, and a Content-Security-Policy
that forbids inline script costs nothing. See docs/review.md for the link/cookie/CSRF model.

The page is a thin client: it reads and decides through `MemoryClient` (decisions are the
turn's own Update), never a worker's disk, so it runs in the distributed mode as it is.
"""
