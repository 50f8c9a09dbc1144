"""What the review page's tests share: a signing secret of their own, and settings using it."""

from pathlib import Path

from durable_memory.config import ReviewSettings, Settings

REVIEW_SECRET = "review-tests-secret-0123456789abcdef"


def with_review(settings: Settings, secret_dir: Path, base_url: str) -> Settings:
    """`settings` with a review section: the secret in a file under `secret_dir`, links made
    for `base_url`."""
    secret_file = secret_dir / "review-secret"
    secret_file.write_text(REVIEW_SECRET + "\n", encoding="utf-8")
    review = ReviewSettings(secret_file=secret_file, base_url=base_url)
    return settings.model_copy(update={"review": review})
