"""Our SSH security group on EC2: one in each VPC a machine joins, found by name or made
(tagged as ours), its 22/tcp rule kept to ``ssh_cidrs``, deleted once no instance is in it."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from functools import partial
from typing import TYPE_CHECKING, Any

from providers.base import TAG_MANAGED_BY, TAG_MANAGED_BY_VALUE, InvalidRequest

if TYPE_CHECKING:
    from providers.aws.adapter import AWSProvider

SSH_GROUP = "provisioner-ssh"
_IN_USE = ("pending", "running", "stopping", "stopped", "shutting-down")


class SshGroups:
    """The SSH groups of one adapter, and the ones it found or made (by region and subnet)."""

    def __init__(self, cloud: AWSProvider) -> None:
        self.cloud = cloud
        self._lock = threading.Lock()
        self._groups: dict[tuple[str, str], str] = {}  # (region, subnet) → our SSH group

    def forget(self) -> None:
        """Find the groups again (one was removed since)."""
        with self._lock:
            self._groups.clear()

    def unused(self, remove: bool) -> list[str]:
        """Our SSH security groups that no instance (not terminated) is in; deleted when
        ``remove``. A group taken into use meanwhile refuses deletion and is kept."""
        out = []
        for region in self.cloud.regions:
            out += self._unused_in(region, remove)
        if remove:
            self.forget()
        return out

    def _unused_in(self, region: str, remove: bool) -> list[str]:
        ec2 = self.cloud._client("ec2", region)
        ours = [
            {"Name": "group-name", "Values": [SSH_GROUP]},
            {"Name": f"tag:{TAG_MANAGED_BY}", "Values": [TAG_MANAGED_BY_VALUE]},
        ]
        groups = self.cloud.call(
            lambda: ec2.describe_security_groups(Filters=ours)["SecurityGroups"],
            f"list our security groups in {region}",
        )
        out = []
        for group in groups:
            gid = str(group["GroupId"])
            users = [
                {"Name": "instance.group-id", "Values": [gid]},
                {"Name": "instance-state-name", "Values": list(_IN_USE)},
            ]
            found = self.cloud.call(
                partial(ec2.describe_instances, Filters=users), f"find instances in {gid}"
            )
            if any(r.get("Instances") for r in found.get("Reservations", [])):
                continue
            if remove:
                try:
                    self.cloud.call(
                        partial(ec2.delete_security_group, GroupId=gid), f"delete {gid}"
                    )
                except InvalidRequest:  # DependencyViolation: in use after all
                    continue
            out.append(f"security group {gid} ({SSH_GROUP}, {region}, {group.get('VpcId', '')})")
        return out

    def group(self, region: str, subnet: str | None) -> str:
        """Our security group in the VPC the machine joins: found by name, else created with
        22/tcp open to ``ssh_cidrs`` and tagged as ours (a VPC's default group admits only its
        own members: no SSH from outside). Outbound stays open, as a new group's is."""
        with self._lock:
            key = (region, subnet or "")
            if key in self._groups:
                return self._groups[key]
        ec2 = self.cloud._client("ec2", region)
        vpc = self._vpc(ec2, region, subnet)
        filters = [
            {"Name": "group-name", "Values": [SSH_GROUP]},
            {"Name": "vpc-id", "Values": [vpc]},
        ]

        def find() -> str | None:
            groups = ec2.describe_security_groups(Filters=filters)["SecurityGroups"]
            return str(groups[0]["GroupId"]) if groups else None

        found = self.cloud.call(
            lambda: ec2.describe_security_groups(Filters=filters)["SecurityGroups"],
            f"find security group {SSH_GROUP} in {vpc}",
        )
        group = str(found[0]["GroupId"]) if found else None
        if found:
            self._sync_ssh_cidrs(ec2, found[0])
        if group is None:
            tags = tag_list({TAG_MANAGED_BY: TAG_MANAGED_BY_VALUE, "Name": SSH_GROUP})

            def create() -> str:
                # Either call may act and lose its answer, and the retry then meets what it
                # did: the group (InvalidGroup.Duplicate) or the rule (InvalidPermission.
                # Duplicate, "the specified rule already exists" — EC2 API error codes).
                try:
                    made = ec2.create_security_group(
                        GroupName=SSH_GROUP,
                        Description="provisioner: SSH to GPU machines",
                        VpcId=vpc,
                        TagSpecifications=[{"ResourceType": "security-group", "Tags": tags}],
                    )
                    group_id = str(made["GroupId"])
                except Exception as exc:  # made before: by another process, or by us
                    if code(exc) != "InvalidGroup.Duplicate":
                        raise
                    group_id = find() or ""
                try:
                    ec2.authorize_security_group_ingress(
                        GroupId=group_id,
                        IpPermissions=[
                            {
                                "IpProtocol": "tcp",
                                "FromPort": 22,
                                "ToPort": 22,
                                "IpRanges": [
                                    {"CidrIp": c, "Description": "provisioner SSH"}
                                    for c in self.cloud.options.ssh_cidrs
                                ],
                            }
                        ],
                    )
                except Exception as exc:
                    if code(exc) != "InvalidPermission.Duplicate":
                        raise
                return group_id

            group = self.cloud.call(create, f"create security group {SSH_GROUP} in {vpc}")
        with self._lock:
            self._groups[key] = group
        return group

    def _sync_ssh_cidrs(self, ec2: Any, group: Mapping[str, Any]) -> None:
        """``ssh_cidrs`` changed since our group was made: admit the CIDRs now listed, revoke
        the ones no longer listed (22/tcp only). A group of that name not tagged ours is the
        user's, used as it is. Another process doing the same at once is no error."""
        tags = {t.get("Key"): t.get("Value") for t in group.get("Tags") or []}
        if tags.get(TAG_MANAGED_BY) != TAG_MANAGED_BY_VALUE:
            return
        have = _admitted(group)
        want = list(dict.fromkeys(self.cloud.options.ssh_cidrs))
        gid = str(group["GroupId"])
        for verb, cidrs, benign in (
            ("authorize", [c for c in want if c not in have], "InvalidPermission.Duplicate"),
            ("revoke", sorted(have - set(want)), "InvalidPermission.NotFound"),
        ):
            if not cidrs:
                continue
            call = getattr(ec2, f"{verb}_security_group_ingress")
            try:
                self.cloud.call(
                    partial(call, GroupId=gid, IpPermissions=[_ssh_permission(verb, cidrs)]),
                    f"{verb} SSH from {', '.join(cidrs)} in {gid}",
                )
            except InvalidRequest as exc:
                if exc.code != benign:
                    raise

    def _vpc(self, ec2: Any, region: str, subnet: str | None) -> str:
        if subnet:
            found = self.cloud.call(
                lambda: ec2.describe_subnets(SubnetIds=[subnet])["Subnets"], f"find {subnet}"
            )
            return str(found[0]["VpcId"])
        vpcs = self.cloud.call(
            lambda: ec2.describe_vpcs(Filters=[{"Name": "isDefault", "Values": ["true"]}])["Vpcs"],
            f"find the default VPC of {region}",
        )
        if not vpcs:
            raise InvalidRequest(
                f"aws: {region} has no default VPC: set clouds.aws.subnet_id (or subnet_ids), "
                "or create one with `aws ec2 create-default-vpc`",
                code="NoDefaultVpc",
            )
        return str(vpcs[0]["VpcId"])


