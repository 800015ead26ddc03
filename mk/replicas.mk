# Benchmarks of placement and failover (issue: replicas).
.PHONY: bench-scheduler bench-failover

bench-scheduler: $(STAMP)
	scripts/services.sh
	$(PY) bench/scheduler.py

bench-failover: $(STAMP)
	scripts/services.sh
	$(PY) bench/failover.py
