"""Our SSH security group on Huawei ECS: one per project, found by name and tag or made once,
its inbound rules made exactly 22/tcp from ``ssh_cidrs``, deleted once no server is in it.
huaweicloudsdkvpc is imported inside the methods."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from providers.base import TAG_MANAGED_BY, TAG_MANAGED_BY_VALUE, InvalidRequest, NotFound, paginate

if TYPE_CHECKING:
    from providers.sbercloud.adapter import SberCloudProvider

# Our SSH security group, as on AWS: one per project (a Huawei security group is not bound to a
# VPC: "vpc_id ... does not restrict that the security group must be associated with the VPC",
# VPC API "Creating a Security Group"), tagged managed-by=provisioner.
SSH_GROUP = "provisioner-ssh"
SSH_GROUP_IN_USE = "VPC.0602"  # "Security Group <id> in use." (409), deleting a group in use
GONE = ("DELETED", "SOFT_DELETED")  # server statuses of a server that is no more


class SshGroup:
    """The SSH group of one adapter, once found or made and checked."""

    def __init__(self, cloud: SberCloudProvider) -> None:
        self.cloud = cloud
        self._id: str | None = None

    def group(self) -> str:
        """Without ``security_group_id`` a server would join the project's "default" group,
        whose rules admit no inbound traffic from outside it (huaweicloudsdkecs
        PrePaidServer.security_groups; Huawei ECS user guide, "Default Security Group and
        Rules"): SSH would stay closed. So servers join our group instead, found by name and
        tag or created once (and tagged), its inbound rules made exactly 22/tcp from
        ``ssh_cidrs``: a new group's own rules (it may open 22 and 3389 to any address: VPC API
        "Creating a Security Group") and rules for CIDRs no longer in the settings are deleted.
        Outbound rules are left as made (all allowed), so the agent can report."""
        if self._id is None:
            group = self._find_group()
            if group is None:
                group = self._create_group()
            self._fit_rules(group)
            self._id = group.id
        return self._id

    def _our_groups(self) -> list[Any]:
        from huaweicloudsdkvpc.v2 import model as v

        def page(marker: str | None) -> tuple[list[Any], str | None]:
            listed = self.cloud._call(
                "list security groups",
                lambda c: c.list_security_groups(
                    v.ListSecurityGroupsRequest(limit=100, marker=marker)
                ),
                service="vpc",
            )
            batch = listed.security_groups or []
            return batch, batch[-1].id if len(batch) >= 100 else None

        groups = [g for g in paginate(page) if g.name == SSH_GROUP]
        return [g for g in groups if self._tagged_ours(g.id)]

    def _tagged_ours(self, group_id: str) -> bool:
        from huaweicloudsdkvpc.v2 import model as v

        tags = self.cloud._call(
            f"read the tags of security group {group_id}",
            lambda c: c.show_security_group_tags(
                v.ShowSecurityGroupTagsRequest(security_group_id=group_id)
            ),
            service="vpc",
        ).tags
        return any(t.key == TAG_MANAGED_BY and t.value == TAG_MANAGED_BY_VALUE for t in tags or [])

    def _find_group(self) -> Any | None:
        groups = sorted(self._our_groups(), key=lambda g: g.id)
        return groups[0] if groups else None

    def _create_group(self) -> Any:
        from huaweicloudsdkvpc.v2 import model as v

        option = v.CreateSecurityGroupOption(name=SSH_GROUP, vpc_id=self.cloud.options.vpc_id)
        created = self.cloud._call(
            f"create security group {SSH_GROUP}",
            lambda c: c.create_security_group(
                v.CreateSecurityGroupRequest(
                    body=v.CreateSecurityGroupRequestBody(security_group=option)
                )
            ),
            service="vpc",
        ).security_group
        tag = v.ResourceTag(key=TAG_MANAGED_BY, value=TAG_MANAGED_BY_VALUE)
        self.cloud._call(
            f"tag security group {created.id}",
            lambda c: c.create_security_group_tag(
                v.CreateSecurityGroupTagRequest(
                    security_group_id=created.id,
                    body=v.CreateSecurityGroupTagRequestBody(tag=tag),
                )
            ),
            service="vpc",
        )
        return created

    def _fit_rules(self, group: Any) -> None:
        from huaweicloudsdkvpc.v2 import model as v

        wanted = set(self.cloud.options.ssh_cidrs)
        rules = self.cloud._call(
            f"list the rules of security group {group.id}",
            lambda c: c.list_security_group_rules(
                v.ListSecurityGroupRulesRequest(security_group_id=group.id, limit=1000)
            ),
            service="vpc",
        ).security_group_rules
        have = set()
        for rule in rules or []:
            if rule.direction != "ingress" or rule.remote_group_id:
                continue  # outbound rules, and members reaching each other, stay
            ssh = (rule.protocol, rule.port_range_min, rule.port_range_max) == ("tcp", 22, 22)
            if ssh and rule.remote_ip_prefix in wanted:
                have.add(rule.remote_ip_prefix)
                continue

            def delete(c: Any, rule_id: str = rule.id) -> Any:
                return c.delete_security_group_rule(
                    v.DeleteSecurityGroupRuleRequest(security_group_rule_id=rule_id)
                )

            self.cloud._call(f"delete rule {rule.id} of group {group.id}", delete, service="vpc")
        for cidr in sorted(wanted - have):
            option = v.CreateSecurityGroupRuleOption(
                security_group_id=group.id,
                description="provisioner: SSH to GPU machines",
                direction="ingress",
                ethertype="IPv6" if ":" in cidr else "IPv4",
                protocol="tcp",
                port_range_min=22,
                port_range_max=22,
                remote_ip_prefix=cidr,
            )

            def create(c: Any, rule: Any = option) -> Any:
                return c.create_security_group_rule(
                    v.CreateSecurityGroupRuleRequest(
                        body=v.CreateSecurityGroupRuleRequestBody(security_group_rule=rule)
                    )
                )

            self.cloud._call(f"open 22/tcp from {cidr} in group {group.id}", create, service="vpc")

    def _in_use(self) -> set[str]:
        """The ids of the security groups a live server of the project is in."""
        return {
            g.id
            for server in self.cloud._servers()
            if (server.status or "").upper() not in GONE
            for g in server.security_groups or []
        }

    def _delete(self, group_id: str) -> bool:
        """Delete one of our groups: False when it refuses as in use (409 VPC.0602), kept."""
        from huaweicloudsdkvpc.v2 import model as v

        def delete(c: Any) -> Any:
            return c.delete_security_group(v.DeleteSecurityGroupRequest(security_group_id=group_id))

        try:
            self.cloud._call(f"delete security group {group_id}", delete, service="vpc")
        except InvalidRequest as e:
            if e.code != SSH_GROUP_IN_USE:
                raise
            return False
        except NotFound:
            pass
        return True

    def unused(self, remove: bool) -> list[str]:
        """Our SSH security groups no server is in (any server of the project, ours or not);
        deleted when ``remove``. A group taken into use meanwhile refuses deletion (409
        VPC.0602) and is kept. Our EIPs need no collecting: each is made with its server and
        released with it (``delete_on_termination``)."""
        groups = self._our_groups()
        if not groups:
            return []
        in_use = self._in_use()
        out = []
        for group in groups:
            if group.id in in_use or (remove and not self._delete(group.id)):
                continue
            out.append(f"security group {group.id} ({SSH_GROUP}, {self.cloud.region})")
        if remove:
            self._id = None
        return out
