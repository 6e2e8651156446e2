"""Harness around :mod:`calibration`: ``peer``, the multi-GPU suite's NVLink peer calibration."""
