"""Check rendered Kubernetes manifests' NetworkPolicies against the connections the workloads
themselves name: `python deploy/k8s/network_policy.py FILE --isolated NS [--public NS/SVC]
[--scrape-port NAME]` (FILE: `kubectl kustomize` output; `make k8s-check` runs it per overlay).

No cluster here enforces a policy (kwok's nodes run no network plugin), so the rules are read
the way the API defines them (ingress only: podSelector, namespaceSelector, named and
numbered ports) and compared with what the manifests need:
- every address a container's environment names (`dns:///cache:8012`, `https://milvus:19530`,
  also through `envFrom` ConfigMaps), or a ConfigMap mounted as a file (a collector's config:
  `endpoint: jaeger-collector:4317`, or `hostname:` and `port:` side by side), that is a
  Service of the manifests: its caller's pods must reach the Service's pods on the target
  port;
- each `--public` Service's ports from anywhere (a pod of another namespace stands for a
  client), and each container port named `--scrape-port` from another namespace (Prometheus).
In an `--isolated` namespace every other connection a pod could open to a container port
(from the manifests' workloads, a stray pod of the namespace, a pod of another namespace)
must be denied. Each needed connection denied, and each admitted one not needed, is a
problem; the exit status is 1 when there is any.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

# Pod templates, by the path to them in each kind of workload.
TEMPLATE_PATHS: Mapping[str, tuple[str, ...]] = {
    "Deployment": ("spec", "template"),
    "StatefulSet": ("spec", "template"),
    "DaemonSet": ("spec", "template"),
    "ReplicaSet": ("spec", "template"),
    "Job": ("spec", "template"),
    "CronJob": ("spec", "jobTemplate", "spec", "template"),
}
NAME_LABEL = "kubernetes.io/metadata.name"  # every namespace carries its own name
ELSEWHERE = "elsewhere"  # the namespace of the pod that stands for the rest of the cluster
# host:port in an address, optionally behind a scheme (https://, dns:///, grpc://).
ADDRESS = re.compile(r"(?:[a-z][a-z0-9+.-]*://+)?(?P<host>[a-z0-9][a-z0-9.-]*):(?P<port>\d+)")


@dataclasses.dataclass(frozen=True)
class Pod:
    """A workload's pods (or a stand-in): what a policy selects and what it may admit."""

    name: str
    namespace: str
    labels: Mapping[str, str]
    ports: Mapping[str, tuple[int, str]]  # container port name -> (number, protocol)
    numbers: frozenset[tuple[int, str]]  # every container port
    addresses: tuple[str, ...]  # environment values that may name a Service


@dataclasses.dataclass(frozen=True)
class Service:
    name: str
    namespace: str
    selector: Mapping[str, str]
    ports: tuple[tuple[int, int | str, str], ...]  # (port, targetPort, protocol)


@dataclasses.dataclass(frozen=True)
class Flow:
    source: str  # "namespace/workload"
    target: str
    port: int
    protocol: str

    def __str__(self) -> str:
        return f"{self.source} -> {self.target}:{self.port}/{self.protocol}"


@dataclasses.dataclass
class Manifests:
    namespaces: dict[str, dict[str, str]]  # name -> labels
    pods: list[Pod]
    services: list[Service]
    policies: list[dict[str, Any]]


def load(documents: Iterable[Any]) -> Manifests:
    """The objects a check needs out of a stream of manifests."""
    objects = [d for d in documents if isinstance(d, dict) and d.get("kind")]
    config_maps = {
        (_namespace(o), o["metadata"]["name"]): o.get("data") or {}
        for o in objects
        if o["kind"] == "ConfigMap"
    }
    # The namespace of the pod that stands for the rest of the cluster (`_strays`).
    found = Manifests({ELSEWHERE: {NAME_LABEL: ELSEWHERE}}, [], [], [])
    for obj in objects:
        namespace, kind = _namespace(obj), obj["kind"]
        if kind in (*TEMPLATE_PATHS, "Service", "NetworkPolicy"):
            found.namespaces.setdefault(namespace, {NAME_LABEL: namespace})
        if kind == "Namespace":
            name = obj["metadata"]["name"]
            labels = obj["metadata"].get("labels") or {}
            found.namespaces[name] = {**labels, NAME_LABEL: name}
        elif kind in TEMPLATE_PATHS:
            found.pods.append(_pod(obj, config_maps))
        elif kind == "Service" and obj.get("spec", {}).get("selector"):
            found.services.append(_service(obj))
        elif kind == "NetworkPolicy":
            found.policies.append(obj)
    return found


def _namespace(obj: Mapping[str, Any]) -> str:
    return str(obj.get("metadata", {}).get("namespace") or "default")


