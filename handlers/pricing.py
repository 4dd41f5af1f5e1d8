"""Expected-version commands: the messaging form of HTTP ``If-Match``.

A ``ChangeProductPrice`` carries the version its sender saw when it decided
on the new price, maybe minutes ago. The UPDATE is guarded by *that* version,
not by one the worker loads now: a guard on a fresh read would happily apply
the sender's stale decision over a newer price. A mismatch is final ("precondition
failed"): not applied, not retried, recorded in ``rejections`` and acked.
"""

from __future__ import annotations

from decimal import Decimal
from typing import cast

from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import Integer, Numeric, String, Table, bindparam, select, update
from sqlalchemy.orm import Mapped, mapped_column

from worker import Base, Context, PreconditionFailed, RowDeleted, handler


class Product(Base):
    __tablename__ = "products"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    price: Mapped[Decimal] = mapped_column(Numeric(18, 2))
    version: Mapped[int] = mapped_column(Integer, nullable=False)

    __mapper_args__ = {"version_id_col": version}


class ChangeProductPrice(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    product_id: str = Field(min_length=1, max_length=64)
    price: Decimal = Field(ge=0, max_digits=18, decimal_places=2)
    expected_version: int = Field(ge=1)


_products = cast(Table, Product.__table__)
# The sender's version in the WHERE; "price differs" keeps a no-op from moving
# the token, which would fail every other sender holding the same version.
_CHANGE = (
    update(_products)
    .where(
        _products.c.id == bindparam("product_id"),
        _products.c.version == bindparam("expected"),
        _products.c.price != bindparam("new_price"),
    )
    .values(price=bindparam("new_price"), version=_products.c.version + 1)
)
_CURRENT = select(_products.c.version, _products.c.price).where(
    _products.c.id == bindparam("product_id")
)


@handler("ChangeProductPrice", ChangeProductPrice, consumer="pricing")
async def change_price(ctx: Context, message: ChangeProductPrice) -> None:
    params = {
        "product_id": message.product_id,
        "expected": message.expected_version,
        "new_price": message.price,
    }
    result = await ctx.session.execute(_CHANGE, params)
    if result.rowcount == 1:  # type: ignore[attr-defined]
        return
    # Zero rows: look before deciding (gone, moved on, or already at this price).
    current = (await ctx.session.execute(_CURRENT, params)).first()
    subject = f"products:{message.product_id}"
    if current is None:
        raise RowDeleted(
            f"product {message.product_id!r} does not exist",
            subject=subject,
            expected=message.expected_version,
        )
    if current.version == message.expected_version:  # by value: never `is`
        return  # the price already is the requested one: nothing to write
    raise PreconditionFailed(
        f"product {message.product_id!r} is at version {current.version}, "
        f"the sender expected {message.expected_version}",
        subject=subject,
        expected=message.expected_version,
        actual=current.version,
    )
