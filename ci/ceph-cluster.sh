#!/usr/bin/env bash
# A throw-away single-node Ceph cluster on 127.0.0.1, for the RBD tests, the
# benchmarks and the manual's RBD recipe (docs/manual/ceph.md):
#
#   ci/ceph-cluster.sh start DIR [--parent PID]   prints DIR/ceph.conf when ready
#   ci/ceph-cluster.sh up DIR      prints DIR/ceph.conf if its daemons run, else fails
#   ci/ceph-cluster.sh stop DIR
#
# One monitor and one OSD, no manager, no authentication, pool "rbd" initialised;
# every file (configuration, stores, logs, sockets) under DIR, nothing in /etc/ceph
# or /var/lib/ceph. Clients take `-c DIR/ceph.conf` (rbd, rados, ceph), CEPH_CONF
# (fio's rbd engine, qemu) or `:conf=DIR/ceph.conf` in a dmkit `rbd:` name.
# With --parent, the cluster stops by itself once process PID has exited.
#
# CEPH_STORE=memstore (default: data in the OSD's memory, about 3x the bytes
# written, lost when the OSD stops) or bluestore (a sparse 10 GiB file in DIR,
# which must not be on tmpfs; survives an OSD restart).
#
# Measured on Ceph 16.2 (Debian 12), and why the configuration is what it is:
# the monitor speaks msgr2 only (with msgr v1 about one start in five failed with
# "wrong fsid"); paxos_propose_interval 0.1 starts it in about 2 s instead of 8;
# readiness is probed with real I/O (`ceph -s` warns about the missing manager
# for ever); the OSD stops before the monitor (else it waits 5 s for an ack).
# Only the PIDs recorded in DIR/pids are ever signalled.
set -euo pipefail

