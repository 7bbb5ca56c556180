#!/usr/bin/env bash
# Installs nginx (Debian's nginx-light, else nginx) for the tests that put a real balancer in front of several
# servers (tests/nginx_server.py). Idempotent: returns at once when an nginx binary is there
# ($VITSERVE_TEST_NGINX, `nginx` on PATH, or /usr/sbin/nginx). Needs root and apt-get; without them it says so
# and exits 0, and those tests skip with that reason (in CI, where CI=true, they fail instead).
# The package's own service is never started: the tests run nginx as a child with a config of their own.
set -euo pipefail
found() {
  [ -n "${VITSERVE_TEST_NGINX:-}" ] && [ -x "$VITSERVE_TEST_NGINX" ] && return 0
  command -v nginx >/dev/null 2>&1 && return 0
  [ -x /usr/sbin/nginx ]
}
if found; then
  echo "nginx.sh: nginx is there"
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1 || [ "$(id -u)" != 0 ]; then
  echo "nginx.sh: no nginx, and no apt-get as root to install it: the balancer tests will skip" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
# policy-rc.d 101: the package's postinst must not start a system nginx (it would take port 80)
policy=/usr/sbin/policy-rc.d
made_policy=false
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod +x "$policy" && made_policy=true
fi
apt-get update -qq
apt-get install -y -qq --no-install-recommends nginx-light >/dev/null 2>&1 \
  || apt-get install -y -qq --no-install-recommends nginx >/dev/null
if "$made_policy"; then
  rm -f "$policy"
fi
found && echo "nginx.sh: installed $( (command -v nginx || echo /usr/sbin/nginx) | head -1)"
