# make bench-gateway: the same load against a sim engine directly, nginx,
# the llmgw gateway and the LiteLLM proxy (its own venv, made here), and
# the figures of docs/benchmarks.md. Loopback only; a few minutes.
#   make bench-gateway BENCH_GATEWAY_ARGS="--runs 3"
BENCH_VENVS := var/bench-venvs
LITELLM_VERSION := 1.108.7
BENCH_GATEWAY_ARGS ?= --runs 3

.PHONY: bench-gateway bench-gateway-deps

$(BENCH_VENVS)/litellm/.installed: mk/gateway.mk
	rm -rf $(BENCH_VENVS)/litellm
	$(PYTHON) -m venv $(BENCH_VENVS)/litellm
	$(BENCH_VENVS)/litellm/bin/pip install --quiet "litellm[proxy]==$(LITELLM_VERSION)"
	touch $@

bench-gateway-deps: $(STAMP) $(BENCH_VENVS)/litellm/.installed
	command -v nginx >/dev/null 2>&1 || test -x /usr/sbin/nginx || { \
		echo "installing nginx-light (Debian) for the reverse-proxy baseline"; \
		apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx-light >/dev/null; }

bench-gateway: bench-gateway-deps
	$(PY) bench/gateway.py $(BENCH_GATEWAY_ARGS)

# make bench-routing: the routing policies side by side on 8 sim engines that
# model a KV cache, each workload at 80 % of the capacity a ramp finds first
# (docs/benchmarks.md); about 8-10 minutes on a 2-core box, --quick about 5.
#   make bench-routing BENCH_ROUTING_ARGS="--quick --gateways 2"
# make bench-routing-pure: the routing decision's CPU and the cost of reading engines' /metrics.
BENCH_ROUTING_ARGS ?=

.PHONY: bench-routing bench-routing-pure bench-gateway-profile

bench-routing: $(STAMP)
	$(PY) bench/routing.py $(BENCH_ROUTING_ARGS)

bench-routing-pure: $(STAMP)
	$(PY) bench/routing_pure.py

bench-gateway-profile: $(STAMP)
	$(PY) bench/gateway_profile.py

# make bench-tenancy: per-key limits' exactness through two gateway processes, interactive TTFT under a
# batch flood, and the CPU limits add per request (docs/benchmarks.md); PostgreSQL and Redis; a few minutes.
BENCH_TENANCY_ARGS ?=

.PHONY: bench-tenancy

bench-tenancy: $(STAMP)
	$(PY) bench/tenancy.py $(BENCH_TENANCY_ARGS)
