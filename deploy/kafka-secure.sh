#!/usr/bin/env bash
# A secured single-node Apache Kafka (KRaft) for local runs and tests: TLS, SASL, ACLs.
#
#   deploy/kafka-secure.sh up       certificates + users (first run), format, start, topics and ACLs
#   deploy/kafka-secure.sh down     stop the broker (graceful, then forced)
#   deploy/kafka-secure.sh status   print "running <pid> on 127.0.0.1:<ssl port>,<sasl_ssl port>" or "stopped"
#   deploy/kafka-secure.sh renew-certificate [DAYS]   a new broker key and certificate from the
#                                   same CA, restart on it; data, users and ACLs kept
#   deploy/kafka-secure.sh wipe     stop and delete its data, certificates and passwords
#
# Listeners on 127.0.0.1 (base port KAFKA_SECURE_PORT, default 9192):
#   base      SSL with client certificates required (mutual TLS; CN=<name> is principal User:<name>)
#   base + 1  SASL_SSL, SCRAM-SHA-512 (users created at storage format time)
#   base + 2  the controller (PLAINTEXT, so its principal User:ANONYMOUS is a super user)
# StandardAuthorizer with allow.everyone.if.no.acl.found=false: no ACL means denied.
#
# Principals (passwords: random hex, made once, in $KAFKA_SECURE_HOME/secrets/<name>.password):
#   admin   super user; creates the topics and the ACLs (from Python, kafka-python's admin client)
#   svc     the service: exactly the minimal ACL set of docs/operations.md (SCRAM, or the client
#           certificate secrets/svc.pem + svc.key over mutual TLS)
#   sim     the simulator: WRITE on the topic
#   denied  no ACL at all (SCRAM, or secrets/denied.pem + denied.key)
# The CA every client trusts: secrets/ca.pem. The server certificate has
# subjectAltName=IP:127.0.0.1,DNS:localhost.
#
# Settings (environment): KAFKA_SECURE_PORT, KAFKA_SECURE_HOME (default
# ~/.cache/streamtrain/kafka-secure-<port>), KAFKA_SECURE_TOPIC (sensor-events),
# KAFKA_SECURE_GROUP (streamtrain), KAFKA_SECURE_PARTITIONS (3), PYTHON (.venv/bin/python);
# the jar cache and JVM settings of deploy/kafka.sh. Every command is idempotent.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# deploy/kafka.sh's functions (need_java, fetch_jars, run_java, start_broker, stop_broker) and its
# jar cache: sourcing it runs its read-only "status" command, whose output and exit status are
# dropped here.
# shellcheck source=kafka.sh
source "$here/kafka.sh" status >/dev/null 2>&1 || true
set -euo pipefail

port="${KAFKA_SECURE_PORT:-9192}"
sasl_port="$((port + 1))"
controller_port="$((port + 2))"
home_dir="${KAFKA_SECURE_HOME:-$cache_root/kafka-secure-$port}"
data_dir="$home_dir/data"
secrets="$home_dir/secrets"
log_file="$home_dir/broker.log"
pid_file="$home_dir/broker.pid"
props="$home_dir/server.properties"
topic="${KAFKA_SECURE_TOPIC:-sensor-events}"
group="${KAFKA_SECURE_GROUP:-streamtrain}"
partitions="${KAFKA_SECURE_PARTITIONS:-3}"
python="${PYTHON:-$here/../.venv/bin/python}"
cluster_id="c3RyZWFtdHJhaW4tc2VjdXJl"
users=(admin svc sim denied)

die() { echo "kafka-secure.sh: $*" >&2; exit 1; }

password() { cat "$secrets/$1.password"; }

