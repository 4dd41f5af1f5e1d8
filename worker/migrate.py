"""Schema migrations (Alembic), shipped inside the package."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

MIGRATIONS = Path(__file__).with_name("migrations")


def alembic_config(database_url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    # ConfigParser interpolation would choke on a '%' in a URL-encoded password
    config.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    return config


def upgrade(database_url: str, revision: str = "head") -> None:
    """Bring the database to ``revision``. Blocking: call it outside an event loop."""
    command.upgrade(alembic_config(database_url), revision)