def _admitted(group: Mapping[str, Any]) -> set[str]:
    """The CIDRs a security group admits to 22/tcp."""
    return {
        r["CidrIp"]
        for p in group.get("IpPermissions") or []
        if (p.get("IpProtocol"), p.get("FromPort"), p.get("ToPort")) == ("tcp", 22, 22)
        for r in p.get("IpRanges") or []
    }


def _ssh_permission(verb: str, cidrs: list[str]) -> dict[str, Any]:
    """22/tcp from ``cidrs``, to authorize (with our description) or revoke."""
    described = {"Description": "provisioner SSH"} if verb == "authorize" else {}
    return {
        "IpProtocol": "tcp",
        "FromPort": 22,
        "ToPort": 22,
        "IpRanges": [{"CidrIp": c, **described} for c in cidrs],
    }


def code(exc: Exception) -> str | None:
    """The AWS error code of a botocore ClientError; None for anything else (a lost answer)."""
    response = getattr(exc, "response", None) or {}
    return response.get("Error", {}).get("Code")


def tag_list(tags: Mapping[str, str]) -> list[dict[str, str]]:
    """EC2's tag list. A key beginning with ``aws:`` (any case) is reserved ("Tag keys
    starting with 'aws:' are reserved for internal use", InvalidParameterValue; EC2 User
    Guide, "Tag restrictions"): a user's label so named is sent as ``aws_…``. Keys ≤ 128 and
    values ≤ 256 characters are the experiment file's own limits (provisioner.spec)."""
    return [{"Key": _unreserved(key), "Value": str(value)} for key, value in tags.items()]


def _unreserved(key: str) -> str:
    return "aws_" + key[4:] if key[:4].lower() == "aws:" else key
