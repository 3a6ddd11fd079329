"""The clients' data: the task (model + dataset), partitioning, input files, truncation."""
