#!/usr/bin/env bash
# `make test` after lint: the tests that start processes or open sockets in one pytest, while
# mypy and the unit tests run beside it at nice 19. Those two take only the CPU the process
# suites leave while they wait (most of their time), not the CPU the suites' liveness windows
# need (a probe answered within 0.8 s). Their reports come after the main run's.
#
#   scripts/test.sh PYTHON WORKERS [PYTEST_ARGS...]
set -uo pipefail
cd "$(dirname "$0")/.."
py=$1 workers=$2
shift 2
logs=.venv
unit_dirs=(libs/*/tests/unit services/*/tests/unit tests/unit)

setsid nice -n 19 make --no-print-directory typecheck > "$logs/typecheck.log" 2>&1 &
types=$!
setsid nice -n 19 "$py" -m pytest -m "not slow" -q "${unit_dirs[@]}" "$@" > "$logs/unit-tests.log" 2>&1 &
unit=$!
# Background jobs of a script ignore Ctrl-C: each runs in a process group of its own (setsid),
# stopped whole with the script.
trap 'kill -- -$types -$unit 2>/dev/null' EXIT
trap 'exit 130' INT TERM

"$py" -m pytest -m "not slow" -n "$workers" --ignore=tests/unit --ignore-glob='*/tests/unit' "$@"
rest=$?
wait $types; typed=$?
wait $unit; units=$?
trap - EXIT

# pytest's 5 is "no test selected": a PYTEST_ARGS -k that matches one side only.
ok() { [ "$1" -eq 0 ] || [ "$1" -eq 5 ]; }
report() {  # the whole log when it failed, its last line when not
    echo "==== $1, run beside the above at nice 19 (log: $2) ===="
    if ok "$3"; then tail -n 1 "$2"; else cat "$2"; fi
}
report "mypy" "$logs/typecheck.log" "$typed"
report "unit tests" "$logs/unit-tests.log" "$units"
ok "$rest" && ok "$typed" && ok "$units"
