"""The causes a finding names, and what each says to do.

``worker.testing`` exports each cause's sentence as a constant, so a test can assert which
mistake the checker found (``report.finding.cause == NO_TOKEN``).
"""

from __future__ import annotations

from worker.testing.probe import Escape

ESCAPED = "a write escaped the transaction"
COMMITTED = "the handler ended the pump's transaction itself"
SWALLOWED = "the handler swallowed a database error"
NO_TOKEN = "the row was read without a version token"
RACED = "two messages decided on the same rows at once (write skew)"
STATE = "the handler keeps state in memory across messages"
OUT_OF_ORDER = "an older message overwrote what a newer one wrote"
OUTSIDE_CLAIM = "an effect ran outside a claim"
NEW_ID = "an id was made anew on each attempt"
NO_INBOX = "the handler runs again without the inbox, and its writes are not idempotent"
REPEATED_CALL = "a side effect's call was repeated under another key"
LOST = "a delivery ended without its effects"
UNSTABLE = "applying the samples once does not leave the same result twice"
NOT_ONCE = "the samples do not apply cleanly once"
UNKNOWN = "the handler's effects depend on how often or when it runs"

CAUSES = (
    ESCAPED,
    COMMITTED,
    SWALLOWED,
    NO_TOKEN,
    RACED,
    STATE,
    OUT_OF_ORDER,
    OUTSIDE_CLAIM,
    NEW_ID,
    NO_INBOX,
    REPEATED_CALL,
    LOST,
    UNSTABLE,
    NOT_ONCE,
    UNKNOWN,
)

FIX_SAMPLES = (
    "applied once, one after the other, the samples must all be acked; fix the samples (or "
    "the handler) until they are"
)


def escaped(escape: Escape) -> tuple[str, str]:
    """The cause, and what to do, for something the probe saw pass the transaction."""
    if escape.how == "sent":
        return COMMITTED, (
            f"the handler sent {escape.sql} itself: what it wrote before commits on its own "
            "(with the inbox marker), so a failure after it leaves half the work done and "
            "the redelivery a duplicate. Never commit or roll back in a handler: the pump "
            "commits once, after it returns; raise to undo."
        )
    return ESCAPED, (
        f"{escape.sql} ran {escape.how} ({escape.engine}) while the handler's transaction "
        "was open: it commits on its own, so neither a rollback nor a duplicate's rejected "
        "marker undoes it. Write through ctx.session only."
    )


def from_reason(reason: str) -> tuple[str, str] | None:
    """A cause the pump itself named in a dead letter's reason."""
    if "StatementSwallowed" in reason or "swallowed" in reason.lower():
        return SWALLOWED, (
            "a statement failed inside the handler and the handler carried on; the pump "
            "refuses to commit such a transaction (on PostgreSQL it is already aborted). "
            "Catch database errors inside `async with ctx.session.begin_nested():`, or use "
            "a statement that cannot fail that way (insert ... on conflict)."
        )
    if "TransactionOwnedByPump" in reason or "must not commit" in reason:
        return COMMITTED, (
            "the handler called commit (or rollback) on the pump's session, which the pump "
            "refuses: the marker and the handler's writes commit together, once, after it "
            "returns. Remove the commit; raise to undo."
        )
    return None


def _emulated(emulated: bool, postgres: bool) -> str:
    if not emulated:
        return ""
    if postgres:
        return (
            "(emulated: the handler's recorded writes ran again after the other's commit, "
            "as PostgreSQL runs them) "
        )
    return (
        "(emulated: SQLite lets no other writer commit inside the handler's transaction; "
        "PostgreSQL would) "
    )


def no_token(table: str, unguarded: str | None, emulated: bool, postgres: bool) -> str:
    write = f" ({unguarded})" if unguarded else ""
    how = _emulated(emulated, postgres)
    return (
        f"another writer committed to {table} between the handler's read and its write"
        f"{write} {how}and the handler's write overwrote that change: its WHERE carries no "
        "version token. Map a version column (__mapper_args__ = {'version_id_col': ...}), "
        "put the version read into the UPDATE's WHERE, or lock the row when reading it "
        "(with_for_update())."
    )


