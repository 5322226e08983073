#!/usr/bin/env bash
# A three-broker Apache Kafka cluster (KRaft) on one machine, for failover runs and tests:
# three JVMs, each a combined broker + controller (a quorum of three voters), own ports,
# own data directory.
#
#   deploy/kafka-cluster.sh up              format (first run) and start the three nodes, wait until all serve
#   deploy/kafka-cluster.sh down            stop every node (graceful, then forced)
#   deploy/kafka-cluster.sh status          one line per node: "node <id> running <pid> on 127.0.0.1:<port>" or
#                                           "node <id> stopped"; exit status 0 only when all three run
#   deploy/kafka-cluster.sh kill <id>       SIGKILL node <id> (1, 2 or 3): no controlled shutdown
#   deploy/kafka-cluster.sh stop <id>       stop node <id> gracefully
#   deploy/kafka-cluster.sh start <id>      start node <id> again (data kept), wait until it serves
#   deploy/kafka-cluster.sh leader <topic> <partition>
#                                           the node id leading that partition and its in-sync replicas
#   deploy/kafka-cluster.sh bootstrap       the clients' bootstrap list (127.0.0.1:p1,127.0.0.1:p2,127.0.0.1:p3)
#   deploy/kafka-cluster.sh logs <id>       tail node <id>'s log
#   deploy/kafka-cluster.sh wipe            stop and delete every node's data (keeps the jar cache)
#
# Ports on 127.0.0.1 (base KAFKA_CLUSTER_PORT, default 29092; 9092/9093 are deploy/kafka.sh's,
# 9192-9194 deploy/kafka-secure.sh's, 19092/19093 scripts/gpu-check.sh's):
#   base, base + 1, base + 2           the clients' listeners of nodes 1, 2, 3
#   base + 100, base + 101, base + 102 their controller listeners
# Topics default to replication 3 with min.insync.replicas=2 (so are the group offsets and the
# transaction log): a topic stays writable with acks=all while one node is down, and readable
# while two are.
#
# Settings (environment): KAFKA_CLUSTER_PORT, KAFKA_CLUSTER_HOME (default
# ~/.cache/streamtrain/kafka-cluster-<port>), KAFKA_CLUSTER_HEAP_OPTS (default -Xms128m -Xmx384m
# per node), PYTHON (for "leader": .venv/bin/python); the jar cache of deploy/kafka.sh.
# Every command is idempotent.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# deploy/kafka.sh's functions (need_java, fetch_jars, run_java, start_broker, stop_broker, pid_alive)
# and its jar cache: sourcing it runs its read-only "status" command, whose output and exit status
# are dropped here. Its functions work on $props, $log_file, $pid_file and $heap, set per node below.
# shellcheck source=kafka.sh
source "$here/kafka.sh" status >/dev/null 2>&1 || true
set -euo pipefail

base="${KAFKA_CLUSTER_PORT:-29092}"
cluster_home="${KAFKA_CLUSTER_HOME:-$cache_root/kafka-cluster-$base}"
heap="${KAFKA_CLUSTER_HEAP_OPTS:--Xms128m -Xmx384m}"
python="${PYTHON:-$here/../.venv/bin/python}"
cluster_id="c3RyZWFtdHJhaW4tM2Jyaw"   # base64 of "streamtrain-3brk": fixed, re-formatting is a no-op
nodes=(1 2 3)

die() { echo "kafka-cluster.sh: $*" >&2; exit 1; }

client_port() { echo "$((base + $1 - 1))"; }
controller_port() { echo "$((base + 100 + $1 - 1))"; }

bootstrap() {
  local list=() id
  for id in "${nodes[@]}"; do list+=("127.0.0.1:$(client_port "$id")"); done
  (IFS=,; echo "${list[*]}")
}

voters() {
  local list=() id
  for id in "${nodes[@]}"; do list+=("$id@127.0.0.1:$(controller_port "$id")"); done
  (IFS=,; echo "${list[*]}")
}

# Point kafka.sh's globals at node $1.
use_node() {
  case "$1" in 1|2|3) ;; *) die "no node '$1' (nodes: ${nodes[*]})" ;; esac
  node="$1"
  home_dir="$cluster_home/node-$node"
  data_dir="$home_dir/data"
  log_file="$home_dir/broker.log"
  pid_file="$home_dir/broker.pid"
  props="$home_dir/server.properties"
  port="$(client_port "$node")"
}

write_props() {
  mkdir -p "$data_dir"
  cat > "$props" <<PROPS
process.roles=broker,controller
node.id=$node
controller.quorum.voters=$(voters)
listeners=PLAINTEXT://127.0.0.1:$port,CONTROLLER://127.0.0.1:$(controller_port "$node")
advertised.listeners=PLAINTEXT://127.0.0.1:$port
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
log.dirs=$data_dir
num.partitions=3
default.replication.factor=3
min.insync.replicas=2
offsets.topic.replication.factor=3
offsets.topic.num.partitions=4
transaction.state.log.replication.factor=3
transaction.state.log.min.isr=2
share.coordinator.state.topic.replication.factor=3
share.coordinator.state.topic.min.isr=2
unclean.leader.election.enable=false
group.initial.rebalance.delay.ms=0
auto.create.topics.enable=false
message.max.bytes=4194304
replica.fetch.max.bytes=4194304
log.retention.hours=24
log.segment.bytes=67108864
num.network.threads=2
num.io.threads=4
num.replica.fetchers=1
PROPS
}

