#!/usr/bin/env bash
# `make test`'s pytest, as two streams at once over the machine's cores:
#  - the tests tests/conftest.py marks serial (servers with concurrent clients, workers killed at a moment,
#    launchers), one at a time in a pytest of their own: they use one core or less most of the time;
#  - the rest spread over both cores by pytest-xdist.
# Run one after the other, the cores idled through half of the serial stream. Each stream's slowest tests are
# listed at its end (the serial stream's log follows the other's), so every CI log shows where the time goes.
set -u
python=${1:-.venv/bin/python}
serial_log=$(mktemp)
"$python" -m pytest -q -p no:cacheprovider -m serial --durations=15 tests > "$serial_log" 2>&1 &
serial=$!
"$python" -m pytest -q -m "not serial" -n 2 --dist worksteal --durations=25 tests
rest=$?
wait "$serial"
serial_rc=$?
echo "---- the serial stream (ran beside the above) ----"
cat "$serial_log"
rm -f "$serial_log"
[ "$rest" -eq 0 ] && [ "$serial_rc" -eq 0 ]
