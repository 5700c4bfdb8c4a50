#!/bin/bash
# provisioner agent: GPU utilisation heartbeats for the idle scheduler.
# Rendered by provisioner.idle.startup_data (Jinja2); every value is shell-quoted there.
# The token is readable by the agent's own system user only (0600 in a 0700 directory); the
# agent signs heartbeats with it and never sends it. With a preemption-notice action the agent
# runs as root: it signals the job's processes, which the user's script (root) started.
(
umask 077
id -u {{ user }} >/dev/null 2>&1 || useradd --system --no-create-home --shell /usr/sbin/nologin {{ user }} || true
mkdir -p {{ agent_dir }}
cat > {{ agent_dir }}/agent-token <<'PV_TOKEN_EOF'
{{ token }}
PV_TOKEN_EOF
cat > {{ agent_dir }}/agent.py <<'PV_AGENT_EOF'
{{ agent_py }}PV_AGENT_EOF
{% if on_notice -%}
cat > {{ agent_dir }}/on-notice.json <<'PV_NOTICE_EOF'
{{ on_notice }}
PV_NOTICE_EOF
{% endif -%}
chmod 0700 {{ agent_dir }}
chmod 0600 {{ agent_dir }}/agent-token
chmod 0644 {{ agent_dir }}/agent.py
run_as=root
if {% if on_notice %}false{% else %}id -u {{ user }} >/dev/null 2>&1{% endif %}; then
  chown -R {{ user }}: {{ agent_dir }} && run_as={{ user }}
fi
python3 -c 'import pynvml' 2>/dev/null || pip3 install -q nvidia-ml-py || true
if command -v systemctl >/dev/null 2>&1; then
  cat > /etc/systemd/system/provisioner-agent.service <<'PV_UNIT_EOF'
[Unit]
Description=provisioner GPU heartbeat and preemption notice agent
After=network-online.target
[Service]
User=root
ExecStart={{ cmd }}
Restart=always
RestartSec=30
Nice=10
NoNewPrivileges=yes
[Install]
WantedBy=multi-user.target
PV_UNIT_EOF
  sed -i "s/^User=root$/User=$run_as/" /etc/systemd/system/provisioner-agent.service
  chmod 0644 /etc/systemd/system/provisioner-agent.service
  systemctl daemon-reload && systemctl enable --now provisioner-agent.service
elif [ "$run_as" != root ] && command -v runuser >/dev/null 2>&1; then
  nohup runuser -u "$run_as" -- {{ cmd }} >/var/log/provisioner-agent.log 2>&1 &
else
  nohup {{ cmd }} >/var/log/provisioner-agent.log 2>&1 &
fi
) >/var/log/provisioner-agent-install.log 2>&1 || true
