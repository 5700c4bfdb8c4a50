#!/bin/sh
# provisioner-job v2: the supervisor of provisioner's jobs on a cloud machine.
# Installed by the startup data (/usr/local/bin) or pushed over SSH (~/.provisioner/bin).
# Each job lives in ~/.provisioner/jobs/<id>/: cmd, env, setup (written by provisioner), out
# (stdout and stderr), pid, boot (the boot it ran in), exit (written when the job ends), stage
# ("setup" when its setup failed: the run never started).
# A job is its own session (setsid nohup): it outlives the SSH connection that started it.
# PV_HOME replaces the login home (where the jobs and the workdir are).
set -u
top="${PV_HOME:-$HOME}"
d="$top/.provisioner/jobs/${2:-none}"
boot_id() { cat /proc/sys/kernel/random/boot_id 2>/dev/null || echo unknown; }
alive() { kill -0 "$1" 2>/dev/null && ! grep -qs '^State:.*Z' "/proc/$1/status"; }  # no zombie
# No job runs before its volumes are mounted (PV_VOLUMES from the job's env, $PV_STATE/volumes
# from the mount script): wait, then refuse with the reason, exit 97 (machines/jobs.py).
pv_volumes() {
  s="${PV_STATE:-/var/lib/provisioner}" waited=0
  while :; do
    want=$(printf '%s\n' "${PV_VOLUMES:-}"; cat "$s/volumes" 2>/dev/null)
    missing=
    while IFS= read -r dir; do
      if [ -n "$dir" ] && ! mountpoint -q "$dir"; then missing="$missing $dir"; fi
    done <<PV_END
$want
PV_END
    [ -z "$missing" ] && return 0
    if [ -f "$s/volumes.failed" ] && [ ! -e "$s/volumes.pending" ]; then break; fi
    [ "$waited" -ge "${PV_VOLUME_WAIT:-900}" ] && break
    sleep 2
    waited=$((waited + 2))
  done
  echo "provisioner: the job did not run: no volume is mounted at$missing"
  if [ -f "$s/volumes.failed" ]; then sed 's/^/provisioner: /' "$s/volumes.failed"; fi
  if [ -e "$s/volumes.pending" ]; then echo "provisioner: still mounting after ${waited}s"
  elif [ ! -f "$s/volumes" ]; then echo "provisioner: the startup data mounted nothing in ${waited}s"
  fi
  echo "provisioner: the mount script's log is in /var/log/cloud-init-output.log"
  return 1
}
case "${1:-}" in
start)  # start ID: cmd (and env, setup) are in place; run it detached in the workdir
  rm -f "$d/exit" "$d/exit.tmp"
  boot_id > "$d/boot"
  mkdir -p "$top/workdir"
  cd "$top/workdir" || exit 1
  setsid nohup sh "$0" run "$2" > "$d/out" 2>&1 < /dev/null &
  echo $! > "$d/pid"
  ;;
run)  # the job itself: env exported, setup once per machine, then cmd; its exit code kept
  if [ -f "$d/env" ]; then . "$d/env"; fi
  if ! pv_volumes; then echo 97 > "$d/exit.tmp" && mv "$d/exit.tmp" "$d/exit"; exit 0; fi
  if [ -f "$d/setup" ] && [ ! -e "$top/.provisioner/setup.done" ]; then
    sh "$d/setup"
    code=$?
    if [ "$code" -ne 0 ]; then
      echo setup > "$d/stage"; echo "$code" > "$d/exit.tmp" && mv "$d/exit.tmp" "$d/exit"; exit 0
    fi
    touch "$top/.provisioner/setup.done"
  fi
  sh "$d/cmd"
  echo $? > "$d/exit.tmp" && mv "$d/exit.tmp" "$d/exit"
  ;;
state)  # state ID: "exit CODE", "running", "lost" (ended without a code: the machine stopped)
  if [ ! -f "$d/pid" ]; then echo none
  elif [ -f "$d/exit" ]; then echo "exit $(cat "$d/exit") $(cat "$d/stage" 2>/dev/null || echo run)"
  elif [ "$(boot_id)" = "$(cat "$d/boot" 2>/dev/null)" ] && alive "$(cat "$d/pid")"; then echo running
  else echo lost
  fi
  ;;
cancel)  # cancel ID GRACE: TERM to the job's process group (its session), KILL after GRACE s
  if [ ! -f "$d/pid" ]; then echo "no job ${2:-}" >&2; exit 3; fi
  pid=$(cat "$d/pid") waited=0
  [ "$(boot_id)" = "$(cat "$d/boot" 2>/dev/null)" ] || exit 0  # ended with an earlier boot
  kill -TERM -- "-$pid" 2>/dev/null
  while kill -0 -- "-$pid" 2>/dev/null && [ "$waited" -lt "${3:-10}" ]; do
    sleep 1; waited=$((waited + 1))
  done
  kill -KILL -- "-$pid" 2>/dev/null
  exit 0
  ;;
output)  # output ID OFFSET: the job's output from byte OFFSET
  if [ ! -f "$d/out" ]; then echo "no job ${2:-}" >&2; exit 3; fi
  tail -c +"$(( ${3:-0} + 1 ))" "$d/out"
  ;;
*)
  echo "usage: provisioner-job start|run|state|output|cancel ID [OFFSET|GRACE]" >&2
  exit 2
  ;;
esac
