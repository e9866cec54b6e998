#!/usr/bin/env bash
# A one-node SLURM cluster on this machine, with accounting, for trying and testing the SLURM
# launcher (`hydra/launcher=slurm`) without a real cluster. Debian/Ubuntu, as root; no systemd
# needed (the daemons are started directly).
#
#   scripts/slurm.sh up      # install slurm-wlm, munge, slurmdbd, mariadb-server if missing, write
#                            # /etc/slurm/{slurm,slurmdbd}.conf for this host, start munged, mariadbd,
#                            # slurmdbd, slurmctld and slurmd, register the cluster, wait for `sinfo`
#                            # to show the node idle, and write conf/local/slurm.yaml (below). A
#                            # second `up` changes nothing and succeeds.
#   scripts/slurm.sh down    # cancel the cluster's jobs and stop every daemon `up` started
#   scripts/slurm.sh status  # the daemons and `sinfo`
#
# The node has this host's CPUs (nproc) and its memory (free) less 1 GiB for the system, no GPUs, and
# two partitions: `debug` (the default, 2 h limit) and `batch` (no limit). Accounting (slurmdbd on
# MariaDB) is what lets submitit see a cancelled or requeued job for what it is: submitit polls
# `sacct` for job states. Requeued jobs may start again 10 s later (AuthInfo cred_expire; SLURM's
# default is 120 s), and SIGTERM turns into SIGKILL after 5 s (KillWait).
#
# `up` also writes conf/local/slurm.yaml in this checkout (git-ignored; conf/hydra/launcher/slurm.yaml
# reads it): the launcher settings this cluster can serve (no GPU, 1 CPU, memory that fits, a time
# limit within `debug`'s), so `python run.py -m hydra/launcher=slurm ...` runs here with no
# hydra.launcher overrides. The launcher's own defaults (a GPU, 12 h) would be refused by sbatch or
# pend forever on `debug`.
#
# State, logs and pid files live in $SLURM_LOCAL_DIR (default /var/lib/snapkv-slurm). Files in
# /etc/slurm and conf/local/slurm.yaml that this script did not write are never overwritten.
set -euo pipefail

CLUSTER=snapkv
STATE=${SLURM_LOCAL_DIR:-/var/lib/snapkv-slurm}
ETC=/etc/slurm
MARK="# written by snapkv-bench scripts/slurm.sh"
PACKAGES=(slurm-wlm slurmdbd munge mariadb-server)
DB_SOCKET=/run/mysqld/mysqld.sock
WAIT_S=${SLURM_WAIT_S:-120}
DEBUG_LIMIT_MIN=120  # `debug`'s MaxTime (slurm.conf below): the launcher's timeout_min here
LAUNCHER_CONF=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/conf/local/slurm.yaml

