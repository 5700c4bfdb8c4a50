"""Our SSH firewall rule on GCP: one per VPC network (``provisioner-allow-ssh-<network>``),
admitting tcp:22 from ``ssh_cidrs`` to instances carrying our network tag, made once, kept to
``ssh_cidrs``, deleted once no instance of ours is on its network. google-cloud-compute is
imported inside the methods."""

from __future__ import annotations

import hashlib
import re
import uuid
from functools import partial
from typing import TYPE_CHECKING, Any

from providers.base import TAG_MANAGED_BY, TAG_MANAGED_BY_VALUE, InvalidRequest, NotFound, Throttled

if TYPE_CHECKING:
    from providers.gcp.adapter import GCPProvider

# SSH reachability, as SkyPilot and dstack do it on GCP: a firewall rule of ours admitting
# tcp:22 from `ssh_cidrs` to instances carrying our network tag. Firewall rule names are unique
# per project, not per network (cloud.google.com/firewall/docs/using-firewalls), so the rule's
# name carries its network's (dstack names its rule "dstack-ssh-in-" + the network the same way).
SSH_TAG = "provisioner-ssh"
SSH_RULE = "provisioner-allow-ssh"
_NETWORK_URL = re.compile(
    r"(?:(?:https://[^/]+/compute/v1/)?projects/([^/]+)/)?global/networks/([a-z0-9-]+)"
)


