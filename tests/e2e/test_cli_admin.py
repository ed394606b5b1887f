"""The operator CLI end to end against one local stack: real Valkey, a real Ray worker actor,
the controller on loopback, and ``kvtier.cli.main.main`` invoked as a user would (in-process,
stdout and stderr captured). Each test uses its own tenant, so they do not share cache.

The stack's event loop runs on a background thread: the controller must keep serving
while the CLI (its own event loop, on the test's thread) calls it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from kvtier.cli.main import main
from kvtier.client import Client
from kvtier.domain.errors import InvalidArgument, Unavailable
from kvtier.domain.params import SamplingParams
from kvtier.domain.records import Policy, Watermarks
from kvtier.domain.tiers import Tier
from kvtier.local.stack import LocalStack, StackOptions, start_local_stack

PAGE = 16
PAGE_BYTES = 32 << 10  # the built-in model in fp32: 2 x 4 layers x 2 KV heads x 32 dims x 4 B x 16 tokens


@dataclass
class Running:
    stack: LocalStack
    call: Callable[..., Any]
    client: Client

    @property
    def address(self) -> str:
        return self.stack.controller_address

    @property
    def worker_id(self) -> str:
        return self.stack.workers[0].worker_id

    def namespace(self, tenant: str):
        return dataclasses.replace(self.stack.namespace, tenant=tenant)


@pytest.fixture(scope="module")
def stack(local_ray, tmp_path_factory):
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="stack-loop", daemon=True)
    thread.start()

    def call(coro, timeout_s: float = 120.0):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout_s)

    options = StackOptions(
        state_dir=tmp_path_factory.mktemp("cli-admin"),
        num_workers=1,
        lease_ttl_s=1.5,  # a heartbeat every 0.5 s: drain --wait sees the worker empty soon
        max_restarts=0,
        hbm_bytes=128 * PAGE_BYTES,  # small, so a few prompts put HBM under pressure
        dram_bytes=512 * PAGE_BYTES,
    )
    s = call(start_local_stack(options))
    client = Client(s.controller_address, timeout_s=60)
    try:
        yield Running(s, call, client)
    finally:
        client.close()
        call(s.stop())

        async def cancel_leftovers() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        call(cancel_leftovers())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
        loop.close()


def cli(capsys, stack: Running, *args: str) -> tuple[int, str, str]:
    """``kvtier ARGS --controller ADDRESS``: (exit code, stdout, stderr)."""
    with pytest.raises(SystemExit) as info:
        main([*args, "--controller", stack.address])
    out, err = capsys.readouterr()
    return int(info.value.code or 0), out, err


def cli_json(capsys, stack: Running, *args: str) -> Any:
    code, out, err = cli(capsys, stack, *args, "--json")
    assert code == 0, err
    return json.loads(out)  # the whole of stdout is one JSON document


def error_line(err: str) -> str:
    """The CLI's error: exactly one ``error:`` line, and no traceback (the stack's own log
    lines, from its background thread, may share stderr)."""
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, err
    return lines[0]


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 512) for _ in range(n)]


def complete(stack: Running, tenant: str, prompt: list[int], max_tokens: int = 1):
    return stack.client.complete(
        stack.namespace(tenant), prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    )


def wait_for(predicate: Callable[[], Any], what: str, timeout_s: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(0.1)


def hbm_tokens(capsys, stack: Running, tenant: str, prompt: list[int], tier: str = "hbm") -> int:
    """Tokens of ``prompt`` the directory has in the worker's ``tier`` (or "any"), through `kvtier lookup`."""
    found = cli_json(capsys, stack, "lookup", "--tenant", tenant, "--tokens", ",".join(map(str, prompt)))
    key = "hbm_tokens dram_tokens nvme_tokens".split() if tier == "any" else [f"{tier}_tokens"]
    return sum(m["matched_tokens"][k] for m in found["matches"] for k in key)


# ---- read-only views -------------------------------------------------------------------------


