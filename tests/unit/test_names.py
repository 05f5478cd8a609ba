"""One name per feature (issue 19, docs/architecture.md "Names"): the retired names appear in
``src/`` only where the deprecated aliases that keep them working are defined, and the modules
the names table points to exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import ferrymq

PKG = Path(ferrymq.__file__).parent
DOCS = PKG.parent.parent / "docs"

RETIRED = {
    # half messages (RocketMQ's transactional messages) were called transactions
    "PrepareTransactionRequest": "PrepareHalfRequest",
    "EndTransactionRequest": "EndHalfRequest",
    "TxnCheckPollRequest": "HalfCheckPollRequest",
    "TxnCheck": "HalfCheck",
    "PREPARE_TRANSACTION": "PREPARE_HALF",
    "END_TRANSACTION": "END_HALF",
    "TXN_CHECK_POLL": "HALF_CHECK_POLL",
    "UNKNOWN_TRANSACTION": "UNKNOWN_HALF_MESSAGE",
    "TRANSACTION_RESOLVED": "HALF_MESSAGE_RESOLVED",
    "UnknownTransactionError": "UnknownHalfMessageError",
    "TransactionResolvedError": "HalfMessageResolvedError",
    "TransactionProducer": "HalfMessageProducer",
    "AsyncTransactionProducer": "AsyncHalfMessageProducer",
    "TransactionResult": "HalfMessageResult",
    "TransactionState": "HalfState",
    "TransactionManager": "HalfMessageManager",
    "txn_check_after_ms": "half_check_after_ms",
    "txn_check_interval_ms": "half_check_interval_ms",
    "txn_max_checks": "half_max_checks",
    "txn_max_pending": "half_max_pending",
    "txn_id": "half_id",
    # the client's misuse error of Kafka-style transactions, apart from InvalidTxnStateError
    "TransactionStateError": "TxnUsageError",
    # delivery groups' requests were named after consumers; pull groups are consumer groups
    "ConsumerHeartbeatRequest": "DeliveryHeartbeatRequest",
    "ConsumerLeaveRequest": "DeliveryLeaveRequest",
    "CONSUMER_HEARTBEAT": "DELIVERY_HEARTBEAT",
    "CONSUMER_LEAVE": "DELIVERY_LEAVE",
    "GroupCoordinator": "ConsumerGroupCoordinator",
}
"""Retired name -> its name now."""

ALIASES = {"_deprecated.py", "__init__.py", "errors.py", "protocol/codes.py", "client/transaction.py",
           "client/half_messages.py", "broker/config.py"}
"""Where the deprecated aliases are defined (and documented)."""

SOURCES = sorted(p for p in PKG.rglob("*.py") if str(p.relative_to(PKG)) not in ALIASES)


@pytest.mark.parametrize("path", SOURCES, ids=[str(p.relative_to(PKG)) for p in SOURCES])
def test_no_retired_name_outside_the_aliases(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    found = {old: new for old, new in RETIRED.items()
             if re.search(rf"(?<![%\w]){re.escape(old)}(?!\w)", text)}
    assert not found, f"{path.name} uses retired names (old -> new): {found}"


def test_the_names_table_points_to_modules_that_exist() -> None:
    text = (DOCS / "architecture.md").read_text(encoding="utf-8")
    section = text.split("## Names", 1)[1].split("\n## ", 1)[0]
    paths = re.findall(r"`((?:broker|client|admin|protocol|storage|spark)/[\w/]+(?:\.py|/))`",
                       section)
    assert paths, "the Names section names no module"
    missing = [p for p in paths if not (PKG / p).exists()]
    assert not missing, f"docs/architecture.md names modules that do not exist: {missing}"
