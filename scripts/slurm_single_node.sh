#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, started by hand (no systemd), for tests/integration/test_slurm_job.py.
#
#   scripts/slurm_single_node.sh start STATE_DIR   # writes STATE_DIR/slurm.conf, starts munged, slurmctld, slurmd
#   scripts/slurm_single_node.sh stop STATE_DIR    # stops the three by the pids in STATE_DIR
#
# Needs root and Debian's packages: apt-get install --no-install-recommends slurmd slurmctld slurm-client munge
# (`make system-deps` installs them). Everything it writes is under STATE_DIR: the munge key and socket, the
# config (clients read it through SLURM_CONF=STATE_DIR/slurm.conf), state, spool, logs and pid files; the
# daemons listen on free ports, so a Slurm already on the machine is not touched. The node declares 16 CPUs
# and 16 GB whatever the machine has (SlurmdParameters=config_overrides): a CPU test job asks for more CPUs
# than a small machine has, and each step only runs processes. No GPUs (a CPU run asks --gres=none).
set -euo pipefail
cmd=${1:?start|stop}
state=$(realpath -m "${2:?STATE_DIR}")

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

stop() {
  # This cluster's jobs first (it is private: SLURM_CONF points at it), so that no step outlives its slurmd.
  if [ -s "$state/slurmctld.pid" ] && [ -f "$state/slurm.conf" ]; then
    export SLURM_CONF="$state/slurm.conf"
    scancel --user="$(id -un)" 2>/dev/null || true
    for _ in $(seq 60); do [ -z "$(squeue -h 2>/dev/null)" ] && break; sleep 1; done
  fi
  for name in slurmd slurmctld munged; do
    pidfile="$state/$name.pid"
    if [ -s "$pidfile" ]; then
      pid=$(cat "$pidfile")
      kill "$pid" 2>/dev/null || true
      for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
      kill -9 "$pid" 2>/dev/null || true
      rm -f "$pidfile"
    fi
  done
}

if [ "$cmd" = stop ]; then stop; exit 0; fi
[ "$cmd" = start ] || { echo "usage: $0 start|stop STATE_DIR" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "error: slurmd runs job steps as their user and must run as root" >&2; exit 1; }
for c in munged mungekey slurmctld slurmd sbatch; do
  command -v "$c" >/dev/null || { echo "error: $c missing: apt-get install slurmd slurmctld slurm-client munge" >&2; exit 1; }
done

mkdir -p "$state"/{munge,spool,ctld,log}
chmod 700 "$state/munge"
[ -s "$state/munge/munge.key" ] || mungekey --create --keyfile="$state/munge/munge.key" >/dev/null 2>&1 \
  || dd if=/dev/urandom of="$state/munge/munge.key" bs=1024 count=1 status=none
chmod 600 "$state/munge/munge.key"
munged --key-file="$state/munge/munge.key" --socket="$state/munge/munge.socket" \
  --pid-file="$state/munged.pid" --log-file="$state/log/munged.log" --seed-file="$state/munge/seed" --force

host=$(hostname -s)
cat > "$state/slurm.conf" <<EOF
ClusterName=horizonrl-test
SlurmctldHost=$host
SlurmctldPort=$(free_port)
SlurmdPort=$(free_port)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$state/munge/munge.socket
StateSaveLocation=$state/ctld
SlurmdSpoolDir=$state/spool
SlurmctldPidFile=$state/slurmctld.pid
SlurmdPidFile=$state/slurmd.pid
SlurmctldLogFile=$state/log/slurmctld.log
SlurmdLogFile=$state/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
MinJobAge=3600
NodeName=$host CPUs=16 RealMemory=16000 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
export SLURM_CONF="$state/slurm.conf"
slurmctld -f "$SLURM_CONF"
slurmd -f "$SLURM_CONF"
for _ in $(seq 60); do
  if sinfo -h -o %t 2>/dev/null | grep -qE '^(idle|mix|alloc)'; then
    echo "slurm up: SLURM_CONF=$SLURM_CONF"; exit 0
  fi
  sleep 1
done
echo "error: the node did not become idle within 60 s; see $state/log" >&2
sinfo >&2 || true
stop
exit 1