format_node() {
  mkdir -p "$home_dir"
  write_props
  run_java kafka.tools.StorageTool format --ignore-formatted -t "$cluster_id" -c "$props" \
      >>"$home_dir/format.log" 2>&1 \
    || { tail -n 20 "$home_dir/format.log" >&2; die "storage format of node $node failed"; }
}

cmd_up() {
  need_java
  fetch_jars
  local id starting=() pids=()
  for id in "${nodes[@]}"; do
    use_node "$id"
    if pid_alive; then continue; fi
    format_node
    starting+=("$id")
  done
  # A node finishes starting only once a quorum of controllers is up: start them together.
  for id in "${starting[@]}"; do
    ( use_node "$id"; start_broker ) &
    pids+=($!)
  done
  local failed=0 pid
  for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
  [ "$failed" = 0 ] || die "a node did not start (see its log under $cluster_home)"
  cmd_status
}

cmd_start() {
  need_java
  fetch_jars
  use_node "$1"
  if pid_alive; then echo "kafka-cluster.sh: node $node already running (pid $(cat "$pid_file"))"; return; fi
  format_node
  start_broker
  echo "kafka-cluster.sh: node $node running (pid $(cat "$pid_file")) on 127.0.0.1:$port"
}

cmd_kill() {
  use_node "$1"
  if pid_alive; then
    local pid; pid="$(cat "$pid_file")"
    kill -KILL "$pid" 2>/dev/null || true
    for _ in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
    echo "kafka-cluster.sh: node $node killed (pid $pid)"
  else
    echo "kafka-cluster.sh: node $node not running"
  fi
  rm -f "$pid_file"
}

cmd_stop() {
  use_node "$1"
  stop_broker
  echo "kafka-cluster.sh: node $node stopped"
}

cmd_down() {
  # in parallel: a node waiting for its controller quorum to shut down cleanly needs the others up
  local id pids=()
  for id in "${nodes[@]}"; do
    ( use_node "$id"; stop_broker ) &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || true; done
  echo "kafka-cluster.sh: stopped"
}

cmd_status() {
  local id all=0
  for id in "${nodes[@]}"; do
    use_node "$id"
    if pid_alive; then echo "node $id running $(cat "$pid_file") on 127.0.0.1:$port"
    else echo "node $id stopped"; all=3; fi
  done
  return "$all"
}

cmd_leader() {
  [ $# -eq 2 ] || die "usage: deploy/kafka-cluster.sh leader <topic> <partition>"
  KC_BOOTSTRAP="$(bootstrap)" KC_TOPIC="$1" KC_PARTITION="$2" "$python" - <<'PY'
import os

from kafka.admin import KafkaAdminClient

admin = KafkaAdminClient(bootstrap_servers=os.environ["KC_BOOTSTRAP"], request_timeout_ms=10000)
try:
    (topic,) = admin.describe_topics([os.environ["KC_TOPIC"]])
finally:
    admin.close()
if topic.get("error_code"):
    raise SystemExit(f"topic {os.environ['KC_TOPIC']}: error {topic['error_code']}")
wanted = int(os.environ["KC_PARTITION"])
for partition in topic["partitions"]:
    if partition["partition_index"] == wanted:
        isr = ",".join(str(n) for n in partition["isr_nodes"])
        print(f"leader {partition['leader_id']} isr {isr}")
        break
else:
    raise SystemExit(f"topic {os.environ['KC_TOPIC']} has no partition {wanted}")
PY
}

case "${1:-}" in
  up) cmd_up ;;
  down) cmd_down ;;
  status) cmd_status ;;
  kill) [ $# -eq 2 ] || die "usage: kill <node-id>"; cmd_kill "$2" ;;
  stop) [ $# -eq 2 ] || die "usage: stop <node-id>"; cmd_stop "$2" ;;
  start) [ $# -eq 2 ] || die "usage: start <node-id>"; cmd_start "$2" ;;
  leader) shift; cmd_leader "$@" ;;
  bootstrap) bootstrap ;;
  logs) [ $# -ge 2 ] || die "usage: logs <node-id> [lines]"; use_node "$2"; tail -n "${3:-100}" -f "$log_file" ;;
  wipe) cmd_down; rm -rf "$cluster_home" ;;
  *) echo "usage: deploy/kafka-cluster.sh up|down|status|kill <id>|stop <id>|start <id>|leader <topic> <partition>|bootstrap|logs <id>|wipe" >&2; exit 2 ;;
esac
