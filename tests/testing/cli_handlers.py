"""A handler module for ``worker check`` in a subprocess (``WORKER_HANDLERS=
tests.testing.cli_handlers``), as an application's would be: on worker.Base and the default
registry. Imported only by those subprocesses, so no other test's registry or metadata
sees it. The mistake is RENAMING's of wrong_handlers.py: an event id made anew each time."""

from __future__ import annotations

import json
import uuid

from pydantic import BaseModel
from sqlalchemy import String
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Mapped, mapped_column

from worker import Base, Context, handler, insert_ignoring_conflicts
from worker.outbox.model import OutboxMessage


class Nickname(Base):
    __tablename__ = "cli_nicknames"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(200))


class SetNickname(BaseModel):
    user_id: str
    name: str


@handler("SetNickname", SetNickname, consumer="set-nickname", inbox=False)
async def set_nickname(ctx: Context, message: SetNickname) -> None:
    dialect = postgresql if ctx.session.get_bind().dialect.name == "postgresql" else sqlite
    upsert = dialect.insert(Nickname).values(id=message.user_id, name=message.name)
    await ctx.session.execute(
        upsert.on_conflict_do_update(index_elements=["id"], set_={"name": message.name})
    )
    event = {
        "message_id": str(uuid.uuid4()),  # WRONG: new on every attempt
        "message_type": "NicknameSet",
        "body": json.dumps(message.model_dump()).encode(),
        "source_message_id": ctx.message_id,
        "consumer": ctx.consumer,
    }
    await ctx.session.execute(insert_ignoring_conflicts(ctx.session, OutboxMessage).values(event))
