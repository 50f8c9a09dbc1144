"""Running the review page: `dmem serve` (uvicorn over `build_app`) and `dmem review-link`."""

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


def review_server(app: Starlette, host: str, port: int) -> uvicorn.Server:
    """uvicorn for the page; `await server.serve()` runs it until Ctrl-C (or should_exit)."""
    config = uvicorn.Config(
        app, host=host, port=port, log_level="warning", proxy_headers=False, lifespan="off"
    )
    return uvicorn.Server(config)


async def serve(settings: Settings, host: str | None = None, port: int | None = None) -> None:
    """Serve the page until interrupted. The secret is checked before anything is started."""
    review = settings.review
    review.secret()
    async with await MemoryClient.connect(settings) as client:
        server = review_server(build_app(client, review), host or review.host, port or review.port)
        await server.serve()
