"""The chest X-ray tasks of the paper: one sensitive task per NIH ChestX-ray14 finding, with the
14 observations of CheXpert or MIMIC-CXR as the public label sources.

The images are read from the data sets' published layouts by `data.cxr`; nothing is downloaded.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from dpmix_jax.data import cxr
from dpmix_jax.pipeline.image import SharedInputTask

PUBLIC_DATA = ("chexpert", "mimic")


def nih_tasks(
    nih_root: str | os.PathLike,
    public_root: str | os.PathLike,
    *,
    public: str,
    image_size: int,
    findings: Sequence[str] | None = None,
) -> list[SharedInputTask]:
    """One task per NIH finding (its official train/val/test splits, frontal views of the
    public data set's train split as the public pool), in the order of `findings`.

    Args:
        nih_root: the NIH ChestX-ray14 folder (`data.cxr.nih_official_splits`).
        public_root: the CheXpert or MIMIC-CXR folder.
        public: "chexpert" or "mimic", the public data set under `public_root`.
        image_size: images are resized to this square size.
        findings: NIH findings to make tasks of (None: all 14, `data.cxr.NIH_LABELS`).

    Returns:
        The tasks, sharing one public pool and one set of NIH splits.
    """
    if public not in PUBLIC_DATA:
        raise ValueError(f"public must be one of {PUBLIC_DATA}, got {public!r}.")
    findings = tuple(findings or cxr.NIH_LABELS)
    unknown = sorted(set(findings) - set(cxr.NIH_LABELS))
    if unknown:
        raise ValueError(f"unknown NIH findings {unknown}; choose from {list(cxr.NIH_LABELS)}")
    size = (image_size, image_size)
    nih = cxr.nih_official_splits(nih_root, image_size=size)
    load = cxr.load_chexpert if public == "chexpert" else cxr.load_mimic_cxr
    pool = load(public_root, split="train", views="frontal", image_size=size)
    return [
        SharedInputTask(
            name=f"NIH {finding} <- {public}",
            public=pool,
            source_names=tuple(pool.label_names),
            train=nih["train"],
            val=nih["val"],
            test=nih["test"],
            task_index=cxr.NIH_LABELS.index(finding),
        )
        for finding in findings
    ]
