#!/usr/bin/env bash
# tests/cluster/cluster.sh: a simulated cluster on this machine, for tests.
#
#   source tests/cluster/cluster.sh
#   cluster_up N [RATE]          N nodes, node1 .. nodeN: each a network namespace
#                                with its own eth0 address, joined to the others
#                                by a veth pair on one bridge; RATE (tc tbf, e.g.
#                                1gbit) on both ends of every link, none if omitted
#   cluster_run NODE CMD...      runs CMD inside NODE: its network, and a UTS
#                                namespace where gethostname() is NODE; node names
#                                resolve through the node's own /etc/hosts
#   cluster_ip NODE              NODE's address
#   cluster_cut_off NODE         NODE's link cut, no connection closed (its processes
#                                stay, unreachable: freeze them for a host without power)
#   cluster_new_host NODE        a new host with the name and addresses of NODE, cut off
#   cluster_hosts_loopback NODE  NODE's /etc/hosts maps NODE to 127.0.1.1, as
#                                Debian does for a machine's own name
#   cluster_exit_hook=CMD        also run CMD when the shell exits (set before cluster_up)
#   cluster_workers NODE         pids of the dtrain workers running in NODE (RANK in
#                                their environment)
#   cluster_pids NODE            pids of every process in NODE (a whole host, to
#                                freeze with SIGSTOP)
#   cluster_agent NODE PROGRAM   pid of the agent PROGRAM runs in NODE: the oldest
#                                process running PROGRAM without RANK (not a worker)
#                                whose parent does not (not the agent's warden)
#   cluster_rsh                  path of an ssh stand-in for mpirun
#                                (--mca plm_rsh_agent), which runs in the named node
#   cluster_fail MESSAGE         FAILED: MESSAGE, the tail of each $work/*.out and
#                                *.err, exit 1
#
# Everything it makes is removed when the sourcing shell exits, and by a
# guardian in a session of its own when that shell is killed (SIGKILL too):
# namespaces with every process in them, links, the bridge, /etc/netns files.
# Without root, `ip`, `tc` or namespaces it prints "SKIPPED: <why>" and exits 77.

cluster_id=$$
cluster_nodes=0
cluster_dir=/run/dtrain-cluster/$cluster_id
cluster_here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

cluster_skip() {
  echo "SKIPPED: simulated cluster: $*"
  exit 77
}

# cluster_fail MESSAGE...: the test failed: says so, with the last 30 lines of
# each non-empty $work/*.out and $work/*.err (the jobs' output), and exits 1.
cluster_fail() {
  echo "FAILED: $*"
  for f in "$work"/*.out "$work"/*.err; do
    # Without the line of each checkpoint saved, which would hide what went wrong.
    [[ -s $f ]] && { echo "--- $(basename "$f")"; grep -v "^dtrain checkpoint: saved " "$f" | tail -n 30; }
  done
  exit 1
}

# The namespace of node N of the cluster with id ID (its host's: the Gth
# since the first, cluster_new_host()).
cluster_generation=()
cluster_mac=()  # a host cut off: its MAC address, for the next
cluster_ns() {
  local g=${cluster_generation[$2]:-0}
  if ((g == 0)); then echo "dtc$1-node$2"; else echo "dtc$1-node$2-$g"; fi
}

# Removes cluster ID: what `cluster_teardown` and the guardian run.
cluster_remove() {
  local id=$1 ns pid
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep "^dtc$id-node"); do
    for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$pid" 2>/dev/null; done
  done
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep "^dtc$id-node"); do
    ip netns del "$ns" 2>/dev/null
    rm -rf "/etc/netns/$ns"
  done
  ip link del "dtb$id" 2>/dev/null
  rm -rf "/run/dtrain-cluster/$id"
  return 0
}

cluster_teardown() {
  ((cluster_nodes > 0)) || return 0
  cluster_remove "$cluster_id"
  cluster_nodes=0
}

# Clusters whose owner died without cleaning up (a machine reboot keeps none).
cluster_sweep() {
  local dir id
  for dir in /run/dtrain-cluster/*/; do
    [[ -d $dir ]] || continue
    id=$(basename "$dir")
    kill -0 "$id" 2>/dev/null || cluster_remove "$id"
  done
}

