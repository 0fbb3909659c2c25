# Sourced by the launch scripts. run_group CMD...: run CMD as a process group (session) of its own and wait
# for it; when this script exits, or gets Ctrl-C or TERM, the whole group is killed, so that no rank outlives
# its launcher (mpiexec's and deepspeed's ranks included), and the /dev/shm segments that DeepSpeed's CPU
# all-reduce op made for this launch (named for its port, $PORT; the op never removes them) are removed.
run_group() {
    setsid "$@" &
    _group=$!
    trap 'kill -KILL -- "-$_group" 2>/dev/null || true; remove_launch_segments' EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM
    wait "$_group"
}

remove_launch_segments() {
    if [ -n "${PORT:-}" ]; then rm -f /dev/shm/deepspeed_allreduce_buffer_"$(id -u)"_*_"$PORT"_*; fi
}
