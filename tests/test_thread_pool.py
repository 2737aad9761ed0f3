"""The native thread pool's logic (csrc/thread_pool.h), without timing: every task of every job
runs exactly once whether workers are late, held up before they start, held up inside a
task, or more numerous than the cores; an exception from a task reaches the caller and
leaves the pool usable. How fast it is when the CPU is shared is benchmarks/shared_cpu.py's
business. The checks run in a child process: a pool that waited for a held-up worker would
hang there, and the child's timeout turns that into a failure."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from moerun import kernels

pytestmark = pytest.mark.skipif(not kernels.native(), reason="the native extension is not in use")

CHILD = r"""
import json
from moerun import _native as nat

out = {}
for threads in (2, 3, 8):  # 8: more threads than this machine's cores, so workers are often late
    nat.set_threads(threads)
    r = {}
    for n in (2, 3, 17, 1000):
        r[f"free {n}"] = nat.pool_check(n, jobs=300)
    # workers held up before they take a task (as if descheduled): the caller runs every task
    r["held"] = nat.pool_check(37, jobs=50, hold=True)
    # ... then released: they wake on stale jobs and must not take a task of a later one
    r["after held"] = nat.pool_check(5, jobs=500)
    # a worker held up inside its task (it sleeps 2 ms first)
    r["slow worker"] = nat.pool_check(64, jobs=20, worker_sleep_us=2000)
    # task 5 of the first job throws
    r["throws"] = nat.pool_check(64, jobs=3, throw_task=5)
    r["after throw"] = nat.pool_check(64, jobs=3)
    out[threads] = r
# more tasks than one job's word holds (2^20 - 1): run as several jobs
nat.set_threads(2)
big = nat.pool_check((1 << 20) + 7, jobs=1)
out["big"] = {"n": len(big["counts"]), "all once": all(c == 1 for c in big["counts"])}
nat.set_threads(1)
out["one thread"] = nat.pool_check(9, jobs=4, hold=True)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def results():
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("threads", ["2", "3", "8"])
def test_every_task_runs_once_per_job(results, threads):
    r = results[threads]
    for n in (2, 3, 17, 1000):
        assert r[f"free {n}"]["counts"] == [300] * n
        assert not r[f"free {n}"]["raised"]
    assert r["after held"]["counts"] == [500] * 5
    assert r["slow worker"]["counts"] == [20] * 64
    assert r["after throw"]["counts"] == [3] * 64 and not r["after throw"]["raised"]


@pytest.mark.parametrize("threads", ["2", "3", "8"])
def test_job_completes_while_workers_are_held_up(results, threads):
    """No job waits for a worker that has not started: with every worker held up before its
    first task, the calling thread runs all of them, and each job still completes."""
    held = results[threads]["held"]
    assert held["counts"] == [50] * 37
    assert held["by_caller"] == 37 * 50


@pytest.mark.parametrize("threads", ["2", "3", "8"])
def test_exception_in_a_task_reaches_the_caller_after_the_job(results, threads):
    r = results[threads]["throws"]
    assert r["raised"]
    assert r["counts"] == [3] * 64  # the other tasks of the throwing job still ran, once


def test_jobs_larger_than_one_word(results):
    assert results["big"] == {"n": (1 << 20) + 7, "all once": True}


def test_one_thread_runs_inline(results):
    r = results["one thread"]
    assert r["counts"] == [4] * 9 and r["by_caller"] == 36


def test_bench_json_reports_the_threads_it_used(capsys):
    """`moerun bench --json` without --threads: all cores this process may use, as the help
    says, and the native pool really ran with that many."""
    from moerun.cli import main

    try:
        assert main(["bench", "--prompt-tokens", "8", "--gen-tokens", "4", "--json"]) == 0
        d = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert d["threads"] == len(os.sched_getaffinity(0))
        assert kernels._native().get_threads() == d["threads"]
    finally:
        kernels.set_threads(None)


def test_the_pool_watches_for_a_shared_cpu_only_beside_one_torch_thread():
    """kernels.split_threads: a prefill runs torch's ops on every thread, whose spinning would
    look like another process to the pool, so the pool does not watch then; decode passes
    (torch on one thread) turn the watch back on."""
    import torch

    import moerun
    from moerun import kernels

    llm = moerun.load(threads=2)
    if not kernels.split_threads(llm.net, 2):
        pytest.skip("the native extension is not in use")
    with torch.inference_mode():
        llm.net(torch.zeros(1, 64, dtype=torch.long))
        assert kernels._state["watch"] is False
        llm.net(torch.zeros(1, 1, dtype=torch.long))
        assert kernels._state["watch"] is True
