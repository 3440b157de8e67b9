"""deploy/k8s/network_policy.py: NetworkPolicy rules read as the API defines them, and the
check that compares them with the connections manifests name. No cluster here enforces a
policy (kwok's nodes run no network plugin), so these are the rules' meaning on small
manifests; `make k8s-check` runs the check on the rendered overlays."""

from __future__ import annotations

from typing import Any

import pytest

from hopline.deploy.k8s.network_policy import Manifests, admitted, load, matches, problems

NS = "app"


def deployment(
    name: str,
    ports: dict[str, int],
    env: dict[str, str] | None = None,
    config_map: str = "",
    namespace: str = NS,
) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": name,
        "ports": [{"name": k, "containerPort": v} for k, v in ports.items()],
        "env": [{"name": k, "value": v} for k, v in (env or {}).items()],
    }
    if config_map:
        container["envFrom"] = [{"configMapRef": {"name": config_map}}]
    return {
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "template": {
                "metadata": {"labels": {"name": name}},
                "spec": {"containers": [container]},
            }
        },
    }


def service(
    name: str, port: int, target: int | str = "grpc", namespace: str = NS
) -> dict[str, Any]:
    return {
        "kind": "Service",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"selector": {"name": name}, "ports": [{"port": port, "targetPort": target}]},
    }


def policy(
    name: str, selects: dict[str, Any], ingress: list[dict[str, Any]] | None
) -> dict[str, Any]:
    spec: dict[str, Any] = {"podSelector": selects, "policyTypes": ["Ingress"]}
    if ingress is not None:
        spec["ingress"] = ingress
    return {"kind": "NetworkPolicy", "metadata": {"name": name, "namespace": NS}, "spec": spec}


def from_pods(name: str, port: str | int) -> list[dict[str, Any]]:
    return [{"from": [{"podSelector": {"matchLabels": {"name": name}}}], "ports": [{"port": port}]}]


DENY_ALL = policy("deny", {}, None)
FRONT_DOOR = policy("front", {"matchLabels": {"name": "front"}}, [{"ports": [{"port": "grpc"}]}])
BACK_FROM_FRONT = policy("back", {"matchLabels": {"name": "back"}}, from_pods("front", "grpc"))
METRICS = policy(
    "metrics", {}, [{"from": [{"namespaceSelector": {}}], "ports": [{"port": "metrics"}]}]
)


def mesh(*policies: dict[str, Any], env: str = "dns:///back:9000") -> Manifests:
    return load(
        [
            {"kind": "Namespace", "metadata": {"name": NS}},
            deployment("front", {"grpc": 8001, "metrics": 9090}, {"BACK_ADDR": env}),
            deployment("back", {"grpc": 9000, "metrics": 9090}),
            service("front", 8001),
            service("back", 9000),
            *policies,
        ]
    )


def check(found: Manifests) -> list[str]:
    return problems(found, [NS], [f"{NS}/front"], "metrics")[0]


def test_the_policies_a_mesh_needs_pass_and_deny_everything_else() -> None:
    wrong, needed, denied = problems(
        mesh(DENY_ALL, FRONT_DOOR, BACK_FROM_FRONT, METRICS), [NS], [f"{NS}/front"], "metrics"
    )
    assert wrong == []
    # front's and back's metrics from each of 4 sources (the 2 workloads, a stray pod in app
    # and one in another namespace), front's grpc from the same 4, and front -> back.
    assert needed == 4 + 4 + 4 + 1
    # back's grpc from the 3 sources other than front.
    assert denied == 3


def test_a_connection_an_address_names_and_no_rule_admits_is_a_problem() -> None:
    assert check(mesh(DENY_ALL, FRONT_DOOR, METRICS)) == [
        "needed, not admitted: app/front -> app/back:9000/TCP (it names dns:///back:9000)"
    ]


def test_a_rule_wider_than_the_mesh_needs_is_a_problem() -> None:
    open_back = policy("back", {"matchLabels": {"name": "back"}}, [{"ports": [{"port": 9000}]}])
    assert sorted(check(mesh(DENY_ALL, FRONT_DOOR, open_back, METRICS))) == [
        "admitted, not needed: app/(a pod no workload here owns) -> app/back:9000/TCP",
        "admitted, not needed: app/back -> app/back:9000/TCP",
        "admitted, not needed: elsewhere/(a pod no workload here owns) -> app/back:9000/TCP",
    ]


def test_without_any_policy_every_port_is_open() -> None:
    wrong = check(mesh())
    assert "admitted, not needed: app/front -> app/back:9000/TCP" not in wrong  # it is needed
    assert "admitted, not needed: app/back -> app/back:9000/TCP" in wrong


def test_an_address_through_a_config_map_or_a_cluster_name_is_followed() -> None:
    for address in ("https://back.app.svc.cluster.local:9000", "back.app:9000"):
        assert check(mesh(DENY_ALL, FRONT_DOOR, METRICS, env=address)) == [
            f"needed, not admitted: app/front -> app/back:9000/TCP (it names {address})"
        ]
    found = load(
        [
            {
                "kind": "ConfigMap",
                "metadata": {"name": "env", "namespace": NS},
                "data": {"BACK_ADDR": "dns:///back:9000"},
            },
            deployment("front", {"grpc": 8001}, config_map="env"),
            deployment("back", {"grpc": 9000}),
            service("back", 9000),
            DENY_ALL,
        ]
    )
    assert problems(found, [NS], [], "metrics")[0] == [
        "needed, not admitted: app/front -> app/back:9000/TCP (it names dns:///back:9000)"
    ]