def test_status_json_matches_admin_status(capsys, stack: Running) -> None:
    shown = cli_json(capsys, stack, "status")
    status = stack.client.status()
    assert set(shown) == {f.name for f in dataclasses.fields(status)}
    for name in ("controller_id", "is_leader", "leader_address", "version", "num_workers", "num_live_workers",
                 "policy_version", "is_directory_reachable"):
        assert shown[name] == getattr(status, name), name
    assert shown["is_leader"] and shown["num_live_workers"] == 1
    assert [(t["tier"], t["total_pages"]) for t in shown["tiers"]] == [
        (t.tier.label, t.total_pages) for t in status.tiers
    ]
    assert abs(shown["uptime_s"] - status.uptime_s) <= 5


def test_models_lists_the_namespace_fields_a_frontend_sends(capsys, stack: Running) -> None:
    (model,) = cli_json(capsys, stack, "models")["models"]
    served = stack.stack.namespace
    assert model["namespace"] == {**dataclasses.asdict(served), "tenant": ""}
    assert model["num_workers"] == 1 and model["adapters"] == []
    assert model["facts"]["vocab_size"] == stack.stack.vocab_size
    assert model["facts"]["max_context_tokens"] >= 1 and model["facts"]["eos_token_ids"]
    # The fields as listed route and generate (the tenant filled in).
    namespace = dataclasses.replace(served, **{k: v for k, v in model["namespace"].items() if k != "tenant"},
                                    tenant="models")
    assert stack.client.route(namespace, [5, 6, 7]).workers[0].worker_id == stack.worker_id
    code, out, err = cli(capsys, stack, "models")
    assert code == 0 and served.model_id in out, err


def test_workers_and_tiers(capsys, stack: Running) -> None:
    shown = cli_json(capsys, stack, "workers")
    (worker,) = shown["workers"]
    assert worker["worker_id"] == stack.worker_id and worker["address"] == stack.stack.workers[0].address
    assert worker["state"] == "live" and worker["model"]["model_id"] == stack.stack.namespace.model_id
    hbm = next(t for t in worker["tiers"] if t["tier"] == "hbm")
    assert hbm["total_pages"] == 128

    tiers = cli_json(capsys, stack, "tiers")
    summed = {t["tier"]: t for t in tiers["tiers"]}
    assert summed["hbm"]["total_pages"] == 128 and summed["dram"]["total_pages"] == 512
    assert summed["hbm"]["capacity_bytes"] == 128 * PAGE_BYTES
    for t in summed.values():
        assert t["free_pages"] + t["cached_pages"] + t["in_use_pages"] == t["total_pages"]
    assert tiers["workers"][stack.worker_id] == tiers["tiers"]  # one worker: its rows are the sums

    code, out, err = cli(capsys, stack, "workers")
    assert code == 0 and stack.worker_id in out and "live" in out


def test_sessions_snapshot_and_lookup_views(capsys, stack: Running) -> None:
    rng = random.Random(5)
    prompt = tokens(rng, 3 * PAGE + 5)
    stack.client.complete(stack.namespace("views"), prompt, SamplingParams(max_tokens=2), session_id="cli-views-1")
    stack.client.pause("cli-views-1", tool="search", expected_ms=60_000)
    paused = cli_json(capsys, stack, "sessions", "--state", "paused")
    assert "cli-views-1" in [s["session_id"] for s in paused["sessions"]]
    assert all(s["state"] == "paused" for s in paused["sessions"]) and paused["truncated"] is False
    everything = cli_json(capsys, stack, "sessions", "--limit", "1")
    assert len(everything["sessions"]) == 1

    snapshots = cli_json(capsys, stack, "snapshot", "--wait")["snapshots"]
    assert [(s["worker_id"], s["is_complete"]) for s in snapshots] == [(stack.worker_id, True)]

    # A paused session's pages may sink to DRAM: any tier counts here.
    wait_for(lambda: hbm_tokens(capsys, stack, "views", prompt, "any") == 3 * PAGE, "the prompt's pages")
    other_tenant = cli_json(capsys, stack, "lookup", "--tenant", "nobody", "--tokens", ",".join(map(str, prompt)))
    assert other_tenant["matches"] == [] and other_tenant["num_query_pages"] == 3
    code, out, _ = cli(capsys, stack, "lookup", "--tenant", "views", "--tokens", ",".join(map(str, prompt)))
    assert code == 0 and stack.worker_id in out
    assert ",".join(map(str, prompt[:4])) not in out  # the table shows counts, never the tokens


