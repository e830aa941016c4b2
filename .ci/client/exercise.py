"""A checkout's and an operator's calls through a client generated from /openapi.json.

`.ci/client/run` generates the client with openapi-python-client (PyPI), unmodified,
and runs this against a fresh `stockd serve`. Each call goes through the generated
functions and models; the script fails if one of them cannot express a request or
parse an answer.
"""

import os
import sys
import uuid

from stockd_client import AuthenticatedClient
from stockd_client.api.credentials import create_service_key, who_am_i
from stockd_client.api.orders import create_order, get_order, list_orders, pay
from stockd_client.api.reservations import confirm_reservation, create_reservation, get_reservation
from stockd_client.api.stock import get_sku, get_stock_movement, record_movement, save_sku
from stockd_client.models import (
    CreateOrderRequest,
    CreateReservationRequest,
    CreateServiceKeyRequest,
    PayRequest,
    Problem409,
    ReservationBody,
    ReceiveMovement,
    ReceiveMovementKind,
    ReservationLineRequest,
    SaveSkuRequest,
)

base = os.environ["STOCKD_URL"]
admin = AuthenticatedClient(base_url=base, token=os.environ["STOCKD_ADMIN_TOKEN"], raise_on_unexpected_status=True)


def key():
    return f"client-{uuid.uuid4()}"


def check(condition, message):
    if not condition:
        print(f"client: FAILED: {message}")
        sys.exit(1)


me = who_am_i.sync(client=admin)
check(me.role == "admin", f"who am I: {me}")

sku = save_sku.sync(client=admin, sku="CLIENT-TEA", idempotency_key=key(),
                    body=SaveSkuRequest(title="Tea", price=250, currency="CNY"))
check(sku.sku == "CLIENT-TEA" and sku.shop == "default", f"save sku: {sku}")

received = record_movement.sync(client=admin, sku="CLIENT-TEA", idempotency_key=key(),
                                body=ReceiveMovement(kind=ReceiveMovementKind.RECEIVE, quantity=3))
check(received.available == 3, f"receive: {received}")
movement = get_stock_movement.sync(client=admin, movement_id=received.movement_id)
check(movement.kind == "receive" and movement.available_delta == 3, f"movement: {movement}")

created = create_service_key.sync(client=admin, idempotency_key=key(),
                                  body=CreateServiceKeyRequest(shop="default", name="generated client"))
checkout = AuthenticatedClient(base_url=base, token=created.secret, raise_on_unexpected_status=True)

reservation = create_reservation.sync(client=checkout, idempotency_key=key(), body=CreateReservationRequest(
    lines=[ReservationLineRequest(sku="CLIENT-TEA", quantity=2)], order_ref="SO-CLIENT-1", source="web"))
check(isinstance(reservation, ReservationBody) and reservation.status == "RESERVED", f"reserve: {reservation}")
refused = create_reservation.sync(client=checkout, idempotency_key=key(), body=CreateReservationRequest(
    lines=[ReservationLineRequest(sku="CLIENT-TEA", quantity=5)]))
check(isinstance(refused, Problem409) and refused.code == "insufficient_stock", f"refusal: {refused}")

confirmed = confirm_reservation.sync(client=checkout, id=reservation.reservation_id, idempotency_key=key())
check(confirmed.status == "CONFIRMED" and len(confirmed.movement_ids) == 2, f"confirm: {confirmed}")
read = get_reservation.sync(client=checkout, id=reservation.reservation_id)
check(read.order_ref == "SO-CLIENT-1", f"read: {read}")

order = create_order.sync(client=checkout, idempotency_key=key(), body=CreateOrderRequest(
    user_id="alice", lines=[ReservationLineRequest(sku="CLIENT-TEA", quantity=1)]))
check(order.status == "PENDING_PAYMENT" and order.amount == 250, f"order: {order}")
paid = pay.sync(client=checkout, id=order.order_id, idempotency_key=key(), body=PayRequest(payment_method="pm_card_visa"))
check(paid.status == "PAID", f"pay: {paid}")
again = get_order.sync(client=checkout, id=order.order_id)
check(again.status == "PAID" and again.reservation.status == "CONFIRMED", f"order read: {again}")
listed = list_orders.sync(client=checkout, user_id="alice")
check([summary.order_id for summary in listed.orders] == [order.order_id], f"orders: {listed}")

counters = get_sku.sync(client=admin, sku="CLIENT-TEA")
check((counters.available, counters.reserved) == (0, 0), f"counters: {counters}")
print("client: every call held")
