"""The benchmark commands (``dp-bench <command>``); each is a thin caller of dp-bench's modules."""
