"""This host, whatever the backend: the machine's facts (machine.py: the cache directory, the CPU's name, the
memory available, atomic cache writes), huge pages for the `specdecode` command (hugepages.py), its heavy imports
with the garbage collector paused (imports.py) and OS-level thread names (threads.py). Standard library only and
nothing from the rest of the package: the package's import reads it before torch loads, and every other module can
import it without a cycle."""

from .hugepages import restart_if_command, user_env
from .imports import MODEL_IMPORTS, import_frozen
from .machine import cache_dir, cpu_description, cpu_name, memory_available, write_json
from .threads import name_thread

__all__ = [
    "MODEL_IMPORTS",
    "cache_dir",
    "cpu_description",
    "cpu_name",
    "import_frozen",
    "memory_available",
    "name_thread",
    "restart_if_command",
    "user_env",
    "write_json",
]
