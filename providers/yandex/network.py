"""Where a Yandex VM joins: the folder's subnet in its zone, and, when ``ssh_cidrs`` is not
anywhere, our SSH security group in that subnet's network (labelled ours, 22/tcp from
``ssh_cidrs``, all egress), deleted once no instance's interface is in it. The SDK's protobuf
modules are imported inside the methods."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from providers.base import TAG_MANAGED_BY, TAG_MANAGED_BY_VALUE, InvalidRequest, NotFound

if TYPE_CHECKING:
    from providers.yandex.adapter import YandexProvider

SSH_GROUP = "provisioner-ssh"  # + "-<network id>": our security group in that network
_ANYWHERE = ["0.0.0.0/0"]
_OURS = (TAG_MANAGED_BY, TAG_MANAGED_BY_VALUE)  # the label on what we create (already folded)


class Network:
    """The subnets, networks and SSH groups one adapter found or made."""

    def __init__(self, cloud: YandexProvider) -> None:
        self.cloud = cloud
        self._subnets: dict[str, str] = dict(cloud.options.subnet_ids)  # zone -> subnet id
        self._networks: dict[str, str] = {}  # subnet id -> its network id
        self._groups: dict[str, str] = {}  # network id -> our SSH security group's id

    def unused(self, remove: bool) -> list[str]:
        """Our SSH security groups (labelled ours) that no instance's interface is in; deleted
        when ``remove``. Addresses are the instances' own (released with them) and boot disks
        go with their instance: nothing else of ours outlives a machine."""
        if not self.cloud.folder_id:
            return []
        folder_id = self.cloud.folder_id
        groups = [
            g for g in self._security_groups_raw(folder_id) if g.labels.get(_OURS[0]) == _OURS[1]
        ]
        if not groups:
            return []
        used = self._groups_in_use(folder_id)
        out = []
        for group in groups:
            if group.id in used:
                continue
            if remove:
                try:
                    self._delete_group(group.id)
                except InvalidRequest:  # taken into use meanwhile
                    continue
            out.append(f"security group {group.id} ({group.name}, network {group.network_id})")
        if remove:
            self._groups.clear()
        return out

    def _groups_in_use(self, folder_id: str) -> set[str]:
        """The security groups an instance's interface in the folder is in."""
        return {
            group_id
            for inst in self.cloud._instances_raw(folder_id)
            for nic in inst.network_interfaces
            for group_id in nic.security_group_ids
        }

    def subnet_id(self, folder_id: str, zone: str) -> str:
        """Option ``subnet_ids[zone]``, else the folder's one subnet in that zone (of option
        ``network_id`` when several networks have one)."""
        from yandex.cloud.vpc.v1.subnet_service_pb2 import ListSubnetsRequest
        from yandex.cloud.vpc.v1.subnet_service_pb2_grpc import SubnetServiceStub

        if zone not in self._subnets:
            network = self.cloud.options.network_id
            subnets = [
                s
                for s in self.cloud._pages(
                    lambda token: self.cloud._rpc(
                        SubnetServiceStub,
                        "List",
                        ListSubnetsRequest(folder_id=folder_id, page_size=1000, page_token=token),
                        f"list subnets in folder {folder_id}",
                    ),
                    "subnets",
                )
                if s.zone_id == zone and (not network or s.network_id == network)
            ]
            if len(subnets) != 1:
                found = ", ".join(s.id for s in subnets) or "none"
                raise InvalidRequest(
                    f"yandex: need exactly one subnet in {zone} (found: {found}); set "
                    f"subnet_ids: {{{zone}: <id>}} or network_id in settings",
                    code="NO_SUBNET",
                )
            self._subnets[zone] = subnets[0].id
            self._networks[subnets[0].id] = subnets[0].network_id
        return self._subnets[zone]

    def _network_of(self, subnet_id: str) -> str:
        """The network a subnet belongs to (known from the listing, else SubnetService.Get)."""
        from yandex.cloud.vpc.v1.subnet_service_pb2 import GetSubnetRequest
        from yandex.cloud.vpc.v1.subnet_service_pb2_grpc import SubnetServiceStub

        if subnet_id not in self._networks:
            subnet = self.cloud._rpc(
                SubnetServiceStub,
                "Get",
                GetSubnetRequest(subnet_id=subnet_id),
                f"get subnet {subnet_id}",
            )
            self._networks[subnet_id] = subnet.network_id
        return self._networks[subnet_id]

    def security_groups(self, folder_id: str, subnet_id: str) -> list[str]:
        """The interface's security groups. None while ``ssh_cidrs`` is anywhere: every VM
        without a group gets the network's default group, which Yandex creates admitting
        22/tcp from 0.0.0.0/0 and all egress (yandex-cloud/docs en/vpc/concepts/
        security-groups.md, "Default security group rules"). Otherwise our group in the
        subnet's network: found by name, else created; its SSH rule follows ``ssh_cidrs``."""
        cidrs = list(dict.fromkeys(self.cloud.options.ssh_cidrs))
        if cidrs == _ANYWHERE:
            return []
        network = self._network_of(subnet_id)
        if network not in self._groups:
            self._groups[network] = self._ssh_group(folder_id, network, cidrs)
        return [self._groups[network]]

    def _ssh_group(self, folder_id: str, network: str, cidrs: list[str]) -> str:
        from yandex.cloud.vpc.v1 import security_group_pb2 as sg
        from yandex.cloud.vpc.v1 import security_group_service_pb2 as svc
        from yandex.cloud.vpc.v1.security_group_service_pb2_grpc import SecurityGroupServiceStub

        name = f"{SSH_GROUP}-{network}"
        ssh = svc.SecurityGroupRuleSpec(
            description="provisioner: SSH to GPU machines",
            direction=sg.SecurityGroupRule.INGRESS,
            ports=sg.PortRange(from_port=22, to_port=22),
            protocol_name="TCP",
            cidr_blocks=sg.CidrBlocks(v4_cidr_blocks=cidrs),
        )
        found = [
            g
            for g in self._security_groups_raw(folder_id)
            if g.name == name and g.network_id == network
        ]
        if found:
            group = found[0]
            if group.labels.get(_OURS[0]) != _OURS[1]:
                return str(group.id)  # the user's group of that name: used as it is
            self._follow(group, cidrs, ssh)
            return str(group.id)
        # Egress to anywhere: a group admits only what its rules allow, and the agent must
        # reach its server.
        egress = svc.SecurityGroupRuleSpec(
            description="provisioner: outbound",
            direction=sg.SecurityGroupRule.EGRESS,
            protocol_name="ANY",
            cidr_blocks=sg.CidrBlocks(v4_cidr_blocks=_ANYWHERE),
        )
        what = f"create security group {name}"
        operation = self.cloud._rpc(
            SecurityGroupServiceStub,
            "Create",
            svc.CreateSecurityGroupRequest(
                folder_id=folder_id,
                name=name,
                description="provisioner: SSH to GPU machines",
                labels=dict([_OURS]),
                network_id=network,
                rule_specs=[ssh, egress],
            ),
            what,
            # one key for this call's retries; not derived from the name: Yandex answers a reused
            # key with its first operation, which after a gc is a deleted group
            metadata=[("idempotency-key", str(uuid.uuid4()))],
        )
        created = sg.SecurityGroup()
        self.cloud._wait(operation, what).response.Unpack(created)
        return str(created.id)

    def _follow(self, group: Any, cidrs: list[str], ssh: Any) -> None:
        """Our group's SSH rule made to admit ``cidrs`` (the rule spec ``ssh``) if it does not."""
        from yandex.cloud.vpc.v1 import security_group_pb2 as sg
        from yandex.cloud.vpc.v1 import security_group_service_pb2 as svc
        from yandex.cloud.vpc.v1.security_group_service_pb2_grpc import SecurityGroupServiceStub

        rules = [
            r
            for r in group.rules
            if r.direction == sg.SecurityGroupRule.INGRESS
            and r.protocol_name == "TCP"
            and (r.ports.from_port, r.ports.to_port) == (22, 22)
        ]
        have = {c for r in rules for c in r.cidr_blocks.v4_cidr_blocks}
        if have != set(cidrs):  # ssh_cidrs changed since: one call swaps the rule
            what = f"update SSH rule of security group {group.id}"
            operation = self.cloud._rpc(
                SecurityGroupServiceStub,
                "UpdateRules",
                svc.UpdateSecurityGroupRulesRequest(
                    security_group_id=group.id,
                    deletion_rule_ids=[r.id for r in rules],
                    addition_rule_specs=[ssh],
                ),
                what,
                metadata=[("idempotency-key", str(uuid.uuid4()))],
            )
            self.cloud._wait(operation, what)

    def _security_groups_raw(self, folder_id: str) -> Iterator[Any]:
        from yandex.cloud.vpc.v1.security_group_service_pb2 import ListSecurityGroupsRequest
        from yandex.cloud.vpc.v1.security_group_service_pb2_grpc import SecurityGroupServiceStub

        return self.cloud._pages(
            lambda token: self.cloud._rpc(
                SecurityGroupServiceStub,
                "List",
                ListSecurityGroupsRequest(folder_id=folder_id, page_size=1000, page_token=token),
                f"list security groups in folder {folder_id}",
            ),
            "security_groups",
        )

    def _delete_group(self, group_id: str) -> None:
        from yandex.cloud.vpc.v1.security_group_service_pb2 import DeleteSecurityGroupRequest
        from yandex.cloud.vpc.v1.security_group_service_pb2_grpc import SecurityGroupServiceStub

        what = f"delete security group {group_id}"
        try:
            operation = self.cloud._rpc(
                SecurityGroupServiceStub,
                "Delete",
                DeleteSecurityGroupRequest(security_group_id=group_id),
                what,
                metadata=[("idempotency-key", str(uuid.uuid4()))],
            )
            self.cloud._wait(operation, what)
        except NotFound:
            return
