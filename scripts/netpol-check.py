#!/usr/bin/env python3
"""Reads a rendered kustomization as a cluster would enforce it.

    netpol-check.py RENDERED.yaml KUSTOMIZATION_DIR

Asserts, and prints one line per assertion group:

- every namespaced object is in the berth namespace;
- every connection the mesh makes is allowed by the rendered
  NetworkPolicies (both the source's egress and the destination's
  ingress), on the ports its configuration names: agent and services to
  the control-plane addresses in the ConfigMap, the control plane to the
  database and Redis URLs (from the rendered Secrets, else from the
  example URLs the kustomization's comments give for the operator's own
  Secrets), revisions to OCI registries, every pod to DNS (kube-dns or a
  node-local cache on a link-local address) and to an OTLP collector;
- nothing else reaches a berth port from outside the namespace: a pod in
  another namespace is refused on every declared port, an admin pod
  (labelled berth.internal/admin=true in a namespace with the same label)
  is let in, and the label on either alone is not enough;
- every container with both probes has a liveness probe distinct from its
  readiness probe.

The evaluator follows the NetworkPolicy semantics of networking.k8s.io/v1:
a pod no policy selects for a direction is open in that direction; a pod
some policy selects is open only to what one of those policies' rules
allows; peers are podSelector (the policy's namespace), namespaceSelector,
both (AND), or ipBlock; an absent `from`/`to` is every peer, absent
`ports` every port; `endPort` makes a range; named ports resolve against
the destination pod's containers.
"""

import base64
import ipaddress
import re
import sys
from pathlib import Path
from urllib.parse import urlsplit

import yaml

NAMESPACE = "berth"
CLUSTER_SCOPED = {"Namespace", "PriorityClass", "ClusterRole", "ClusterRoleBinding", "StorageClass"}
WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet"}
ADMIN_LABEL = {"berth.internal/admin": "true"}

# Who dials whom, by the ConfigMap key holding the address: the mesh's
# call graph (each service's clients), which the manifests must allow.
CALLS = {
    "berth-agent": ["BERTH_IDENTITY_ADDR", "BERTH_LEASES_ADDR", "BERTH_REVISIONS_ADDR", "BERTH_EGRESS_ADDR"],
    "berth-revisions": ["BERTH_IDENTITY_ADDR", "BERTH_LEASES_ADDR"],
    "berth-leases": ["BERTH_IDENTITY_ADDR"],
    "berth-egress": ["BERTH_IDENTITY_ADDR", "BERTH_REVISIONS_ADDR", "BERTH_LEASES_ADDR"],
    "berth-identity": [],
    "berth-router": ["BERTH_IDENTITY_ADDR", "BERTH_REVISIONS_ADDR", "BERTH_LEASES_ADDR"],
}
# Pods whose listed ports anyone may reach (the router's HTTP: the users' way
# in), by container port name.
PUBLIC_PORTS = {"berth-router": ["http"]}
CONTROL_PLANE = ["berth-identity", "berth-revisions", "berth-leases", "berth-egress"]
# Outside the cluster: a managed service, a registry, a node-local DNS cache.
EXTERNAL_IP = "203.0.113.10"
NODE_LOCAL_DNS = "169.254.20.10"
KUBE_DNS = {"namespace": "kube-system", "labels": {"k8s-app": "kube-dns"}, "ports": {"dns": 53}}


class Pod:
    def __init__(self, name, namespace, labels, ports, ip=None):
        self.name, self.namespace, self.labels, self.ports, self.ip = name, namespace, labels, ports, ip

    def __repr__(self):
        return f"{self.namespace}/{self.name}" if self.ip is None else self.ip


def selects(selector, labels):
    if selector is None:
        return True
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and labels.get(key) in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


