"""The review page's credentials, all HMAC-SHA256 with the one secret of `review:` settings:

- a **link** (`dmem review-link USER`) names one user, when it stops being accepted and a
  random nonce; it is accepted once per server process (the nonce is remembered until the
  link would have expired anyway), so a link copied from a log or a browser history after it
  was opened is refused;
- a **session** (the cookie an opened link sets) names the same user, its own expiry and a
  random session id;
- a **CSRF token** is the HMAC of that session id: a form is accepted only with the token of
  the session that sent it.

Each kind of message is signed under its own prefix, so one can never stand for another.
Nothing here knows HTTP: the app (app.py) moves these strings in and out of requests.
"""

import base64
import hashlib
import hmac
import secrets
import threading
import time
from dataclasses import dataclass
from urllib.parse import urlencode

from durable_memory.memory.core.errors import DurableMemoryError
from durable_memory.memory.core.ids import validate_user_id

_SEPARATOR = "\x1f"
"""Between the signed fields: a user id never holds it (ids are checked first)."""


class ReviewCredentialRefused(DurableMemoryError):
    """A link, session or CSRF token that is missing, tampered with, expired or used up; the
    message says which, for the person who opened it."""


@dataclass(frozen=True)
class Session:
    user_id: str
    expires_at: int
    session_id: str


@dataclass(frozen=True)
class ReviewLink:
    user_id: str
    expires_at: int
    nonce: str
    signature: str

    def query(self) -> str:
        return urlencode(
            {"u": self.user_id, "exp": self.expires_at, "n": self.nonce, "sig": self.signature}
        )


class Signer:
    """Signs and checks the three credentials; remembers which links were opened."""

    def __init__(self, secret: bytes) -> None:
        self._secret = secret
        self._opened: dict[str, int] = {}
        """nonce -> the link's expiry: the links this process has accepted."""
        self._lock = threading.Lock()

    def _sign(self, kind: str, *fields: str) -> str:
        message = _SEPARATOR.join((kind, *fields)).encode("utf-8")
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()

    # -- links -----------------------------------------------------------------------------

    def link(self, user_id: str, ttl_s: float, now: float | None = None) -> ReviewLink:
        validate_user_id(user_id)
        if ttl_s <= 0:
            raise DurableMemoryError("a review link's ttl must be positive")
        expires_at = int((time.time() if now is None else now) + ttl_s)
        nonce = secrets.token_urlsafe(16)
        signature = self._sign("link", user_id, str(expires_at), nonce)
        return ReviewLink(user_id, expires_at, nonce, signature)

    def open_link(self, user_id: str, expires_at: str, nonce: str, signature: str) -> str:
        """The user the link is for, once: refused if tampered with, expired or opened before."""
        expected = self._sign("link", user_id, expires_at, nonce)
        if not hmac.compare_digest(expected, signature):
            raise ReviewCredentialRefused(
                "this review link is not valid (it was changed or cut short): ask for a new one"
            )
        expiry = int(expires_at)  # signed by us, so a number
        now = int(time.time())
        if expiry <= now:
            raise ReviewCredentialRefused("this review link has expired: ask for a new one")
        with self._lock:
            self._opened = {n: e for n, e in self._opened.items() if e > now}
            if nonce in self._opened:
                raise ReviewCredentialRefused(
                    "this review link was already used: a link opens one session; ask for a new one"
                )
            self._opened[nonce] = expiry
        return validate_user_id(user_id)

    # -- sessions --------------------------------------------------------------------------

    def new_session(self, user_id: str, ttl_s: float) -> tuple[Session, str]:
        """A session for the user and its cookie value."""
        session = Session(user_id, int(time.time() + ttl_s), secrets.token_urlsafe(16))
        fields = (session.user_id, str(session.expires_at), session.session_id)
        signature = self._sign("session", *fields)
        raw = _SEPARATOR.join((*fields, signature)).encode("utf-8")
        return session, base64.urlsafe_b64encode(raw).decode("ascii")

    def session(self, cookie: str | None) -> Session:
        if not cookie:
            raise ReviewCredentialRefused(
                "no review session: open the review link you were given (links are made with "
                "`dmem review-link USER`)"
            )
        try:
            raw = base64.urlsafe_b64decode(cookie.encode("ascii")).decode("utf-8")
            user_id, expires_at, session_id, signature = raw.split(_SEPARATOR)
        except (ValueError, UnicodeError):
            raise ReviewCredentialRefused(
                "the review session is not valid: open your review link again"
            ) from None
        if not hmac.compare_digest(
            self._sign("session", user_id, expires_at, session_id), signature
        ):
            raise ReviewCredentialRefused(
                "the review session is not valid: open your review link again"
            )
        if int(expires_at) <= time.time():
            raise ReviewCredentialRefused("the review session has expired: ask for a new link")
        return Session(user_id, int(expires_at), session_id)

    # -- CSRF ------------------------------------------------------------------------------

    def csrf_token(self, session: Session) -> str:
        return self._sign("csrf", session.session_id)

    def check_csrf(self, session: Session, token: str | None) -> None:
        if not token or not hmac.compare_digest(self.csrf_token(session), token):
            raise ReviewCredentialRefused(
                "the form was refused: its CSRF token is missing or not this session's "
                "(reload the page and try again)"
            )
