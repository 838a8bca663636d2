"""One table of settings (common/settings.py) behind every service's flags, its config and docs/configuration.md."""
from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import pytest

from common import settings
from common.worker import WorkerConfig
from router import cluster
from router.config import RouterConfig
from tests.deploy.manifests import OVERLAYS, container, of_kind, render

ROOT = Path(__file__).resolve().parents[1]
# Settings a config does not hold as a field of the same name: parsed into another form.
CONSUMED = {"log_level", "api_keys_file", "tls_cert", "tls_key", "tls_ca", "tls_server_name",
            "tls_require_client_cert", "public_tls_cert", "public_tls_key", "redis_acl"}


def test_the_reference_is_printed_from_the_table():
    written = (ROOT / "docs" / "configuration.md").read_text()
    assert written == settings.reference(), (
        "docs/configuration.md differs from common/settings.py: run `python -m common.settings > "
        "docs/configuration.md`")


@pytest.mark.parametrize("service, configs", [
    (settings.ROUTER, (RouterConfig,)), (settings.PREFILL, (WorkerConfig,)), (settings.DECODE, (WorkerConfig,)),
    (settings.CLUSTER, (RouterConfig, WorkerConfig))])
def test_every_setting_reaches_a_config_field_with_its_default(service, configs):
    """from_settings keeps the parsed values whose names are fields: a setting with no field of its name would
    be parsed and then dropped without a word."""
    by_name = {f.name: f for config in configs for f in fields(config)}
    for s in settings.for_service(service):
        if s.name in CONSUMED:
            continue
        assert s.name in by_name, f"{s.flag} ({service}) sets no field of {', '.join(c.__name__ for c in configs)}"
        if s.name in ("port", "metrics_port", "http_port"):
            continue  # a library user's ports are free ones or off; the commands' are the table's
        assert by_name[s.name].default == s.default_for(service), f"{s.name}: the config's default drifted"


def _help(capsys, parse) -> str:
    with pytest.raises(SystemExit):
        parse(["--help"])
    return capsys.readouterr().out


@pytest.mark.parametrize("service, parse", [
    (settings.ROUTER, RouterConfig.from_args),
    (settings.PREFILL, lambda argv: WorkerConfig.from_args("prefill", argv)),
    (settings.DECODE, lambda argv: WorkerConfig.from_args("decode", argv)),
    (settings.CLUSTER, cluster.parse_args)])
def test_help_lists_exactly_the_table_with_envs_and_defaults(capsys, service, parse):
    text = _help(capsys, parse)
    flags = set(re.findall(r"^\s{2}(--[a-z0-9-]+)", text, re.M)) - {"--help"}
    expected = {s.flag for s in settings.for_service(service)}
    if service == settings.CLUSTER:  # its pool sizes and the one request it may answer (router.client's flags)
        flags -= {"--prefill", "--decode"} | {a for a in flags if a not in expected and _is_request_flag(a)}
    assert flags == expected, f"flags outside common/settings.py: {flags - expected}; missing: {expected - flags}"
    flat = " ".join(text.split())
    for s in settings.for_service(service):
        assert f"env {s.env_name};" in flat, f"{s.flag}: --help does not name {s.env_name}"
        for choice in s.choices:
            assert choice in flat, f"{s.flag}: --help does not list {choice}"


def _is_request_flag(flag: str) -> bool:
    import argparse

    from router import client
    p = argparse.ArgumentParser()
    client.add_request_flags(p)
    return flag in p._option_string_actions


def test_environment_then_flag(monkeypatch):
    monkeypatch.setenv("HANDOFF_MAX_ATTEMPTS", "5")
    monkeypatch.setenv("HANDOFF_PREFIX_CACHING", "off")
    monkeypatch.setenv("HANDOFF_LOG_LEVEL", "warning")
    assert RouterConfig.from_args([]).max_attempts == 5
    assert RouterConfig.from_args(["--max-attempts", "2"]).max_attempts == 2
    worker = WorkerConfig.from_args("decode", [])
    assert worker.prefix_caching is False
    # One boolean syntax everywhere: the flag alone is true, or a value as on the environment.
    assert WorkerConfig.from_args("decode", ["--prefix-caching"]).prefix_caching is True
    assert WorkerConfig.from_args("decode", ["--prefix-caching", "yes"]).prefix_caching is True
    assert WorkerConfig.from_args("prefill", ["--stream-kv=false"]).stream_kv is False