cluster_node_index() {
  local node=$1
  [[ $node =~ ^node([0-9]+)$ ]] || { echo "cluster: no node '$node' (node1 .. node$cluster_nodes)" >&2; return 1; }
  local i=${BASH_REMATCH[1]}
  ((i >= 1 && i <= cluster_nodes)) || { echo "cluster: no node '$node' (node1 .. node$cluster_nodes)" >&2; return 1; }
  echo "$i"
}

cluster_ip() {
  local i
  i=$(cluster_node_index "$1") || return 1
  echo "$cluster_net.$i"
}

cluster_up() {
  local n=$1 rate=${2:-} i ns host_end
  ((EUID == 0)) || cluster_skip "needs root (network and UTS namespaces)"
  command -v ip >/dev/null || cluster_skip "needs ip (Debian: iproute2)"
  [[ -z $rate ]] || command -v tc >/dev/null || cluster_skip "needs tc (Debian: iproute2)"
  command -v unshare >/dev/null || cluster_skip "needs unshare (util-linux)"
  mkdir -p /run/dtrain-cluster || cluster_skip "cannot write /run/dtrain-cluster"
  cluster_sweep
  # One /24 per cluster, from the owner's pid, so that tests run side by side.
  cluster_net="10.$((100 + cluster_id % 100)).$(((cluster_id / 100) % 250))"
  mkdir -p "$cluster_dir"
  # cluster_exit_hook: what the caller also wants done at exit (its own cleanup).
  trap 'cluster_teardown; eval "${cluster_exit_hook:-}"' EXIT
  trap 'exit 143' TERM
  trap 'exit 130' INT
  # The guardian: removes the cluster once its owner is gone, however it went.
  # Started from a subshell, so it is no job of this shell (a bare `wait` returns).
  (setsid bash -c "source '$cluster_here/cluster.sh'; while kill -0 $cluster_id 2>/dev/null; do sleep 0.5; done; cluster_remove $cluster_id" \
    </dev/null >/dev/null 2>&1 &)
  if ! ip link add "dtb$cluster_id" type bridge 2>"$cluster_dir/error"; then
    cluster_skip "cannot create a bridge ($(head -c 200 "$cluster_dir/error")); needs CAP_NET_ADMIN"
  fi
  cluster_nodes=$n
  cluster_rate=$rate
  ip link set "dtb$cluster_id" up
  for ((i = 1; i <= n; i++)); do cluster_add_host "$i" "" || return 1; done
  for ((i = 1; i <= n; i++)); do cluster_write_hosts "$i" ""; done
}

# The host of node I: its namespace, its link to the bridge (at cluster_rate),
# its address; MAC, if given, is its eth0's hardware address.
cluster_add_host() {
  local i=$1 mac=$2 ns host_end
  ns=$(cluster_ns "$cluster_id" "$i")
  host_end="dtv${cluster_id}n$i"
  if ! ip netns add "$ns" 2>"$cluster_dir/error"; then
    cluster_skip "cannot create a network namespace ($(head -c 200 "$cluster_dir/error")); needs CAP_SYS_ADMIN"
  fi
  ip link add "$host_end" type veth peer name eth0 ${mac:+address "$mac"} netns "$ns" || return 1
  ip link set "$host_end" master "dtb$cluster_id" up || return 1
  ip -n "$ns" link set lo up
  ip -n "$ns" addr add "$cluster_net.$i/24" dev eth0
  ip -n "$ns" link set eth0 up
  if [[ -n $cluster_rate ]]; then
    tc qdisc add dev "$host_end" root tbf rate "$cluster_rate" burst 512kb latency 100ms 2>"$cluster_dir/error" &&
      ip netns exec "$ns" tc qdisc add dev eth0 root tbf rate "$cluster_rate" burst 512kb latency 100ms 2>"$cluster_dir/error" ||
      cluster_skip "cannot limit a link with tc tbf ($(head -c 200 "$cluster_dir/error")); needs sch_tbf"
  fi
}

# NODE's host is cut off, as one that lost its power is (freeze its processes
# first): its link is gone, without a connection closed; its processes stay,
# unreachable. cluster_new_host NODE then gives its name and addresses to a
# new host.
cluster_cut_off() {
  local i mac
  i=$(cluster_node_index "$1") || return 1
  mac=$(ip -n "$(cluster_ns "$cluster_id" "$i")" -o link show eth0 |
    sed -n 's|.*link/ether \([0-9a-f:]*\).*|\1|p')
  [[ -n $mac ]] || { echo "cluster: $1 has no link to cut" >&2; return 1; }
  cluster_mac[i]=$mac
  ip link del "dtv${cluster_id}n$i"
}