# ---- policy ----------------------------------------------------------------------------------


def test_policy_bad_input_names_the_field(capsys, stack: Running, tmp_path) -> None:
    code, _, err = cli(capsys, stack, "policy", "set", "--watermark", "hbm=0.5:0.9")
    assert code == 2 and "--watermark" in error_line(err) and "low (0.9) must be <= high (0.5)" in err
    bad = tmp_path / "policy.json"
    bad.write_text(json.dumps({"watermarks": {"dram": {"high": 0.2, "low": 0.3}}}))
    code, _, err = cli(capsys, stack, "policy", "set", "--file", str(bad))
    assert code == 2 and "policy.watermarks.dram.low" in error_line(err)
    # The controller checks too: a client that skips the CLI's checks gets INVALID_ARGUMENT naming the field.
    with pytest.raises(InvalidArgument) as info:
        stack.client.set_policy(Policy(watermarks={Tier.HBM: Watermarks(high=0.5, low=0.9)}))
    assert info.value.field == "policy.watermarks.hbm.low"
    # Failures on the controller exit 1 with one line.
    current = cli_json(capsys, stack, "policy", "show")["version"]
    code, _, err = cli(capsys, stack, "policy", "set", "--weight", "nvme=0.1", "--expected-version", str(current + 7))
    assert code == 1 and "FAILED_PRECONDITION" in error_line(err)
    code, _, err = cli(capsys, stack, "policy", "show", "--version", str(current + 100))
    assert code == 1 and "NOT_FOUND" in error_line(err)
    assert cli_json(capsys, stack, "policy", "show")["version"] == current  # nothing was installed


def test_policy_set_history_and_rollback_round_trip(capsys, stack: Running, tmp_path) -> None:
    before = cli_json(capsys, stack, "policy", "show")
    v0 = before["version"]
    changed = cli_json(
        capsys, stack, "policy", "set", "--weight", "dram=0.42", "--budget", "nvme=64MiB", "--reason", "cli test"
    )
    assert changed["version"] == v0 + 1 and changed["reason"] == "cli test"
    assert changed["policy"]["tier_weights"]["dram"] == 0.42
    assert changed["policy"]["budget_bytes_per_s"]["nvme"] == 64 << 20
    # Flags change only what they name.
    assert changed["policy"]["watermarks"] == before["policy"]["watermarks"]
    assert cli_json(capsys, stack, "status")["policy_version"] == v0 + 1

    history = cli_json(capsys, stack, "policy", "history", "--limit", "2")["policies"]
    assert [p["version"] for p in history] == [v0 + 1, v0]
    assert history[1]["policy"] == before["policy"]

    rolled = cli_json(capsys, stack, "policy", "rollback", str(v0), "--reason", "undo")
    assert rolled["version"] == v0 + 2 and rolled["policy"] == before["policy"] and rolled["reason"] == "undo"
    assert cli_json(capsys, stack, "policy", "show")["version"] == v0 + 2
    assert cli_json(capsys, stack, "policy", "show", "--version", str(v0 + 1))["policy"] == changed["policy"]

    # A file written from `policy show --json` installs the same policy again.
    saved = tmp_path / "policy.json"
    saved.write_text(json.dumps(changed))
    again = cli_json(capsys, stack, "policy", "set", "--file", str(saved), "--expected-version", str(v0 + 2))
    assert again["version"] == v0 + 3 and again["policy"] == changed["policy"]
    restored = cli_json(capsys, stack, "policy", "rollback", str(v0))
    assert restored["policy"] == before["policy"]
    code, out, _ = cli(capsys, stack, "policy", "history")
    assert code == 0 and "undo" in out


# ---- cache operations ------------------------------------------------------------------------


