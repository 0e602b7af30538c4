#!/usr/bin/env bash
# Install Open MPI (the MPI backend's library and mpirun) and bring up a one-node SLURM on this machine (Debian 12, slurm 22.05, no systemd, container) so that
# `srun -n 4 <program>` launches 4 Open MPI ranks directly (PMIx: MpiDefault=pmix).
# Idempotent: exits at once when srun already works. Needs root (or passwordless sudo).
#
# Stop everything again:   scontrol shutdown; kill "$(cat /run/munge/munged.pid)"
# Knobs (environment):     SLURM_CI_CPUS (CPUs the node advertises, default 16; >= 4),
#                          SLURM_CI_DEADLINE (seconds each wait may take, default 60),
#                          SLURM_CI_FORCE=1 (skip the "srun already works" shortcut, e.g. to apply a
#                          new SLURM_CI_CPUS; daemons restart only if slurm.conf changes).
set -euo pipefail

CPUS="${SLURM_CI_CPUS:-16}"
DEADLINE="${SLURM_CI_DEADLINE:-60}"
CONF_DIR=/etc/slurm
CONF="$CONF_DIR/slurm.conf"
LOG_DIR=/var/log/slurm
CTLD_LOG="$LOG_DIR/slurmctld.log"
SLURMD_LOG="$LOG_DIR/slurmd.log"
CTLD_PID=/run/slurmctld.pid
SLURMD_PID=/run/slurmd.pid
MUNGE_LOG=/var/log/munge/munged.log
APT_LOG=/tmp/slurm-ci-apt.log
NODE="$(hostname -s 2>/dev/null || true)"
NODE="${NODE:-localhost}"

if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then exec sudo -n -E bash "$0" "$@"; fi
  echo "slurm.sh: must run as root" >&2
  exit 1
fi

srun_works() {
  command -v mpirun >/dev/null 2>&1 && command -v srun >/dev/null 2>&1 && [ -r "$CONF" ] && timeout 20 srun -N 1 -n 1 true >/dev/null 2>&1
}

fail() {
  echo "slurm.sh: FAILED: $*" >&2
  for f in "$CTLD_LOG" "$SLURMD_LOG" "$MUNGE_LOG"; do
    if [ -r "$f" ]; then echo "----- tail -n 30 $f -----" >&2; tail -n 30 "$f" >&2; fi
  done
  if command -v sinfo >/dev/null 2>&1; then
    echo "----- sinfo -----" >&2
    timeout 10 sinfo -N -l >&2 2>&1 || true
  fi
  exit 1
}

pid_alive() { # pid (a zombie counts as gone: PID 1 in a container may not reap it)
  local st
  st="$(ps -o stat= -p "$1" 2>/dev/null)" || return 1
  case "$st" in Z*) return 1 ;; esac
  return 0
}

alive() { # pidfile
  [ -r "$1" ] && pid_alive "$(cat "$1" 2>/dev/null)"
}

stop_pidfile() { # pidfile name
  local pid t=0
  alive "$1" || return 0
  pid="$(cat "$1")"
  kill "$pid" 2>/dev/null || true
  while pid_alive "$pid"; do
    t=$((t + 1))
    [ "$t" -gt $((DEADLINE * 2)) ] && fail "$2 (pid $pid) did not stop"
    sleep 0.5
  done
}

mpi_plugin() {
  if srun --mpi=list 2>&1 | grep -qw pmix; then echo pmix; else echo none; fi
}

# --- 0. already working? ---------------------------------------------------------------------------
if [ "${SLURM_CI_FORCE:-0}" != 1 ] && srun_works; then
  echo "slurm: srun -n 4 ready (mpi=$(mpi_plugin); already running)"
  exit 0
fi

# --- 1. packages -----------------------------------------------------------------------------------
# slurm-wlm-basic-plugins (a dependency of slurmd) ships mpi_pmix.so -> mpi_pmix_v4.so, which
# dlopen()s /usr/lib/x86_64-linux-gnu/pmix2/lib/libpmix.so: that unversioned link is in libpmix-dev.
PKGS=(openmpi-bin libopenmpi-dev munge slurmctld slurmd slurm-client libpmix-dev)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  # Keep the packages' maintainer scripts from starting daemons (no systemd here; we start them).
  added_policy=0
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
    chmod 755 /usr/sbin/policy-rc.d
    added_policy=1
  fi
  install_pkgs() {
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >>"$APT_LOG" 2>&1
  }
  : >"$APT_LOG"
  if ! install_pkgs; then
    # Stale or absent package lists: refresh once and retry.
    apt-get update -qq >>"$APT_LOG" 2>&1 || true
    if ! install_pkgs; then
      if [ "$added_policy" = 1 ]; then rm -f /usr/sbin/policy-rc.d; fi
      tail -n 30 "$APT_LOG" >&2
      fail "apt-get install ${missing[*]}"
    fi
  fi
  if [ "$added_policy" = 1 ]; then rm -f /usr/sbin/policy-rc.d; fi
