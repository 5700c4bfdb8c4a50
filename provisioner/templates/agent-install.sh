#!/bin/bash
# provisioner agent: GPU utilisation heartbeats for the idle scheduler.
# Rendered by provisioner.idle.startup_data (Jinja2); every value is shell-quoted there.
(
umask 077
mkdir -p {{ agent_dir }}
cat > {{ agent_dir }}/agent-token <<'PV_TOKEN_EOF'
{{ token }}
PV_TOKEN_EOF
cat > {{ agent_dir }}/agent.py <<'PV_AGENT_EOF'
{{ agent_py }}PV_AGENT_EOF
python3 -c 'import pynvml' 2>/dev/null || pip3 install -q nvidia-ml-py || true
if command -v systemctl >/dev/null 2>&1; then
  cat > /etc/systemd/system/provisioner-agent.service <<'PV_UNIT_EOF'
[Unit]
Description=provisioner GPU heartbeat agent
After=network-online.target
[Service]
ExecStart={{ cmd }}
Restart=always
RestartSec=30
Nice=10
[Install]
WantedBy=multi-user.target
PV_UNIT_EOF
  systemctl daemon-reload && systemctl enable --now provisioner-agent.service
else
  nohup {{ cmd }} >/var/log/provisioner-agent.log 2>&1 &
fi
) >/var/log/provisioner-agent-install.log 2>&1 || true
