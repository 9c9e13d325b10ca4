#!/bin/sh
# tools/step.sh WHAT COMMAND...: says WHAT before running COMMAND, then a line every 8 s while it
# runs (pip -q and friends print nothing for minutes), so `make` never leaves a silent terminal.
what=$1
shift
echo "==> $what"
start=$(date +%s)
"$@" &
pid=$!
trap 'kill $pid 2>/dev/null' INT TERM
last=$start
while kill -0 "$pid" 2>/dev/null; do
  sleep 1
  now=$(date +%s)
  if [ $((now - last)) -ge 8 ]; then
    echo "    ... $what ($((now - start)) s)"
    last=$now
  fi
done
wait "$pid"
rc=$?
[ $rc -eq 0 ] || echo "==> failed ($rc): $what"
exit $rc
