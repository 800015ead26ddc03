#!/usr/bin/env bash
# Make sure PostgreSQL and Redis answer on 127.0.0.1, starting them if this
# machine has them installed but stopped. Used by `make test` and .ci/run.
set -euo pipefail

pg_up() { (exec 3<>/dev/tcp/127.0.0.1/5432) 2>/dev/null; }
redis_up() { (exec 3<>/dev/tcp/127.0.0.1/6379) 2>/dev/null; }

if ! pg_up; then
  echo "starting PostgreSQL"
  pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -1)" main start
fi
if ! redis_up; then
  echo "starting Redis"
  mkdir -p /var/lib/redis /var/log/redis
  redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
    --dir /var/lib/redis --logfile /var/log/redis/ci.log
fi
for _ in $(seq 1 50); do pg_up && redis_up && exit 0; sleep 0.2; done
echo "PostgreSQL or Redis did not come up on 127.0.0.1" >&2
exit 1