fi

# --- 2. munge --------------------------------------------------------------------------------------
MUNGE_USER=munge
id "$MUNGE_USER" >/dev/null 2>&1 || MUNGE_USER=root
mkdir -p /etc/munge /var/lib/munge /var/log/munge /run/munge
if [ ! -s /etc/munge/munge.key ]; then
  dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
fi
chown -R "$MUNGE_USER": /etc/munge /var/lib/munge /var/log/munge /run/munge
chmod 700 /etc/munge /var/lib/munge /var/log/munge
chmod 755 /run/munge
chmod 400 /etc/munge/munge.key
munge_ok() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }
if ! munge_ok; then
  stop_pidfile /run/munge/munged.pid munged
  rm -f /run/munge/munge.socket.2 /run/munge/munge.socket.2.lock /run/munge/munged.pid
  if [ "$MUNGE_USER" = root ]; then
    /usr/sbin/munged --force || fail "munged did not start"
  else
    runuser -u "$MUNGE_USER" -- /usr/sbin/munged || fail "munged did not start"
  fi
  t=0
  until munge_ok; do
    t=$((t + 1))
    [ "$t" -gt $((DEADLINE * 2)) ] && fail "munge -n | unmunge still fails after ${DEADLINE}s"
    sleep 0.5
  done
fi

# --- 3. slurm.conf ---------------------------------------------------------------------------------
mkdir -p "$CONF_DIR" "$LOG_DIR" /var/spool/slurmctld /var/spool/slurmd
MPI_DEFAULT=none
ls /usr/lib/*/slurm-wlm/mpi_pmix.so >/dev/null 2>&1 && MPI_DEFAULT=pmix
new_conf="$(mktemp)"
cat >"$new_conf" <<EOF
# Written by .ci/slurm.sh: one-node CI cluster on this machine.
ClusterName=ci
MailProg=/bin/true
SlurmctldHost=${NODE}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=${CTLD_PID}
SlurmdPidFile=${SLURMD_PID}
SlurmctldLogFile=${CTLD_LOG}
SlurmdLogFile=${SLURMD_LOG}
# No cgroups in a container.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=${MPI_DEFAULT}
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# Trust the CPU count below rather than the hardware (the machine may have fewer cores).
SlurmdParameters=config_overrides
ReturnToService=2
SlurmdTimeout=300
InactiveLimit=0
MinJobAge=30
KillWait=5
Waittime=0
NodeName=${NODE} NodeAddr=127.0.0.1 NodeHostname=${NODE} CPUs=${CPUS} State=UNKNOWN
PartitionName=debug Nodes=${NODE} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
restart=0
if ! cmp -s "$new_conf" "$CONF"; then
  install -m 644 "$new_conf" "$CONF"
  restart=1
fi
rm -f "$new_conf"

# --- 4. daemons ------------------------------------------------------------------------------------
if [ "$restart" = 1 ]; then
  stop_pidfile "$SLURMD_PID" slurmd
  stop_pidfile "$CTLD_PID" slurmctld
fi
if ! alive "$CTLD_PID"; then
  slurmctld -i || fail "slurmctld did not start"
fi
if ! alive "$SLURMD_PID"; then
  slurmd -N "$NODE" || fail "slurmd did not start"
fi

# --- 5. wait for the node to be idle ---------------------------------------------------------------
end=$((SECONDS + DEADLINE))
state=""
while :; do
  state="$(timeout 10 sinfo -h -N -n "$NODE" -o '%T' 2>/dev/null | head -n 1 || true)"
  case "$state" in
    idle | mixed | allocated | completing) break ;;
    drain* | drained | down* | fail* | "not_responding"*)
      timeout 10 scontrol update nodename="$NODE" state=resume >/dev/null 2>&1 || true
      ;;
  esac
  [ "$SECONDS" -ge "$end" ] && fail "node $NODE not idle after ${DEADLINE}s (state: '${state:-no answer}')"
  sleep 1
done

# --- 6. final check --------------------------------------------------------------------------------
out="$(timeout "$DEADLINE" srun -N 1 -n 4 true 2>&1)" || { echo "$out" >&2; fail "srun -n 4 true"; }
echo "slurm: srun -n 4 ready (mpi=$(mpi_plugin), node $NODE, $CPUS cpus)"