say() { printf '[slurm %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
die() { printf '[slurm] error: %s\n' "$*" >&2; exit 1; }

alive() {  # alive PIDFILE: the process named in PIDFILE runs
  [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null
}

wait_for() {  # wait_for WHAT COMMAND...: retry COMMAND every second for up to $WAIT_S s
  local what=$1 i
  shift
  for ((i = 0; i < WAIT_S; i++)); do
    if "$@" >/dev/null 2>&1; then return 0; fi
    if ((i > 0 && i % 10 == 0)); then say "still waiting for $what (${i} s)"; fi
    sleep 1
  done
  die "$what not ready after ${WAIT_S} s; logs in $STATE/log"
}

write_conf() {  # write_conf PATH MODE: stdin -> PATH unless PATH is someone else's file
  local path=$1 mode=$2 new
  new=$(cat)
  if [[ -e $path ]] && ! grep -qF "$MARK" "$path"; then
    die "$path exists and was not written by this script; move it away to use the local cluster"
  fi
  if [[ -e $path ]] && [[ "$(cat "$path")" == "$new" ]]; then
    return 0
  fi
  say "writing $path"
  printf '%s\n' "$new" >"$path"
  chmod "$mode" "$path"
}

install_packages() {
  local missing=()
  for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
  done
  ((${#missing[@]} == 0)) && return 0
  command -v apt-get >/dev/null || die "apt-get not found; install ${missing[*]} with your package manager"
  ((EUID == 0)) || die "installing ${missing[*]} needs root"
  say "installing ${missing[*]} (apt-get, ~20 s)"
  export DEBIAN_FRONTEND=noninteractive
  if ! apt-get install -y -qq "${missing[@]}" >"$STATE/log/apt.log" 2>&1; then
    say "apt-get install failed; running apt-get update first"
    apt-get update -qq >>"$STATE/log/apt.log" 2>&1
    apt-get install -y -qq "${missing[@]}" >>"$STATE/log/apt.log" 2>&1 ||
      die "apt-get install ${missing[*]} failed; see $STATE/log/apt.log"
  fi
}

db_password() {  # the slurmdbd database password: the one already configured, else a new one
  local old
  old=$(sed -n 's/^StoragePass=//p' "$ETC/slurmdbd.conf" 2>/dev/null || true)
  if [[ -n $old ]]; then echo "$old"; else od -An -N12 -tx1 /dev/urandom | tr -d ' \n'; fi
}

write_configs() {
  local host cpus mem_mb
  host=$(hostname -s)
  cpus=$(nproc)
  mem_mb=$(free -m | awk '/^Mem:/ {print $2}')
  mem_mb=$((mem_mb > 2048 ? mem_mb - 1024 : mem_mb))  # leave the system 1 GiB
  mkdir -p "$ETC"
  write_conf "$ETC/slurm.conf" 644 <<EOF
$MARK: a one-node cluster for tests.
ClusterName=$CLUSTER
SlurmctldHost=$host
SlurmUser=root
AuthType=auth/munge
# Requeued jobs may start again after cred_expire seconds (SLURM's default: 120).
AuthInfo=cred_expire=10
StateSaveLocation=$STATE/slurmctld
SlurmdSpoolDir=$STATE/slurmd
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmdPidFile=$STATE/run/slurmd.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.log
# No cgroups needed: plain /proc process tracking, no task binding.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
MailProg=/bin/true
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=1024
ReturnToService=2
SlurmdParameters=config_overrides
KillWait=5
JobRequeue=1
SchedulerParameters=sched_interval=5,bf_interval=5
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=02:00:00 State=UP
PartitionName=batch Nodes=$host Default=NO MaxTime=INFINITE State=UP
EOF
  write_conf "$ETC/slurmdbd.conf" 600 <<EOF
$MARK: accounting for the local cluster.
AuthType=auth/munge
DbdHost=localhost
SlurmUser=root
PidFile=$STATE/run/slurmdbd.pid
LogFile=$STATE/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StoragePass=$DB_PASS
StorageLoc=slurm_acct_db
EOF
}

write_launcher_conf() {  # conf/local/slurm.yaml: hydra/launcher=slurm's settings for this cluster
  local cpus mem_mb mem_gb new
  cpus=$(nproc)
  mem_mb=$(free -m | awk '/^Mem:/ {print $2}')
  mem_mb=$((mem_mb > 2048 ? mem_mb - 1024 : mem_mb))
  mem_gb=$((mem_mb / 1024 / cpus))  # one job per CPU fits at once
  mem_gb=$((mem_gb < 1 ? 1 : mem_gb > 8 ? 8 : mem_gb))
  new="$MARK: hydra/launcher=slurm on the local cluster
# (one node: $cpus CPUs, $mem_mb MB, no GPUs; partition debug, the default, allows $DEBUG_LIMIT_MIN min).
# Rewritten by every \`up\`; delete the line above to keep your own edits.
gpus_per_node: null
cpus_per_task: 1
mem_gb: $mem_gb
timeout_min: $DEBUG_LIMIT_MIN"
  if [[ -e $LAUNCHER_CONF ]] && ! grep -qF "$MARK" "$LAUNCHER_CONF"; then
    say "$LAUNCHER_CONF is not this script's: left as is (this cluster needs" \
      "gpus_per_node: null, and timeout_min <= $DEBUG_LIMIT_MIN or partition: batch)"
    return 0
  fi
  if [[ -e $LAUNCHER_CONF ]] && [[ "$(cat "$LAUNCHER_CONF")" == "$new" ]]; then
    return 0
  fi
  say "writing $LAUNCHER_CONF"
  mkdir -p "$(dirname "$LAUNCHER_CONF")"
  printf '%s\n' "$new" >"$LAUNCHER_CONF"
}

start_munge() {
  if alive /run/munge/munged.pid; then say "munged already running"; return; fi
  say "starting munged"
  install -d -o munge -g munge -m 0755 /run/munge
  [[ -s /etc/munge/munge.key ]] || runuser -u munge -- mungekey --create
  runuser -u munge -- /usr/sbin/munged
  wait_for "munge" bash -c 'munge -n | unmunge'
}

start_mariadb() {
  if alive /run/mysqld/mysqld.pid; then
    say "mariadbd already running"
  else
    say "starting mariadbd"
    install -d -o mysql -g mysql -m 0755 /run/mysqld
    setsid /usr/sbin/mariadbd --user=mysql --bind-address=127.0.0.1 --socket=$DB_SOCKET \
      --pid-file=/run/mysqld/mysqld.pid >>"$STATE/log/mariadb.log" 2>&1 </dev/null &
    wait_for "mariadb" mariadb-admin --socket=$DB_SOCKET ping
  fi
  # The accounting database user; the password is the one in slurmdbd.conf.
  mariadb --socket=$DB_SOCKET -u root <<EOF
CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '$DB_PASS';
ALTER USER 'slurm'@'localhost' IDENTIFIED BY '$DB_PASS';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';
EOF
}

start_slurmdbd() {
  if alive "$STATE/run/slurmdbd.pid"; then say "slurmdbd already running"; return; fi
  say "starting slurmdbd"
  /usr/sbin/slurmdbd
  wait_for "slurmdbd" sacctmgr -n list cluster
}

register_cluster() {
  if [[ -n $(sacctmgr -n -P list cluster "$CLUSTER" format=Cluster) ]]; then return; fi
  say "registering cluster $CLUSTER in accounting"
  sacctmgr -i add cluster "$CLUSTER" >/dev/null
}

node_state() { sinfo -h -N -o %t 2>/dev/null | head -1; }

start_slurm() {
  if alive "$STATE/run/slurmctld.pid"; then
    say "slurmctld already running"
  else
    say "starting slurmctld"
    /usr/sbin/slurmctld
    wait_for "slurmctld" scontrol ping
  fi
  if alive "$STATE/run/slurmd.pid"; then
    say "slurmd already running"
  else
    say "starting slurmd"
    /usr/sbin/slurmd
  fi
  say "waiting for the node to be idle"
  local i state
  for ((i = 0; i < WAIT_S; i++)); do
    state=$(node_state)
    case $state in
      idle | mix | alloc | comp) say "node $(hostname -s): $state"; return 0 ;;
      drain* | down* | fail*)  # e.g. left down by an earlier run: it is healthy now that slurmd runs
        ((i % 5 == 0)) && scontrol update nodename="$(hostname -s)" state=resume >/dev/null 2>&1 || true ;;
    esac
    ((i > 0 && i % 10 == 0)) && say "still waiting for the node (state ${state:-unknown}, ${i} s)"
    sleep 1
  done
  die "node not idle after ${WAIT_S} s (state ${state:-unknown}); logs in $STATE/log"
}

up() {
  ((EUID == 0)) || die "run as root (it installs packages and starts daemons)"
  mkdir -p "$STATE"/{log,run,slurmctld,slurmd}
  install_packages
  DB_PASS=$(db_password)
  write_configs
  start_munge
  start_mariadb
  start_slurmdbd
  register_cluster
  start_slurm
  write_launcher_conf
  sinfo
}

stop_pid() {  # stop_pid NAME PIDFILE: SIGTERM, up to 30 s, then SIGKILL
  local name=$1 file=$2 pid i
  alive "$file" || { rm -f "$file"; return 0; }
  pid=$(cat "$file")
  say "stopping $name (pid $pid)"
  kill "$pid" 2>/dev/null || true
  for ((i = 0; i < 150; i++)); do
    kill -0 "$pid" 2>/dev/null || { rm -f "$file"; return 0; }
    sleep 0.2
  done
  say "$name did not stop in 30 s; killing it"
  kill -9 "$pid" 2>/dev/null || true
  rm -f "$file"
}

down() {
  if alive "$STATE/run/slurmctld.pid"; then
    local jobs
    jobs=$(squeue -h -o %A 2>/dev/null | sort -u | tr '\n' ' ')
    if [[ -n ${jobs// /} ]]; then
      say "cancelling jobs $jobs"
      # shellcheck disable=SC2086
      scancel $jobs || true
      local i
      for ((i = 0; i < 60; i++)); do
        [[ -z $(squeue -h -o %A 2>/dev/null) ]] && break
        sleep 1
      done
    fi
  fi
  stop_pid slurmd "$STATE/run/slurmd.pid"
  stop_pid slurmctld "$STATE/run/slurmctld.pid"
  stop_pid slurmdbd "$STATE/run/slurmdbd.pid"
  stop_pid mariadbd /run/mysqld/mysqld.pid
  stop_pid munged /run/munge/munged.pid
  say "down"
}

status() {
  local name file
  for name in munged:/run/munge/munged.pid mariadbd:/run/mysqld/mysqld.pid \
    slurmdbd:"$STATE/run/slurmdbd.pid" slurmctld:"$STATE/run/slurmctld.pid" slurmd:"$STATE/run/slurmd.pid"; do
    file=${name#*:}
    if alive "$file"; then echo "${name%%:*}: running (pid $(cat "$file"))"; else echo "${name%%:*}: stopped"; fi
  done
  if alive "$STATE/run/slurmctld.pid"; then sinfo; fi
}

case ${1:-} in
  up) up ;;
  down) down ;;
  status) status ;;
  *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
