"""librdkafka's mock cluster (from the confluent-kafka wheel) as a Kafka test broker.

Tansu, the suite's usual Kafka stand-in, refuses InitProducerId, so the idempotent
producer can't be tested on it. librdkafka ships a mock cluster that answers
InitProducerId, consumer groups and offset commits over real TCP on 127.0.0.1 (see
docs/kafka.md, "Testing against librdkafka's mock cluster", for what it does not do).

The cluster runs in a child process, so librdkafka's threads never live in the
test process: this file is also that child's script (``python kafka_mock.py N``).
It drives the mock's C API (``rdkafka_mock.h``) through ctypes, because the Python
binding exposes only ``test.mock.num.brokers``, which can neither create a topic
with a chosen partition count nor shorten the mock's 3 s initial rebalance delay.
The child prints one JSON line with the bootstrap address, then answers one
command per stdin line with one JSON line, and exits when stdin closes (so it also
ends when the test process dies). :meth:`MockCluster.stop` ends it by its PID.

Commands: ``topic NAME PARTITIONS`` creates a topic (the mock has no CreateTopics
handler); ``requests`` counts the requests the brokers received, by ApiKey.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import select
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from typing import IO, Any

INIT_PRODUCER_ID = 22  # the Kafka protocol's ApiKey of InitProducerId
PRODUCE = 0


class MockCluster:
    """A mock cluster of ``brokers`` brokers in a child process, stopped by its PID."""

    def __init__(self, brokers: int = 1) -> None:
        self.brokers = brokers
        self.bootstrap = ""
        self.process: subprocess.Popen[str] | None = None
        self._log: IO[bytes] | None = None

    def start(self, timeout: float = 20.0) -> None:
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 (closed by stop)
        self.process = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), str(self.brokers)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
        )
        self.bootstrap = self._answer(timeout)["bootstrap"]

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def create_topic(self, name: str, partitions: int = 1) -> None:
        self._ask(f"topic {name} {partitions}")

    def request_counts(self) -> dict[int, int]:
        """How many requests of each ApiKey the brokers received since the start."""
        counts: dict[str, int] = self._ask("requests")["counts"]
        return {int(key): count for key, count in counts.items()}

    def _ask(self, command: str, timeout: float = 10.0) -> Any:
        process = self.process
        if process is None or process.stdin is None:
            raise RuntimeError("the mock cluster is not running")
        process.stdin.write(command + "\n")
        process.stdin.flush()
        return self._answer(timeout)

    def _answer(self, timeout: float) -> Any:
        """The child's next JSON line, within ``timeout`` seconds."""
        process = self.process
        assert process is not None and process.stdout is not None
        ready, _, _ = select.select([process.stdout], [], [], timeout)
        line = process.stdout.readline() if ready else ""
        if not line:
            raise RuntimeError(
                f"the mock cluster (pid {process.pid}) did not answer in {timeout}s; "
                f"exit code {process.poll()}; its log: {self.log()[-2000:]}"
            )
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"the mock cluster: {answer['error']}")
        return answer

    def log(self) -> str:
        """What librdkafka logged in the child (stderr)."""
        if self._log is None:
            return ""
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    def stop(self) -> None:
        process = self.process
        if process is None:
            return
        with contextlib.suppress(OSError):
            if process.stdin is not None:
                process.stdin.close()  # the child's signal to exit
        try:
            process.wait(5)
        except subprocess.TimeoutExpired:
            process.kill()  # this Popen's own PID
            process.wait(5)
        if process.stdout is not None:
            process.stdout.close()
        if self._log is not None:
            self._log.close()
        self.process = self._log = None


@contextlib.contextmanager
def running_mock_cluster(brokers: int = 1) -> Iterator[MockCluster]:
    """A started mock cluster, stopped (by PID) on exit whatever happened meanwhile."""
    cluster = MockCluster(brokers)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


# -- the child process ------------------------------------------------------------------


