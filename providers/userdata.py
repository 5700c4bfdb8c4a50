"""User data for cloud-init: the startup script and the SSH key in the one document every cloud
image with cloud-init runs (AWS UserData, Azure custom data, Yandex ``user-data`` metadata,
Huawei ``user_data``). GCP runs its own ``startup-script`` and ``ssh-keys`` metadata instead.

Input may be a shell script, a ``#cloud-config`` document, or a MIME multipart of them (the
scheduler's agent install joined with the user's script); the output keeps each part's kind.
"""

from __future__ import annotations

import base64
import email
import gzip
import hashlib
import json
from email.mime.multipart import MIMEMultipart
from email.mime.text import MIMEText

SCRIPT_PATH = "/var/lib/provisioner/startup.sh"


def cloud_init(
    script: str | None,
    ssh_public_key: str | None,
    *,
    user: str | None = None,
    inline: bool = False,
) -> str | None:
    """One cloud-init document that authorises the key (for ``user``, created with sudo, or for
    the image's default user) and runs the script once at first boot. ``inline``: the script
    is a part of its own, as text, beside the ``#cloud-config`` (a MIME multipart: for a
    document that is then gzip-compressed whole); else it is a file the config writes (gzip,
    then base64) and runs, in one ``#cloud-config`` (for a text-only field)."""
    if not ssh_public_key:
        return script or None
    key = ssh_public_key.strip()
    config: dict = (
        {
            "users": [
                "default",
                {
                    "name": user,
                    "sudo": "ALL=(ALL) NOPASSWD:ALL",
                    "shell": "/bin/bash",
                    "ssh_authorized_keys": [key],
                },
            ]
        }
        if user
        else {"ssh_authorized_keys": [key]}
    )
    if script and _kind(script) == "x-shellscript" and not inline:
        config["write_files"] = [
            {
                "path": SCRIPT_PATH,
                "permissions": "0755",
                # gzip, then base64 (cloud-init docs, module "Write Files": encoding
                # "gz+b64"): the script costs a third of its size, not a third more
                "encoding": "gz+b64",
                "content": base64.b64encode(gzipped(_shebang(script))).decode(),
            }
        ]
        config["runcmd"] = [[SCRIPT_PATH]]
        script = None
    return combine(_config(config), script)


def gzipped(text: str) -> bytes:
    """``text`` gzip-compressed, the same bytes for the same text (no timestamp in the header),
    so a retried launch sends exactly what the first one sent."""
    return gzip.compress(text.encode(), compresslevel=9, mtime=0)


def decoded(data: bytes | str) -> str:
    """What the machine reads back: gzip content uncompressed, as cloud-init does first
    (cloud-init docs, "User data formats": "Gzip compressed content")."""
    raw = data.encode() if isinstance(data, str) else data
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    return raw.decode()


def parts(doc: str) -> list[tuple[str, str]]:
    """Each part of a cloud-init document, in order: (kind, text), kind one of
    ``cloud-config``, ``x-shellscript``… (a lone document is one part)."""
    return _parts(doc)


def file_content(entry: dict) -> str:
    """The text of one ``write_files`` entry, as cloud-init writes it (b64 or gz+b64)."""
    content = entry["content"]
    if entry.get("encoding") in ("b64", "base64", "gz+b64", "gzip+base64", "gz+base64"):
        return decoded(base64.b64decode(content))
    return decoded(content.encode())


def combine(*documents: str | None) -> str | None:
    """Join documents into one MIME multipart that cloud-init runs part by part, in order.
    A single document is returned as it is."""
    docs = [d for d in documents if d]
    if len(docs) <= 1:
        return docs[0] if docs else None
    # the boundary from the content: the same documents make the same bytes (a retried launch
    # sends what the first sent; a measure before the launch is the launch's size)
    digest = hashlib.sha256("\0".join(docs).encode()).hexdigest()[:32]
    message = MIMEMultipart(boundary=f"==provisioner-{digest}==")
    for doc in docs:
        for subtype, content in _parts(doc):
            charset = "us-ascii" if content.isascii() else "utf-8"  # readable unless it must not be
            message.attach(MIMEText(content, subtype, charset))
    return message.as_string()


def _parts(doc: str) -> list[tuple[str, str]]:
    if _kind(doc) == "multipart":
        out = []
        for part in email.message_from_string(doc).walk():
            if not part.is_multipart():
                payload = part.get_payload(decode=True)
                # decode=True on a non-multipart part: the bytes, or None when there are none
                text = (
                    payload.decode(part.get_content_charset() or "utf-8")
                    if isinstance(payload, bytes) and payload
                    else ""
                )
                out.append((part.get_content_subtype(), text))
        return out
    kind = _kind(doc)
    return [(kind, _shebang(doc) if kind == "x-shellscript" else doc)]


def _kind(doc: str) -> str:
    if doc.startswith(("Content-Type: multipart/", "MIME-Version:")):
        return "multipart"
    return "cloud-config" if doc.lstrip().startswith("#cloud-config") else "x-shellscript"


def _shebang(script: str) -> str:
    return script if script.startswith("#!") else "#!/bin/sh\n" + script


def _config(config: dict) -> str:
    return "#cloud-config\n" + json.dumps(config, indent=1)  # JSON is YAML
