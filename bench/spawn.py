"""Run one command (stdout to /dev/null) and print ``wall_s cpu_s peak_rss_bytes exit_code``.

The runner starts this with ``python -I -S`` instead of forking the command itself: Linux starts a
child's ``ru_maxrss`` at the RSS of the process that forked it, so the fork must come from a
process as small as this one (about 6.5 MiB), not from the runner (numpy, generated data). Only
builtin modules are imported.
"""

import os
import sys
import time


def main() -> None:
    argv = sys.argv[1:]
    start = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
            os.execvp(argv[0], argv)
        except OSError as exc:
            os.write(2, f"{argv[0]}: {exc}\n".encode())
        os._exit(127)
    _, status, ru = os.wait4(pid, 0)
    wall = time.perf_counter() - start
    print(wall, ru.ru_utime + ru.ru_stime, ru.ru_maxrss * 1024, os.waitstatus_to_exitcode(status))


main()
