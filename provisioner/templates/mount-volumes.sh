#!/bin/bash
{#- provisioner volumes: each network disk mounted at its path before the user's script runs.
Rendered by provisioner.startup.mount_script (Jinja2); every value is shell-quoted there.
A disk gets a filesystem only when blkid finds none on it (exit 2): data is never formatted
over. The fstab line has nofail, so a stop and start mounts it again, and a boot without it
still boots. A disk formatted here is given to the login user (when it exists yet), so the
user's own files go on it; a disk with data keeps its owners.
Never silent: $PV_STATE/volumes lists the paths, volumes.pending exists while mounting,
volumes.failed says what failed; provisioner-job runs no job until they are mounted.
Template comments, not shell ones: the machine is not sent them (docs/LIMITS.md). #}
PV_STATE=${PV_STATE:-/var/lib/provisioner}
mkdir -p "$PV_STATE"
: > "$PV_STATE/volumes.pending"
rm -f "$PV_STATE/volumes.failed"
pv_failed() {
  echo "provisioner: volume at $1 is not mounted: $2" >&2
  echo "$1: $2" >> "$PV_STATE/volumes.failed"
  chmod 0644 "$PV_STATE/volumes.failed"
  return 1
}
pv_mount() {
  link=$1 dir=$2 owner=$3 fstab=${PV_FSTAB:-/etc/fstab} waited=0 fresh=
  while [ ! -e "$link" ]; do
    if [ "$waited" -ge "${PV_WAIT_SECONDS:-600}" ]; then
      pv_failed "$dir" "its disk $link did not appear in ${waited}s"
      return 1
    fi
    sleep 2
    waited=$((waited + 2))
  done
  dev=$(readlink -f "$link")
  blkid -p "$dev" >/dev/null 2>&1
  found=$?
  if [ "$found" -eq 2 ]; then
    mkfs.ext4 -q "$dev" || { pv_failed "$dir" "mkfs.ext4 $dev failed"; return 1; }
    fresh=1
  elif [ "$found" -ne 0 ]; then
    pv_failed "$dir" "blkid cannot tell what is on $dev (exit $found); not touching it"
    return 1
  fi
  uuid=$(blkid -p -s UUID -o value "$dev")
  source=${uuid:+UUID=$uuid}
  mkdir -p "$dir"
  if ! grep -qs "^[^#]*[[:space:]]$dir[[:space:]]" "$fstab"; then
    echo "${source:-$link} $dir auto defaults,nofail 0 2" >> "$fstab"
  fi
  mountpoint -q "$dir" || mount "$dev" "$dir" || { pv_failed "$dir" "mount $dev failed"; return 1; }
  if [ -n "$fresh" ] && [ -n "$owner" ] && id -u "$owner" >/dev/null 2>&1; then
    chown "$owner": "$dir"
  fi
}
printf '%s\n'{% for link, path in mounts %} {{ path }}{% endfor %} > "$PV_STATE/volumes.tmp"
chmod 0644 "$PV_STATE/volumes.tmp" && mv "$PV_STATE/volumes.tmp" "$PV_STATE/volumes"
{% for link, path in mounts -%}
pv_mount {{ link }} {{ path }} {{ owner }} || true
{% endfor -%}
rm -f "$PV_STATE/volumes.pending"

