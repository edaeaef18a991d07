"""Test settings shared by the whole suite: offline hubs, deterministic float32 CPU runs."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

# Scripts run in their own processes with simulated devices; importing them (doctest collection)
# would set XLA_FLAGS for the whole test session.
collect_ignore = ["parallel_check.py", "multiprocess_check.py"]
