"""Shim of DeepSpeed's ``tests/unit`` package (only ``unit.common.DistributedTest``)."""
