#!/bin/bash
# Ends what start-cluster.sh DIR started (by the pids it wrote), then forgets the cluster.
DIR=$(realpath "${1:?usage: stop-cluster.sh DIR}")
pids() { for f in "$DIR"/slurmd.*.pid "$DIR/slurmctld.pid" "$DIR/munge/munged.pid"; do [ -f "$f" ] && cat "$f"; done; }
for p in $(pids); do kill "$p" 2>/dev/null; done
for _ in $(seq 1 20); do alive=0; for p in $(pids); do kill -0 "$p" 2>/dev/null && alive=1; done; [ $alive = 0 ] && break; sleep 0.1; done
for p in $(pids); do kill -9 "$p" 2>/dev/null; done
rm -f "$DIR"/slurmd.*.pid "$DIR/slurmctld.pid" "$DIR/munge/munged.pid"
rm -rf "$DIR/state" "$DIR/spool"
exit 0