# A new host takes the name, address and MAC address of NODE, cut off before
# (the others' ARP caches stay true), as when a scheduler gives a failed
# machine's name and address to another: a namespace of its own, which
# cluster_run, cluster_pids... NODE name from then on.
cluster_new_host() {
  local i
  i=$(cluster_node_index "$1") || return 1
  [[ -n ${cluster_mac[i]:-} ]] || { echo "cluster: $1 was not cut off" >&2; return 1; }
  cluster_generation[i]=$((${cluster_generation[i]:-0} + 1))
  cluster_add_host "$i" "${cluster_mac[i]}" || return 1
  cluster_mac[i]=""
  cluster_write_hosts "$i" ""
}

# /etc/hosts of node I: every node's name and address; with `loopback`, its
# own name on 127.0.1.1 instead (Debian's default for a machine's own name).
cluster_write_hosts() {
  local i=$1 mode=$2 j ns
  ns=$(cluster_ns "$cluster_id" "$i")
  mkdir -p "/etc/netns/$ns"
  {
    echo "127.0.0.1 localhost"
    for ((j = 1; j <= cluster_nodes; j++)); do
      if ((j == i)) && [[ $mode == loopback ]]; then
        echo "127.0.1.1 node$j"
      else
        echo "$cluster_net.$j node$j"
      fi
    done
  } >"/etc/netns/$ns/hosts"
}

cluster_hosts_loopback() {
  local i
  i=$(cluster_node_index "$1") || return 1
  cluster_write_hosts "$i" loopback
}

cluster_run() {
  local node=$1 i
  shift
  i=$(cluster_node_index "$node") || return 1
  ip netns exec "$(cluster_ns "$cluster_id" "$i")" unshare --uts \
    bash -c 'hostname "$0" && exec "$@"' "$node" "$@"
}

cluster_pids() {
  local i
  i=$(cluster_node_index "$1") || return 1
  ip netns pids "$(cluster_ns "$cluster_id" "$i")"
}

cluster_workers() {
  local i p
  i=$(cluster_node_index "$1") || return 1
  for p in $(ip netns pids "$(cluster_ns "$cluster_id" "$i")"); do
    tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -q '^RANK=' && echo "$p"
  done
}

cluster_agent() {
  local i p parent stat start best="" best_start=0 candidates=()
  i=$(cluster_node_index "$1") || return 1
  for p in $(ip netns pids "$(cluster_ns "$cluster_id" "$i")"); do
    [[ $(tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null) == "$2 "* ]] &&
      ! tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -q '^RANK=' && candidates+=("$p")
  done
  # Not by the lowest pid: the agent's warden (a child of its own, with its
  # command line and no RANK) has the lower one once the pids wrap around
  # (pid_max is 32768 here). The agent is the oldest whose parent is none of them.
  for p in "${candidates[@]}"; do
    parent=$(awk '/^PPid:/ { print $2 }' "/proc/$p/status" 2>/dev/null) || continue
    [[ " ${candidates[*]} " == *" $parent "* ]] && continue
    stat=$(cat "/proc/$p/stat" 2>/dev/null) || continue
    start=$(awk '{ print $20 }' <<<"${stat##*) }")  # field 22, the start time, after "pid (comm) "
    if [[ -z $best ]] || ((start < best_start)); then
      best=$p
      best_start=$start
    fi
  done
  [[ -z $best ]] || echo "$best"
}

cluster_rsh() {
  local rsh=$cluster_dir/rsh
  if [[ ! -x $rsh ]]; then
    cat >"$rsh" <<RSH
#!/usr/bin/env bash
# ssh stand-in for mpirun: rsh [options] NODE COMMAND...
while [[ \$1 == -* ]]; do shift; done
node=\$1; shift
source '$cluster_here/cluster.sh'
cluster_id=$cluster_id cluster_nodes=$cluster_nodes cluster_net=$cluster_net
cluster_run "\$node" bash -c "\$*"
RSH
    chmod +x "$rsh"
  fi
  echo "$rsh"
}