class Cluster:
    def __init__(self, docs):
        self.docs = docs
        self.namespaces = {NAMESPACE: {}, "kube-system": {}, "other": {}, "admins": dict(ADMIN_LABEL)}
        for doc in docs:
            if doc["kind"] == "Namespace":
                self.namespaces[doc["metadata"]["name"]] = doc["metadata"].get("labels") or {}
        self.policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
        self.pods = {}
        for doc in docs:
            if doc["kind"] in WORKLOADS:
                template = doc["spec"]["template"]
                ports = {}
                for container in template["spec"]["containers"]:
                    for port in container.get("ports") or []:
                        ports[port.get("name") or str(port["containerPort"])] = port["containerPort"]
                name = doc["metadata"]["name"]
                self.pods[name] = Pod(name, doc["metadata"].get("namespace", ""), template["metadata"]["labels"], ports)
        self.services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}

    def policies_for(self, pod, direction):
        if pod.ip is not None:
            return []
        return [
            p
            for p in self.policies
            if p["metadata"].get("namespace") == pod.namespace
            and selects(p["spec"].get("podSelector") or {}, pod.labels)
            and direction in (p["spec"].get("policyTypes") or ["Ingress"])
        ]

    def peer_matches(self, peer, policy_namespace, other):
        if "ipBlock" in peer:
            if other.ip is None:
                return False
            address = ipaddress.ip_address(other.ip)
            block = peer["ipBlock"]
            if address not in ipaddress.ip_network(block["cidr"]):
                return False
            return not any(address in ipaddress.ip_network(e) for e in block.get("except") or [])
        if other.ip is not None:
            return False
        if "namespaceSelector" in peer:
            if not selects(peer["namespaceSelector"], self.namespaces.get(other.namespace, {})):
                return False
        elif other.namespace != policy_namespace:
            return False
        return selects(peer.get("podSelector"), other.labels)

    @staticmethod
    def port_matches(rule, destination, port, protocol):
        if not rule.get("ports"):
            return True
        for entry in rule["ports"]:
            if entry.get("protocol", "TCP") != protocol:
                continue
            wanted = entry.get("port")
            if wanted is None:
                return True
            if isinstance(wanted, str):
                wanted = destination.ports.get(wanted)
                if wanted is None:
                    continue
            if wanted <= port <= entry.get("endPort", wanted):
                return True
        return False

    def rules_allow(self, policies, direction, peer, destination, port, protocol):
        """Whether a rule of `policies` in `direction` admits `peer` to `destination`'s `port`."""
        rules_key, peers_key = ("egress", "to") if direction == "Egress" else ("ingress", "from")
        return any(
            self.port_matches(rule, destination, port, protocol)
            and (
                peers_key not in rule
                or any(self.peer_matches(entry, p["metadata"]["namespace"], peer) for entry in rule[peers_key])
            )
            for p in policies
            for rule in p["spec"].get(rules_key) or []
        )

    def allowed(self, source, destination, port, protocol="TCP"):
        """Whether `source` may open `port` on `destination`, and if not, which side refuses."""
        egress = self.policies_for(source, "Egress")
        if egress and not self.rules_allow(egress, "Egress", destination, destination, port, protocol):
            return False, f"no egress rule of {source} allows it"
        ingress = self.policies_for(destination, "Ingress")
        if ingress and not self.rules_allow(ingress, "Ingress", source, destination, port, protocol):
            return False, f"no ingress rule of {destination} allows it"
        return True, ""

    def resolve(self, host, port):
        """The pod behind `host:port` (a Service of the namespace), or an address outside the cluster."""
        name = host.split(".")[0]
        service = self.services.get(name)
        if service is None or (host != name and not host.startswith(f"{name}.{NAMESPACE}")):
            return Pod(host, "", {}, {}, ip=EXTERNAL_IP), port
        selector = service["spec"].get("selector") or {}
        target = next((p for p in service["spec"]["ports"] if p["port"] == port), None)
        if target is None:
            raise SystemExit(f"netpol-check: Service {name} has no port {port}")
        pods = [p for p in self.pods.values() if p.namespace == NAMESPACE and selects({"matchLabels": selector}, p.labels)]
        if not pods:
            raise SystemExit(f"netpol-check: Service {name} selects no pod")
        target_port = target.get("targetPort", port)
        if isinstance(target_port, str):
            target_port = pods[0].ports[target_port]
        return pods[0], target_port


def env_of(doc, name):
    for container in doc["spec"]["template"]["spec"]["containers"]:
        for entry in container.get("env") or []:
            if entry["name"] == name:
                return entry
    return None


def url_ports(cluster, docs, directory):
    """(what, host, port) of the database and Redis URLs the control plane is given."""
    secrets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Secret"}
    examples = re.findall(r"(postgres(?:ql)?://\S+|rediss?://\S+)", (directory / "kustomization.yaml").read_text())
    found = []
    for variable, scheme, default in (("BERTH_DATABASE_URL", "postgres", 5432), ("BERTH_REDIS_URL", "redis", 6379)):
        entry = env_of(next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "berth-identity"), variable)
        reference = (entry or {}).get("valueFrom", {}).get("secretKeyRef")
        if reference and reference["name"] in secrets:
            url = base64.b64decode(secrets[reference["name"]]["data"][reference["key"]]).decode()
        else:
            url = next((u for u in examples if u.startswith(scheme)), None)
            if url is None:
                raise SystemExit(f"netpol-check: no {variable} in a Secret nor an example URL in {directory}")
        parts = urlsplit(url.rstrip(".,;)"))
        found.append((variable, parts.hostname, parts.port or default))
    return found


