"""Peak RSS of the process that runs it, as the benchmarks' child processes report it."""

import inspect
import resource


def peak_rss_kb() -> int:
    """This process's own peak RSS (VmHWM). ru_maxrss would include the RSS of the benchmark that
    started it, which Linux carries into a child across fork and exec."""
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


SOURCE = "import resource\n" + inspect.getsource(peak_rss_kb)
"""The function's source, for the harnesses the benchmarks run with ``python -c``."""
