"""Alternating the LoRA factors: the schedule, the controller that drives it, the factor lookup."""
