"""Token tables, principals and tenant binding, the method → role map, the `kvtier token`
commands, and the rule that only loopback may go unauthenticated (kvtier.rpc.auth,
kvtier.rpc.auth_interceptor, kvtier.rpc.server_options). Over-the-wire checks of every
service are in tests/e2e/test_auth_stack.py."""

from __future__ import annotations

import hashlib
import io
import os
import stat
import sys
from pathlib import Path

import pytest

from kvtier.domain.errors import ConfigError, InvalidArgument, PermissionDenied, Unauthenticated
from kvtier.domain.hashing import NamespaceIdentity
from kvtier.rpc import auth
from kvtier.rpc._gen import admin_pb2, common_pb2, router_pb2, sessions_pb2, worker_link_pb2, worker_pb2
from kvtier.rpc.auth import Principal, Role, TokenTableFile, bind_tenant, hash_token, load_token_table
from kvtier.rpc.auth_interceptor import (
    METHOD_ROLES,
    PUBLIC_METHODS,
    TICKET_METHODS,
    AuthInterceptor,
    bearer_token,
    is_public,
    principal_name,
    principal_tenant,
    required_roles,
)
from kvtier.rpc.server_options import check_exposure, is_loopback
from kvtier.runtime.config import ControllerConfig, WorkerConfig, load_config

GEN_MODULES = (admin_pb2, common_pb2, router_pb2, sessions_pb2, worker_link_pb2, worker_pb2)
TOKENS = {"admin": "kvt_admin-secret", "fe-a": "kvt_fe-a-secret", "fe-ab": "kvt_fe-ab-secret",
          "worker": "kvt_worker-secret"}


def table_yaml(tmp_path: Path, body: str, name: str = "tokens.yaml") -> Path:
    path = tmp_path / name
    path.write_text(body)
    return path


def entry(name: str, role: str, tenants: str = "", token: str | None = None, worker_id: str | None = None) -> str:
    lines = f"  - name: {name}\n    role: {role}\n"
    if tenants:
        lines += f"    tenants: [{tenants}]\n"
    if role == "worker" or worker_id:
        lines += f"    worker_id: {worker_id or 'w-' + name}\n"
    return lines + f"    sha256: {hash_token(token or TOKENS[name])}\n"


@pytest.fixture
def table_file(tmp_path):
    return table_yaml(tmp_path, "tokens:\n" + entry("admin", "admin") + entry("fe-a", "frontend", "a")
                      + entry("fe-ab", "frontend", "a, b") + entry("worker", "worker"))


# -- hashing and the table --------------------------------------------------------------------


def test_hash_is_sha256_hex_of_the_token_text():
    assert hash_token("password") == "5e884898da28047151d0e56f8dc6292773603d0d6aabbdd62a11ef721d1542d8"
    token = auth.new_token()
    assert token.startswith("kvt_") and len(token) > 40 and token != auth.new_token()
    assert hash_token(token) == hashlib.sha256(token.encode()).hexdigest()


def test_yaml_table_authenticates_each_token_as_its_principal(table_file):
    table = load_token_table(table_file)
    assert len(table) == 4
    assert table.authenticate(TOKENS["fe-ab"]) == Principal("fe-ab", Role.FRONTEND, frozenset({"a", "b"}))
    assert table.authenticate(TOKENS["admin"]) == Principal("admin", Role.ADMIN)
    worker = table.authenticate(TOKENS["worker"])
    assert worker == Principal("worker", Role.WORKER, worker_id="w-worker")
    assert worker.key_digest == hashlib.sha256(TOKENS["worker"].encode()).digest()
    assert table.authenticate("kvt_unknown") is None
    assert table.authenticate(TOKENS["admin"] + " ") is None  # exact text, no normalising
    assert table.authenticate(hash_token(TOKENS["admin"])) is None  # the hash is not a token


def test_toml_table_reads_the_same(tmp_path):
    path = tmp_path / "tokens.toml"
    auth.dump_token_table([auth.make_entry("fe-a", "frontend", ["a"], hash_token(TOKENS["fe-a"]))], path)
    assert "[[tokens]]" in path.read_text()
    assert load_token_table(path).authenticate(TOKENS["fe-a"]) == Principal("fe-a", Role.FRONTEND, frozenset({"a"}))


