# Two entry points, both self-installing into .venv on first use:
#   make demo   the end-to-end story on the embedded SQLite default
#   make test   lint, types, the documentation site and the suite (SQLite, PostgreSQL
#               and MariaDB) but for the tests that start the product's processes (`make
#               test-processes`), the console in headless Chromium (`make
#               test-browser`), the fault proofs (`make test-faults`) and the long tests
#               (`make test-long`), which .ci/run runs after it
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-processes test-mysql test-browser test-faults test-long lint docs package-check test-nats-newest faults-report screenshots clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[fast,dev,bench]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/outbox demo

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports
	$(BIN)/mypy .ci/package_check.py .ci/nats_newest.py

# The documentation site, into site/ (ignored by git): --strict makes a broken link,
# anchor or nav entry an error. The reference pages it shows are checked against the
# code by tests/test_docs.py.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# Three test processes on two cores: the process tests spend much of their time waiting
# for leases to expire and processes to start, so they overlap well.
test: lint docs
	$(BIN)/python -m pytest -n 3 --dist worksteal -m "not long and not faults and not browser and not processes" $(PYTEST_ARGS)

# The tests that start the product's own processes (receivers, relays, workers) and talk to
# them over sockets and signals (tests/conftest.py's PROCESSES): a third of the suite's
# time, which a busy machine stretches most, so out of `make test`'s six minutes; .ci/run
# runs them right after it.
test-processes: $(STAMP)
	$(BIN)/python -m pytest -n 3 --dist worksteal -m "processes and not long and not faults and not browser" $(PYTEST_ARGS)

# The backend-parametrised tests' runs on MariaDB and the MySQL driver's own tests alone
# (marked mysql by tests/conftest.py), the processes' too: `make test` and the steps after
# it run them with the rest; this target is for a change to the MySQL driver.
test-mysql: $(STAMP)
	$(BIN)/python -m pytest -n 3 --dist worksteal -m "mysql and not long and not faults and not browser" $(PYTEST_ARGS)

# The console in headless Chromium (Debian's chromium and chromium-driver, which .ci/run
# installs) against real console, relay and receiver processes: the pages, the 3 a.m.
# story, and axe-core's accessibility checks. A minute and more of `make test`'s six, so
# .ci/run runs them right after `make test-processes`.
test-browser: $(STAMP)
	$(BIN)/python -m pytest -n 2 --dist worksteal -m browser $(PYTEST_ARGS)

# The fault proofs (tests/faults): processes killed at every failpoint, inside the
# server's commit window, stale leases resumed, networks and brokers cut. A third of
# the suite's CPU, so out of the default run; .ci/run runs them after `make test`.
test-faults: $(STAMP)
	$(BIN)/python -m pytest -n 3 --dist worksteal -m faults $(PYTEST_ARGS)

# The tests marked long (the benchmark suite's quick form, minutes of CPU on both cores),
# and the fuzz tests' whole forms (`make test` draws a fifth of their examples):
# .ci/run runs them after the fault proofs, so the default suite stays quick.
FUZZ_TESTS = tests/receiver/test_strict_json_fast_path.py tests/relay/test_relay_answer_fuzz.py
test-long: $(STAMP)
	$(BIN)/python -m pytest -m long $(PYTEST_ARGS)
	OUTBOXDEV_FUZZ=full $(BIN)/python -m pytest -n 2 -m "not mysql" $(FUZZ_TESTS) $(PYTEST_ARGS)

# What users install: builds the sdist and the wheel, checks the wheel's contents, and
# runs the command and tests/package against the wheel in clean venvs (no extras, each
# extra, the lowest versions pyproject's bounds allow). .ci/run runs it after `make test`.
package-check: $(STAMP)
	$(BIN)/python .ci/package_check.py

# The NATS tests on the newest nats-py the nats extra allows (the suite runs on the dev
# extra's pin): the relay's fast client overrides nats-py internals. In a clean venv of its
# own; .ci/run runs it after package-check.
test-nats-newest: $(STAMP)
	$(BIN)/python .ci/nats_newest.py $(PYTEST_ARGS)

# Runs tests/faults and writes docs/explanation/faults.md from the figures of that run.
faults-report: $(STAMP)
	$(BIN)/python tests/faults/report.py

# Seeds a database, runs `outbox console` and writes a PNG of each page to docs/assets/console/
# (needs Debian's chromium and chromium-driver).
screenshots: $(STAMP)
	$(BIN)/python -m benchmarks.console_screenshots

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache site