def _library() -> ctypes.CDLL:
    """librdkafka as bundled with confluent-kafka: its extension module links it.

    dlsym on the extension's handle searches its dependencies too, so this works
    whatever (hashed) file name the wheel gave the bundled library.
    """
    import confluent_kafka.cimpl as cimpl

    lib = ctypes.CDLL(cimpl.__file__)
    pointer, text, number = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int
    signatures: dict[str, tuple[Any, list[Any]]] = {
        "rd_kafka_conf_new": (pointer, []),
        "rd_kafka_conf_set": (number, [pointer, text, text, text, ctypes.c_size_t]),
        "rd_kafka_new": (pointer, [number, pointer, text, ctypes.c_size_t]),
        "rd_kafka_mock_cluster_new": (pointer, [pointer, number]),
        "rd_kafka_mock_cluster_bootstraps": (text, [pointer]),
        "rd_kafka_mock_topic_create": (number, [pointer, text, number, number]),
        "rd_kafka_mock_group_initial_rebalance_delay_ms": (None, [pointer, ctypes.c_int32]),
        "rd_kafka_mock_start_request_tracking": (None, [pointer]),
        "rd_kafka_mock_get_requests": (ctypes.POINTER(pointer), [pointer, ctypes.c_void_p]),
        "rd_kafka_mock_request_api_key": (ctypes.c_int16, [pointer]),
        "rd_kafka_mock_request_destroy_array": (None, [ctypes.POINTER(pointer), ctypes.c_size_t]),
        "rd_kafka_err2str": (text, [number]),
    }
    for name, (result, arguments) in signatures.items():
        function = getattr(lib, name)
        function.restype, function.argtypes = result, arguments
    return lib


def _serve(brokers: int) -> None:
    lib = _library()
    errors = ctypes.create_string_buffer(512)
    conf = lib.rd_kafka_conf_new()
    # the handle only owns the cluster: it is never asked to connect anywhere
    lib.rd_kafka_conf_set(conf, b"log_level", b"4", errors, len(errors))
    handle = lib.rd_kafka_new(0, conf, errors, len(errors))  # 0: RD_KAFKA_PRODUCER
    if not handle:
        _say(error=f"rd_kafka_new: {errors.value.decode()}")
        return
    cluster = lib.rd_kafka_mock_cluster_new(handle, brokers)
    if not cluster:
        _say(error="rd_kafka_mock_cluster_new failed")
        return
    lib.rd_kafka_mock_group_initial_rebalance_delay_ms(cluster, 0)  # 3000 by default
    lib.rd_kafka_mock_start_request_tracking(cluster)
    _say(bootstrap=lib.rd_kafka_mock_cluster_bootstraps(cluster).decode())
    for line in sys.stdin:  # until the test closes stdin (or dies)
        command, *arguments = line.split()
        if command == "topic" and len(arguments) == 2:
            name, partitions = arguments[0], int(arguments[1])
            err = lib.rd_kafka_mock_topic_create(cluster, name.encode(), partitions, 1)
            if err:
                _say(error=f"topic {name}: {lib.rd_kafka_err2str(err).decode()}")
            else:
                _say(ok=True)
        elif command == "requests":
            _say(counts=_request_counts(lib, cluster))
        else:
            _say(error=f"unknown command {line.strip()!r}")
    # The handle and the cluster go with the process: destroying them here only
    # waits for librdkafka's threads, which the exit ends anyway.
    os._exit(0)


def _request_counts(lib: ctypes.CDLL, cluster: int) -> dict[str, int]:
    size = ctypes.c_size_t(0)
    requests = lib.rd_kafka_mock_get_requests(cluster, ctypes.byref(size))
    counts: dict[str, int] = {}
    try:
        for index in range(size.value):
            key = str(lib.rd_kafka_mock_request_api_key(requests[index]))
            counts[key] = counts.get(key, 0) + 1
    finally:
        if requests:
            lib.rd_kafka_mock_request_destroy_array(requests, size.value)
    return counts


def _say(**answer: Any) -> None:
    sys.stdout.write(json.dumps(answer) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    _serve(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
