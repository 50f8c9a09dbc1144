"""Running the review page: `dmem serve` (uvicorn over `build_app`) and `dmem review-link`."""

from urllib.parse import urlsplit

import uvicorn
from starlette.applications import Starlette

from durable_memory.client import MemoryClient
from durable_memory.config import ReviewSettings, Settings
from durable_memory.review.app import build_app
from durable_memory.review.signing import Signer


def review_link(review: ReviewSettings, user_id: str, ttl_s: float | None = None) -> str:
    """A signed link that opens a session for `user_id`, accepted for `ttl_s` (default:
    review.link_ttl_s) and once."""
    link = Signer(review.secret()).link(user_id, review.link_ttl_s if ttl_s is None else ttl_s)
    return f"{review.base_url.rstrip('/')}/open?{link.query()}"


def review_server(app: Starlette, host: str, port: int, root_path: str = "") -> uvicorn.Server:
    """uvicorn for the page; `await server.serve()` runs it until Ctrl-C (or should_exit).
    `root_path`: the path a proxy in front strips (`/review` of https://example.org/review),
    which the page's links, forms and cookie then carry."""
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        root_path=root_path,
        log_level="warning",
        proxy_headers=False,
        lifespan="off",
    )
    return uvicorn.Server(config)


async def serve(settings: Settings, host: str | None = None, port: int | None = None) -> None:
    """Serve the page until interrupted, under the path of review.base_url (a proxy in front
    strips it). The secret is checked before anything is started."""
    review = settings.review
    review.secret()
    async with await MemoryClient.connect(settings) as client:
        app = build_app(client, review)
        root_path = urlsplit(review.base_url).path.rstrip("/")
        await review_server(app, host or review.host, port or review.port, root_path).serve()
