#!/bin/bash
# A real Slurm cluster of NODES nodes on this one machine, on loopback, for the tests:
# Debian's slurm-wlm (one slurmctld, one slurmd per node: `slurmd -N nI`, each on its own
# port) with munge authentication, every file under DIR. Adapted from the shared recipe
# (../shared/recipes/slurm/). Root only (slurmd runs the steps as their user).
#   usage: start-cluster.sh DIR [NODES] [CPUS_PER_NODE]
#   env:   SLURMCTLD_PORT (default 6917), SLURMD_PORT_BASE (default 17000: node i on base+i)
#   then:  export SLURM_CONF=DIR/slurm.conf;  stop: stop-cluster.sh DIR
set -euo pipefail
DIR=$(realpath "${1:?usage: start-cluster.sh DIR [NODES] [CPUS]}"); NODES=${2:-2}; CPUS=${3:-2}
if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq slurm-wlm munge >/dev/null
fi
mkdir -p "$DIR"/{state,log,munge} /run/munge
chown munge:munge /run/munge 2>/dev/null || true
[ -f "$DIR/munge/munge.key" ] || { dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1 count=1024 status=none; chmod 400 "$DIR/munge/munge.key"; }
munged --force --key-file="$DIR/munge/munge.key" --socket="$DIR/munge/socket" \
       --pid-file="$DIR/munge/munged.pid" --log-file="$DIR/log/munged.log" --seed-file="$DIR/munge/seed"
H=$(hostname)
{
  echo "ClusterName=nltest"
  echo "SlurmctldHost=$H(127.0.0.1)"
  echo "AuthType=auth/munge"
  echo "AuthInfo=socket=$DIR/munge/socket"
  echo "CredType=cred/munge"
  echo "SlurmUser=root"
  echo "SlurmdUser=root"
  echo "StateSaveLocation=$DIR/state"
  echo "SlurmdSpoolDir=$DIR/spool/%n"
  echo "SlurmctldPidFile=$DIR/slurmctld.pid"
  echo "SlurmdPidFile=$DIR/slurmd.%n.pid"
  echo "SlurmctldLogFile=$DIR/log/slurmctld.log"
  echo "SlurmdLogFile=$DIR/log/slurmd.%n.log"
  echo "SlurmctldPort=${SLURMCTLD_PORT:-6917}"
  echo "ProctrackType=proctrack/linuxproc"
  echo "TaskPlugin=task/none"
  echo "SchedulerType=sched/backfill"
  echo "SelectType=select/cons_tres"
  echo "SelectTypeParameters=CR_Core"
  echo "ReturnToService=2"
  echo "MpiDefault=none"
  echo "KillWait=5"
  echo "SlurmdTimeout=10"
  echo "MinJobAge=60"
  for i in $(seq 1 "$NODES"); do
    echo "NodeName=n$i NodeHostname=$H NodeAddr=127.0.0.1 Port=$(( ${SLURMD_PORT_BASE:-17000} + i )) CPUs=$CPUS RealMemory=4000 State=UNKNOWN"
  done
  echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4"
} > "$DIR/slurm.conf"
export SLURM_CONF="$DIR/slurm.conf"
slurmctld -f "$SLURM_CONF"
for i in $(seq 1 "$NODES"); do mkdir -p "$DIR/spool/n$i"; slurmd -f "$SLURM_CONF" -N "n$i"; done
for _ in $(seq 1 120); do
  idle=$(sinfo -h -t idle -o '%D' 2>/dev/null | head -1)
  [ "${idle:-0}" = "$NODES" ] && { echo "export SLURM_CONF=$SLURM_CONF"; exit 0; }
  sleep 0.25
done
echo "slurm did not come up: see $DIR/log" >&2; exit 1