def _pod(obj: Mapping[str, Any], config_maps: Mapping[tuple[str, str], Mapping[str, str]]) -> Pod:
    template: Any = obj
    for step in TEMPLATE_PATHS[obj["kind"]]:
        template = template.get(step) or {}
    spec = template.get("spec") or {}
    namespace = _namespace(obj)
    ports: dict[str, tuple[int, str]] = {}
    numbers: set[tuple[int, str]] = set()
    addresses: list[str] = []
    for container in [*spec.get("containers", []), *spec.get("initContainers", [])]:
        for port in container.get("ports") or []:
            entry = (int(port["containerPort"]), port.get("protocol", "TCP"))
            numbers.add(entry)
            if "name" in port:
                ports[port["name"]] = entry
        addresses += [str(e["value"]) for e in container.get("env") or [] if "value" in e]
        for source in container.get("envFrom") or []:
            if ref := source.get("configMapRef"):
                addresses += map(str, config_maps.get((namespace, ref["name"]), {}).values())
    for volume in spec.get("volumes") or []:
        if ref := volume.get("configMap"):
            for text in config_maps.get((namespace, ref["name"]), {}).values():
                addresses += [str(text), *_host_and_port(_parsed(str(text)))]
    return Pod(
        f"{namespace}/{obj['metadata']['name']}",
        namespace,
        (template.get("metadata") or {}).get("labels") or {},
        ports,
        frozenset(numbers),
        tuple(addresses),
    )


