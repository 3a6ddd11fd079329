"""The DP client: one DP-SGD round on a partition, adapter state in and out, losses."""