def raced(table: str, emulated: bool, postgres: bool) -> str:
    how = _emulated(emulated, postgres).strip()
    how = f" {how}" if how else ""
    return (
        f"one message read rows, another committed a change to {table}, and the first "
        f"then wrote what it had decided from the rows as they were{how}: the result is "
        "neither message applied after the other. Lock what the decision rests on "
        "(SELECT ... FOR UPDATE on the rows, or on one parent row all writers lock), put "
        "the condition into the write's WHERE and check its row count, or let a unique "
        "constraint say no."
    )


def state(names: list[str]) -> str:
    shown = ", ".join(names[:4]) + (" ..." if len(names) > 4 else "")
    return (
        f"the handler changed data it keeps in memory ({shown}), and the result changes "
        "when that memory is forgotten between messages: another replica, a restarted "
        "process or a retry after a rollback sees other data than the database holds. "
        "Keep it in the database, in the handler's transaction (the inbox already "
        "removes duplicates), or read it afresh each time."
    )


def out_of_order(field: str | None) -> str:
    if field is None:
        return (
            "without the inbox a redelivery runs the handler again, and a late one wrote "
            "an older value over a newer one. Keep the inbox, or write only when the "
            "message is newer than the row (a version or a sequence in the WHERE)."
        )
    return (
        f"the samples carry a sequence ({field}) and arrived newest first: the handler "
        "wrote each one over whatever the row held. Compare the sequence in the write "
        f"(WHERE row.{field} < :{field}), or refuse the older message (raise Rejected)."
    )


def outside_claim(where: str) -> str:
    return (
        f"a handler called {where} from inside its transaction, so a rollback, a crash or "
        "a redelivery makes the call again. Make the call a @side_effect handler (a claim "
        "with a lease) and send ctx.idempotency_key with it."
    )


REPEATED = (
    "the claim repeats a call whose outcome it never recorded (after a crash, a lost lease "
    "or a redelivery); the provider counts it once only when it gets the same key every "
    "time: send ctx.idempotency_key, not a key made anew (uuid4()) or none."
)


def new_id(table: str, columns: str) -> str:
    return (
        f"{table} got a row again that differs from the first only in {columns}, whose "
        "values change from run to run (uuid4(), a clock): to its constraints the re-run's "
        "row is a new one. Derive the id from ctx.message_id (uuid5, as ctx.publish does), "
        "or publish with ctx.publish."
    )


NO_INBOX_TEXT = (
    "inbox=False skips the marker, so a duplicate runs the handler again: only an upsert of "
    "absolute values may opt out of the inbox."
)
LOST_TEXT = (
    "a message was acked or dead-lettered without what applying it once writes: a swallowed "
    "error, or a decision taken from state another delivery left."
)
LOST_EFFECT = (
    "fewer calls reached the outside than applying each message once makes: a call was "
    "skipped, for instance because something said it had been made already."
)
UNSTABLE_TEXT = (
    "two runs that each apply every message once, from the same rows, left different rows "
    "(not only values such as uuid4() or a clock that change every time): the handler "
    "depends on something besides the database and the message, such as memory kept where "
    "the kit cannot copy it per run (a class attribute, another module, an object), a "
    "file or an outside service, which the first run changed and the second believed."
)
CRASH_SURVIVED = (
    "the crashed attempt's change survived its rollback: something committed it on its "
    "own (another connection, engine or process). Write through ctx.session only."
)
CRASH_UNDONE = (
    "after the crash the redelivery did not redo the work: it was acked without what "
    "applying it once writes. Something outside the transaction (memory, a file, another "
    "service) said it was done although the crashed attempt rolled back."
)