usage() { echo "usage: $0 start DIR [--parent PID] | up DIR | stop DIR" >&2; exit 2; }
[ $# -ge 2 ] || usage
cmd=$1
self=$(realpath "$0")
D=$(realpath -m "$2")
shift 2
parent=
if [ "${1-}" = --parent ]; then parent=${2:?}; fi
C=$D/ceph.conf
store=${CEPH_STORE:-memstore}

log() { echo "ceph-cluster: $*" >&2; }
die() { log "$*"; exit 1; }

# PID START-TIME pairs guard against signalling a reused PID
starttime() { local s; s=$(cat "/proc/$1/stat" 2>/dev/null) || return 1; s=${s##*) }; set -- $s; echo "${20}"; }
alive() { [ "$(starttime "$1" 2>/dev/null)" = "$2" ]; }

stop_one() { # NAME: SIGTERM, up to 30 s, then SIGKILL
  local f=$D/pids/$1 pid st i
  [ -f "$f" ] || return 0
  read -r pid st <"$f"
  alive "$pid" "$st" || return 0
  kill -TERM "$pid" 2>/dev/null || true
  for i in $(seq 300); do alive "$pid" "$st" || return 0; sleep 0.1; done
  kill -KILL "$pid" 2>/dev/null || true
}

stop() {
  [ -d "$D" ] || return 0
  [ -f "$D/.ceph-cluster" ] || die "$D was not made by $0; not touching it"
  stop_one osd.0
  stop_one mon.a
  rm -rf "$D"
}

# run a step with a time limit, output to the log
step() { timeout 60 "$@" >>"$D/log/setup.log" 2>&1; }
# retry a probe for up to 60 s
until_ok() {
  local what=$1 i
  shift
  for i in $(seq 240); do "$@" && return 0; sleep 0.25; done
  log "$what not ready in 60 s"
  return 1
}

spawn() { # NAME CMD...: a daemon in the foreground mode, PID recorded
  local name=$1 pid
  shift
  "$@" </dev/null >>"$D/log/$name.out" 2>&1 &
  pid=$!
  echo "$pid $(starttime "$pid")" >"$D/pids/$name"
}

ceph_() { timeout 20 ceph -c "$C" --connect-timeout 10 "$@" 2>>"$D/log/setup.log"; }
osd_up() { ceph_ osd stat -f json | grep -q '"num_up_osds":1[,}]'; }
io_ok() {
  local r=(timeout 15 rados -c "$C" --rados-osd-op-timeout 10 -p rbd)
  "${r[@]}" put probe "$D/probe" 2>>"$D/log/setup.log" &&
    "${r[@]}" get probe "$D/probe.back" 2>>"$D/log/setup.log" &&
    cmp -s "$D/probe" "$D/probe.back"
}

start() {
  local port fsid osd
  for b in ceph-mon ceph-osd ceph rados rbd monmaptool; do
    command -v "$b" >/dev/null || die "$b missing (ci/install.sh installs Ceph)"
  done
  [ ! -e "$D" ] || [ -z "$(ls -A "$D")" ] || die "$D exists and is not empty"
  mkdir -p "$D"/{log,run,crash,pids,mon.a,osd.0}
  touch "$D/.ceph-cluster" "$D/keyring"
  trap 'log "start failed; logs:"; tail -n 20 "$D"/log/* >&2 || true; stop' ERR
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  fsid=$(cat /proc/sys/kernel/random/uuid)
  cat >"$C" <<EOF
[global]
fsid = $fsid
mon_host = v2:127.0.0.1:$port
public_addr = 127.0.0.1
cluster_addr = 127.0.0.1
ms_bind_msgr1 = false
ms_bind_ipv6 = false
auth_cluster_required = none
auth_service_required = none
auth_client_required = none
keyring = $D/keyring
run_dir = $D/run
crash_dir = $D/crash
osd_pool_default_size = 1
osd_pool_default_min_size = 1
osd_pool_default_pg_num = 8
osd_pool_default_pgp_num = 8
osd_pool_default_pg_autoscale_mode = off
osd_crush_chooseleaf_type = 0
mon_allow_pool_size_one = true
mon_allow_pool_delete = true
mon_warn_on_pool_no_redundancy = false
mon_data_avail_warn = 2
mon_data_avail_crit = 1
paxos_propose_interval = 0.1
osd_objectstore = $store
memstore_device_bytes = 4294967296
bluestore_block_size = 10737418240
bluestore_block_create = true
bluestore_fsck_on_mkfs = false
osd_memory_target = 1073741824
rados_osd_op_timeout = 60

[mon]
mon_data = $D/mon.\$id
log_file = $D/log/\$name.log
admin_socket = $D/run/\$name.asok
mon_cluster_log_file = $D/log/cluster.\$channel.log

[osd]
osd_data = $D/osd.\$id
log_file = $D/log/\$name.log
admin_socket = $D/run/\$name.asok
EOF
  step monmaptool --create --clobber --fsid "$fsid" --addv a "[v2:127.0.0.1:$port]" "$D/monmap"
  step ceph-mon -c "$C" -i a --mkfs --monmap "$D/monmap" --keyring "$D/keyring"
  spawn mon.a ceph-mon -c "$C" -i a -f
  until_ok monitor ceph_ mon dump >/dev/null
  osd=$(cat /proc/sys/kernel/random/uuid)
  [ "$(ceph_ osd new "$osd")" = 0 ] || die "osd new did not give id 0"
  step ceph-osd -c "$C" -i 0 --mkfs --osd-uuid "$osd"
  spawn osd.0 ceph-osd -c "$C" -i 0 -f
  until_ok OSD osd_up
  ceph_ osd pool create rbd 8 8 replicated >/dev/null
  until_ok "rbd pool init" step rbd -c "$C" pool init rbd
  echo "$fsid" >"$D/probe"
  until_ok I/O io_ok
  trap - ERR
  if [ -n "$parent" ]; then
    # stop with the parent; detached, so the caller's pipes close
    setsid bash -c "while kill -0 $parent 2>/dev/null; do sleep 1; done; exec '$self' stop '$D'" \
      </dev/null >/dev/null 2>&1 &
  fi
  echo "$C"
}

# both daemons of the cluster in DIR still run (their recorded PIDs and start
# times)
up() {
  local name pid st
  [ -f "$D/.ceph-cluster" ] || return 1
  for name in mon.a osd.0; do
    [ -f "$D/pids/$name" ] || return 1
    read -r pid st <"$D/pids/$name"
    alive "$pid" "$st" || return 1
  done
  echo "$C"
}

case $cmd in
  start) start ;;
  up) up ;;
  stop) stop ;;
  *) usage ;;
esac
