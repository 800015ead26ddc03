# Benchmarks of placement and failover (issue: replicas).
.PHONY: bench-scheduler bench-failover

bench-scheduler: $(STAMP)
	scripts/services.sh
	$(PY) bench/scheduler.py

bench-failover: $(STAMP)
	scripts/services.sh
	$(PY) bench/failover.py

# make bench-autoscale: the autoscaler on the simulated cluster under a load
# trace (steady, 4x step, down, idle to zero, burst from zero, noisy); about
# 6 minutes. The long trace: make bench-autoscale BENCH_AUTOSCALE_ARGS=--full
.PHONY: bench-autoscale
bench-autoscale: $(STAMP)
	scripts/services.sh
	$(PY) bench/autoscale.py $(BENCH_AUTOSCALE_ARGS)