@pytest.mark.parametrize(
    ("address", "flows"),
    [
        ("0.0.0.0:8001", 0),  # a listen address, no Service
        ("back.other:9000", 0),  # no Service back in namespace other
        ("back.app.example.com:9000", 0),  # a name outside the cluster
        ("dns:///back:9001", 0),  # not a port of the Service
        ("back:9000", 1),
    ],
)
def test_only_a_services_own_name_and_port_is_a_connection(address: str, flows: int) -> None:
    found = load(
        [
            deployment("front", {}, {"ADDR": address}),
            deployment("back", {"grpc": 9000}),
            service("back", 9000),
        ]
    )
    assert problems(found, [], [], "metrics")[1] == flows


def test_selectors_follow_the_api() -> None:
    labels = {"name": "cache", "tier": "internal"}
    assert matches({}, labels)
    assert matches(None, labels)
    assert matches({"matchLabels": {"name": "cache"}}, labels)
    assert not matches({"matchLabels": {"name": "cache", "tier": "edge"}}, labels)
    expression = {"key": "name", "operator": "In", "values": ["cache", "inference"]}
    assert matches({"matchExpressions": [expression]}, labels)
    assert not matches({"matchExpressions": [{**expression, "operator": "NotIn"}]}, labels)
    assert matches({"matchExpressions": [{"key": "zone", "operator": "DoesNotExist"}]}, labels)
    assert not matches({"matchExpressions": [{"key": "zone", "operator": "Exists"}]}, labels)
    with pytest.raises(ValueError, match="unknown selector operator"):
        matches({"matchExpressions": [{"key": "x", "operator": "Near"}]}, labels)


def test_a_peer_with_both_selectors_needs_both_and_two_peers_need_either() -> None:
    """`- namespaceSelector: ..., podSelector: ...` is one peer (AND); as two list items they
    are two peers (OR): the classic mistake that opens a namespace to the whole cluster."""
    monitoring = {"kind": "Namespace", "metadata": {"name": "mon", "labels": {"team": "obs"}}}
    prometheus = deployment("prom", {}, namespace="mon")
    stranger = deployment("stranger", {}, namespace="mon")
    target = deployment("back", {"metrics": 9090})

    def reaches(peers: list[dict[str, Any]], source: str) -> bool:
        rule = {"from": peers, "ports": [{"port": "metrics"}]}
        found = load([monitoring, prometheus, stranger, target, policy("m", {}, [rule])])
        pods = {p.name: p for p in found.pods}
        return admitted(found, pods[source], pods["app/back"], 9090, "TCP")

    namespace = {"namespaceSelector": {"matchLabels": {"team": "obs"}}}
    pod = {"podSelector": {"matchLabels": {"name": "prom"}}}
    assert reaches([{**namespace, **pod}], "mon/prom")
    assert not reaches([{**namespace, **pod}], "mon/stranger")
    assert reaches([namespace, pod], "mon/stranger")  # any pod of the namespace
    assert not reaches([pod], "mon/prom")  # a podSelector alone: the policy's own namespace


def test_ports_by_name_number_range_and_protocol() -> None:
    target = deployment("back", {"grpc": 9000, "admin": 9001})

    def reaches(port: int, entries: list[dict[str, Any]], protocol: str = "TCP") -> bool:
        found = load([target, policy("p", {}, [{"ports": entries}])])
        return admitted(found, found.pods[0], found.pods[0], port, protocol)

    assert reaches(9000, [{"port": "grpc"}])
    assert not reaches(9001, [{"port": "grpc"}])  # the name is the pod's, not a number
    assert reaches(9001, [{"port": 9000, "endPort": 9001}])
    assert not reaches(9002, [{"port": 9000, "endPort": 9001}])
    assert not reaches(9000, [{"port": 9000, "protocol": "UDP"}])
    assert reaches(9000, [{"protocol": "TCP"}])  # no port: every TCP port
    assert reaches(9001, [])  # an empty `ports` list, as a missing one: every port


@pytest.mark.parametrize(
    "config",
    [
        # An OpenTelemetry collector's exporter, in the file's own words.
        "exporters:\n  otlp:\n    endpoint: back:9000\n",
        # The load-balancing exporter names the host and the port apart.
        "exporters:\n  loadbalancing:\n    resolver:\n      dns:\n"
        "        hostname: back.app.svc.cluster.local\n        port: 9000\n",
    ],
)
def test_an_address_in_a_config_file_mounted_from_a_config_map_is_followed(config: str) -> None:
    front = deployment("front", {"grpc": 8001})
    spec = front["spec"]["template"]["spec"]
    spec["volumes"] = [{"name": "config", "configMap": {"name": "collector"}}]
    found = load(
        [
            {
                "kind": "ConfigMap",
                "metadata": {"name": "collector", "namespace": NS},
                # A receiver's listening address names no Service: nothing needed for it.
                "data": {
                    "config.yaml": "receivers:\n  otlp:\n    endpoint: 0.0.0.0:4317\n" + config
                },
            },
            front,
            deployment("back", {"grpc": 9000}),
            service("back", 9000),
            DENY_ALL,
        ]
    )
    wrong = problems(found, [NS], [], "metrics")[0]
    assert len(wrong) == 1
    assert wrong[0].startswith("needed, not admitted: app/front -> app/back:9000/TCP (it names ")
