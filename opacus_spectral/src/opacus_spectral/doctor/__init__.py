"""The doctor: checks for the silent ways DP training goes wrong, and the batch-independence check."""

from .doctor import Doctor, DoctorSetting, install_doctor

__all__ = ["Doctor", "DoctorSetting", "install_doctor"]
