#!/usr/bin/env bash
# One-command set-up on a fresh machine: build tools, a virtual environment with
# the package, its dev extra and its test harness (testing/), a second one with the
# multi-process LangGraph server (langhost) for the server harness, a third with Arize
# Phoenix (an OTLP receiver), Prometheus, and the llama-server used by integration tests
# and benchmarks (built once, then cached).
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v cmake >/dev/null 2>&1 || need_apt+=(cmake)
command -v g++ >/dev/null 2>&1 || need_apt+=(g++)
command -v make >/dev/null 2>&1 || need_apt+=(make)
# PostgreSQL server binaries for tests/integration/test_postgres.py (Debian keeps initdb off PATH).
want_apt=()
compgen -G '/usr/lib/postgresql/*/bin/initdb' >/dev/null || command -v initdb >/dev/null 2>&1 \
  || want_apt+=(postgresql)
# Redis for the multi-process LangGraph server (tests/integration/test_langgraph_server_harness.py).
command -v redis-server >/dev/null 2>&1 || [[ -x /usr/bin/redis-server ]] || want_apt+=(redis-server)
# Prometheus scraping the server's workers (tests/integration/test_telemetry_deployment.py).
command -v prometheus >/dev/null 2>&1 || want_apt+=(prometheus)
if ((${#need_apt[@]} + ${#want_apt[@]})); then
  if [[ $(id -u) -eq 0 ]]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
      "${need_apt[@]}" "${want_apt[@]}" >/dev/null
  elif ((${#need_apt[@]})); then
    echo "missing build tools: ${need_apt[*]} (install them with your package manager)" >&2
    exit 1
  else
    [[ " ${want_apt[*]} " != *" postgresql "* ]] \
      || echo "PostgreSQL server not found: tests/integration/test_postgres.py will skip (install 'postgresql')" >&2
    [[ " ${want_apt[*]} " != *" redis-server "* ]] \
      || echo "redis-server not found: the LangGraph server harness tests will skip (install 'redis-server')" >&2
    [[ " ${want_apt[*]} " != *" prometheus "* ]] \
      || echo "prometheus not found: the telemetry deployment test will skip (install 'prometheus')" >&2
  fi
fi

PYTHON="${PYTHON:-python3}"
[[ -x .venv/bin/python ]] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e ".[dev]"
# The test harness (llama-server, tiny model, fake OpenAI server) is its own distribution.
.venv/bin/python -m pip install --quiet -e ./testing
# The multi-process LangGraph server (langhost: stock langgraph-api on Postgres + Redis) pins
# langgraph-api and langgraph-checkpoint-postgres older than the dev extra's langgraph-cli[inmem]:
# a virtualenv of its own, with the package installed so the workers can import the graph.
LANGHOST_VERSION="${LANGHOST_VERSION:-0.11.1.post1}"
[[ -x .venv-server/bin/python ]] || "$PYTHON" -m venv .venv-server
.venv-server/bin/python -m pip install --quiet --upgrade pip
.venv-server/bin/python -m pip install --quiet "langhost==${LANGHOST_VERSION}" -e ".[telemetry]"
# Arize Phoenix, a real OTLP receiver for tests/integration/test_traces_phoenix.py: a virtualenv of
# its own too (its dependencies would pin the test environment's).
PHOENIX_VERSION="${PHOENIX_VERSION:-20.26.1}"
if [[ ! -x .venv-phoenix/bin/phoenix ]]; then
  "$PYTHON" -m venv .venv-phoenix
  .venv-phoenix/bin/python -m pip install --quiet --upgrade pip
  .venv-phoenix/bin/python -m pip install --quiet "arize-phoenix==${PHOENIX_VERSION}"
fi
PYTHON=.venv/bin/python bash scripts/build_llama_server.sh
