#!/usr/bin/env bash
# The local cluster's shared settings and helpers, sourced by `up`, `down` and `status`.
#
# Everything listens on loopback. Ports (fixed by the contract: 15432 and 15433):
#   HAProxy      15432 writes (the leader, Patroni REST /primary)
#                15433 reads  (the replicas, Patroni REST /replica)
#   PostgreSQL   15501 15502 15503   (nodes node1 node2 node3)
#   Patroni REST 18001 18002 18003
#   etcd         12379 (clients) 12380 (peers)
# Data and logs live under $STOCKD_CLUSTER_DIR (default a directory under
# the system's temporary directory), which `down` removes.
set -euo pipefail

CLUSTER_DIR="${STOCKD_CLUSTER_DIR:-${TMPDIR:-/tmp}/stockd-local-cluster}"
CLUSTER_SCOPE="stockd-local"
NODES=(node1 node2 node3)
WRITE_PORT=15432
READ_PORT=15433
ETCD_CLIENT_PORT=12379
ETCD_PEER_PORT=12380
PG_BIN_DIR="${STOCKD_CLUSTER_PG_BIN_DIR:-$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n1)}"
# Seconds `up` waits for a leader and two streaming replicas before it gives up.
UP_TIMEOUT_SECONDS="${STOCKD_CLUSTER_UP_TIMEOUT_SECONDS:-120}"

node_index() { # node1 -> 1
    echo "${1#node}"
}
node_pg_port() { echo $((15500 + $(node_index "$1"))); }
node_rest_port() { echo $((18000 + $(node_index "$1"))); }

write_url() { echo "postgres://postgres@127.0.0.1:${WRITE_PORT}/postgres"; }
read_url() { echo "postgres://postgres@127.0.0.1:${READ_PORT}/postgres"; }

log() { echo "local-cluster: $*" >&2; }

# PostgreSQL refuses to run as root: as root, Patroni (and so PostgreSQL) runs as the
# `postgres` user the Debian package creates.
as_database_user() {
    if [ "$(id -u)" = 0 ]; then
        runuser -u postgres -- "$@"
    else
        "$@"
    fi
}

port_open() {
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}


# Processes are found by their command lines, which name this cluster's directory: a pid
# file would hold the pid of `runuser`, not of Patroni, and PostgreSQL's children outlive
# a killed postmaster.
patroni_pattern() { # node (or "node" for all)
    echo "patroni $CLUSTER_DIR/$1"
}
postgres_pattern() {
    echo "$CLUSTER_DIR/node[0-9]/data"
}
etcd_pattern() {
    echo "etcd --name stockd-etcd --data-dir $CLUSTER_DIR/etcd"
}
haproxy_pattern() {
    echo "haproxy -D -f $CLUSTER_DIR/haproxy.cfg"
}
running() { # pattern
    pgrep -f -- "$1" >/dev/null 2>&1
}

# Whether Patroni's REST API on `node` answers 200 to `path` (/primary, /replica).
rest_ok() { # node path
    curl -s -o /dev/null -w '%{http_code}' --max-time 2 \
        "http://127.0.0.1:$(node_rest_port "$1")$2" 2>/dev/null | grep -q 200
}

# The name of the node Patroni reports as leader, or nothing.
leader_node() {
    local node
    for node in "${NODES[@]}"; do
        if rest_ok "$node" /primary; then
            echo "$node"
            return 0
        fi
    done
    return 0
}

# The number of nodes Patroni reports as streaming replicas.
replica_count() {
    local node count=0
    for node in "${NODES[@]}"; do
        if rest_ok "$node" /replica; then
            count=$((count + 1))
        fi
    done
    echo "$count"
}

cluster_ready() {
    [ -n "$(leader_node)" ] && [ "$(replica_count)" -ge 2 ] \
        && port_open "$WRITE_PORT" && port_open "$READ_PORT" \
        && "$PG_BIN_DIR/psql" -h 127.0.0.1 -p "$WRITE_PORT" -U postgres -d postgres -Atqc \
            "SELECT NOT pg_is_in_recovery()" 2>/dev/null | grep -q t
}
