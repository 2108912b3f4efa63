"""Spawned gloo process pools for multi-process tests: one pool per world size and module.

Each rank runs jobs (a module-level function of a test module and its arguments) sent by the
tests; the rendezvous is a ``file://`` under pytest's tmp_path, never a fixed port.
"""

from __future__ import annotations

import datetime
import multiprocessing
import queue
import time
import traceback

import pytest
import torch
import torch.distributed as dist

JOB_TIMEOUT_S = 180


def _worker(rank: int, world: int, init_file: str, jobs, results) -> None:
    import spccl_train.ddp  # noqa: F401 - before init, so DDP cannot pin the group past destroy (its docstring)

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=JOB_TIMEOUT_S - 30),
    )
    while True:
        job = jobs.get()
        if job is None:
            break
        fn, args = job
        try:
            results.put((rank, True, fn(rank, world, *args)))
        except BaseException as exc:  # noqa: BLE001 (report everything to the test, keep serving)
            results.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    dist.destroy_process_group()


class Pool:
    """``world`` spawned ranks in one gloo group, running jobs on request."""

    def __init__(self, world: int, directory, context: str = "") -> None:
        ctx = multiprocessing.get_context("spawn")
        self.world = world
        self.context = context
        self.broken = False
        self.jobs = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        init_file = str(directory / "rendezvous")
        self.procs = [
            ctx.Process(target=_worker, args=(r, world, init_file, self.jobs[r], self.results), daemon=True)
            for r in range(world)
        ]
        for p in self.procs:
            p.start()

    def run(self, fn, *args) -> list:
        """Run ``fn(rank, world, *args)`` on every rank; return the results by rank or fail with all errors."""
        outcomes = self.run_raw(fn, *args)
        errors = [f"rank {r}: {value}" for r, (ok, value) in enumerate(outcomes) if not ok]
        if errors:
            pytest.fail(f"{self.context}\n" + "\n".join(errors), pytrace=False)
        return [value for _, value in outcomes]

    def run_raw(self, fn, *args) -> list[tuple[bool, object]]:
        """Like :meth:`run`, but return ``(ok, value or error text)`` per rank."""
        for q in self.jobs:
            q.put((fn, args))
        got: dict[int, tuple[bool, object]] = {}
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while len(got) < self.world:
            try:
                rank, ok, value = self.results.get(timeout=max(1.0, deadline - time.monotonic()))
            except queue.Empty:
                self.broken = True
                self.close()
                pytest.fail(f"{self.context}: ranks {sorted(set(range(self.world)) - set(got))} hung")
            got[rank] = (ok, value)
        return [got[r] for r in range(self.world)]

    def close(self) -> None:
        for q in self.jobs:
            q.put(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()


def pool_factory(tmp_path_factory, context: str = ""):
    """A generator for a module-scoped fixture: yields ``get(world) -> Pool``, closes all after."""
    made: dict[int, Pool] = {}

    def get(world: int) -> Pool:
        if world not in made or made[world].broken:
            made[world] = Pool(world, tmp_path_factory.mktemp(f"world{world}"), context)
        return made[world]

    yield get
    for pool in made.values():
        pool.close()
