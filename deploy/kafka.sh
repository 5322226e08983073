#!/usr/bin/env bash
# Single-node Apache Kafka (KRaft, no ZooKeeper, no Docker) for local runs and tests.
#
#   deploy/kafka.sh up       fetch jars (cached), format storage, start, wait until ready
#   deploy/kafka.sh down     stop the broker (graceful, then forced)
#   deploy/kafka.sh status   print "running <pid> on 127.0.0.1:<port>" or "stopped"
#   deploy/kafka.sh logs     tail the broker log
#   deploy/kafka.sh wipe     stop and delete the broker's data (keeps the jar cache)
#
# Settings (environment):
#   KAFKA_PORT      broker port on 127.0.0.1 (default 9092); controller uses KAFKA_PORT+1
#   KAFKA_HOME_DIR  state: data, logs, pid (default ~/.cache/streamtrain/kafka-<port>)
#   KAFKA_JAR_CACHE jar cache (default ~/.cache/streamtrain/kafka-jars)
#   KAFKA_HEAP_OPTS JVM heap (default -Xms256m -Xmx512m)
# Every command is idempotent.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
port="${KAFKA_PORT:-9092}"
controller_port="$((port + 1))"
cache_root="${XDG_CACHE_HOME:-$HOME/.cache}/streamtrain"
jar_dir="${KAFKA_JAR_CACHE:-$cache_root/kafka-jars}"
home_dir="${KAFKA_HOME_DIR:-$cache_root/kafka-$port}"
data_dir="$home_dir/data"
log_file="$home_dir/broker.log"
pid_file="$home_dir/broker.pid"
props="$home_dir/server.properties"
heap="${KAFKA_HEAP_OPTS:--Xms256m -Xmx512m}"
cluster_id="c3RyZWFtdHJhaW4tbG9jYWw"   # fixed: one local cluster, re-formatting is a no-op

die() { echo "kafka.sh: $*" >&2; exit 1; }

need_java() {
  command -v java >/dev/null 2>&1 || die "Java not found: install a JDK 17 (e.g. apt-get install openjdk-17-jre-headless)"
  local major
  major="$(java -version 2>&1 | sed -n 's/.*version "\([0-9]*\).*/\1/p' | head -n1)"
  [ "${major:-0}" -ge 17 ] || die "Java ${major:-unknown} found, Kafka 4.1 needs Java 17 or newer"
}

fetch_jars() {
  if [ -f "$jar_dir/.complete" ] && cmp -s "$here/kafka/pom.xml" "$jar_dir/.pom"; then return; fi
  command -v mvn >/dev/null 2>&1 || die "Maven not found: install it (e.g. apt-get install maven) to fetch the Kafka jars"
  echo "kafka.sh: resolving Kafka jars with Maven into $jar_dir" >&2
  rm -rf "$jar_dir.tmp" && mkdir -p "$jar_dir.tmp"
  mvn -q -B -f "$here/kafka/pom.xml" dependency:copy-dependencies \
      -DincludeScope=runtime -DoutputDirectory="$jar_dir.tmp" >&2 \
    || die "mvn dependency:copy-dependencies failed (see output above)"
  cp "$here/kafka/pom.xml" "$jar_dir.tmp/.pom" && touch "$jar_dir.tmp/.complete"
  rm -rf "$jar_dir" && mv "$jar_dir.tmp" "$jar_dir"
}

pid_alive() { [ -f "$pid_file" ] && kill -0 "$(cat "$pid_file")" 2>/dev/null; }

write_props() {
  mkdir -p "$data_dir"
  cat > "$props" <<PROPS
process.roles=broker,controller
node.id=1
controller.quorum.bootstrap.servers=127.0.0.1:$controller_port
listeners=PLAINTEXT://127.0.0.1:$port,CONTROLLER://127.0.0.1:$controller_port
advertised.listeners=PLAINTEXT://127.0.0.1:$port
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
PROPS
  single_node_props true >> "$props"
}

# What every single-node broker here shares: storage, one replica of the internal topics, the
# message limit; $1 is auto.create.topics.enable. deploy/kafka-secure.sh appends it too.
single_node_props() {
  cat <<PROPS
log.dirs=$data_dir
num.partitions=1
offsets.topic.replication.factor=1
offsets.topic.num.partitions=4
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
auto.create.topics.enable=$1
message.max.bytes=4194304
log.retention.hours=24
log.segment.bytes=67108864
PROPS
}

classpath() { echo "$jar_dir/*"; }

run_java() {
  # shellcheck disable=SC2086
  java $heap -XX:+UseG1GC -Djava.awt.headless=true \
    -Dlog4j2.configurationFile="$here/kafka/log4j2.yaml" \
    -cp "$(classpath)" "$@"
}

cmd_up() {
  if pid_alive; then echo "kafka.sh: already running (pid $(cat "$pid_file")) on 127.0.0.1:$port"; return; fi
  need_java
  fetch_jars
  mkdir -p "$home_dir"
  write_props
  run_java kafka.tools.StorageTool format --standalone --ignore-formatted \
      -t "$cluster_id" -c "$props" >>"$home_dir/format.log" 2>&1 \
    || { tail -n 20 "$home_dir/format.log" >&2; die "storage format failed"; }
  start_broker
  echo "kafka.sh: running (pid $(cat "$pid_file")) on 127.0.0.1:$port"
}

# Start kafka.Kafka on $props in the background ($pid_file, $log_file) and wait until it serves.
# deploy/kafka-secure.sh sources this file and calls it with its own paths.
start_broker() {
  : > "$log_file"
  nohup bash -c "exec java $heap -XX:+UseG1GC -Djava.awt.headless=true \
      -Dlog4j2.configurationFile='$here/kafka/log4j2.yaml' -cp '$(classpath)' kafka.Kafka '$props'" \
      >>"$log_file" 2>&1 < /dev/null &
  echo $! > "$pid_file"
  local deadline=$((SECONDS + ${KAFKA_START_TIMEOUT_S:-90}))
  until grep -q "Kafka Server started" "$log_file"; do
    if ! pid_alive; then tail -n 30 "$log_file" >&2; die "broker exited during start-up"; fi
    [ $SECONDS -lt $deadline ] || { tail -n 30 "$log_file" >&2; die "broker not ready after ${KAFKA_START_TIMEOUT_S:-90}s"; }
    sleep 0.5
  done
}

# Stop the broker of $pid_file: SIGTERM, up to 30 s for a clean shutdown, then SIGKILL.
stop_broker() {
  if pid_alive; then
    local pid; pid="$(cat "$pid_file")"
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$pid_file"
}

cmd_down() {
  stop_broker
  echo "kafka.sh: stopped"
}

cmd_status() {
  if pid_alive; then echo "running $(cat "$pid_file") on 127.0.0.1:$port"; else echo "stopped"; return 3; fi
}

case "${1:-}" in
  up) cmd_up ;;
  down) cmd_down ;;
  status) cmd_status ;;
  logs) tail -n "${2:-100}" -f "$log_file" ;;
  wipe) cmd_down; rm -rf "$home_dir" ;;
  *) echo "usage: deploy/kafka.sh up|down|status|logs|wipe" >&2; exit 2 ;;
esac
