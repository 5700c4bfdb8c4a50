"""What an Azure VM needs around it, all in the resource group and tagged as ours: a public IP
(Standard, static), a NIC in the region's subnet, and our SSH network security group per region
(22/tcp from ``ssh_cidrs``); and the collection of those no VM uses any more. azure-mgmt-network
is imported inside the methods."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from functools import partial
from typing import TYPE_CHECKING, Any

from providers.azure import arm_tags
from providers.base import (
    TAG_MANAGED_BY,
    TAG_MANAGED_BY_VALUE,
    InvalidRequest,
    LaunchRequest,
    NotFound,
)

if TYPE_CHECKING:
    from providers.azure.adapter import AzureProvider

_SSH_RULE = "provisioner-ssh"  # our inbound rule's name in our NSG


class Network:
    """The network pieces of one adapter, and the NSGs it found or made (by region)."""

    def __init__(self, cloud: AzureProvider) -> None:
        self.cloud = cloud
        self._lock = threading.Lock()
        self._groups: dict[str, str] = {}  # region -> our SSH NSG's id

    def unused(self, remove: bool) -> list[str]:
        """Our pieces in the resource group that no VM uses: NICs attached to no VM, public IPs
        held by no NIC (or only by such a NIC), NSGs no NIC (but such a NIC) is in. Removed
        when ``remove``, NICs first (a public IP cannot go while a NIC holds it). ARM refuses
        to delete one taken into use meanwhile; it is kept."""
        _, network = self.cloud._clients()
        rg = self.cloud.resource_group
        nics, ips, groups = self._orphans(network)
        out = []
        for kind, items, delete in (
            ("network interface", nics, network.network_interfaces.begin_delete),
            ("public IP", ips, network.public_ip_addresses.begin_delete),
            ("network security group", groups, network.network_security_groups.begin_delete),
        ):
            for item in items:
                if remove:
                    try:
                        self.cloud._wait(partial(delete, rg, item.name))
                    except InvalidRequest:  # in use after all (NicInUse, …CannotBeDeleted)
                        continue
                address = getattr(item, "ip_address", None)
                where = f"{item.location}, {address}" if address else item.location
                out.append(f"{kind} {item.name} ({where}, resource group {rg})")
        if remove:
            with self._lock:
                self._groups.clear()
        return out

    def _orphans(self, network: Any) -> tuple[list[Any], list[Any], list[Any]]:
        """Our NICs attached to no VM, public IPs held by none (or only by such a NIC), NSGs
        on no subnet with no NIC but such NICs."""
        nics = [n for n in self._ours(network.network_interfaces) if n.virtual_machine is None]
        free = {str(n.id).lower() for n in nics}
        ips = [ip for ip in self._ours(network.public_ip_addresses) if _ip_unused(ip, free)]
        groups = [g for g in self._ours(network.network_security_groups) if _nsg_unused(g, free)]
        return nics, ips, groups

    def _ours(self, resources: Any) -> list[Any]:
        """The resources of one kind in the resource group tagged ours, in our regions."""
        rg = self.cloud.resource_group
        try:
            listed = self.cloud.call(lambda: list(resources.list(rg)))
        except NotFound:  # no resource group: nothing of ours
            return []
        return [
            r
            for r in listed
            if (r.tags or {}).get(TAG_MANAGED_BY) == TAG_MANAGED_BY_VALUE
            and r.location in self.cloud.regions
        ]

    def ssh_group(self, region: str) -> str:
        """Our network security group in ``region``: found by name, else created with 22/tcp open
        to ``ssh_cidrs`` and tagged as ours. A Standard public IP is closed to inbound traffic
        until an NSG admits it. Outbound stays open (the default AllowInternetOutBound rule).
        When ``ssh_cidrs`` changed since, our rule is rewritten to the new list; a group of
        that name not tagged ours is the user's, used as it is."""
        with self._lock:
            if region in self._groups:
                return self._groups[region]
        from azure.mgmt.network import models

        _, network = self.cloud._clients()
        rg, name = self.cloud.resource_group, nsg_name(region)
        try:
            group = self.cloud.call(lambda: network.network_security_groups.get(rg, name))
        except NotFound:
            body = models.NetworkSecurityGroup(  # type: ignore[call-overload]
                location=region,
                tags={TAG_MANAGED_BY: TAG_MANAGED_BY_VALUE},
                security_rules=[self._ssh_rule()],
            )
            # PUT by name: a concurrent creator's PUT lands on the same group, never a second.
            group = self.cloud._wait(
                partial(network.network_security_groups.begin_create_or_update, rg, name, body)
            )
        else:
            ours = (group.tags or {}).get(TAG_MANAGED_BY) == TAG_MANAGED_BY_VALUE
            if ours and _admitted(group) != list(self.cloud.options.ssh_cidrs):
                # The rule alone (Security Rules - Create Or Update): the group's other rules
                # and its NIC associations stay as they are.
                self.cloud._wait(
                    partial(
                        network.security_rules.begin_create_or_update,
                        rg,
                        name,
                        _SSH_RULE,
                        self._ssh_rule(),
                    )
                )
        with self._lock:
            self._groups[region] = group.id
        return str(group.id)

    def _ssh_rule(self) -> Any:
        """Our inbound rule: 22/tcp from ``ssh_cidrs``."""
        from azure.mgmt.network import models

        cidrs = list(self.cloud.options.ssh_cidrs)
        source: dict[str, Any] = (
            {"source_address_prefix": cidrs[0]}
            if len(cidrs) == 1
            else {"source_address_prefixes": cidrs}
        )
        return models.SecurityRule(  # type: ignore[call-overload]
            name=_SSH_RULE,
            description="provisioner: SSH to GPU machines",
            protocol="Tcp",
            source_port_range="*",
            destination_port_range="22",
            destination_address_prefix="*",
            access="Allow",
            direction="Inbound",
            priority=1000,
            **source,
        )

    def ip_body(self, request: LaunchRequest) -> Any:
        from azure.mgmt.network import models

        # Standard SKU (Basic is retired) is static-only. Zone-redundant by default where the
        # region has zones, so it serves a VM in any zone.
        return models.PublicIPAddress(  # type: ignore[call-overload]
            location=request.region,
            tags=arm_tags(request.labels),
            sku=models.PublicIPAddressSku(name="Standard", tier="Regional"),
            public_ip_allocation_method="Static",
            public_ip_address_version="IPv4",
        )

    def nic_body(self, request: LaunchRequest, public_ip_id: str, group_id: str) -> Any:
        from azure.mgmt.network import models

        # The flattened keywords (ip_configurations=…, subnet=…) are what every supported
        # azure-mgmt-network accepts; the newer SDK's overloads declare only ``properties=``
        # although its __init__ still takes them, hence the ignores.
        return models.NetworkInterface(  # type: ignore[call-overload]
            location=request.region,
            tags=arm_tags(request.labels),
            ip_configurations=[
                models.NetworkInterfaceIPConfiguration(  # type: ignore[call-overload]
                    name="ipconfig1",
                    subnet=models.Subnet(id=self.subnet_id(request.region)),
                    private_ip_allocation_method="Dynamic",
                    # deleteOption is honoured as set here, on the NIC's reference, not in the
                    # public IP's own body (Azure/azure-sdk-for-java#38806).
                    public_ip_address=models.PublicIPAddress(  # type: ignore[call-overload]
                        id=public_ip_id, delete_option="Delete"
                    ),
                )
            ],
            network_security_group=models.NetworkSecurityGroup(id=group_id),
        )

    def nic_id(self, vm_name: str) -> str:
        return (
            f"/subscriptions/{self.cloud._subscription_id()}/resourceGroups/{self.cloud.resource_group}"
            f"/providers/Microsoft.Network/networkInterfaces/{nic_name(vm_name)}"
        )

    def subnet_id(self, region: str) -> str:
        configured = self.cloud.options.subnet_id
        if isinstance(configured, Mapping):
            configured = configured.get(region)
        if configured:
            return str(configured)
        vnet = self.cloud.options.vnet.format(region=region)
        subnet = self.cloud.options.subnet.format(region=region)
        return (
            f"/subscriptions/{self.cloud._subscription_id()}/resourceGroups/{self.cloud.resource_group}"
            f"/providers/Microsoft.Network/virtualNetworks/{vnet}/subnets/{subnet}"
        )


def nic_name(vm_name: str) -> str:
    return f"{vm_name}-nic"


def ip_name(vm_name: str) -> str:
    return f"{vm_name}-ip"


def nsg_name(region: str) -> str:
    return f"provisioner-ssh-{region}"


def _admitted(group: Any) -> list[str]:
    """The sources our SSH rule in ``group`` admits (none without the rule)."""
    rule = next((r for r in group.security_rules or [] if r.name == _SSH_RULE), None)
    if rule is None:
        return []
    return rule.source_address_prefixes or [rule.source_address_prefix]


def _ip_unused(ip: Any, free_nics: set[str]) -> bool:
    """A public IP held by no NIC, or only by one of ``free_nics`` (lowercased NIC ids)."""
    if ip.ip_configuration is None:
        return True
    nic = (ip.ip_configuration.id or "").lower().split("/ipconfigurations/")[0]
    return nic in free_nics


def _nsg_unused(group: Any, free_nics: set[str]) -> bool:
    """An NSG on no subnet, with no NIC but ``free_nics`` (lowercased NIC ids)."""
    nics = group.network_interfaces or []
    return not group.subnets and all(str(n.id).lower() in free_nics for n in nics)