@pytest.mark.parametrize(
    ("body", "field", "words"),
    [
        ("tokens:\n" + entry("fe-a", "frontend"), "tokens[0].tenants", "at least one tenant"),
        ("tokens:\n" + entry("admin", "admin", "a"), "tokens[0].tenants", "frontend tokens only"),
        ("tokens:\n" + entry("admin", "root"), "tokens[0].role", "frontend, worker, admin"),
        ("tokens:\n  - {name: x, role: admin, sha256: abc}\n", "tokens[0].sha256", "64 lowercase hex"),
        ("tokens:\n  - {name: x, role: admin}\n", "tokens[0].sha256", "missing"),
        ("tokens:\n  - {name: x, role: admin, token: kvt_raw}\n", "tokens[0].token", "raw token"),
        ("tokens:\n" + entry("admin", "admin") + "    expires: 2030\n", "tokens[0].expires", "unknown key"),
        ("tokens:\n  - {name: 'bad name', role: admin, sha256: " + "0" * 64 + "}\n", "tokens[0].name", "name"),
        ("tokens:\n" + entry("admin", "admin") + entry("admin", "admin", token="other"), "tokens[1].name",
         "repeats tokens[0]"),
        ("tokens:\n" + entry("admin", "admin") + entry("ops", "admin", token=TOKENS["admin"]),
         "tokens[1].sha256", "one token, two entries"),
        ("tokens: {name: x}\n", "tokens", "list"),
        ("users: []\n", "tokens", "exactly one key"),
        ("tokens: [\n", "tokens", "not valid YAML"),
        ("tokens:\n  - 3\n", "tokens[0]", "mapping"),
        ("tokens:\n  - {name: w, role: worker, sha256: " + "0" * 64 + "}\n", "tokens[0].worker_id",
         "required for a worker token"),
        ("tokens:\n" + entry("admin", "admin", worker_id="w-1"), "tokens[0].worker_id", "worker tokens only"),
        ("tokens:\n" + entry("worker", "worker", worker_id="bad id"), "tokens[0].worker_id", "1-128 characters"),
    ],
)
def test_bad_tables_are_refused_naming_the_entry_and_field(tmp_path, body, field, words):
    path = table_yaml(tmp_path, body)
    with pytest.raises(ConfigError) as info:
        load_token_table(path)
    assert info.value.field == field
    assert words in info.value.message and str(path) in info.value.message


def test_missing_table_and_wrong_suffix_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read token table"):
        load_token_table(tmp_path / "absent.yaml")
    with pytest.raises(ConfigError, match=r"\.toml, \.yaml or \.yml"):
        load_token_table(table_yaml(tmp_path, "tokens: []\n", name="tokens.json"))


def test_table_file_follows_changes_and_keeps_the_last_good_table(tmp_path, table_file):
    tokens = TokenTableFile(table_file, reload_interval_s=0.0)
    assert tokens.authenticate(TOKENS["fe-a"]) is not None
    # Revoke fe-a: the next call after the change no longer knows it; the others still work.
    table_file.write_text("tokens:\n" + entry("admin", "admin") + entry("worker", "worker") + "# revoked fe-a\n")
    assert tokens.authenticate(TOKENS["fe-a"]) is None
    assert tokens.authenticate(TOKENS["admin"]).role is Role.ADMIN
    # A broken edit is refused and the table in force stays.
    table_file.write_text("tokens:\n  - {name: x, role: superuser}\n")
    assert tokens.authenticate(TOKENS["admin"]).role is Role.ADMIN
    assert tokens.authenticate(TOKENS["fe-a"]) is None


def test_append_entry_refuses_a_duplicate_name(tmp_path):
    path = tmp_path / "t.yaml"
    auth.append_entry(path, auth.make_entry("ops", "admin", [], hash_token("one")))
    with pytest.raises(ConfigError, match="repeats"):
        auth.append_entry(path, auth.make_entry("ops", "admin", [], hash_token("two")))
    assert len(load_token_table(path)) == 1