class Firewall:
    """The SSH rules of one adapter, and the (project, network) pairs it has checked."""

    def __init__(self, cloud: GCPProvider) -> None:
        self.cloud = cloud
        self._rules: set[tuple[str, str]] = set()  # (project, network) with our rule

    def unused(self, remove: bool) -> list[str]:
        """Our SSH firewall rules (``provisioner-allow-ssh-*`` admitting our tag) on a network
        where no instance of ours is, in any zone and any state but deleted (a stopped one needs
        its rule again when started); deleted when ``remove``. Firewall rules are global, so
        every zone of the project is asked, not only the configured regions."""
        from google.cloud import compute_v1

        project = self.cloud._project()
        listing = compute_v1.ListFirewallsRequest(project=project, max_results=500)
        rules = self.cloud.call(
            lambda: list(self.cloud._client("firewalls").list(request=listing, retry=None))
        )
        ours = [
            r
            for r in rules
            if r.name.startswith(f"{SSH_RULE}-") and list(r.target_tags) == [SSH_TAG]
        ]
        if not ours:
            return []
        in_use = self._networks_in_use(project)
        out = []
        for rule in ours:
            network = last(rule.network)
            if network in in_use:
                continue
            if remove:
                self._delete(project, rule.name)
            out.append(f"firewall rule {rule.name} (network {network}, tcp:22 to {SSH_TAG})")
        if remove:
            self._rules.clear()
        return out

    def _networks_in_use(self, project: str) -> set[str]:
        """The networks an instance of ours carrying our tag is on, in any zone of the project."""
        from google.cloud import compute_v1

        instances = compute_v1.AggregatedListInstancesRequest(
            project=project,
            filter=f'(labels.{TAG_MANAGED_BY} = "{TAG_MANAGED_BY_VALUE}")',
            max_results=500,
        )

        def every_page() -> list[Any]:
            pager = self.cloud._instances().aggregated_list(request=instances, retry=None)
            return [item for _, scoped in pager for item in scoped.instances]

        return {
            last(nic.network)
            for item in self.cloud.call(every_page)
            if SSH_TAG in item.tags.items
            for nic in item.network_interfaces
        }

    def _delete(self, project: str, name: str) -> None:
        from google.cloud import compute_v1

        delete = compute_v1.DeleteFirewallRequest(
            project=project, firewall=name, request_id=str(uuid.uuid4())
        )
        try:
            operation = self.cloud.call(
                partial(self.cloud._client("firewalls").delete_unary, request=delete, retry=None)
            )
            self.cloud._wait_global(operation, project)
        except NotFound:
            pass  # someone else removed it meanwhile

    def ensure(self) -> None:
        """Our firewall rule on the machine's network: found by name, else created (awaited as
        the global operation it is). A create that loses a race to another process (409
        alreadyExists) uses the rule that process made."""
        from google.cloud import compute_v1

        network = self.cloud.options.network
        match = _NETWORK_URL.fullmatch(network)
        project = (match.group(1) if match else None) or self.cloud._project()
        if (project, network) in self._rules:
            return
        network_name = match.group(2) if match else last(network)
        name = ssh_rule_name(network_name)
        rule = self._find_rule(project, name)
        if rule is None:
            rule = self._create(project, name, network)
        if last(rule.network) != network_name:
            raise InvalidRequest(
                f"gcp: firewall rule {name} belongs to network {last(rule.network)}, "
                f"not {network_name}",
                code="firewallNetworkMismatch",
            )
        if sorted(rule.source_ranges) != sorted(self.cloud.options.ssh_cidrs):
            # ssh_cidrs changed in the settings: the rule follows (firewalls.patch replaces the
            # list fields it is given, and only those)
            patch = compute_v1.PatchFirewallRequest(
                project=project,
                firewall=name,
                firewall_resource=compute_v1.Firewall(
                    source_ranges=list(self.cloud.options.ssh_cidrs)
                ),
                request_id=str(uuid.uuid4()),
            )
            operation = self.cloud.call(
                lambda: self.cloud._client("firewalls").patch_unary(request=patch, retry=None)
            )
            self.cloud._wait_global(operation, project)
        self._rules.add((project, network))

    def _create(self, project: str, name: str, network: str) -> Any:
        """Our rule made on ``network`` (awaited), or the one a racing process made (409)."""
        from google.cloud import compute_v1

        firewall = compute_v1.Firewall(
            name=name,
            network=network,
            description="provisioner: SSH to GPU machines",
            direction="INGRESS",
            priority=1000,
            allowed=[compute_v1.Allowed(I_p_protocol="tcp", ports=["22"])],
            source_ranges=list(self.cloud.options.ssh_cidrs),
            target_tags=[SSH_TAG],
        )
        insert = compute_v1.InsertFirewallRequest(
            project=project, firewall_resource=firewall, request_id=str(uuid.uuid4())
        )
        try:
            operation = self.cloud.call(
                lambda: self.cloud._client("firewalls").insert_unary(request=insert, retry=None)
            )
            self.cloud._wait_global(operation, project)
        except InvalidRequest as exc:
            if exc.code != "alreadyExists":
                raise
        except NotFound as exc:  # the one resource a firewall insert names is its network
            raise InvalidRequest(
                f"gcp: network {network} was not found in project {project} (set "
                "`network`/`subnetwork` in the gcp settings to a VPC network of this project)",
                code=exc.code,
            ) from exc

        def made() -> Any:  # another process's create may still be under way
            found = self._find_rule(project, name)
            if found is None:
                raise Throttled(f"gcp: firewall rule {name} not there yet", code="notFound")
            return found

        return self.cloud.call(made)

    def _find_rule(self, project: str, name: str) -> Any | None:
        try:
            return self.cloud.call(
                lambda: self.cloud._client("firewalls").get(
                    project=project, firewall=name, retry=None
                )
            )
        except NotFound:
            return None


def ssh_rule_name(network: str) -> str:
    """``provisioner-allow-ssh-<network>``, kept within the 63 characters a name may have (a
    long network name is cut and a hash of it appended, so two never share a rule)."""
    name = f"{SSH_RULE}-{network}"
    if len(name) <= 63:
        return name
    digest = hashlib.sha256(network.encode()).hexdigest()[:8]
    return f"{SSH_RULE}-{network[:31]}-{digest}"


def last(url: str) -> str:
    """The last part of a resource URL: its name."""
    return url.rsplit("/", 1)[-1]