def main():
    rendered, directory = Path(sys.argv[1]), Path(sys.argv[2])
    docs = [d for d in yaml.safe_load_all(rendered.read_text()) if d]
    failures = []

    misplaced = [
        f"{d['kind']}/{d['metadata']['name']}"
        for d in docs
        if d["kind"] not in CLUSTER_SCOPED and d["metadata"].get("namespace") != NAMESPACE
    ]
    if misplaced:
        failures.append(f"objects outside namespace {NAMESPACE}: {misplaced}")

    cluster = Cluster(docs)
    config = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "berth-config")["data"]
    flows = []
    for caller, keys in CALLS.items():
        for key in keys:
            host, port = config[key].rsplit(":", 1)
            destination, target = cluster.resolve(host, int(port))
            flows.append((cluster.pods[caller], destination, target, "TCP", f"{caller} -> {config[key]}"))
    for variable, host, port in url_ports(cluster, docs, directory):
        for caller in CONTROL_PLANE:
            destination, target = cluster.resolve(host, port)
            flows.append((cluster.pods[caller], destination, target, "TCP", f"{caller} -> {variable} {host}:{port}"))
    # The router reaches every agent's data plane at its pod address.
    agent = cluster.pods["berth-agent"]
    flows.append((cluster.pods["berth-router"], agent, agent.ports["grpc"], "TCP", "berth-router -> an agent's data plane"))
    registry = Pod("registry", "", {}, {}, ip=EXTERNAL_IP)
    for port in (443, 5000):
        flows.append((cluster.pods["berth-revisions"], registry, port, "TCP", f"berth-revisions -> registry :{port}"))
    kube_dns = Pod("kube-dns", KUBE_DNS["namespace"], KUBE_DNS["labels"], KUBE_DNS["ports"])
    node_local = Pod("node-local-dns", "", {}, {}, ip=NODE_LOCAL_DNS)
    collector = Pod("otel-collector", "", {}, {}, ip=EXTERNAL_IP)
    for pod in cluster.pods.values():
        if pod.namespace != NAMESPACE or pod.name not in CALLS:
            continue
        for resolver in (kube_dns, node_local):
            for protocol in ("UDP", "TCP"):
                flows.append((pod, resolver, 53, protocol, f"{pod.name} -> DNS {resolver} {protocol}"))
        flows.append((pod, collector, 4317, "TCP", f"{pod.name} -> OTLP collector"))
    for source, destination, port, protocol, what in flows:
        ok, why = cluster.allowed(source, destination, port, protocol)
        if not ok:
            failures.append(f"{what} ({protocol} {port}) is blocked: {why}")
    print(f"netpol-check: {len(flows)} connections the mesh makes are allowed")

    outsiders = {
        "a pod in another namespace": Pod("stranger", "other", {}, {}),
        "an admin-labelled pod in an unlabelled namespace": Pod("impostor", "other", dict(ADMIN_LABEL), {}),
        "an unlabelled pod in the admin namespace": Pod("bystander", "admins", {}, {}),
    }
    admin = Pod("toolbox", "admins", dict(ADMIN_LABEL), {})
    checked = 0
    public = 0
    for pod in cluster.pods.values():
        if pod.name not in CALLS:
            continue
        open_to_all = {pod.ports[name] for name in PUBLIC_PORTS.get(pod.name, [])}
        for port in sorted(open_to_all):
            public += 1
            for outsider in [*outsiders.values(), Pod("user", "", {}, {}, ip=EXTERNAL_IP)]:
                ok, why = cluster.allowed(outsider, pod, port)
                if not ok:
                    failures.append(f"{outsider} cannot reach the public {pod.name}:{port}: {why}")
        for port in set(pod.ports.values()) - open_to_all:
            checked += 1
            for what, outsider in outsiders.items():
                if cluster.allowed(outsider, pod, port)[0]:
                    failures.append(f"{what} reaches {pod.name}:{port}")
            ok, why = cluster.allowed(admin, pod, port)
            if not ok:
                failures.append(f"an admin pod cannot reach {pod.name}:{port}: {why}")
    print(f"netpol-check: {checked} berth ports refused from outside the namespace, open to admins")
    print(f"netpol-check: {public} public ports open to everyone")

    probes = 0
    for doc in docs:
        if doc["kind"] not in WORKLOADS:
            continue
        for container in doc["spec"]["template"]["spec"]["containers"]:
            live, ready = container.get("livenessProbe"), container.get("readinessProbe")
            if live and ready:
                probes += 1
                if live == ready:
                    failures.append(f"{doc['metadata']['name']}: liveness and readiness run the same check")
    print(f"netpol-check: {probes} containers' liveness and readiness distinct")

    if failures:
        for failure in failures:
            print(f"netpol-check: FAILED: {failure}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
