"""Doctest settings for the README and the library's docstrings."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