def test_secret_files_are_owner_only_even_when_they_existed(tmp_path):
    path = tmp_path / "admin.token"
    path.write_text("old")
    os.chmod(path, 0o644)
    auth.write_secret_file(path, "kvt_new\n")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert auth.read_token_file(path) == "kvt_new"
    path.write_text("  \n")
    with pytest.raises(ConfigError, match="empty") as info:
        auth.read_token_file(path)
    assert info.value.field == "auth_token_file"


# -- principals and tenants -------------------------------------------------------------------

NS = NamespaceIdentity(model_id="m")


def test_frontend_acts_only_for_its_tenants():
    fe_a = Principal("fe-a", Role.FRONTEND, frozenset({"a"}))
    assert bind_tenant(NS, fe_a).tenant == "a"  # no tenant named: the token's only tenant
    assert bind_tenant(NamespaceIdentity(model_id="m", tenant="a"), fe_a).tenant == "a"
    with pytest.raises(PermissionDenied) as info:
        bind_tenant(NamespaceIdentity(model_id="m", tenant="b"), fe_a)
    assert info.value.field == "namespace.tenant" and "'b'" in info.value.message


def test_multi_tenant_frontend_must_name_its_tenant_and_admin_may_name_any():
    fe_ab = Principal("fe-ab", Role.FRONTEND, frozenset({"a", "b"}))
    with pytest.raises(InvalidArgument) as info:
        bind_tenant(NS, fe_ab)
    assert info.value.field == "namespace.tenant"
    assert bind_tenant(NamespaceIdentity(model_id="m", tenant="b"), fe_ab).tenant == "b"
    admin = Principal("ops", Role.ADMIN)
    assert bind_tenant(NamespaceIdentity(model_id="m", tenant="z"), admin).tenant == "z"
    assert bind_tenant(NS, admin).tenant == ""
    with pytest.raises(PermissionDenied):
        bind_tenant(NS, Principal("w", Role.WORKER))
    assert bind_tenant(NamespaceIdentity(model_id="m", tenant="b"), None).tenant == "b"  # auth off


def test_without_an_interceptor_the_caller_is_anonymous():
    assert principal_tenant(None) is None
    assert principal_name(None) == "anonymous"


# -- the role map -----------------------------------------------------------------------------


def all_methods():
    for module in GEN_MODULES:
        for service in module.DESCRIPTOR.services_by_name.values():
            for method in service.methods:
                yield f"/{service.full_name}/{method.name}"


def test_every_generated_rpc_has_roles_or_is_public_and_nothing_else_does():
    methods = list(all_methods())
    assert len(methods) >= 22
    unmapped = [m for m in methods if not required_roles(m) and not is_public(m)]
    assert not unmapped, f"RPCs without roles (refused to everyone): {unmapped}"
    assert set(METHOD_ROLES) | PUBLIC_METHODS == set(methods), "the role map names methods the protos no longer have"
    assert TICKET_METHODS <= set(METHOD_ROLES)
    assert PUBLIC_METHODS == {"/kvtier.v1.Worker/ProveAddress"}  # answers with a proof, reveals nothing


@pytest.mark.parametrize(
    ("method", "roles"),
    [
        ("/kvtier.v1.Router/Route", {Role.FRONTEND, Role.ADMIN}),
        ("/kvtier.v1.Sessions/Pause", {Role.FRONTEND, Role.ADMIN}),
        ("/kvtier.v1.Worker/Generate", {Role.FRONTEND}),  # by Route ticket only
        ("/kvtier.v1.Worker/Stats", {Role.ADMIN}),
        ("/kvtier.v1.Worker/CheckIntegrity", {Role.ADMIN}),
        ("/kvtier.v1.WorkerLink/Connect", {Role.WORKER}),
        ("/kvtier.v1.Admin/Status", {Role.ADMIN}),
        ("/kvtier.v1.Admin/SetPolicy", {Role.ADMIN}),
        ("/kvtier.v1.Admin/NotYetInvented", set()),
    ],
)
def test_role_map(method, roles):
    assert set(required_roles(method)) == roles
    assert not is_public(method)


def test_health_and_reflection_are_public():
    assert is_public("/grpc.health.v1.Health/Check")
    assert is_public("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo")
    assert not is_public("/grpc.health.v1.Healthy/Check")


