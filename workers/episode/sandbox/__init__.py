"""The tool sandbox (``rollout.tool_sandbox.level: sandbox``): each tool call in a fresh process.

The tool server (``rollcall.workers.episode.tools``: a single-threaded forkserver child, one per
agent loop) forks, before it reads any request, a *zygote* (``zygote``) that never sees one. The
zygote forks, ahead of need, a *spare* for the next call: a *keeper* that sets the call up and
forks the *tool process*, which waits for its one request, runs the tool and exits. As root
(``Sandbox.direct``) there is no keeper: the zygote forks the tool process as the first process
of a pid namespace of its own, it sets itself up as the keeper would, and the zygote reports
how it ended. So a limit is
per call (RLIMIT_CPU counts one call's CPU), a call's processes never held another call's
request or answer (nor the prompt fields its task did not declare: ``tool_prompt_fields``), and
nothing a call leaves behind in memory, in its working directory or in its process tree reaches
the next. Set-up, in order (``probe`` finds what the kernel allows; a call fails closed when a
step that the probe found possible fails):

- the keeper starts a session of its own (a process group: killing it kills the call's
  processes that stayed in it);
- namespaces (``unshare``): a network namespace unless the call's task is granted the network
  (``rollout.tool_sandbox.network_tasks``): nothing is brought up, so there is only a loopback
  that is down, and every address, 127.0.0.1 included, is unreachable; a pid namespace, whose
  first process is the tool process: when it ends, or is killed, the kernel kills every process
  of the namespace (fork bombs, ``sleep`` subprocesses, daemons that left the session), and a
  tool cannot name, signal or trace a process outside it; a mount namespace that covers, with
  empty read-only file systems, the node's home directory (``HOME``), ``ROLLCALL_HOME``, the
  embedded PostgreSQL's socket directories (``/tmp/rollcall-pg-*``), Ray's temporary directory
  and the Ray token file (``RAY_AUTH_TOKEN_PATH``), and binds back read-only what the
  interpreter needs from under them (``sys.prefix``, ``sys.path`` but the cwd, never a path at
  or above a hidden one: ``layout``), and replaces ``/tmp``, ``/var/tmp``, ``/dev/shm`` and
  ``/run/user`` with a fresh tmpfs of ``file_mb`` each (the node's sockets there out of reach;
  the call's working directory bound in); an IPC namespace (SysV shared memory and message
  queues die with the call). As root the namespaces are
  made directly; otherwise in a user namespace of the call's own, with the node's uid and gid
  mapped to themselves (``unshare -Urn`` without the root mapping);
- the process limit (RLIMIT_NPROC) counts the processes of a user, and root's are not counted
  at all (the kernel exempts uid 0). As root, the tool process therefore runs as an unused uid
  of its own, ``TOOL_UID_BASE`` + the keeper's pid (no supplementary groups; the working
  directory made its), so the limit holds per call and concurrent calls cannot touch each
  other's processes or files; it reads only what any user may read. Not as root, in a user
  namespace, the limit counts the call's processes in that namespace (kernels 5.14 and later
  count per user namespace; the user's processes on the whole host also stay under the limit
  the node had when the namespace was made); without a user namespace it would count every
  process of the user on the host, so it is set to that count plus ``processes`` (approximate);
- a cgroup of the call's own (``cgroups``; as root, v2 or v1): made by the keeper, joined by the
  tool process first: ``memory_mb`` across the call's processes (an OOM kill of the tool
  process there is the call's ``memory`` failure), ``processes`` of them, a low I/O weight
  where the kernel has one; removed once the keeper is reaped (by the zygote);
- a seccomp filter (``seccomp``), installed in the tool process right after ``no_new_privs``;
- the tool process: a ``/proc`` of its pid namespace (a failure fails the call; ``probe`` tries
  it), every capability dropped and ``no_new_privs`` after its mounts (and, as root, its uid
  change: then its parent-death signal set again), RLIMIT_CPU (``cpu_s``, soft = hard: SIGKILL
  when spent), RLIMIT_AS (``memory_mb``), RLIMIT_NPROC (``processes``), RLIMIT_NOFILE
  (``open_files``), RLIMIT_FSIZE (``file_mb``; SIGXFSZ ignored, so a write past it fails with
  EFBIG), RLIMIT_CORE 0; a fresh empty working directory (removed after the call) as cwd, ``HOME``
  and ``TMPDIR``; an environment of ``PATH``, ``LANG``, ``HOME`` and ``TMPDIR`` only (the tool
  server already dropped everything else, rollcall's database URL, Ray's token and PostgreSQL's
  variables among it, and overwrote its environment block, so ``/proc/self/environ`` holds nothing
  either); stdin from /dev/null; stdout and stderr into a file whose first ``OUTPUT_BYTES`` the
  server copies to its own stderr (the node's log) after the call, escaped, each line marked
  ``tool| `` (``server._forward_output``); no file descriptor of the
  server's (its pipe to the node among them).

The tool process answers through a pipe (length-prefixed bytes: the tool server's JSON, never a
pickle); the keeper reports the tool process's pid, then its exit status and CPU time. The
server waits ``timeout_s`` for the answer, then kills the tool process (and with it its pid
namespace) and the keeper's process group. A call that ends without an answer is an
``CallResult`` with a failure: ``timeout``, ``cpu`` (killed with its CPU time spent), ``memory``
(OOM-killed in its cgroup), ``file`` (killed by SIGXFSZ), ``crashed`` (any other death) or
``setup``; never the server's failure.

The answer frame is at most ``answer_bytes`` (longer: the call crashed, never read).

What this does not do: limit the total disk a call writes (RLIMIT_FSIZE bounds each file; the
working directory is removed after the call, or by the next server if its own was killed; files
written elsewhere that the tool's user may write stay), limit memory other than per process
without a cgroup (then a call's processes have ``memory_mb`` each), limit CPU other than per
process within ``timeout_s``, or hide files any user may read (see ``Protections.describe``).
Linux only; pure standard library, so that ``probe`` can run this package in a bare interpreter
(``probe_main.py``).

The modules: ``linux`` (the kernel's interface: ``unshare``, ``mount``, ``prctl``, ``capset``),
``paths`` (``Limits``; ``layout``: what a call's mount namespace covers and binds back),
``namespaces`` (a call's namespaces and mounts, made in its keeper), ``protections``
(``probe``: what the kernel allows here), ``seccomp`` (the tool process's system-call filter),
``cgroups`` (a call's cgroup), ``zygote`` (the clean process that forks the spares, and the
server's side of it), ``keeper`` (``Sandbox``: a call, its keeper, its tool process and the
server's side), ``server`` (the tool server's environment, the calls' output forwarded to its
log, escaped, and their working directories). They import one another relatively and nothing
of rollcall's.
"""

