"""The benchmark commands (``dp-bench <command>``); each is a thin caller of the harness modules."""
