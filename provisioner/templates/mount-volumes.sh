#!/bin/bash
# provisioner volumes: each network disk mounted at its path before the user's script runs.
# Rendered by provisioner.startup.mount_script (Jinja2); every value is shell-quoted there.
# A disk gets a filesystem only when blkid finds none on it (exit 2): data is never formatted
# over. The fstab line has nofail, so a stop and start mounts it again, and a boot without it
# still boots. A disk formatted here is given to the login user (when it exists yet), so the
# user's own files go on it; a disk with data keeps its owners.
pv_mount() {
  link=$1 dir=$2 owner=$3 fstab=${PV_FSTAB:-/etc/fstab} waited=0 fresh=
  while [ ! -e "$link" ]; do
    if [ "$waited" -ge "${PV_WAIT_SECONDS:-600}" ]; then
      echo "provisioner: $link did not appear in ${waited}s; $dir is not mounted" >&2
      return 1
    fi
    sleep 2
    waited=$((waited + 2))
  done
  dev=$(readlink -f "$link")
  blkid -p "$dev" >/dev/null 2>&1
  found=$?
  if [ "$found" -eq 2 ]; then
    mkfs.ext4 -q "$dev" || { echo "provisioner: mkfs.ext4 $dev failed" >&2; return 1; }
    fresh=1
  elif [ "$found" -ne 0 ]; then
    echo "provisioner: blkid cannot tell what is on $dev (exit $found); not touching it" >&2
    return 1
  fi
  uuid=$(blkid -p -s UUID -o value "$dev")
  source=${uuid:+UUID=$uuid}
  mkdir -p "$dir"
  if ! grep -qs "^[^#]*[[:space:]]$dir[[:space:]]" "$fstab"; then
    echo "${source:-$link} $dir auto defaults,nofail 0 2" >> "$fstab"
  fi
  mountpoint -q "$dir" || mount "$dev" "$dir" || return 1
  if [ -n "$fresh" ] && [ -n "$owner" ] && id -u "$owner" >/dev/null 2>&1; then
    chown "$owner": "$dir"
  fi
}
{% for link, path in mounts -%}
pv_mount {{ link }} {{ path }} {{ owner }} || true
{% endfor -%}
