# make engine-check: every engine adapter's output through vLLM's and SGLang's
# REAL argument parsers, each engine installed in an environment of its own
# (CPU only, no model, nothing downloaded at run time). It rewrites the option
# tables in replicas/engines/options/ that regular CI tests the adapters against,
# then runs those tests. See docs/engine-check.md.
ENGINE_VENVS := .engine-venvs
ENGINE_CHECK := tools/engine_check
VLLM_VERSION := 0.33.0
XGRAMMAR_VERSION := 0.2.8
SGLANG_VERSION := 0.5.23
# The CPU build on this machine's disk; uv and poetry do not see it, pip does.
ENGINE_TORCH := torch==2.13.0

.PHONY: engine-check engine-venvs engine-venvs-clean

$(ENGINE_VENVS)/vllm/.installed: $(ENGINE_CHECK)/vllm-requirements.txt $(ENGINE_CHECK)/constraints.txt mk/engine-check.mk
	rm -rf $(ENGINE_VENVS)/vllm
	$(PYTHON) -m venv $(ENGINE_VENVS)/vllm
	$(ENGINE_VENVS)/vllm/bin/pip install --quiet $(ENGINE_TORCH)
	$(ENGINE_VENVS)/vllm/bin/pip install --quiet --no-deps vllm==$(VLLM_VERSION) xgrammar==$(XGRAMMAR_VERSION)
	$(ENGINE_VENVS)/vllm/bin/pip install --quiet -c $(ENGINE_CHECK)/constraints.txt -r $(ENGINE_CHECK)/vllm-requirements.txt
	! $(ENGINE_VENVS)/vllm/bin/python -c "import triton" 2>/dev/null
	touch $@

$(ENGINE_VENVS)/sglang/.installed: $(ENGINE_CHECK)/sglang-requirements.txt $(ENGINE_CHECK)/constraints.txt mk/engine-check.mk
	rm -rf $(ENGINE_VENVS)/sglang
	$(PYTHON) -m venv $(ENGINE_VENVS)/sglang
	$(ENGINE_VENVS)/sglang/bin/pip install --quiet $(ENGINE_TORCH)
	$(ENGINE_VENVS)/sglang/bin/pip install --quiet --no-deps sglang==$(SGLANG_VERSION)
	$(ENGINE_VENVS)/sglang/bin/pip install --quiet -c $(ENGINE_CHECK)/constraints.txt -r $(ENGINE_CHECK)/sglang-requirements.txt
	! $(ENGINE_VENVS)/sglang/bin/python -c "import triton" 2>/dev/null
	touch $@

engine-venvs: $(ENGINE_VENVS)/vllm/.installed $(ENGINE_VENVS)/sglang/.installed

engine-check: engine-venvs $(STAMP)
	VLLM_TARGET_DEVICE=cpu $(ENGINE_VENVS)/vllm/bin/python $(ENGINE_CHECK)/check.py vllm
	$(ENGINE_VENVS)/sglang/bin/python $(ENGINE_CHECK)/check.py sglang
	$(TEST_ENV) $(PY) -m pytest -q -p no:cacheprovider tests/replicas/test_engines.py
	-git diff --stat -- replicas/engines/options/

engine-venvs-clean:
	rm -rf $(ENGINE_VENVS)
