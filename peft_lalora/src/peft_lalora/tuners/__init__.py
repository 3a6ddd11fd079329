"""PEFT tuners (PEFT's own layout: ``tuners/<method>/``)."""

# PEFT first: importing it registers LALORA (``peft_lalora/__init__.py``), which needs this package's modules whole —
# so none of them may be the one whose ``from peft import ...`` triggers it.
import peft  # noqa: F401