# sign NAME CN EXTENSIONS [DAYS]: a new key and a certificate for CN signed by the CA (in $secrets)
sign() {
  (
    cd "$secrets"
    openssl req -newkey rsa:2048 -nodes -sha256 -subj "/CN=$2" -keyout "$1.rsa" -out "$1.csr" 2>/dev/null
    printf '%s\n' "$3" > "$1.ext"
    openssl x509 -req -in "$1.csr" -CA ca.pem -CAkey ca.key -CAcreateserial -days "${4:-30}" -sha256 \
      -extfile "$1.ext" -out "$1.pem" 2>/dev/null
    openssl pkcs8 -topk8 -nocrypt -in "$1.rsa" -out "$1.key"
    rm -f "$1.rsa" "$1.csr" "$1.ext"
    chmod 600 "$1.pem" "$1.key"
  )
}

# the broker's certificate, valid for DAYS, as its PEM keystore
server_certificate() {
  sign server localhost "subjectAltName=IP:127.0.0.1,DNS:localhost" "${1:-30}"
  (cd "$secrets" && cat server.key server.pem > server.keystore.pem && chmod 600 server.keystore.pem)
}

make_secrets() {
  [ -f "$secrets/.complete" ] && return
  command -v openssl >/dev/null 2>&1 || die "openssl not found: install it (apt-get install openssl)"
  rm -rf "$secrets" && mkdir -p "$secrets" && chmod 700 "$secrets"
  (
    cd "$secrets"
    openssl req -x509 -newkey rsa:2048 -nodes -sha256 -days 30 -subj "/CN=streamtrain local CA" \
      -keyout ca.key -out ca.pem 2>/dev/null
  )
  server_certificate 30
  sign svc svc "extendedKeyUsage=clientAuth"
  sign denied denied "extendedKeyUsage=clientAuth"
  (cd "$secrets" && for user in "${users[@]}"; do openssl rand -hex 16 > "$user.password"; done && chmod 600 ./*)
  touch "$secrets/.complete"
}

write_props() {
  mkdir -p "$data_dir"
  cat > "$props" <<PROPS
process.roles=broker,controller
node.id=1
controller.quorum.bootstrap.servers=127.0.0.1:$controller_port
listeners=SSL://127.0.0.1:$port,SASL_SSL://127.0.0.1:$sasl_port,CONTROLLER://127.0.0.1:$controller_port
advertised.listeners=SSL://127.0.0.1:$port,SASL_SSL://127.0.0.1:$sasl_port
controller.listener.names=CONTROLLER
inter.broker.listener.name=SSL
listener.security.protocol.map=SSL:SSL,SASL_SSL:SASL_SSL,CONTROLLER:PLAINTEXT
ssl.keystore.type=PEM
ssl.keystore.location=$secrets/server.keystore.pem
ssl.truststore.type=PEM
ssl.truststore.location=$secrets/ca.pem
listener.name.ssl.ssl.client.auth=required
ssl.principal.mapping.rules=RULE:^CN=([^,]+)\$/\$1/,DEFAULT
sasl.enabled.mechanisms=SCRAM-SHA-512
listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required;
authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer
allow.everyone.if.no.acl.found=false
super.users=User:ANONYMOUS;User:localhost;User:admin
PROPS
  single_node_props false >> "$props"
}

# Topics and the minimal ACL set of docs/operations.md, created as the super user admin.
grant() {
  KS_BOOTSTRAP="127.0.0.1:$sasl_port" KS_CA="$secrets/ca.pem" KS_PASSWORD="$(password admin)" \
  KS_SIM_PASSWORD="$(password sim)" KS_TOPIC="$topic" KS_GROUP="$group" KS_PARTITIONS="$partitions" \
  "$python" - <<'PY'
import os

from kafka.admin import (ACL, ACLOperation, ACLPermissionType, KafkaAdminClient, NewTopic, ResourcePattern,
                         ResourceType)
from kafka.errors import TopicAlreadyExistsError

env = os.environ
topic, dlq, group = env["KS_TOPIC"], env["KS_TOPIC"] + ".dlq", env["KS_GROUP"]
admin = KafkaAdminClient(
    bootstrap_servers=env["KS_BOOTSTRAP"], security_protocol="SASL_SSL", ssl_cafile=env["KS_CA"],
    sasl_mechanism="SCRAM-SHA-512", sasl_plain_username="admin", sasl_plain_password=env["KS_PASSWORD"],
    request_timeout_ms=20000,
)
partitions = int(env["KS_PARTITIONS"])
limit = 1 << 20  # the service's MAX_MESSAGE_BYTES; its .dlq takes that plus 64 KiB of headers (topics.py)
for new in (NewTopic(topic, partitions, 1, topic_configs={"max.message.bytes": str(limit)}),
            NewTopic(dlq, partitions, 1, topic_configs={"max.message.bytes": str(limit + 65536)})):
    try:
        admin.create_topics([new], timeout_ms=20000)
    except TopicAlreadyExistsError:
        pass
T, G = ResourceType.TOPIC, ResourceType.GROUP
O = ACLOperation
wanted = [
    ("User:svc", O.READ, T, topic), ("User:svc", O.DESCRIBE_CONFIGS, T, topic),
    ("User:svc", O.WRITE, T, dlq), ("User:svc", O.DESCRIBE_CONFIGS, T, dlq),
    ("User:svc", O.READ, G, group),
    ("User:sim", O.WRITE, T, topic),
]
acls = [ACL(principal, "*", operation, ACLPermissionType.ALLOW, ResourcePattern(kind, name))
        for principal, operation, kind, name in wanted]
result = admin.create_acls(acls)
if result["failed"]:
    raise SystemExit(f"creating ACLs failed: {result['failed']}")
admin.close()
PY
}

cmd_up() {
  if pid_alive; then echo "kafka-secure.sh: already running (pid $(cat "$pid_file")) on 127.0.0.1:$port,$sasl_port"; return; fi
  need_java
  fetch_jars
  mkdir -p "$home_dir"
  make_secrets
  write_props
  local scram=()
  for user in "${users[@]}"; do scram+=(--add-scram "SCRAM-SHA-512=[name=$user,password=$(password "$user")]"); done
  run_java kafka.tools.StorageTool format --standalone --ignore-formatted \
      -t "$cluster_id" -c "$props" "${scram[@]}" >>"$home_dir/format.log" 2>&1 \
    || { tail -n 20 "$home_dir/format.log" >&2; die "storage format failed"; }
  start_broker
  grant || die "creating the topics and ACLs as admin failed"
  echo "kafka-secure.sh: running (pid $(cat "$pid_file")) on 127.0.0.1:$port (SSL), 127.0.0.1:$sasl_port (SASL_SSL); secrets in $secrets"
}

cmd_down() {
  stop_broker
  echo "kafka-secure.sh: stopped"
}

cmd_status() {
  if pid_alive; then echo "running $(cat "$pid_file") on 127.0.0.1:$port,$sasl_port"; else echo "stopped"; return 3; fi
}

# A new broker key and certificate from the same CA (DAYS, default 30), then a restart on it, data,
# users and ACLs kept: what renewing a broker's certificate looks like to a client. (Kafka refuses
# to start on an expired or foreign certificate of its own.)
cmd_renew() {
  [ -f "$secrets/.complete" ] || die "no certificates yet: run up first"
  server_certificate "${1:-30}"
  if pid_alive; then stop_broker; fi
  start_broker
  echo "kafka-secure.sh: broker certificate renewed (${1:-30} days), running (pid $(cat "$pid_file"))"
}

case "${1:-}" in
  up) cmd_up ;;
  down) cmd_down ;;
  status) cmd_status ;;
  renew-certificate) cmd_renew "${2:-30}" ;;
  wipe) cmd_down; rm -rf "$home_dir" ;;
  *) echo "usage: deploy/kafka-secure.sh up|down|status|renew-certificate [DAYS]|wipe" >&2; exit 2 ;;
esac