def test_invalidate_makes_a_cached_prefix_miss(capsys, stack: Running) -> None:
    rng = random.Random(11)
    prompt = tokens(rng, 4 * PAGE + 3)
    kept = tokens(rng, 4 * PAGE + 3)
    complete(stack, "inv-a", prompt)
    _, hit = complete(stack, "inv-a", prompt)
    assert hit.usage.cached_tokens == 4 * PAGE
    complete(stack, "inv-b", kept)

    result = cli_json(capsys, stack, "invalidate", "--tenant", "inv-a", "--reason", "cli test")
    assert result["num_workers_notified"] == 1 and result["policy_epoch"] >= 1
    assert result["scope"]["tenant"] == "inv-a"

    _, miss = complete(stack, "inv-a", prompt)
    assert miss.usage.cached_tokens == 0
    _, other = complete(stack, "inv-b", kept)  # another tenant keeps its cache
    assert other.usage.cached_tokens == 4 * PAGE
    code, out, _ = cli(capsys, stack, "invalidate", "--tenant", "inv-b")
    assert code == 0 and "tenant inv-b" in out and "1 worker(s) notified" in out
    _, miss = complete(stack, "inv-b", kept)
    assert miss.usage.cached_tokens == 0


def test_evict_drops_a_prefix(capsys, stack: Running) -> None:
    rng = random.Random(13)
    prompt = tokens(rng, 4 * PAGE + 1)
    complete(stack, "evict", prompt)
    wait_for(lambda: hbm_tokens(capsys, stack, "evict", prompt) == 4 * PAGE, "the prompt's pages in HBM")
    evicted = cli_json(capsys, stack, "evict", "--tenant", "evict", "--tokens", ",".join(map(str, prompt[:2 * PAGE])))
    assert evicted["num_pages"] == 4 and evicted["num_workers"] == 1  # the prefix's 2 pages and the 2 after
    _, after = complete(stack, "evict", prompt)
    assert after.usage.cached_tokens == 0


def test_pin_keeps_a_prefix_resident_under_pressure(capsys, stack: Running) -> None:
    rng = random.Random(17)
    pinned = tokens(rng, 4 * PAGE)
    control = tokens(rng, 4 * PAGE)
    for prompt in (pinned, control):
        complete(stack, "pin", prompt + [1])
    for prompt in (pinned, control):
        wait_for(lambda p=prompt: hbm_tokens(capsys, stack, "pin", p) == 4 * PAGE, "the prefix in HBM")

    pin = cli_json(capsys, stack, "pin", "--tenant", "pin", "--tokens", ",".join(map(str, pinned)), "--tier", "hbm")
    assert pin["num_pinned_pages"] == 4 and pin["expires_at_ms"] is None

    # Pressure: prompts that together need more than HBM's 128 pages push cached pages out.
    def pressed() -> bool:
        complete(stack, "pin-pressure", tokens(rng, 12 * PAGE))
        return hbm_tokens(capsys, stack, "pin", control) < 4 * PAGE

    wait_for(pressed, "the unpinned control prefix to leave HBM", timeout_s=60)
    assert hbm_tokens(capsys, stack, "pin", pinned) == 4 * PAGE
    _, hit = complete(stack, "pin", pinned + [2])
    assert hit.usage.cached_tokens_by_tier.hbm_tokens == 4 * PAGE

    released = cli_json(capsys, stack, "unpin", pin["pin_id"])
    assert released["num_unpinned_pages"] == 4
    code, _, err = cli(capsys, stack, "unpin", pin["pin_id"])
    assert code == 1 and "NOT_FOUND" in error_line(err)


def test_tables_for_people_and_a_bounded_bench(capsys, stack: Running) -> None:
    for command in (["status"], ["workers"], ["tiers"], ["sessions"], ["policy", "show"], ["policy", "history"],
                    ["snapshot"], ["lookup", "--tokens", "1,2,3"]):
        code, out, err = cli(capsys, stack, *command)
        assert code == 0 and out.strip(), (command, err)
    bench = cli_json(capsys, stack, "bench", "--sessions", "1,2")
    assert set(bench["ttft_ms"]) == {"1", "2"} and bench["tokens_per_s"]["2"] > 0
    assert bench["route"]["route_p50_ms"] > 0