def test_router_cluster_honours_the_same_variables(monkeypatch):
    monkeypatch.setenv("HANDOFF_KV_MEMORY_GIB", "0.25")
    monkeypatch.setenv("HANDOFF_PREFILL_MODE", "colocated")
    monkeypatch.setenv("HANDOFF_MAX_RUNNING", "8")
    monkeypatch.setenv("HANDOFF_DEFAULT_MAX_TOKENS", "17")
    args, router, worker = cluster.parse_args([])
    assert args.kv_memory_gib == worker.kv_memory_gib == 0.25
    assert router.prefill_mode == "colocated" and args.prefill == 0
    assert worker.max_running == 8 and router.default_max_tokens == 17
    assert router.max_request_s == settings.default("max_request_s")


@pytest.mark.parametrize("env, value, named", [
    ("HANDOFF_MAX_QUEUED", "many", "HANDOFF_MAX_QUEUED"),
    ("HANDOFF_ROUTING", "random", "HANDOFF_ROUTING"),
    ("HANDOFF_STREAM_KV", "maybe", "HANDOFF_STREAM_KV")])
def test_a_bad_environment_value_names_its_variable(monkeypatch, capsys, env, value, named):
    monkeypatch.setenv(env, value)
    parse = (lambda: WorkerConfig.from_args("prefill", [])) if env == "HANDOFF_STREAM_KV" else (
        lambda: RouterConfig.from_args([]))
    with pytest.raises(SystemExit):
        parse()
    assert named in capsys.readouterr().err


def test_limits_are_settings():
    """The limits an operator needs, settable with the values they had as defaults."""
    for name, value in (("max_running", 64), ("prefill_kv_tokens", 16384), ("default_max_tokens", 256),
                        ("max_request_s", 600.0), ("max_attempts", 3), ("kv_wait_s", 30.0),
                        ("max_prefill_tokens", 2048)):
        assert settings.default(name) == value


def test_every_environment_variable_the_code_reads_is_in_the_reference():
    known = ({s.env_name for s in settings.SETTINGS} | {name for name, *_ in settings.SECRETS}
             | {name for name, _ in settings.ENGINE_ENVIRONMENT})
    read = set()
    for folder in ("common", "router", "prefill_svc", "decode_svc"):
        for path in (ROOT / folder).rglob("*.py"):
            read |= set(re.findall(r"[\"'](HANDOFF_[A-Z0-9_]+)[\"']", path.read_text()))
    # router.client's own (a client, not a service): its key and TLS files.
    read -= {"HANDOFF_API_KEY"}
    assert read <= known, f"read by the code but not in docs/configuration.md: {sorted(read - known)}"


def test_every_opentelemetry_variable_the_code_reads_is_in_the_reference():
    """The standard OTEL_* variables are not settings, but the reference lists those the code reads itself."""
    read = set()
    for folder in ("common", "router", "prefill_svc", "decode_svc"):
        for path in (ROOT / folder).rglob("*.py"):
            read |= set(re.findall(r"[\"'](OTEL_[A-Z0-9_]+)[\"']", path.read_text()))
    assert "OTEL_TRACES_EXPORTER" in read  # the pattern finds them
    reference = settings.reference()
    missing = sorted(name for name in read if f"`{name}" not in reference)
    assert not missing, f"read by the code but not in docs/configuration.md (TRACING_ENVIRONMENT): {missing}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_variable_a_deployment_sets_is_a_setting_of_its_service(overlay):
    objs = render(overlay)
    services = {"router": settings.ROUTER, "prefill": settings.PREFILL, "decode": settings.DECODE}
    engine = {name for name, _ in settings.ENGINE_ENVIRONMENT}
    for deployment in of_kind(objs, "Deployment"):
        component = deployment["metadata"]["labels"].get("app.kubernetes.io/component")
        if component not in services:
            continue
        service = services[component]
        known = ({s.env_name for s in settings.for_service(service)}
                 | {name for name, _, users in settings.SECRETS if service in users} | engine)
        for var in container(deployment).get("env", []):
            name = var["name"]
            if name.startswith(("HANDOFF_", "REDIS_")):
                assert name in known, f"{component} sets {name}, which {service} does not read"


def test_a_routers_registration_outlives_one_heartbeat_that_times_out():
    """The router's heartbeat TTL was the Redis socket timeout (2 s): one beat that timed out let its
    registration lapse, and any worker then reaped the live router's requests."""
    from common.redis_server import SOCKET_TIMEOUT_S
    config = RouterConfig()
    assert config.heartbeat_ttl_s > SOCKET_TIMEOUT_S + config.heartbeat_s
    with pytest.raises(ValueError, match="socket timeout"):
        RouterConfig(heartbeat_ttl_s=SOCKET_TIMEOUT_S)