@pytest.mark.parametrize(
    ("metadata", "token"),
    [
        ((("authorization", "Bearer kvt_x"),), "kvt_x"),
        ((("Authorization", "bearer   kvt_x "),), "kvt_x"),
        ((("x-other", "1"), ("authorization", "Bearer kvt_y")), "kvt_y"),
        ((("authorization", "Basic dXNlcg=="),), None),
        ((("authorization", "Bearer "),), None),
        ((), None),
        (None, None),
    ],
)
def test_bearer_token_parsing(metadata, token):
    assert bearer_token(metadata) == token


def test_authorize_names_the_method_and_role_but_never_the_token(table_file):
    interceptor = AuthInterceptor(load_token_table(table_file), server="controller")
    with pytest.raises(Unauthenticated, match="needs a bearer token"):
        interceptor.authorize("/kvtier.v1.Admin/Status", ())
    with pytest.raises(Unauthenticated) as info:
        interceptor.authorize("/kvtier.v1.Admin/Status", (("authorization", "Bearer kvt_guess"),))
    assert "kvt_guess" not in info.value.message and "not valid" in info.value.message
    with pytest.raises(PermissionDenied) as info:
        interceptor.authorize("/kvtier.v1.Admin/Status", (("authorization", f"Bearer {TOKENS['fe-a']}"),))
    assert "Admin.Status needs role admin" in info.value.message and "'fe-a' has role frontend" in info.value.message
    assert TOKENS["fe-a"] not in info.value.message
    assert interceptor.authorize("/kvtier.v1.Router/Route",
                                 (("authorization", f"Bearer {TOKENS['fe-a']}"),)).name == "fe-a"


# -- `kvtier token` ---------------------------------------------------------------------------


def run_cli(argv, monkeypatch, capsys, stdin: str = ""):
    from kvtier.cli.main import main

    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    with pytest.raises(SystemExit) as info:
        main(argv)
    out = capsys.readouterr()
    return info.value.code, out.out, out.err


def test_token_create_prints_the_token_once_and_stores_its_hash(tmp_path, monkeypatch, capsys):
    table = tmp_path / "tokens.yaml"
    code, out, err = run_cli(["token", "create", "--name", "fe-acme", "--role", "frontend", "--tenant", "acme",
                              "--tenant", "beta", "--table", str(table)], monkeypatch, capsys)
    assert code in (0, None), err
    token = out.strip()
    assert token.startswith("kvt_") and token not in table.read_text()
    assert hash_token(token) in table.read_text() and hash_token(token) in err
    assert load_token_table(table).authenticate(token) == Principal("fe-acme", Role.FRONTEND,
                                                                    frozenset({"acme", "beta"}))
    code, out, _ = run_cli(["token", "hash"], monkeypatch, capsys, stdin=token + "\n")
    assert code in (0, None) and out.strip() == hash_token(token)
    code, out, err = run_cli(["token", "create", "--name", "w-0", "--role", "worker", "--worker-id", "gpu-0",
                              "--table", str(table)], monkeypatch, capsys)
    assert code in (0, None), err
    assert load_token_table(table).authenticate(out.strip()) == Principal("w-0", Role.WORKER, worker_id="gpu-0")


