# The two set-up commands (see README): `make example` and `make test`.
# Both create .venv and install the project on first use.
VENV  ?= .venv
PY    := $(VENV)/bin/python
STAMP := $(VENV)/.relaytrain-installed
export RAY_USAGE_STATS_ENABLED := 0

.PHONY: example test venv bench serve clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

example: $(STAMP)
	$(VENV)/bin/relaytrain run examples/digits_mlp.yaml --out out/digits-mlp

test: $(STAMP)
	$(PY) -m pytest -q

serve: $(STAMP)
	$(VENV)/bin/relaytrain serve

bench: $(STAMP)
	$(PY) bench/pipeline.py

clean:
	rm -rf out checkpoints .pytest_cache
