"""NIH ChestX-ray14 with MIMIC-CXR as public data. Command and expected numbers:
`experiments/configs/nih.py`."""

from experiments.cxr import cli

if __name__ == "__main__":
    cli("mimic")
