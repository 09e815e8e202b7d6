"""fork() at awkward moments: while another thread rebuilds the pool, and while another thread makes the first call.

Each scenario runs in a fresh interpreter without torch (torch's OpenMP pool is not fork-safe), forks children
that each run a small diff and exit, and counts the children that do not finish within a timeout.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="fork is POSIX-only")

CHILDREN = 200
CHILD_TIMEOUT_S = 10.0

# Shared by both scenarios: fork a child that diffs a small state and exits 0 (1 on a wrong answer), and wait
# for it with a timeout; a child still running then is killed and counted as hung.
_COMMON = r"""
import json, os, random, signal, sys, threading, time, warnings
warnings.simplefilter("ignore")  # "This process is multi-threaded, use of fork() may lead to deadlocks"
import numpy as np
import deltasync_rs as ds

prev = {"w": np.arange(4096, dtype=np.float32)}
curr = {"w": prev["w"].copy()}
curr["w"][::7] += 1.0
expected = 586

def fork_child():
    pid = os.fork()
    if pid == 0:
        try:
            os._exit(0 if ds.diff(prev, curr).num_changed == expected else 1)
        except BaseException:
            os._exit(2)
    return pid

def wait_child(pid, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.001)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None
"""

# Scenario 1: one thread rebuilds the pool over and over (a new size, then a call that builds it) while the main
# thread forks.
_REBUILDING = (
    _COMMON
    + r"""
stop = threading.Event()
def rebuild():
    size = 1
    while not stop.is_set():
        size = size % 8 + 1
        ds.set_num_threads(size)
        ds.diff(prev, curr)
rebuilder = threading.Thread(target=rebuild, daemon=True)
rebuilder.start()
hung = failed = 0
for _ in range(int(sys.argv[1])):
    time.sleep(random.uniform(0, 0.002))
    code = wait_child(fork_child(), float(sys.argv[2]))
    hung += code is None
    failed += code not in (None, 0)
stop.set()
rebuilder.join()
print(json.dumps({"hung": hung, "failed": failed}))
"""
)

# Scenario 2: first use. The parent imports deltasync_rs but never calls it, so each forked round process starts
# with every lazily initialised static unset, as a fresh interpreter would. In the round process one thread makes
# the first call while the main thread forks a grandchild, which then makes its own call.
_FIRST_USE = (
    _COMMON
    + r"""
hung = failed = 0
for _ in range(int(sys.argv[1])):
    delay = random.uniform(0, 0.003)
    round_pid = os.fork()
    if round_pid == 0:
        first = threading.Thread(target=ds.diff, args=(prev, curr))
        first.start()
        end = time.perf_counter() + delay
        while time.perf_counter() < end:
            pass
        child = fork_child()
        first.join()
        code = wait_child(child, float(sys.argv[2]))
        os._exit(3 if code is None else code)
    code = wait_child(round_pid, 2 * float(sys.argv[2]))
    hung += code in (None, 3)
    failed += code not in (None, 0, 3)
print(json.dumps({"hung": hung, "failed": failed}))
"""
)


def _run(script: str) -> dict[str, int]:
    result = subprocess.run(
        [sys.executable, "-c", script, str(CHILDREN), str(CHILD_TIMEOUT_S)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_fork_while_another_thread_rebuilds_the_pool():
    assert _run(_REBUILDING) == {"hung": 0, "failed": 0}


def test_fork_during_first_use():
    assert _run(_FIRST_USE) == {"hung": 0, "failed": 0}


# A publisher and a subscriber that a parent thread is inside of when the process forks (held by a thread that
# waits on an event), and a publisher whose uploads wait on a gate: what a forked child does with them.
_INHERITED = r"""
import os, sys, threading, time, warnings
warnings.simplefilter("ignore")
import numpy as np
import deltasync_rs as ds

root = sys.argv[1]
gate = threading.Event()

class Gated(ds.LocalStore):
    def put(self, key, data, **kwargs):
        gate.wait(60)
        return super().put(key, data, **kwargs)

