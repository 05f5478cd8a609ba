"""Pin the public API: adding or removing an export must be a deliberate change here."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import ferrymq
import ferrymq.errors

FERRYMQ_ALL = [
    "AdminClient",
    "AsyncAdminClient",
    "AsyncProducer",
    "AsyncPullConsumer",
    "AsyncPushConsumer",
    "AsyncSimpleConsumer",
    "AsyncTransactionProducer",
    "Broker",
    "ConsumeResult",
    "Durability",
    "FerryMQError",
    "LeasedMessage",
    "Message",
    "Producer",
    "PullConsumer",
    "PushConsumer",
    "ReceivedMessage",
    "SendResult",
    "SimpleConsumer",
    "TransactionProducer",
    "TransactionResult",
    "TransactionState",
    "__version__",
]

ERRORS_ALL = [
    "AccessDeniedError",
    "AuthenticationDisabledError",
    "AuthenticationFailedError",
    "AuthenticationRequiredError",
    "BatchAlreadyCommittedError",
    "BatchTooLargeError",
    "BrokerError",
    "BrokerShuttingDownError",
    "BusyError",
    "ClientError",
    "ConcurrentTransactionsError",
    "ConfigError",
    "ConnectionClosedError",
    "CorruptRecordError",
    "DuplicateSequenceError",
    "ErrorCode",
    "FerryMQError",
    "FerryMQTimeoutError",
    "FrameSizeError",
    "FrameTooLargeError",
    "IllegalGenerationError",
    "InternalBrokerError",
    "InvalidConfigError",
    "InvalidOffsetError",
    "InvalidReceiptError",
    "InvalidRequestError",
    "InvalidTopicNameError",
    "InvalidTxnStateError",
    "InvalidTxnTimeoutError",
    "LocalProtocolError",
    "LogClosedError",
    "MemberConflictError",
    "MessageTooLargeError",
    "NonEmptyGroupError",
    "NotScheduledError",
    "OffsetOutOfRangeError",
    "OutOfOrderSequenceError",
    "PolicyViolationError",
    "ProducerFencedError",
    "ProtocolError",
    "RebalanceInProgressError",
    "RemoteProtocolError",
    "RequestTimedOutError",
    "StagedTxnExpiredError",
    "StorageError",
    "StorageFailureError",
    "StorageFullError",
    "TopicAlreadyExistsError",
    "TransactionResolvedError",
    "TransactionStateError",
    "TransactionTimedOutError",
    "UnknownApiError",
    "UnknownGroupError",
    "UnknownMemberError",
    "UnknownProducerIdError",
    "UnknownQueueError",
    "UnknownTopicError",
    "UnknownTransactionError",
    "UnknownUserError",
    "UnsupportedVersionError",
    "UserAlreadyExistsError",
    "error_for_code",
]


def test_ferrymq_all_is_pinned() -> None:
    assert sorted(ferrymq.__all__) == sorted(FERRYMQ_ALL)
    assert len(set(ferrymq.__all__)) == len(ferrymq.__all__)


@pytest.mark.parametrize("name", FERRYMQ_ALL)
def test_ferrymq_exports_import(name: str) -> None:
    mod = importlib.import_module("ferrymq")
    assert getattr(mod, name) is not None
    exec(f"from ferrymq import {name}", {})


def test_version_is_a_string() -> None:
    assert isinstance(ferrymq.__version__, str)
    assert ferrymq.__version__


def test_errors_all_is_pinned() -> None:
    assert sorted(ferrymq.errors.__all__) == sorted(ERRORS_ALL)
    assert len(set(ferrymq.errors.__all__)) == len(ferrymq.errors.__all__)


@pytest.mark.parametrize("name", ERRORS_ALL)
def test_errors_exports_import(name: str) -> None:
    obj = getattr(ferrymq.errors, name)
    if isinstance(obj, type) and name != "ErrorCode":
        assert issubclass(obj, ferrymq.errors.FerryMQError)


def test_star_import_matches_all() -> None:
    ns: dict[str, object] = {}
    exec("from ferrymq import *", ns)
    assert set(ns) - {"__builtins__"} == set(FERRYMQ_ALL)
    ns = {}
    exec("from ferrymq.errors import *", ns)
    assert set(ns) - {"__builtins__"} == set(ERRORS_ALL)


def test_every_error_code_has_one_exception_class() -> None:
    from ferrymq.errors import BrokerError, ErrorCode, error_for_code

    for code in ErrorCode:
        if code is ErrorCode.NONE:
            continue
        exc = error_for_code(code, "msg")
        assert isinstance(exc, BrokerError)
        assert exc.code == code
        assert type(exc).__name__ in ERRORS_ALL
    assert type(error_for_code(60_000, "x")).__name__ == "InternalBrokerError"


def test_protocol_package_exports() -> None:
    import ferrymq.protocol

    assert ferrymq.protocol.__all__ == ["ErrorCode"]


@pytest.mark.parametrize("module", ["ferrymq", "ferrymq.testing", "ferrymq.admin.cli"])
def test_importing_leaves_the_broker_out(module: str) -> None:
    # a fresh interpreter: this one has imported the broker long ago
    code = (f"import sys, {module}\n"
            "loaded = sorted(m for m in sys.modules if m.startswith('ferrymq.broker.'))\n"
            "assert 'ferrymq.broker.server' not in sys.modules, loaded\n"
            "print(' '.join(loaded))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         check=False)
    assert out.returncode == 0, out.stderr
    allowed = {"ferrymq.broker.auth"} if module == "ferrymq.admin.cli" else set()  # users file
    assert set(out.stdout.split()) <= allowed


def test_lazy_broker_exports_are_the_classes() -> None:
    from ferrymq import Broker
    from ferrymq.broker import BrokerConfig, BrokerServer, load
    from ferrymq.broker.config import BrokerConfig as config_class
    from ferrymq.broker.config import load as load_function
    from ferrymq.broker.embedded import Broker as embedded_class
    from ferrymq.broker.server import BrokerServer as server_class

    assert Broker is ferrymq.Broker is embedded_class
    assert (BrokerConfig, BrokerServer, load) == (config_class, server_class, load_function)
    assert "Broker" in dir(ferrymq)
    with pytest.raises(AttributeError, match="no attribute 'Brokr'"):
        _ = ferrymq.Brokr  # type: ignore[attr-defined]
