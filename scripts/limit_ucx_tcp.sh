#!/usr/bin/env bash
# A link-bound transport on one host: rate-limit UCX's loopback TCP traffic (and nothing else) with Linux tc.
#
#   sudo RATE=256mbit bash scripts/limit_ucx_tcp.sh on    # then run engines with UCX_TLS=tcp,self and
#                                                         # UCX_TCP_PORT_RANGE=40960-41983 (printed below)
#   sudo bash scripts/limit_ucx_tcp.sh off                # remove the limit
#
# UCX's tcp transport listens on a port from UCX_TCP_PORT_RANGE; an htb class on `lo` caps every packet to or
# from ports 40960-41983 (0xA000/0xFC00) at RATE, other loopback traffic (HTTP, p2pkv's side channels) keeps its
# speed. Needs root (CAP_NET_ADMIN). Replaces any root qdisc on `lo`; `off` deletes it.
set -euo pipefail
RATE=${RATE:-256mbit}
case ${1:-} in
  on)
    tc qdisc del dev lo root 2>/dev/null || true
    tc qdisc add dev lo root handle 1: htb default 10 r2q 1000
    tc class add dev lo parent 1: classid 1:10 htb rate 100gbit quantum 200000
    tc class add dev lo parent 1: classid 1:20 htb rate "$RATE" ceil "$RATE" burst 256k cburst 256k quantum 65536
    tc filter add dev lo protocol ip parent 1: prio 1 u32 match ip dport 40960 0xfc00 flowid 1:20
    tc filter add dev lo protocol ip parent 1: prio 1 u32 match ip sport 40960 0xfc00 flowid 1:20
    echo "UCX tcp on lo limited to $RATE: run with UCX_TLS=tcp,self UCX_TCP_PORT_RANGE=40960-41983"
    ;;
  off)
    tc qdisc del dev lo root 2>/dev/null || true
    echo "lo: no limit"
    ;;
  *) echo "usage: $0 on|off (RATE=256mbit)" >&2; exit 2 ;;
esac
