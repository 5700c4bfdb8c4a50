#!/bin/sh
# provisioner-job v1: the supervisor of provisioner's jobs on a cloud machine.
# Installed by the startup data (/usr/local/bin) or pushed over SSH (~/.provisioner/bin).
# Each job lives in ~/.provisioner/jobs/<id>/: cmd, env, setup (written by provisioner), out
# (stdout and stderr), pid, boot (the boot it ran in), exit (written when the job ends).
# A job is its own session (setsid nohup): it outlives the SSH connection that started it.
# PV_HOME replaces the login home (where the jobs and the workdir are).
set -u
top="${PV_HOME:-$HOME}"
d="$top/.provisioner/jobs/${2:-none}"
boot_id() { cat /proc/sys/kernel/random/boot_id 2>/dev/null || echo unknown; }
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
  if [ -f "$d/setup" ] && [ ! -e "$top/.provisioner/setup.done" ]; then
    sh "$d/setup"
    code=$?
    if [ "$code" -ne 0 ]; then echo "$code" > "$d/exit.tmp" && mv "$d/exit.tmp" "$d/exit"; exit 0; fi
    touch "$top/.provisioner/setup.done"
  fi
  sh "$d/cmd"
  echo $? > "$d/exit.tmp" && mv "$d/exit.tmp" "$d/exit"
  ;;
state)  # state ID: "exit CODE", "running", "lost" (ended without a code: the machine stopped)
  if [ ! -f "$d/pid" ]; then echo none
  elif [ -f "$d/exit" ]; then echo "exit $(cat "$d/exit")"
  elif [ "$(boot_id)" = "$(cat "$d/boot" 2>/dev/null)" ] && kill -0 "$(cat "$d/pid")" 2>/dev/null; then echo running
  else echo lost
  fi
  ;;
output)  # output ID OFFSET: the job's output from byte OFFSET
  if [ ! -f "$d/out" ]; then echo "no job ${2:-}" >&2; exit 3; fi
  tail -c +"$(( ${3:-0} + 1 ))" "$d/out"
  ;;
*)
  echo "usage: provisioner-job start|run|state|output ID [OFFSET]" >&2
  exit 2
  ;;
esac