@pytest.mark.parametrize("suffix", [".yaml", ".toml"])
def test_token_create_leaves_the_table_owner_only_whatever_the_umask(tmp_path, monkeypatch, capsys, suffix):
    table = tmp_path / f"tokens{suffix}"
    old_umask = os.umask(0o022)
    try:
        for name in ("ops", "fe-acme"):  # the first creates the table, the second rewrites it
            code, _, err = run_cli(["token", "create", "--name", name, "--role", "admin", "--table", str(table)],
                                   monkeypatch, capsys)
            assert code in (0, None), err
            assert stat.S_IMODE(table.stat().st_mode) == 0o600, name
        os.chmod(table, 0o644)  # a table someone else left readable is made private on the next write
        code, _, err = run_cli(["token", "create", "--name", "ci", "--role", "admin", "--table", str(table)],
                               monkeypatch, capsys)
        assert code in (0, None), err
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(table.stat().st_mode) == 0o600
    assert len(load_token_table(table)) == 3
    assert [p.name for p in tmp_path.iterdir()] == [table.name], "no temporary file left behind"


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--name", "x", "--role", "frontend"], "--tenant must name at least one tenant"),
        (["--name", "x", "--role", "root"], "--role must be one of"),
        (["--name", "bad name", "--role", "admin"], "--name must be"),
        (["--name", "w", "--role", "worker"], "--worker-id is required for a worker token"),
        (["--name", "x", "--role", "admin", "--worker-id", "w-0"], "--worker-id is for worker tokens only"),
    ],
)
def test_token_create_bad_flags_exit_2_naming_the_flag(tmp_path, monkeypatch, capsys, argv, words):
    code, out, err = run_cli(["token", "create", *argv, "--table", str(tmp_path / "t.yaml")], monkeypatch, capsys)
    assert code == 2 and words in err and "Traceback" not in err and not out
    assert not (tmp_path / "t.yaml").exists()


def test_token_hash_of_empty_stdin_is_an_error(monkeypatch, capsys):
    code, _, err = run_cli(["token", "hash"], monkeypatch, capsys, stdin="")
    assert code == 2 and "stdin is empty" in err


# -- exposure and configuration -----------------------------------------------------------------


@pytest.mark.parametrize(("host", "loopback"), [("127.0.0.1", True), ("127.0.0.7", True), ("::1", True),
                                                ("[::1]", True), ("localhost", True), ("0.0.0.0", False),
                                                ("::", False), ("10.0.0.5", False), ("kvtier.internal", False)])
def test_is_loopback(host, loopback):
    assert is_loopback(host) is loopback


def test_non_loopback_without_auth_is_refused_naming_the_setting():
    with pytest.raises(ConfigError) as info:
        check_exposure("0.0.0.0", what="controller", is_authenticated=False, allow_unauthenticated=False)
    assert info.value.field == "auth_token_file"
    assert "--auth-token-file" in info.value.message and "--allow-unauthenticated" in info.value.message
    with pytest.raises(ConfigError) as info:
        check_exposure("10.1.2.3", what="worker", is_authenticated=False, allow_unauthenticated=False)
    assert info.value.field == "auth_tokens_file"
    check_exposure("0.0.0.0", what="worker", is_authenticated=True, allow_unauthenticated=False)
    check_exposure("0.0.0.0", what="worker", is_authenticated=False, allow_unauthenticated=True)
    check_exposure("127.0.0.1", what="worker", is_authenticated=False, allow_unauthenticated=False)


def test_tls_settings_come_in_pairs():
    with pytest.raises(ConfigError) as info:
        load_config(ControllerConfig, env={"KVTIER_TLS_CERT_FILE": "/c.pem"})
    assert info.value.field == "tls_key_file"
    with pytest.raises(ConfigError) as info:
        load_config(WorkerConfig, env={"KVTIER_TLS_CLIENT_CA_FILE": "/ca.pem"})
    assert info.value.field == "tls_client_ca_file"
    config = load_config(ControllerConfig, env={"KVTIER_ALLOW_UNAUTHENTICATED": "true", "KVTIER_HEALTH_PORT": "0"})
    assert config.allow_unauthenticated and config.health_port == 0


def test_controller_flags_accept_the_override_switch():
    from kvtier.controller.__main__ import controller_args

    args = controller_args(["--host", "0.0.0.0", "--allow-unauthenticated"], env={})
    assert args.config.allow_unauthenticated and args.config.host == "0.0.0.0"
    assert not controller_args([], env={}).config.allow_unauthenticated


def test_worker_flags_name_auth_and_tls_settings(tmp_path):
    from kvtier.worker.actor import worker_args

    args = worker_args(["--auth-tokens-file", str(tmp_path / "t.yaml"), "--allow-unauthenticated",
                        "--tls-ca-file", str(tmp_path / "ca.pem")], env={})
    assert args.config.auth_tokens_file == tmp_path / "t.yaml" and args.config.allow_unauthenticated
    assert args.config.tls_ca_file == tmp_path / "ca.pem"
