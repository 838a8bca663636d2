"""The network policies allow exactly the designed paths."""
from __future__ import annotations

import ipaddress
from urllib.parse import urlparse

import pytest

from tests.deploy.manifests import (
    OVERLAYS,
    POOLS,
    bundled_redis,
    container,
    named_port,
    of_kind,
    one,
    render,
    selector_matches,
)

# What the external Redis's host name resolves to, as DNS would answer in the cluster: an address
# in the range the example overlay's policy admits (both in the documentation ranges).
RESOLVES = {"redis.example.com": ipaddress.ip_address("198.51.100.7")}


def namespace_labels(name: str) -> dict:
    return {"kubernetes.io/metadata.name": name}


def peer_matches(peer: dict, policy_ns: str, other) -> bool:
    """Whether a rule's peer covers `other`: a pod, (namespace, labels), or an address outside the cluster."""
    if isinstance(other, (ipaddress.IPv4Address, ipaddress.IPv6Address)):
        block = peer.get("ipBlock")
        return block is not None and other in ipaddress.ip_network(block["cidr"]) \
            and not any(other in ipaddress.ip_network(e) for e in block.get("except", []))
    if "ipBlock" in peer:
        return False  # pods are matched by selectors; ipBlock is for addresses outside the cluster
    ns, labels = other
    if "namespaceSelector" in peer:
        if not selector_matches(peer["namespaceSelector"], namespace_labels(ns)):
            return False
    elif ns != policy_ns:
        return False
    return selector_matches(peer.get("podSelector", {}), labels)


def ports_match(rule_ports: list[dict] | None, port: int, protocol: str) -> bool:
    if not rule_ports:
        return True
    for p in rule_ports:
        if p.get("protocol", "TCP") != protocol:
            continue
        if "port" not in p or p["port"] == port or p["port"] <= port <= p.get("endPort", p["port"]):
            return True
    return False


def direction_allows(policies: list[dict], direction: str, pod: tuple[str, dict], peer: tuple[str, dict],
                     port: int, protocol: str = "TCP") -> bool:
    """Whether pod's own policies let traffic in from peer (ingress) or out to peer (egress)."""
    ns, labels = pod
    selecting = [p for p in policies if p["metadata"]["namespace"] == ns
                 and direction.capitalize() in p["spec"].get("policyTypes", ["Ingress"])
                 and selector_matches(p["spec"]["podSelector"], labels)]
    if not selecting:
        return True  # no policy isolates this pod in this direction
    peers_key = "from" if direction == "ingress" else "to"
    for policy in selecting:
        for rule in policy["spec"].get(direction) or []:
            peers = rule.get(peers_key)
            if (not peers or any(peer_matches(pe, ns, peer) for pe in peers)) \
                    and ports_match(rule.get("ports"), port, protocol):
                return True
    return False


