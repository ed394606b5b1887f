"""Fixtures shared by the whole suite: one real Valkey/Redis server and one local Ray
instance per test session (each is expensive to start; tests get clean state inside)."""

from __future__ import annotations

import gc
import os

import grpc.aio
import pytest
from hypothesis import settings

from valkey_fixture import flushed_redis_url, redis_client, redis_url  # noqa: F401

# CI runs the same generated examples every time (reproducible); locally they vary, which is
# how new counterexamples are found. Property tests with their own settings keep them.
settings.register_profile("ci", derandomize=True, deadline=None)
if os.environ.get("CI"):
    settings.load_profile("ci")

_ray_started = False


def _start_ray() -> None:
    """One local Ray instance per test session (~5 s, ~0.8 GB).

    ``address="local"`` starts a fresh instance instead of joining a stale session left in
    Ray's temp directory. Started once, after collection and before any test runs: Ray
    launches its GCS and raylet by fork + exec with Python run in between, and once gRPC's
    threads exist in this process a child can deadlock before its exec (gRPC warns "Other
    threads are currently calling into gRPC, skipping fork() handlers"); the raylet then
    never starts and ``ray.init`` times out. One retry covers a slow start on a loaded box.
    """
    global _ray_started
    import ray

    for attempt in range(2):
        try:
            ray.init(address="local", num_cpus=2, object_store_memory=200 * 1024**2, include_dashboard=False)
            _ray_started = True
            return
        except Exception:
            ray.shutdown()
            if attempt:
                raise


def pytest_collection_modifyitems(session, config, items):
    if any("local_ray" in item.fixturenames for item in items):
        _start_ray()
    # Hold one reference on gRPC's asyncio runtime from the main thread for the whole session
    # (after Ray is up: see _start_ray). Otherwise the runtime shuts down whenever the last aio
    # object is collected, and that shutdown joins gRPC's poller thread, which can block
    # forever when collection happens late (pytest's final gc.collect(), after event loops
    # closed): grpc/grpc#22365, #40989. The session then hangs after every test has passed.
    grpc.aio.init_grpc_aio()


def pytest_sessionfinish(session, exitstatus):
    if _ray_started:
        import ray

        ray.shutdown()


@pytest.fixture(scope="session")
def local_ray():
    """The session's local Ray instance (started before the first test; see ``_start_ray``)."""
    if not _ray_started:
        _start_ray()
    yield


@pytest.fixture(scope="module", autouse=True)
def collect_garbage_after_each_module():
    """A full garbage collection once each module's tests are done.

    A gRPC aio server a test left running is shut down by its finalizer, on the event loop
    it was started on; when that loop has closed (module- and test-scoped loops do), the
    finalizer raises, and the traceback is formatted wherever the collection happens to run.
    On CPython 3.11 formatting it inside another ``ast.parse`` (the Triton interpreter parses
    kernels on first use) made that parse fail ("AST constructor recursion depth mismatch",
    gh-106905): one CI run failed so. Collecting here runs such finalizers at a harmless point,
    and pytest reports the leak as a warning of the module's last test.
    """
    yield
    gc.collect()