states = [{"w": np.full(64, step, dtype=np.float32)} for step in range(4)]
with ds.Publisher(os.path.join(root, "done"), background=False) as first:
    first.publish(0, states[0])
subscriber = ds.Subscriber(os.path.join(root, "done"))
gate.set()
publisher = ds.Publisher(Gated(os.path.join(root, "gated")), exit_timeout=5)  # writes run.json
gate.clear()
publisher.publish(2, states[2])  # queued: the upload thread waits on the gate (a next publish would wait for it)

def child(call):
    pid = os.fork()
    if pid == 0:
        signal_alarm = __import__("signal").alarm(20)  # a hung child dies of SIGALRM
        try:
            call()
        except ds.DeltaSyncError as error:
            print("refused:", error, flush=True)
            os._exit(3)
        sys.exit(0)  # a normal exit: atexit hooks run
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])

# 1. A child that does nothing with the inherited publisher and exits normally: its exit hook used to flush the
# parent's queue, report its uploads as lost and abort the parent's uploads in flight.
print("exit", child(lambda: None), flush=True)

# 2. A child using objects another parent thread is inside of: refused, not waited on forever.
inside, leave = threading.Event(), threading.Event()
def hold(owner):
    with owner._lock:
        inside.set()
        leave.wait(60)
for owner, call in ((subscriber, lambda: subscriber.pull({"w": np.zeros(64, np.float32)})),
                    (publisher, lambda: publisher.publish(9, states[3]))):
    inside.clear(); leave.clear()
    holder = threading.Thread(target=hold, args=(owner,)); holder.start(); inside.wait()
    print("held", child(call), flush=True)
    leave.set(); holder.join()

# 3. A child using a subscriber no thread was inside of: it works, from two of its own threads at once too.
print("free", child(lambda: subscriber.pull({"w": np.zeros(64, np.float32)})), flush=True)
def siblings():
    sys.setswitchinterval(1e-6)  # threads switch between any two bytecodes
    pulls = [threading.Thread(target=subscriber.pull, args=({"w": np.zeros(64, np.float32)},)) for _ in range(4)]
    for thread in pulls:
        thread.start()
    for thread in pulls:
        thread.join()
print("siblings", child(siblings), flush=True)

# 4. A child closing or flushing the inherited publisher: closing only marks it closed; flushing says whose the
# uploads are (both said they were lost).
print("close", child(publisher.close), flush=True)
print("flush", child(publisher.flush), flush=True)

gate.set()
publisher.close()
target = {"w": np.zeros(64, np.float32)}
print("parent pulled", ds.Subscriber(os.path.join(root, "gated")).pull(target), bool((target["w"] == 2).all()), flush=True)
"""


def test_a_forked_child_refuses_objects_a_parent_thread_was_inside_and_leaves_the_parents_uploads_alone(tmp_path):
    """A child forked while another thread was inside a Subscriber.pull or Publisher.publish waited forever on the
    lock that thread held (the child has no such thread); a child exiting normally flushed its inherited publisher,
    reported the parent's pending uploads as lost and aborted the parent's uploads in flight (found by a helper)."""
    done = subprocess.run(
        [sys.executable, "-c", _INHERITED, str(tmp_path)], capture_output=True, text=True, timeout=240
    )
    out = done.stdout.splitlines()
    assert done.returncode == 0, done.stdout + done.stderr
    assert out[0] == "exit 0" and "not closed" not in done.stderr and "lost" not in done.stderr, done.stderr
    refusals = [line for line in out if line.startswith("refused:")]
    assert [line for line in out if line.startswith("held")] == ["held 3", "held 3"], out
    assert all("forked from it" in line for line in refusals[:2]), out
    assert "free 0" in out and "siblings 0" in out and "close 0" in out and "flush 3" in out, out
    assert len(refusals) == 3 and "its upload thread and its uploads are that process's" in refusals[2], out
    assert "lost" not in done.stdout and out[-1] == "parent pulled 2 True", out
