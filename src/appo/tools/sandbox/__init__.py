"""Python sandbox: runs model-written code in isolated, pre-forked processes.

The original (ARPO) ran model-written code with `python -c` in the user's own environment,
one fresh interpreter per call, no isolation. Here one zygote process (see
`appo.tools.sandbox.zygote` for how isolation is applied) is started once with numpy and
sympy preloaded; it forks single-use sandboxes ahead of time, already isolated and waiting
for code, and hands them to the host, which keeps `spares` idle ones. A call writes the
code into an idle sandbox's stdin and reads its output pipes: no fork, no interpreter
start-up, no import on the call's path; a replacement is forked after the call.

Guarantees with namespaces (root, or a kernel that allows unprivileged user namespaces):
wall-time, CPU-time, memory (address space), process-count and file-size limits; an empty
environment (nothing inherited, so no API keys); no network at all (a new network namespace:
not even 127.0.0.1); the filesystem read-only except a fresh size-capped tmpfs on /tmp (the
working dir) and /dev/shm that vanishes with the call; a PID namespace whose init kills every
process the code started when it ends or times out; as root, an unprivileged uid of each worker's
own (`sandbox_uid="auto"`: no other process has it; no groups, `no_new_privs`), so
RLIMIT_NPROC holds and counts only the processes of the one call that worker runs (concurrent
calls of one run each get their whole `max_processes`), the code cannot signal the host, and
files only `others` may read are readable (world-readable files remain readable; so do
world-writable Unix sockets such as a D-Bus socket).

Fallback without namespaces (non-root without user namespaces, containers without
CAP_SYS_ADMIN, or `isolation="rlimits"`): the same rlimits (for a non-root user RLIMIT_NPROC
counts all the user's processes, so the cap becomes "current count + max_processes"), the
empty environment, a throwaway working dir removed afterwards, orphans killed through a child
subreaper, and a seccomp filter that makes socket() fail for every family but AF_UNIX (and
blocks io_uring); it is enforced by the kernel and inherited by subprocesses. It does NOT
stop: reading any file the user can read, writing files the user can write outside the
working dir (a non-root sandbox runs as the user), connecting to local Unix sockets the user
may use (e.g. Docker's), signalling the user's other processes (as root with a fixed
`sandbox_uid` such as 65534, other processes of that uid), or a fork bomb from loading the machine up to
the process cap. For the full guarantees run as root (e.g. in a container with
CAP_SYS_ADMIN) or on a kernel with user namespaces; `Sandbox.capabilities` (and
`appo tool python --verbose`) says which layers are active.

Modules. Host side (the training / eval process): `host` (`Sandbox`, the zygote and its pool
of idle workers), `call` (one call on one worker; `SandboxLimits`, `RunOutcome`). Worker side
(the zygote and the processes it forks; standard library only): `zygote_main` (the script
the zygote runs), `zygote`, `mounts`, `linux`, `supervisor` (a worker), `child` (the code
process's isolation), `runtime` (running the code).
"""

from appo.tools.sandbox.call import RunOutcome, SandboxLimits
from appo.tools.sandbox.host import DEFAULT_PRELOAD, Sandbox, describe_capabilities

__all__ = ["DEFAULT_PRELOAD", "RunOutcome", "Sandbox", "SandboxLimits",
           "describe_capabilities"]