# ---- drain (last: it empties the worker) -------------------------------------------------------


def test_drain_waits_until_the_worker_is_empty_then_resume(capsys, stack: Running) -> None:
    rng = random.Random(19)
    ns = stack.namespace("drain")
    prompt = tokens(rng, PAGE)
    max_tokens = 1900  # long enough for a few heartbeats (every 0.5 s) to show it running
    generated: dict[str, Any] = {}

    def generate() -> None:
        generated["tokens"], generated["final"] = stack.client.complete(
            ns, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        )

    runner = threading.Thread(target=generate)
    runner.start()
    try:
        wait_for(lambda: stack.client.list_workers()[0].num_running_seqs >= 1, "a heartbeat showing the request")
        drained = cli_json(capsys, stack, "drain", stack.worker_id, "--wait", "--wait-s", "120")
    finally:
        runner.join(timeout=120)
    # The request admitted before the drain ran to the end; the worker is then empty.
    assert len(generated["tokens"]) == max_tokens
    assert drained["state"] == "draining"
    assert drained["num_running_seqs"] == 0 and drained["queue_depth"] == 0
    assert all(t["cached_pages"] + t["in_use_pages"] == t["pinned_pages"] for t in drained["tiers"])

    assert cli_json(capsys, stack, "workers")["workers"][0]["state"] == "draining"
    with pytest.raises(Unavailable, match="draining"):
        stack.client.route(ns, prompt)
    with pytest.raises(Unavailable):
        stack.client.complete(ns, prompt, SamplingParams(max_tokens=1))

    resumed = cli_json(capsys, stack, "drain", stack.worker_id, "--resume")
    assert resumed["state"] == "live"
    assert [w.worker_id for w in stack.client.route(ns, prompt).workers] == [stack.worker_id]
    tokens_out, _ = stack.client.complete(ns, prompt, SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(tokens_out) == 3

    code, _, err = cli(capsys, stack, "drain", "no-such-worker")
    assert code == 1 and "no-such-worker" in error_line(err)


def test_a_drain_keeps_an_operator_pin_s_pages_until_it_expires_then_drops_them(capsys, stack: Running) -> None:
    """Pinned pages stay on a draining worker only while pinned: once the pin's TTL passes, the
    drain drops them too: it watches the heartbeats rather than stopping after its passes, so
    the pages do not stay cached on the worker for good and ``drain --wait`` sees it empty."""
    rng = random.Random(23)
    prompt = tokens(rng, 4 * PAGE)
    complete(stack, "drain-pin", prompt + [1])
    wait_for(lambda: hbm_tokens(capsys, stack, "drain-pin", prompt) == 4 * PAGE, "the prefix in HBM")
    pin = cli_json(capsys, stack, "pin", "--tenant", "drain-pin", "--tokens", ",".join(map(str, prompt)),
                   "--tier", "hbm", "--ttl-s", "6")
    assert pin["num_pinned_pages"] == 4
    try:
        drained = cli_json(capsys, stack, "drain", stack.worker_id, "--wait", "--wait-s", "60")
        # Empty but for the pinned pages, which stay while the pin stands.
        assert sum(t["pinned_pages"] for t in drained["tiers"]) == 4
        assert all(t["cached_pages"] + t["in_use_pages"] == t["pinned_pages"] for t in drained["tiers"])

        def emptied() -> bool:
            worker = cli_json(capsys, stack, "workers")["workers"][0]
            return all(t["cached_pages"] + t["in_use_pages"] == 0 for t in worker["tiers"])

        wait_for(emptied, "the pages the expired pin kept dropped", timeout_s=60)
        assert time.time() * 1000.0 >= pin["expires_at_ms"]  # not before the pin expired
        assert hbm_tokens(capsys, stack, "drain-pin", prompt) == 0
    finally:
        assert cli_json(capsys, stack, "drain", stack.worker_id, "--resume")["state"] == "live"