def _parsed(text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return None  # not YAML (a script, a certificate): its text is searched all the same


def _host_and_port(node: Any) -> list[str]:
    """`host:port` for each mapping in a parsed config that names both apart (the
    collector's load-balancing exporter: `hostname:` and `port:`)."""
    found = []
    if isinstance(node, dict):
        if isinstance(node.get("hostname"), str) and isinstance(node.get("port"), int):
            found.append(f"{node['hostname']}:{node['port']}")
        for value in node.values():
            found += _host_and_port(value)
    elif isinstance(node, list):
        for value in node:
            found += _host_and_port(value)
    return found


def _service(obj: Mapping[str, Any]) -> Service:
    spec = obj["spec"]
    ports = tuple(
        (int(p["port"]), p.get("targetPort", p["port"]), p.get("protocol", "TCP"))
        for p in spec.get("ports") or []
    )
    return Service(obj["metadata"]["name"], _namespace(obj), spec["selector"], ports)


def matches(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    """A label selector (matchLabels, matchExpressions) against labels; {} selects all."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expression in selector.get("matchExpressions") or []:
        key, operator = expression["key"], expression["operator"]
        values = expression.get("values") or []
        held = key in labels
        ok = {
            "In": held and labels.get(key) in values,
            "NotIn": not held or labels.get(key) not in values,
            "Exists": held,
            "DoesNotExist": not held,
        }.get(operator)
        if ok is None:
            raise ValueError(f"unknown selector operator {operator!r}")
        if not ok:
            return False
    return True


def admitted(found: Manifests, source: Pod, target: Pod, port: int, protocol: str) -> bool:
    """Whether the policies let `source`'s pods open a connection to `target`'s port."""
    selecting = [
        p
        for p in found.policies
        if _namespace(p) == target.namespace
        and "Ingress" in _policy_types(p)
        and matches(p["spec"].get("podSelector"), target.labels)
    ]
    if not selecting:
        return True  # a pod no policy selects is open to all
    for policy in selecting:
        for rule in policy["spec"].get("ingress") or []:
            if _from(found, policy, rule, source) and _ports(rule, target, port, protocol):
                return True
    return False


def _policy_types(policy: Mapping[str, Any]) -> list[str]:
    spec = policy["spec"]
    if "policyTypes" in spec:
        return list(spec["policyTypes"])
    return ["Ingress", "Egress"] if spec.get("egress") else ["Ingress"]


def _from(found: Manifests, policy: Mapping[str, Any], rule: Mapping[str, Any], pod: Pod) -> bool:
    peers = rule.get("from")
    if not peers:
        return True  # no `from`: every source
    for peer in peers:
        if "ipBlock" in peer:
            continue  # CIDRs name no pod; pod-to-pod traffic is judged by the selectors
        in_namespace = (
            matches(peer["namespaceSelector"], found.namespaces.get(pod.namespace, {}))
            if "namespaceSelector" in peer
            else pod.namespace == _namespace(policy)
        )
        if in_namespace and matches(peer.get("podSelector"), pod.labels):
            return True
    return False


def _ports(rule: Mapping[str, Any], target: Pod, port: int, protocol: str) -> bool:
    entries = rule.get("ports")
    if not entries:
        return True  # no `ports`: every port
    for entry in entries:
        if entry.get("protocol", "TCP") != protocol:
            continue
        named = entry.get("port")
        if named is None:
            return True
        if isinstance(named, str):
            if target.ports.get(named) == (port, protocol):
                return True
        elif int(named) <= port <= int(entry.get("endPort", named)):
            return True
    return False


def needed(found: Manifests, public: Sequence[str], scrape_port: str) -> dict[Flow, str]:
    """Each connection the manifests need, with why."""
    stray = _strays(found)
    flows: dict[Flow, str] = {}
    for pod in found.pods:
        for value in pod.addresses:
            for match in ADDRESS.finditer(value):
                for target, port, protocol in _dialled(found, pod, match["host"], match["port"]):
                    flows[Flow(pod.name, target.name, port, protocol)] = f"it names {value}"
    for service in found.services:
        if f"{service.namespace}/{service.name}" in public:
            for target, port, protocol in _behind(found, service, None):
                for source in [*found.pods, *stray.values()]:
                    flows[Flow(source.name, target.name, port, protocol)] = "a public Service"
    for target in found.pods:
        if scrape_port in target.ports:
            port, protocol = target.ports[scrape_port]
            for source in [*found.pods, *stray.values()]:
                flows[Flow(source.name, target.name, port, protocol)] = f"port {scrape_port}"
    return flows


def _strays(found: Manifests) -> dict[str, Pod]:
    """Stand-ins: an unlabelled pod in each namespace, ELSEWHERE (one of its own) included."""
    return {
        ns: Pod(f"{ns}/(a pod no workload here owns)", ns, {}, {}, frozenset(), ())
        for ns in found.namespaces
    }


def _dialled(found: Manifests, caller: Pod, host: str, port: str) -> list[tuple[Pod, int, str]]:
    labels = host.split(".")
    name = labels[0]
    namespace = labels[1] if len(labels) > 1 else caller.namespace
    if len(labels) > 1 and labels[2:] not in ([], ["svc"], ["svc", "cluster", "local"]):
        return []  # not a cluster Service name
    for service in found.services:
        if (service.name, service.namespace) == (name, namespace):
            return _behind(found, service, int(port))
    return []


def _behind(found: Manifests, service: Service, port: int | None) -> list[tuple[Pod, int, str]]:
    """(pod, container port, protocol) a Service's port (every port: None) leads to."""
    reached = []
    for pod in found.pods:
        if pod.namespace != service.namespace or not matches(
            {"matchLabels": service.selector}, pod.labels
        ):
            continue
        for number, target, protocol in service.ports:
            if port is not None and number != port:
                continue
            if isinstance(target, str):
                if target in pod.ports:
                    reached.append((pod, *pod.ports[target]))
            else:
                reached.append((pod, int(target), protocol))
    return reached


def problems(
    found: Manifests, isolated: Sequence[str], public: Sequence[str], scrape_port: str
) -> tuple[list[str], int, int]:
    """What is wrong (each needed connection denied, each one admitted into an isolated
    namespace that nothing needs), and how many connections were needed and denied."""
    need = needed(found, public, scrape_port)
    sources = {p.name: p for p in [*found.pods, *_strays(found).values()]}
    targets = {p.name: p for p in found.pods}
    wrong = [
        f"needed, not admitted: {flow} ({why})"
        for flow, why in sorted(need.items(), key=lambda item: str(item[0]))
        if not admitted(found, sources[flow.source], targets[flow.target], flow.port, flow.protocol)
    ]
    denied = 0
    for target in found.pods:
        if target.namespace not in isolated:
            continue
        for source in sources.values():
            for port, protocol in sorted(target.numbers):
                flow = Flow(source.name, target.name, port, protocol)
                if flow in need:
                    continue
                if admitted(found, source, target, port, protocol):
                    wrong.append(f"admitted, not needed: {flow}")
                else:
                    denied += 1
    return wrong, len(need), denied


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("file", type=Path, help="rendered manifests (kubectl kustomize output)")
    parser.add_argument("--isolated", action="append", default=[], help="a namespace")
    parser.add_argument("--public", action="append", default=[], help="NAMESPACE/SERVICE")
    parser.add_argument("--scrape-port", default="metrics", help="a container port's name")
    args = parser.parse_args(argv)
    found = load(yaml.safe_load_all(args.file.read_text()))
    wrong, need, denied = problems(found, args.isolated, args.public, args.scrape_port)
    for line in wrong:
        print(f"{args.file}: {line}", file=sys.stderr)
    if not wrong:
        print(f"{args.file}: NetworkPolicies admit the {need} connections needed, deny {denied}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
