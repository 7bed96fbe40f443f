# The two set-up commands (see README): `make example` and `make test`.
# Both create .venv and install the project on first use (scripts/install_venv.py: with uv,
# which pip installs first, or with pip where uv fails).
VENV  ?= .venv
PY    := $(VENV)/bin/python
STAMP := $(VENV)/.relaytrain-installed
export RAY_USAGE_STATS_ENABLED := 0

CHROMIUM := /usr/bin/chromium

.PHONY: example test venv bench bench-peers serve clean chromium

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) scripts/install_venv.py test
	touch $(STAMP)

venv: $(STAMP)

example: $(STAMP)
	$(VENV)/bin/relaytrain run examples/digits_mlp.yaml --out out/digits-mlp

# Python caches the project's compiled modules under .venv: every Ray worker of a test
# imports them, and where PYTHONDONTWRITEBYTECODE is set each compiled them again (0.26 s of CPU
# each, 2026-11-27).  With the prefix Python reads every module's compiled code from there, so
# the first process to import torch compiles it once (about 8 s of CPU).
test: $(STAMP) chromium
	env -u PYTHONDONTWRITEBYTECODE PYTHONPYCACHEPREFIX=$(abspath $(VENV))/pycache $(PY) -m pytest -q

# The web page's test drives Debian's chromium through Playwright (never a downloaded
# browser): installed here where apt-get can; elsewhere that test is skipped, saying why.
chromium:
	@if [ ! -x $(CHROMIUM) ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "make: installing chromium for the web page's test (apt-get install -y chromium)"; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y -q chromium >/dev/null 2>&1 || \
	  { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1; } || \
	  echo "make: !!! could not install chromium (not root, or no package index): the web page's test will be skipped !!!"; \
	fi

serve: $(STAMP)
	$(VENV)/bin/relaytrain serve

# bench/peers.py needs the `bench` extra (matplotlib, Ray Train's imports); `make test` does not.
BENCH_STAMP := $(VENV)/.relaytrain-bench-installed
$(BENCH_STAMP): $(STAMP)
	$(PY) scripts/install_venv.py bench
	touch $(BENCH_STAMP)

# relaytrain against torch.distributed.pipelining, Ray Train and one process (README, "Against
# the peers"); every schedule at microbatches of 16, 32, 64 rows and M in {4, 8, 16}: 20-45 minutes
# on 2 cores.  `make bench-peers BENCH_ARGS=--quick`: 32 rows, M = 8 only, 2 minutes.
bench-peers: $(BENCH_STAMP)
	$(PY) bench/peers.py $(BENCH_ARGS)

bench: $(STAMP)
	$(PY) bench/pipeline.py

clean:
	rm -rf out checkpoints .pytest_cache
