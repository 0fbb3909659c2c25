# Sourced by the launch scripts. run_group CMD...: run CMD as a process group (session) of its own and wait
# for it; when this script exits, or gets Ctrl-C or TERM, the whole group is killed, so that no rank outlives
# its launcher (mpiexec's and deepspeed's ranks included).
run_group() {
    setsid "$@" &
    _group=$!
    trap 'kill -KILL -- "-$_group" 2>/dev/null || true' EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM
    wait "$_group"
}
