#!/bin/bash
{#- provisioner agent: the machine's own guard (autostop, on_finish, max_lifetime), its record,
and GPU heartbeats when the scheduler has an endpoint. Rendered by provisioner.startup
(Jinja2); every value is shell-quoted there. It runs as root: it powers the machine off and
reads the login user's jobs. Secrets (the heartbeat token) stay in agent_dir (0700); its state
dir holds none (0755, files 0644). Template comments, not shell ones: the machine is not sent
them (the startup data has EC2's 16 KB to fit in, docs/LIMITS.md). #}
(
umask 022
mkdir -p {{ lib }} {{ state_dir }} "$(dirname {{ bin }})"
{% for name, text in sources.items() -%}
cat > {{ lib }}/{{ name }} <<'PV_AGENT_EOF'
{{ text }}PV_AGENT_EOF
{% endfor -%}
chmod 0755 {{ lib }}/agent.py && chmod 0644 {{ lib }}/agent_guard.py
ln -sf {{ lib }}/agent.py {{ bin }}
chmod 0755 {{ state_dir }}
{% if guard -%}
cat > {{ state_dir }}/guard.json <<'PV_GUARD_EOF'
{{ guard }}
PV_GUARD_EOF
chmod 0644 {{ state_dir }}/guard.json
{% endif -%}
{% if token or on_notice -%}
(umask 077 && mkdir -p {{ agent_dir }})
chmod 0700 {{ agent_dir }}
{% endif -%}
{% if token -%}
(umask 077 && cat > {{ agent_dir }}/agent-token <<'PV_TOKEN_EOF'
{{ token }}
PV_TOKEN_EOF
)
chmod 0600 {{ agent_dir }}/agent-token
{% endif -%}
{% if on_notice -%}
cat > {{ agent_dir }}/on-notice.json <<'PV_NOTICE_EOF'
{{ on_notice }}
PV_NOTICE_EOF
{% endif -%}
{% if pull -%}
{#- the team's pull key: it may run `provisioner-agent --report` and nothing else #}
pv_pull_key() {
  for _ in $(seq 90); do id -u {{ user }} >/dev/null 2>&1 && break; sleep 2; done
  h=$(getent passwd {{ user }} | cut -d: -f6)
  [ -n "$h" ] || return 0
  mkdir -p "$h/.ssh" && touch "$h/.ssh/authorized_keys"
  grep -qxF {{ pull }} "$h/.ssh/authorized_keys" || echo {{ pull }} >> "$h/.ssh/authorized_keys"
  chown {{ user }}: "$h/.ssh" "$h/.ssh/authorized_keys"
  chmod 0700 "$h/.ssh" && chmod 0600 "$h/.ssh/authorized_keys"
}
pv_pull_key &
{% endif -%}
if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
  cat > /etc/systemd/system/provisioner-agent.service <<'PV_UNIT_EOF'
[Unit]
Description=provisioner agent: the machine's guard, its record, heartbeats, preemption notices
After=network-online.target
[Service]
ExecStart={{ cmd }}
Restart=always
RestartSec=30
Nice=10
NoNewPrivileges=yes
[Install]
WantedBy=multi-user.target
PV_UNIT_EOF
  chmod 0644 /etc/systemd/system/provisioner-agent.service
  systemctl daemon-reload && systemctl enable --now provisioner-agent.service
else {#- no systemd running (a container, an image without it): started here, once #}
  nohup {{ cmd }} >/var/log/provisioner-agent.log 2>&1 &
fi
{#- NVML for the GPU readings, after the guard is up: a machine without PyPI access must not
    hold its guard back, nor the startup script; the agent imports it on the first tick it is there #}
python3 -c 'import pynvml' 2>/dev/null || timeout 600 pip3 install -q nvidia-ml-py &
) >/var/log/provisioner-agent-install.log 2>&1 || true
