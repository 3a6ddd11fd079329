"""PEFT tuners (PEFT's own layout: ``tuners/<method>/``)."""
