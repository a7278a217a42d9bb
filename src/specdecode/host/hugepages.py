"""Transparent huge pages for the weights: the `specdecode` command runs itself again with glibc's malloc asking
the kernel for them.

A decode step reads every weight once; llama.cpp keeps the repacked weights (most of a Q4_K model) in memory from
malloc, mapped in 4 KiB pages unless the process asks for huge ones, and where the kernel's THP mode is `madvise`
(the default of Debian, Ubuntu and most clouds) nothing in llama.cpp asks. glibc does, for every block it maps,
when started with GLIBC_TUNABLES=glibc.malloc.hugetlb=1 (glibc 2.35+); a tunable is read only at start-up, so
the `specdecode` command starts the same command line again (execve: same process id) with it set, first thing in
`cli.main` (before torch loads: ~0.1 s); a program that imports the package is never restarted. Most of the weights
then sit in huge pages and steps are a little faster; MADV_COLLAPSE on the loaded buffers, the in-process
alternative, failed (measured: docs/results/notes.md#code-hugepages).

SPECDECODE_HUGEPAGES=0 turns it off. Peers that `bench` and `loadtest` start get the environment as it was before
(`user_env`): they run as a user would start them. Library users can set the variable themselves."""

from __future__ import annotations

import os
import platform
import sys

TUNABLE = "glibc.malloc.hugetlb=1"
BEFORE = "SPECDECODE_GLIBC_TUNABLES_BEFORE"  # GLIBC_TUNABLES as it was before the restart ("" when unset)
THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


def _glibc_has_tunable() -> bool:
    name, version = platform.libc_ver()
    try:
        return name == "glibc" and tuple(int(x) for x in version.split(".")[:2]) >= (2, 35)
    except ValueError:
        return False


def _thp_mode() -> str | None:
    try:
        with open(THP_MODE) as f:
            text = f.read()
    except OSError:
        return None
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else None


def restart_argv(environ=os.environ) -> tuple[list[str], dict] | None:
    """(argv, env) to run this command again with huge pages asked for, or None where that is not needed or not
    possible: off Linux/glibc < 2.35, THP mode not `madvise` (`always` has them already, `never` cannot),
    turned off (SPECDECODE_HUGEPAGES=0), or already asked for (by us or the user)."""
    tunables = environ.get("GLIBC_TUNABLES", "")
    if (
        environ.get("SPECDECODE_HUGEPAGES", "1") == "0"
        or BEFORE in environ
        or "glibc.malloc.hugetlb" in tunables
        or not sys.platform.startswith("linux")
        or not _glibc_has_tunable()
        or _thp_mode() != "madvise"
        or not getattr(sys, "orig_argv", None)
        or not sys.executable
        or getattr(sys, "frozen", False)
        or sys.flags.interactive
    ):
        return None
    env = dict(environ)
    env[BEFORE] = tunables
    env["GLIBC_TUNABLES"] = f"{tunables}:{TUNABLE}" if tunables else TUNABLE
    return [sys.executable, *sys.orig_argv[1:]], env


def restart_with_hugepages() -> None:
    """Start this command again with huge pages asked for (see the module); returns only where that does not
    apply or the restart fails (then the command goes on as it is)."""
    plan = restart_argv()
    if plan is None:
        return
    argv, env = plan
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(argv[0], argv, env)
    except OSError:
        return


def launched_as_command(orig_argv=None) -> bool:
    """Whether this process is the `specdecode` command (its console script, `python -m specdecode` or
    `python -m specdecode.cli`, interpreter options allowed), not a program that imports the package."""
    argv = list(getattr(sys, "orig_argv", []) if orig_argv is None else orig_argv)
    i = 1
    while i < len(argv):
        a = argv[i]
        if a == "-m":
            return argv[i + 1 : i + 2] in (["specdecode"], ["specdecode.cli"])
        if a in ("-c", "-") or not a.startswith("-"):  # code, stdin, or a script: the command only as its own script
            return a not in ("-c", "-") and os.path.basename(a) == "specdecode"
        i += 2 if a in ("-X", "-W") else 1  # an option (with its argument)
    return False


def restart_if_command() -> None:
    """From `cli.main`, first thing: the `specdecode` command restarts before torch is imported (~0.1 s; after it, a
    restart would cost ~1.3 s)."""
    if launched_as_command():
        restart_with_hugepages()


def user_env(environ=os.environ) -> dict:
    """The environment as the user had it: what a peer is started with (our addition to GLIBC_TUNABLES removed)."""
    env = dict(environ)
    if BEFORE in env:
        before = env.pop(BEFORE)
        if before:
            env["GLIBC_TUNABLES"] = before
        else:
            env.pop("GLIBC_TUNABLES", None)
    return env


def status(environ=os.environ) -> str:
    """One line for reports: whether this process asked for huge pages, and the kernel's mode."""
    tunables = environ.get("GLIBC_TUNABLES", "").split(":")
    setting = next((t for t in tunables if t.startswith("glibc.malloc.hugetlb=")), "")
    on = setting not in ("", "glibc.malloc.hugetlb=0")
    mode = _thp_mode() or "n/a"
    how = f"restarted with GLIBC_TUNABLES={TUNABLE}" if BEFORE in environ else f"{setting} set by the user"
    return (
        f"transparent huge pages: on for large allocations ({how}); kernel mode {mode}"
        if on
        else f"transparent huge pages: not asked for; kernel mode {mode}"
    )
