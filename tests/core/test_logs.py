"""worker.logs: no secret leaves the process in a log line, however it is spelled or nested."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest
import structlog

from worker import logs
from worker.logs import scrub, scrub_value

SAS = (
    "SharedAccessSignature sr=sb%3a%2f%2fledger.servicebus.windows.net%2fcredits"
    "&sig=S1gN4tur3Xx%2bYy%3d&se=1767225600&skn=RootManageSharedAccessKey"
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # a Service Bus connection string built from a SAS token: the whole token goes
        (
            f"Endpoint=sb://ledger.servicebus.windows.net/;SharedAccessSignature={SAS}",
            "Endpoint=sb://ledger.servicebus.windows.net/;SharedAccessSignature=***",
        ),
        (
            f"Endpoint=sb://ns/;SharedAccessSignature={SAS};EntityPath=credits",
            "Endpoint=sb://ns/;SharedAccessSignature=***;EntityPath=credits",
        ),
        # the bare token, as the SDK puts it in an Authorization header
        (f"sending with {SAS} now", "sending with SharedAccessSignature *** now"),
        ("Authorization: Bearer eyJhbGciOi.eyJzdWIi.c2lnbmF0dXJl", "Authorization: Bearer ***"),
        ("authorization: Basic dXNlcjpodW50ZXIy", "authorization: Basic ***"),
        ("AUTHORIZATION: abc123", "AUTHORIZATION: ***"),
        ("401 from idp for bearer abc.def-ghi~jk+l/m==", "401 from idp for bearer ***"),
        ("GET /v1/rates?token=t0k3n&page=2", "GET /v1/rates?token=***&page=2"),
        ("access_token=a1; refresh_token=r1", "access_token=***; refresh_token=***"),
        ("api_key=k1 apikey=k2 x-api-key=k3", "api_key=*** apikey=*** x-api-key=***"),
        ("client_secret = c1", "client_secret = ***"),
        ("password='two words' next=1", "password=*** next=1"),
        ("https://acct.blob.core.windows.net/c/b?sv=2022&sig=Ab%2F&se=1", None),
        ('{"access_token": "eyJabc", "expires_in": 3600}', None),
        ("{'Authorization': 'Basic dXNlcjpwYXNz'}", "{'Authorization': '***'}"),
        # what was masked before still is
        ("postgresql+asyncpg://u:s3cret@h/db", "postgresql+asyncpg://u:***@h/db"),
        (
            "Endpoint=sb://x/;SharedAccessKeyName=k;SharedAccessKey=abc=",
            "Endpoint=sb://x/;SharedAccessKeyName=k;SharedAccessKey=***",
        ),
        ("DefaultEndpointsProtocol=https;AccountKey=Zm9v==;x=1", None),
        ("host=db password=pw user=u", "host=db password=*** user=u"),
    ],
)
def test_scrub_masks_every_spelling_of_a_secret(text: str, expected: str | None) -> None:
    masked = scrub(text)
    if expected is not None:
        assert masked == expected
    for secret in ("S1gN4tur3", "t0k3n", "eyJ", "dXNlcj", "Zm9v", "Ab%2F", "s3cret", "k1", "c1"):
        assert secret not in masked


@pytest.mark.parametrize(
    "text",
    [
        "credit key=acct-1 amount=5 tokens=3 consumer=credit",
        "Endpoint=sb://ns/;SharedAccessKeyName=RootManageSharedAccessKey",
        "signature verification failed: expected 3 fields",
        "RuntimeError: authorization failed for account a",
        "no secrets here",
    ],
)
def test_scrub_leaves_ordinary_text_alone(text: str) -> None:
    assert scrub(text) == text


class _Refuses:
    def sub(self, *_args: Any) -> str:
        raise AssertionError("a regular expression ran on text that cannot hold a secret")


def test_text_without_a_trigger_runs_no_regular_expression(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("_URL_PASSWORD", "_SAS", "_AUTHORIZATION", "_BEARER", "_QUOTED_PAIR", "_KV_PAIR"):
        monkeypatch.setattr(logs, name, _Refuses())
    text = "handler failed: RuntimeError: boom (consumer credit, attempt 3, outcome nacked)"
    assert scrub(text) is text
    with pytest.raises(AssertionError):
        scrub("token=abc")


def test_nested_secrets_are_masked_without_touching_the_callers_objects() -> None:
    headers = {"Authorization": "Bearer t0k3n", "x-trace": "abc"}
    value = {
        "headers": headers,
        "urls": ["postgresql://app:hunter2@db/prod", ("amqp://u:hunter3@mq/",)],
        "password": "hunter4",
        "client": {"api_key": "hunter5", "retries": 3, "timeout": None},
        "note": "token=hunter6",
    }
    masked = scrub_value(value)
    assert "hunter" not in json.dumps(masked) and "t0k3n" not in json.dumps(masked)
    assert masked["headers"] == {"Authorization": "***", "x-trace": "abc"}
    assert masked["urls"] == ["postgresql://app:***@db/prod", ("amqp://u:***@mq/",)]
    assert masked["password"] == "***"
    assert masked["client"] == {"api_key": "***", "retries": 3, "timeout": None}
    assert masked["note"] == "token=***"
    assert headers["Authorization"] == "Bearer t0k3n"  # the delivery's own headers untouched
    assert value["password"] == "hunter4"


def test_nesting_is_bounded_and_other_objects_are_scrubbed_by_their_repr() -> None:
    cycle: dict[str, Any] = {"url": "postgresql://a:hunter2@h/d"}
    cycle["self"] = cycle
    masked = scrub_value(cycle)
    assert "hunter2" not in repr(masked)

    class Settings:
        def __repr__(self) -> str:
            return "Settings(database_url='postgresql://a:hunter2@h/d')"

    assert scrub_value(Settings()) == "Settings(database_url='postgresql://a:***@h/d')"
    plain: object = Settings.__new__(type("Plain", (), {}))
    assert scrub_value(plain) is plain  # nothing to hide: the renderer shows it as always
    assert scrub_value(RuntimeError("refused: amqp://u:hunter2@mq/")) == (
        "RuntimeError: refused: amqp://u:***@mq/"
    )


def test_the_processor_masks_nested_and_secret_named_values() -> None:
    event = logs._scrub_event(
        None,
        "warning",
        {
            "event": "call failed",
            "headers": {"Authorization": "Bearer t0k3n"},
            "attempts": [{"url": "https://u:hunter2@api/"}],
            "token": "hunter3",
            "attempt": 2,
        },
    )
    assert event == {
        "event": "call failed",
        "headers": {"Authorization": "***"},
        "attempts": [{"url": "https://u:***@api/"}],
        "token": "***",
        "attempt": 2,
    }


@pytest.fixture
def configured() -> Iterator[None]:
    try:
        yield
    finally:
        structlog.reset_defaults()
        logging.getLogger().handlers.clear()


@pytest.mark.parametrize("fmt", ["json", "console"])
@pytest.mark.usefixtures("configured")
def test_a_real_event_with_a_nested_secret_renders_masked(
    fmt: str, capsys: pytest.CaptureFixture[str]
) -> None:
    logs.configure("INFO", fmt)  # binds the stream pytest captures in this test
    logs.get_logger(pump="p").warning(
        "dead-lettered",
        message_id="m-1",
        headers={"Authorization": SAS, "x-retry": ["amqp://u:hunter2@mq/", 3]},
        reasons=("token=hunter3", {"nested": {"api_key": "hunter4"}}),
        access_token="hunter5",
    )
    text = capsys.readouterr().err
    for secret in ("hunter", "S1gN4tur3", "sr=sb"):
        assert secret not in text
    assert "m-1" in text and "amqp://u:***@mq/" in text
    if fmt == "json":
        line = json.loads(text.strip().splitlines()[-1])
        assert line["headers"] == {"Authorization": "***", "x-retry": ["amqp://u:***@mq/", 3]}
        assert line["reasons"] == ["token=***", {"nested": {"api_key": "***"}}]
        assert line["access_token"] == "***"
        assert line["message_id"] == "m-1" and line["pump"] == "p"