def allowed(policies: list[dict], src: tuple[str, dict], dst, port: int, protocol="TCP") -> bool:
    """Whether NetworkPolicies let pod src (namespace, labels) open port on dst: a pod, or an address
    outside the cluster (which only src's egress rules govern)."""
    if isinstance(dst, (ipaddress.IPv4Address, ipaddress.IPv6Address)):
        return direction_allows(policies, "egress", src, dst, port, protocol)
    return (direction_allows(policies, "egress", src, dst, port, protocol)
            and direction_allows(policies, "ingress", dst, src, port, protocol))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_allow_exactly_the_designed_paths(overlay):
    objs = render(overlay)
    policies = of_kind(objs, "NetworkPolicy")
    ns = "handoff"
    own_redis = bundled_redis(objs)
    services = (*POOLS, "redis") if own_redis else POOLS
    pods = {c: (ns, one(objs, "Deployment", c)["spec"]["template"]["metadata"]["labels"]) for c in services}
    ctrs = {c: container(one(objs, "Deployment", c)) for c in services}
    port = {(c, name): named_port(ctrs[c], name) for c in ctrs for name in
            {"router": ("grpc", "http", "metrics"), "prefill": ("grpc", "metrics"),
             "decode": ("grpc", "kv", "metrics"), "redis": ("redis",)}[c]}
    client = ("clients", {"app": "some-client"})  # a pod in another namespace
    stranger = (ns, {"app": "stranger"})  # an unrelated pod in handoff's namespace
    prometheus = ("monitoring", {"app.kubernetes.io/name": "prometheus"})
    dns = ("kube-system", {"k8s-app": "kube-dns"})
    everyone = [client, stranger, prometheus, *pods.values()]

    names = {id(v): k for k, v in pods.items()} | {id(client): "client", id(stranger): "stranger",
                                                   id(prometheus): "prometheus"}

    def who_reaches(dst: str, port_name: str, ingress_only: bool = False) -> set[str]:
        def ok(src):
            if ingress_only:  # the destination's own rules, as if every source could send anything
                return direction_allows(policies, "ingress", pods[dst], src, port[(dst, port_name)])
            return allowed(policies, src, pods[dst], port[(dst, port_name)])
        return {names[id(src)] for src in everyone if src is not pods[dst] and ok(src)}

    # The router's APIs are open to clients outside the namespace; no handoff pod calls them.
    assert who_reaches("router", "grpc") == {"client", "prometheus"}
    assert who_reaches("router", "http") == {"client", "prometheus"}
    # Each internal port is closed by its own ingress rules, whatever the senders' egress says.
    for ingress_only in (False, True):
        assert who_reaches("prefill", "grpc", ingress_only) == {"router"}
        assert who_reaches("decode", "grpc", ingress_only) == {"router"}
        assert who_reaches("decode", "kv", ingress_only) == {"prefill"}, "only prefill workers push KV"
        if own_redis:
            assert who_reaches("redis", "redis", ingress_only) == {"router", "prefill", "decode"}
        for component in POOLS:
            assert who_reaches(component, "metrics", ingress_only) == {"prometheus"}, f"{component} metrics"
    # And each pod opens only the connections its role needs.
    opens = {c: {(d, name) for (d, name) in port if d != c and allowed(policies, pods[c], pods[d], port[(d, name)])}
             for c in pods}
    to_redis = {("redis", "redis")} if own_redis else set()
    expected = {"router": {("prefill", "grpc"), ("decode", "grpc")} | to_redis,
                "prefill": {("decode", "kv")} | to_redis,
                "decode": to_redis}
    assert opens == ({**expected, "redis": set()} if own_redis else expected), opens
    # Workers of one pool do not talk to each other, and nobody reaches an unopened port.
    assert not allowed(policies, pods["prefill"], pods["prefill"], port[("prefill", "grpc")])
    assert not allowed(policies, pods["decode"], pods["decode"], port[("decode", "kv")])
    assert not allowed(policies, client, pods["decode"], 22)
    for src in pods.values():
        assert allowed(policies, src, dns, 53, "UDP") and allowed(policies, src, dns, 53, "TCP"), "DNS egress"
    # Nothing else leaves the namespace: no egress to the internet or the API server.
    outside = ("elsewhere", {"app": "anything"})
    internet = ipaddress.ip_address("203.0.113.9")
    for src in pods.values():
        assert not allowed(policies, src, outside, 443)
        assert not allowed(policies, src, internet, 443) and not allowed(policies, src, internet, 6379)
    if not own_redis:
        external_redis_paths(objs, policies, pods, stranger)


def external_redis_paths(objs: list[dict], policies: list[dict], pods: dict, stranger: tuple[str, dict]) -> None:
    """components/external-redis: router, prefill and decode reach the address and port of redis-url,
    nothing else there, and no bundled Redis pod any more (a pod labelled as one is not trusted)."""
    url = urlparse(of_kind(objs, "ConfigMap")[0]["data"]["redis-url"])
    assert url.hostname in RESOLVES, f"the test knows no address for {url.hostname}"
    address, redis_port = RESOLVES[url.hostname], url.port or 6379
    for component in POOLS:
        assert allowed(policies, pods[component], address, redis_port), \
            f"{component} cannot reach the external Redis at {address}:{redis_port}: it would time out"
        assert not allowed(policies, pods[component], address, redis_port + 1), f"{component}: only Redis's port"
        assert not allowed(policies, pods[component], address, redis_port, "UDP"), component
        assert not allowed(policies, pods[component], ipaddress.ip_address("192.0.2.200"), redis_port), component
    assert not allowed(policies, stranger, address, redis_port), "other pods in the namespace do not reach it"
    impostor = ("handoff", {"app.kubernetes.io/name": "redis", "app.kubernetes.io/component": "redis",
                            "app.kubernetes.io/part-of": "handoff"})
    for component in POOLS:
        assert not direction_allows(policies, "egress", pods[component], impostor, 6379), \
            f"{component}: egress to the bundled Redis left"
