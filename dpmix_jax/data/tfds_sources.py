"""CIFAR-100 and ImageNet through `tfds.data_source` (random access, no TensorFlow).

`TfdsImageSource` adapts a tfds random-access data source to `Source`: examples are
`{"image": float32 (H, W, C) in [0, 1], "label": int32 ()}`. Images of another size (ImageNet)
are resized (shorter side to the target, then a centre crop) with Pillow. The data must already be
prepared in `data_dir` (tfds downloads nothing here: `open_data_source` stops with one line naming
a data set that is not there and the `tfds build` command that prepares it); tests use
`tfds.testing.mock_data`.

API:
    open_data_source(name, split, *, data_dir=None)
    TfdsImageSource(data_source, *, image_size, label_key="label")
    cifar100_source(split="train", *, data_dir=None, label="label")   or label="coarse_label"
    imagenet_source(split="train", *, data_dir=None, image_size=224)
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import tensorflow_datasets as tfds
from PIL import Image

from dpmix_jax.data.sources import Source


def open_data_source(name: str, split: str, *, data_dir: str | None = None) -> Sequence:
    """`tfds.data_source(name, split=split, data_dir=data_dir)` without downloading anything.

    Raises:
        ValueError: one line naming the data set and split when tfds cannot open them there
            (not prepared there, prepared without a random-access format, no such split).
    """
    try:
        return tfds.data_source(name, split=split, data_dir=data_dir, download=False)
    except Exception as err:  # tfds reports data it cannot open with several exception types
        where = data_dir or "the default tfds folder"
        if not _is_prepared(name, data_dir):
            build = f"tfds build {name} --file_format array_record"
            if data_dir:
                build += f" --data_dir {data_dir}"
            message = f"is not prepared in {where}: prepare it there first with `{build}`"
        else:  # tfds' own reason (e.g. TFRecord files: random access needs array_record)
            reason = next(iter(str(err).strip().splitlines()), "") or type(err).__name__
            message = f"in {where} cannot be opened for random access: {reason.rstrip(':')}"
        raise ValueError(f"tfds data set {name!r} (split {split!r}) {message}") from err


def _is_prepared(name: str, data_dir: str | None) -> bool:
    try:
        return tfds.builder(name, data_dir=data_dir).is_prepared()
    except Exception:  # an unknown name or unreadable metadata: nothing usable is prepared
        return False


def _resize_center_crop(image: np.ndarray, size: int) -> np.ndarray:
    height, width = image.shape[:2]
    if (height, width) == (size, size):
        return image
    scale = size / min(height, width)
    new_h, new_w = max(size, round(height * scale)), max(size, round(width * scale))
    pil = Image.fromarray(image.squeeze(-1) if image.shape[-1] == 1 else image)
    resized = np.asarray(pil.resize((new_w, new_h), Image.Resampling.BILINEAR))
    top, left = (new_h - size) // 2, (new_w - size) // 2
    cropped = resized[top : top + size, left : left + size]
    return cropped.reshape(size, size, image.shape[-1])


class TfdsImageSource(Source):
    """A `Source` over a tfds data source with `image` (uint8 HWC) and an integer label.

    Args:
        data_source: the object `tfds.data_source(...)` returns (supports len and indexing).
        image_size: side of the square images returned.
        label_key: feature holding the integer label.
    """

    def __init__(self, data_source: Sequence, *, image_size: int, label_key: str = "label"):
        if image_size < 1:
            raise ValueError(f"image_size must be >= 1, got {image_size}")
        self._data = data_source
        self._image_size = int(image_size)
        self._label_key = label_key
        if len(data_source) and label_key not in data_source[0]:
            raise ValueError(f"examples have no feature {label_key!r}: {sorted(data_source[0])}")
        self._channels = np.asarray(data_source[0]["image"]).shape[-1] if len(data_source) else 3

    def __len__(self) -> int:
        return len(self._data)

    def _fetch(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        size = self._image_size
        images = np.zeros((len(indices), size, size, self._channels), dtype=np.float32)
        labels = np.zeros(len(indices), dtype=np.int32)
        # tfds' batched __getitems__ is not available on every backend (e.g. under mock_data).
        for row, i in enumerate(indices):
            example = self._data[int(i)]
            images[row] = _resize_center_crop(np.asarray(example["image"]), size) / 255.0
            labels[row] = int(example[self._label_key])
        return {"image": images, "label": labels}


def cifar100_source(
    split: str = "train", *, data_dir: str | None = None, label: str = "label"
) -> TfdsImageSource:
    """CIFAR-100 (32x32x3) with fine labels (`label`, 100 classes) or `coarse_label` (20)."""
    if label not in ("label", "coarse_label"):
        raise ValueError(f"label must be 'label' or 'coarse_label', got {label!r}")
    data = open_data_source("cifar100", split, data_dir=data_dir)
    return TfdsImageSource(data, image_size=32, label_key=label)


def imagenet_source(
    split: str = "train", *, data_dir: str | None = None, image_size: int = 224
) -> TfdsImageSource:
    """ImageNet-2012 (manually prepared in `data_dir`), resized and centre-cropped to a square."""
    data = open_data_source("imagenet2012", split, data_dir=data_dir)
    return TfdsImageSource(data, image_size=image_size)
