"""A side effect outside the transaction: the welcome e-mail, through an HTTP mail API.

Registered with :func:`worker.claims.side_effect`, so it runs as a two-phase
claim with a lease: the call happens at least once and, thanks to the
``Idempotency-Key`` header (the message id), takes effect once at the provider.

Its setting is its own, not the core's: ``WORKER_MAIL_API_URL`` in :class:`MailSettings`,
declared with :func:`worker.settings.handler_settings` so that the worker's
unknown-variable check knows it.
"""

from __future__ import annotations

import httpx
from pydantic import BaseModel, ConfigDict, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from worker import ClaimContext, ConfigurationError, Poison, Retry, handler_settings, side_effect
from worker import load_settings as load

# The provider may succeed later on these; any other 4xx will never succeed.
_TRY_AGAIN = frozenset({408, 409, 425, 429})
# Sent, unanswered: unlike a refused connection (a definite failure), the call may have worked.
_NO_ANSWER = (httpx.ReadTimeout, httpx.WriteTimeout, httpx.ReadError, httpx.RemoteProtocolError)


@handler_settings
class MailSettings(BaseSettings):
    """``WORKER_MAIL_*``: the mail API the welcome e-mail goes through."""

    model_config = SettingsConfigDict(env_prefix="WORKER_MAIL_", extra="ignore")

    api_url: str | None = Field(None, description="Endpoint the SendWelcomeEmail handler POSTs to.")


_settings: MailSettings | None = None


def mail_settings() -> MailSettings:
    """``WORKER_MAIL_*``, read once per process, when the handler first runs."""
    global _settings
    if _settings is None:
        _settings = load(MailSettings)
    return _settings


def configure(settings: MailSettings | None) -> None:
    """Use ``settings`` from now on (None: read the environment again on the next call)."""
    global _settings
    _settings = settings


class SendWelcomeEmail(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    user_id: str = Field(min_length=1, max_length=255)
    email: str = Field(min_length=3, max_length=320, pattern=r"^[^@\s]+@[^@\s]+$")


@side_effect("SendWelcomeEmail", SendWelcomeEmail, consumer="welcome-email")
async def send_welcome_email(ctx: ClaimContext, message: SendWelcomeEmail) -> str:
    url = mail_settings().api_url
    if not url:
        raise ConfigurationError("WORKER_MAIL_API_URL is not set")
    # the time the claim leaves the call: the call timeout, or less when the lease is shorter
    async with httpx.AsyncClient(timeout=ctx.time_left) as client:
        try:
            response = await client.post(
                url,
                json={"template": "welcome", "user_id": message.user_id, "to": message.email},
                headers={"Idempotency-Key": ctx.idempotency_key},
            )
        except _NO_ANSWER as exc:
            # Sent, but no answer: the e-mail may be on its way. A TimeoutError tells the
            # claim "outcome unknown", so it keeps its lease instead of inviting a second call.
            raise TimeoutError(f"mail API did not answer: {type(exc).__name__}") from exc
    status = response.status_code
    if status < 300:
        return f"HTTP {status}"
    if status >= 500 or status in _TRY_AGAIN:
        raise Retry(f"mail API answered HTTP {status}", delay=_retry_after(response))
    raise Poison(f"mail API refused the message: HTTP {status}")


def _retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("Retry-After", "")
    return float(value) if value.isdigit() else None