from __future__ import annotations

from .cgroups import sweep as sweep_groups
from .keeper import KILL_WAIT_S, START_TIMEOUT_S, CallResult, Sandbox
from .linux import CLONE_NEWIPC, CLONE_NEWNET, CLONE_NEWNS, CLONE_NEWPID, CLONE_NEWUSER
from .namespaces import TOOL_UID_BASE
from .paths import SCRATCH, Layout, Limits, layout
from .paths import _under as _under  # (tests)
from .protections import Protections, probe, probe_here
from .server import OUTPUT_BYTES, WORKDIR_PREFIX, forwarded_output, scrub_environment, sweep

__all__ = [
    "CLONE_NEWIPC",
    "CLONE_NEWNET",
    "CLONE_NEWNS",
    "CLONE_NEWPID",
    "CLONE_NEWUSER",
    "KILL_WAIT_S",
    "OUTPUT_BYTES",
    "SCRATCH",
    "START_TIMEOUT_S",
    "TOOL_UID_BASE",
    "WORKDIR_PREFIX",
    "CallResult",
    "Layout",
    "Limits",
    "Protections",
    "Sandbox",
    "forwarded_output",
    "layout",
    "probe",
    "probe_here",
    "scrub_environment",
    "sweep",
    "sweep_groups",
]
