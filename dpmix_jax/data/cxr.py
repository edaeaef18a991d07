"""Chest X-ray data sets: NIH ChestX-ray14, CheXpert and MIMIC-CXR-JPG, read from their own layouts.

Each loader returns a `CxrDataset`: a `Source` whose examples are
`{"image": float32 (H, W, 1) in [0, 1], "labels": float32 (14,)}`, with `.labels` (n, 14),
`.label_names` (the data set's 14 names in its canonical order), `.patient_ids` (its `group_ids`,
and its `user_ids` for patient-level DP), `.paths`, `.views` and `.skipped` (reason -> count of
rows left out on purpose). Images are read lazily with Pillow, converted to grayscale, scaled by
their bit depth (8 or 16 bits) and resized bilinearly to `image_size`.

Label handling: NIH `Finding Labels` are `|`-joined names, `No Finding` means all zeros. CheXpert
and MIMIC-CXR observations are 1.0 / 0.0 / -1.0 (uncertain) / blank; uncertain and blank map to 0
("U-Zeros"); a blank field is allowed, a missing one is not. Any other value, an unknown finding
name, a missing column, a row with more or fewer fields than the header, or a CSV that is not
UTF-8 is a ValueError naming the file and row (rows are numbered as the file's lines); so are an
NIH image listed in two rows (two Patient IDs) and an image in both official NIH lists. A CSV
row whose image file is missing is an error by default; with `on_missing="skip"` it is left out
and counted in `.skipped["missing_image"]` (partial downloads).
MIMIC-CXR images whose study has no row in the CheXpert-labels file are known to exist in the real
set; they are always skipped and counted as `"unlabelled_study"`. Unreadable images raise when read.

API:
    NIH_LABELS, CHEXPERT_LABELS          the canonical label orders
    CxrDataset                           the Source type (also `.subset(indices)`, `.image(i)`)
    load_nih(root, *, image_size=(224, 224), subset="all", on_missing="error")
    nih_official_splits(root, *, val_fraction=0.1, seed=0, image_size=(224, 224)) -> train/val/test
    load_chexpert(root, *, split="train", views="frontal", image_size=..., on_missing="error")
    load_mimic_cxr(root, *, split=None, views="frontal", image_size=..., on_missing="error")
    patient_disjoint_split(dataset, fractions, *, seed) -> index arrays (keyed hash of patient)
"""

from __future__ import annotations

import csv
import gzip
import io
import re
import warnings
import zlib
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal

import numpy as np
from PIL import Image, UnidentifiedImageError

from dpmix_jax.data.sources import Source
from dpmix_jax.privacy.parts import assign_parts

NIH_LABELS = (
    "Atelectasis",
    "Cardiomegaly",
    "Effusion",
    "Infiltration",
    "Mass",
    "Nodule",
    "Pneumonia",
    "Pneumothorax",
    "Consolidation",
    "Edema",
    "Emphysema",
    "Fibrosis",
    "Pleural_Thickening",
    "Hernia",
)
CHEXPERT_LABELS = (
    "No Finding",
    "Enlarged Cardiomediastinum",
    "Cardiomegaly",
    "Lung Opacity",
    "Lung Lesion",
    "Edema",
    "Consolidation",
    "Pneumonia",
    "Atelectasis",
    "Pneumothorax",
    "Pleural Effusion",
    "Pleural Other",
    "Fracture",
    "Support Devices",
)
NIH_NO_FINDING = "No Finding"
_FRONTAL_MIMIC = frozenset({"PA", "AP"})
_LATERAL_MIMIC = frozenset({"LATERAL", "LL"})
# Pillow modes of 16-bit grayscale images (16-bit PNGs open as "I;16", or "I" in old Pillows).
_SIXTEEN_BIT_MODES = frozenset({"I;16", "I;16L", "I;16B", "I;16N"})
_BILINEAR = Image.Resampling.BILINEAR

Views = Literal["frontal", "lateral", "all"]
OnMissing = Literal["error", "skip"]


class CxrDataset(Source):
    """Chest X-ray images with 14 binary labels and a patient per image.

    Args:
        paths: image file of each example.
        labels: float32 (n, 14).
        label_names: the 14 label names, in column order.
        patient_ids: integer patient of each example.
        views: view of each example ("frontal" or "lateral").
        image_size: (height, width) images are resized to.
        skipped: reason -> number of rows the loader left out.
    """

    def __init__(
        self,
        *,
        paths: Sequence[Path],
        labels: np.ndarray,
        label_names: Sequence[str],
        patient_ids: np.ndarray,
        views: Sequence[str],
        image_size: tuple[int, int],
        skipped: Mapping[str, int] | None = None,
    ):
        n = len(paths)
        labels = np.asarray(labels, dtype=np.float32)
        if labels.shape != (n, len(label_names)):
            raise ValueError(
                f"labels must have shape ({n}, {len(label_names)}), got {labels.shape}"
            )
        if np.asarray(patient_ids).shape != (n,) or len(views) != n:
            raise ValueError("patient_ids and views need one entry per image")
        if len(image_size) != 2 or min(image_size) < 1:
            raise ValueError(f"image_size must be (height, width) >= 1, got {image_size}")
        self.paths = tuple(Path(p) for p in paths)
        self.labels = labels
        self.label_names = tuple(label_names)
        self.patient_ids = np.asarray(patient_ids, dtype=np.int64)
        self.views = tuple(views)
        self.image_size = (int(image_size[0]), int(image_size[1]))
        self.skipped = dict(skipped or {})

    def __len__(self) -> int:
        return len(self.paths)

    @property
    def group_ids(self) -> np.ndarray:
        return self.patient_ids

    @property
    def user_ids(self) -> np.ndarray:
        """The patient of each image: the unit of patient-level (user-level) DP."""
        return self.patient_ids

    def image(self, i: int) -> np.ndarray:
        """Reads image i as float32 (H, W, 1) in [0, 1]; an unreadable file is a ValueError.

        8-bit images are scaled by 1/255, 16-bit grayscale ones by 1/65535.
        """
        path = self.paths[i]
        size = self.image_size[::-1]
        try:
            with Image.open(path) as img:
                if img.mode in _SIXTEEN_BIT_MODES or (img.mode == "I" and img.format == "PNG"):
                    # Pillow's "L" conversion clips 16-bit values at 255; scale them instead.
                    scaled = np.asarray(img, dtype=np.float32) / 65535.0
                    resized = Image.fromarray(scaled).resize(size, _BILINEAR)
                    return np.asarray(resized, dtype=np.float32)[..., None]
                gray = img.convert("L").resize(size, _BILINEAR)
        except (OSError, UnidentifiedImageError, Image.DecompressionBombError) as err:
            raise ValueError(f"cannot read image {path}: {err}") from err
        return (np.asarray(gray, dtype=np.float32) / 255.0)[..., None]

    def _fetch(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        images = np.zeros((len(indices), *self.image_size, 1), dtype=np.float32)
        for row, i in enumerate(indices):
            images[row] = self.image(int(i))
        return {"image": images, "labels": self.labels[indices]}

    def subset(self, indices: np.ndarray) -> CxrDataset:
        """The examples at `indices`, as a new CxrDataset."""
        indices = np.asarray(indices, dtype=np.int64)
        return CxrDataset(
            paths=[self.paths[i] for i in indices],
            labels=self.labels[indices],
            label_names=self.label_names,
            patient_ids=self.patient_ids[indices],
            views=[self.views[i] for i in indices],
            image_size=self.image_size,
            skipped=self.skipped,
        )


def patient_disjoint_split(
    dataset: CxrDataset, fractions: Sequence[float], *, seed: int | bytes
) -> tuple[np.ndarray, ...]:
    """Index arrays splitting `dataset` by patient (no patient in two parts).

    Patient p goes to part `privacy.assign_parts([p], fractions, key=seed)`: a keyed hash of
    the patient id, so the parts hold the fractions of patients in expectation.

    Privacy:
        Splits along patients, so every image of a patient lands in one stage; a patient's part
        depends only on their id and `seed`, so adding or removing a patient moves no other.
    """
    parts = assign_parts(dataset.patient_ids, fractions, key=seed)
    return tuple(np.flatnonzero(parts == j) for j in range(len(fractions)))


def _read_text(path: Path) -> str:
    """The UTF-8 text of `path` (without a byte-order mark; gunzipped for a `.gz` name); a
    ValueError names the bad line."""
    if not path.is_file():
        raise ValueError(f"missing file {path}")
    data = path.read_bytes()
    if path.name.endswith(".gz"):
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as err:
            raise ValueError(
                f"{path}: not a complete gzip file ({err}); download it again"
            ) from err
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise ValueError(
            f"{path} line {line}: not UTF-8 text (byte {data[err.start]:#04x}); "
            "save the file as UTF-8"
        ) from err


def _read_csv(path: Path, required: Sequence[str]) -> list[tuple[int, dict[str, str]]]:
    """(line number, row) of every data row; a row with more or fewer fields than the header is
    a ValueError naming the file and line (a blank field is kept as "")."""
    reader = csv.DictReader(io.StringIO(_read_text(path), newline=""))
    columns = reader.fieldnames or []
    missing = [c for c in required if c not in columns]
    if missing:
        raise ValueError(f"{path} lacks column(s) {missing}; found {columns}")
    rows = []
    try:
        for row in reader:
            fields = len(columns) + len(row.get(None, ())) - list(row.values()).count(None)
            if fields != len(columns):
                raise ValueError(
                    f"{path} row {reader.line_num}: {fields} fields, but the header has "
                    f"{len(columns)}; the row is truncated or malformed: repair or remove it"
                )
            rows.append((reader.line_num, row))
    except csv.Error as err:
        raise ValueError(f"{path} row {reader.line_num}: malformed CSV ({err})") from err
    return rows


def _check_options(views: str, on_missing: str) -> None:
    if views not in ("frontal", "lateral", "all"):
        raise ValueError(f"views must be 'frontal', 'lateral' or 'all', got {views!r}")
    if on_missing not in ("error", "skip"):
        raise ValueError(f"on_missing must be 'error' or 'skip', got {on_missing!r}")


def _keep_existing(
    rows: list[tuple[Path, np.ndarray, int, str]], on_missing: OnMissing, csv_path: Path, skipped
) -> list[tuple[Path, np.ndarray, int, str]]:
    kept = []
    for row in rows:
        if row[0].is_file():
            _check_image_header(row[0])
            kept.append(row)
        elif on_missing == "error":
            raise ValueError(f"{csv_path} lists image {row[0]}, which does not exist")
        else:
            skipped["missing_image"] += 1
    return kept


def _check_image_header(path: Path) -> None:
    """Refuses an image Pillow cannot identify or would refuse to decode, before any training.

    Only the header is read; an image over Pillow's decompression-bomb limit is refused here
    rather than in the middle of a run.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(path) as img:
                width, height = img.size
    except Image.DecompressionBombError:
        width = height = None
    except (OSError, UnidentifiedImageError) as err:
        raise ValueError(f"cannot read image {path}: {err}") from None
    limit = Image.MAX_IMAGE_PIXELS
    if width is None or (limit is not None and width * height > limit):
        size = "its size" if width is None else f"{width}x{height} pixels"
        raise ValueError(
            f"image {path}: {size} is over Pillow's decompression-bomb limit of {limit} pixels; "
            "resize or remove it"
        )


def _build(rows, label_names, image_size, skipped) -> CxrDataset:
    if not rows:
        raise ValueError("no images left after filtering; check the root folder and options")
    return CxrDataset(
        paths=[r[0] for r in rows],
        labels=np.stack([r[1] for r in rows]),
        label_names=label_names,
        patient_ids=np.array([r[2] for r in rows], dtype=np.int64),
        views=[r[3] for r in rows],
        image_size=image_size,
        skipped={k: v for k, v in skipped.items() if v},
    )


# ------------------------------------------------------------------------------------------
# NIH ChestX-ray14
# ------------------------------------------------------------------------------------------


def _nih_labels(finding_labels: str, where: str) -> np.ndarray:
    names = [name.strip() for name in finding_labels.split("|")]
    out = np.zeros(len(NIH_LABELS), dtype=np.float32)
    if names == [NIH_NO_FINDING]:
        return out
    for name in names:
        if name not in NIH_LABELS:
            raise ValueError(f"{where}: unknown finding {name!r} in {finding_labels!r}")
        out[NIH_LABELS.index(name)] = 1.0
    return out


def load_nih(
    root: str | Path,
    *,
    image_size: tuple[int, int] = (224, 224),
    subset: Literal["all", "train_val", "test"] = "all",
    on_missing: OnMissing = "error",
) -> CxrDataset:
    """Loads NIH ChestX-ray14 from `root` (all images are frontal).

    Expects `Data_Entry_2017.csv` (or `Data_Entry_2017_v2020.csv`), images in `images*/` folders
    (`images_001/images/x.png` or `images/x.png`), and for `subset != "all"` the official
    `train_val_list.txt` / `test_list.txt`.

    Privacy:
        Reads sensitive images and labels; the returned object holds them in memory (labels) or
        reads them on demand (images). Nothing is logged.
    """
    root = Path(root)
    _check_options("all", on_missing)
    csv_path = next(
        (
            root / n
            for n in ("Data_Entry_2017.csv", "Data_Entry_2017_v2020.csv")
            if (root / n).is_file()
        ),
        root / "Data_Entry_2017.csv",
    )
    if subset not in ("all", "train_val", "test"):
        raise ValueError(f"subset must be 'all', 'train_val' or 'test', got {subset!r}")
    entries = _read_csv(csv_path, ["Image Index", "Finding Labels", "Patient ID"])
    _check_nih_images_unique(entries, csv_path)
    if subset != "all":
        wanted = _nih_list(root, subset)
        entries = [(line, e) for line, e in entries if e["Image Index"] in wanted]
    files = {p.name: p for p in sorted(root.glob("images*/**/*.png"))}
    rows = []
    skipped: Counter = Counter()
    for line, entry in entries:
        where = f"{csv_path} row {line}"
        try:
            patient = int(entry["Patient ID"])
        except ValueError as err:
            raise ValueError(f"{where}: bad Patient ID {entry['Patient ID']!r}") from err
        name = entry["Image Index"]
        path = files.get(name, root / "images" / name)
        rows.append((path, _nih_labels(entry["Finding Labels"], where), patient, "frontal"))
    rows = _keep_existing(rows, on_missing, csv_path, skipped)
    return _build(rows, NIH_LABELS, image_size, skipped)


def _check_nih_images_unique(entries: list[tuple[int, dict[str, str]]], csv_path: Path) -> None:
    """A ValueError naming both rows when one image is listed twice (under two patients or one):
    a patient-disjoint split needs each image to belong to exactly one patient."""
    first: dict[str, tuple[int, str]] = {}
    for line, entry in entries:
        name, patient = entry["Image Index"], entry["Patient ID"]
        if name in first:
            other_line, other_patient = first[name]
            raise ValueError(
                f"{csv_path} rows {other_line} and {line}: image {name!r} is listed twice "
                f"(Patient ID {other_patient!r} and {patient!r}); an image must have one row "
                "and one patient: remove the wrong row"
            )
        first[name] = (line, patient)


def _nih_list(root: Path, subset: str) -> set[str]:
    """The image names of `<subset>_list.txt`; a ValueError when an image is also in the other
    official list (the test images must be held out of train_val)."""
    lists = {name: root / f"{name}_list.txt" for name in ("train_val", "test")}
    if not lists[subset].is_file():
        raise ValueError(f"missing file {lists[subset]}")
    wanted = set(_read_text(lists[subset]).split())
    other = lists["test" if subset == "train_val" else "train_val"]
    if other.is_file():
        shared = wanted & set(_read_text(other).split())
        if shared:
            raise ValueError(
                f"{lists['train_val']} and {lists['test']} both list image {min(shared)!r} "
                f"({len(shared)} images in both); the test images must not be in train_val: "
                "use the official lists"
            )
    return wanted


def nih_official_splits(
    root: str | Path,
    *,
    val_fraction: float = 0.1,
    seed: int = 0,
    image_size: tuple[int, int] = (224, 224),
    on_missing: OnMissing = "error",
) -> dict[str, CxrDataset]:
    """The official NIH test split, and a patient-disjoint train/val split of `train_val_list.txt`.

    Returns:
        {"train": ..., "val": ..., "test": ...}; val holds `val_fraction` of the train_val
        patients in expectation (`patient_disjoint_split` with key `seed`).

    Raises:
        ValueError: an image listed twice in the CSV, or in both official lists.

    Privacy:
        The validation split is disjoint from train by patient, and a patient's split depends
        only on their id and `seed`.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    train_val = load_nih(root, image_size=image_size, subset="train_val", on_missing=on_missing)
    test = load_nih(root, image_size=image_size, subset="test", on_missing=on_missing)
    train_idx, val_idx = patient_disjoint_split(
        train_val, (1 - val_fraction, val_fraction), seed=seed
    )
    return {"train": train_val.subset(train_idx), "val": train_val.subset(val_idx), "test": test}


# ------------------------------------------------------------------------------------------
# CheXpert and MIMIC-CXR (same 14 observations)
# ------------------------------------------------------------------------------------------


def _observation_labels(row: Mapping[str, str], where: str) -> np.ndarray:
    out = np.zeros(len(CHEXPERT_LABELS), dtype=np.float32)
    for col, name in enumerate(CHEXPERT_LABELS):
        value = row[name].strip()
        if value in ("", "0", "0.0", "-1", "-1.0"):
            continue
        if value in ("1", "1.0"):
            out[col] = 1.0
        else:
            raise ValueError(
                f"{where}: column {name!r} has value {value!r} (want 1, 0, -1 or blank)"
            )
    return out


_CHEXPERT_PATIENT = re.compile(r"patient(\d+)")


def _chexpert_image_path(root: Path, relative: str) -> Path:
    parts = Path(relative).parts
    # CSV paths start with the data set's folder name (CheXpert-v1.0-small/train/...), which is
    # the folder holding the CSV (`root`) under whatever name it was unpacked or renamed to.
    if len(parts) > 1 and parts[1] in ("train", "valid", "test"):
        return root.joinpath(*parts[1:])
    return root / relative


def load_chexpert(
    root: str | Path,
    *,
    split: Literal["train", "valid"] = "train",
    views: Views = "frontal",
    image_size: tuple[int, int] = (224, 224),
    on_missing: OnMissing = "error",
) -> CxrDataset:
    """Loads CheXpert-v1.0 (or -small) from its folder `root` (holding train.csv / valid.csv).

    Privacy:
        CheXpert plays the public role in DP-MixMin; it is read without any privacy accounting.
    """
    root = Path(root)
    _check_options(views, on_missing)
    if split not in ("train", "valid"):
        raise ValueError(f"split must be 'train' or 'valid', got {split!r}")
    csv_path = root / f"{split}.csv"
    entries = _read_csv(csv_path, ["Path", "Frontal/Lateral", *CHEXPERT_LABELS])
    rows = []
    skipped: Counter = Counter()
    for line, entry in entries:
        where = f"{csv_path} row {line}"
        view = entry["Frontal/Lateral"].strip().lower()
        if view not in ("frontal", "lateral"):
            raise ValueError(f"{where}: Frontal/Lateral is {entry['Frontal/Lateral']!r}")
        if views != "all" and view != views:
            continue
        match = _CHEXPERT_PATIENT.search(entry["Path"])
        if match is None:
            raise ValueError(f"{where}: no patientNNNNN in path {entry['Path']!r}")
        labels = _observation_labels(entry, where)
        rows.append((_chexpert_image_path(root, entry["Path"]), labels, int(match[1]), view))
    rows = _keep_existing(rows, on_missing, csv_path, skipped)
    return _build(rows, CHEXPERT_LABELS, image_size, skipped)


def _mimic_csv(root: Path, name: str) -> Path:
    """`mimic-cxr-2.0.0-<name>.csv.gz` (as published) if present, else the `.csv`."""
    path = root / f"mimic-cxr-2.0.0-{name}.csv"
    compressed = path.with_name(path.name + ".gz")
    return compressed if compressed.is_file() else path


def load_mimic_cxr(
    root: str | Path,
    *,
    split: Literal["train", "validate", "test"] | None = None,
    views: Views = "frontal",
    image_size: tuple[int, int] = (224, 224),
    on_missing: OnMissing = "error",
) -> CxrDataset:
    """Loads MIMIC-CXR-JPG from `root` (the folder holding the 2.0.0 CSVs and `files/`).

    Labels come from `mimic-cxr-2.0.0-chexpert.csv` per (subject_id, study_id), images and views
    from `mimic-cxr-2.0.0-metadata.csv`; `split` filters by `mimic-cxr-2.0.0-split.csv`. Each
    CSV is read gzip-compressed as published (`.csv.gz`) or uncompressed (`.csv`).
    Frontal = ViewPosition PA/AP, lateral = LATERAL/LL; other positions are skipped and counted.

    Privacy:
        MIMIC-CXR plays the public role in DP-MixMin; it is read without any privacy accounting.
    """
    root = Path(root)
    _check_options(views, on_missing)
    label_path = _mimic_csv(root, "chexpert")
    meta_path = _mimic_csv(root, "metadata")
    study_labels = {}
    for line, entry in _read_csv(label_path, ["subject_id", "study_id", *CHEXPERT_LABELS]):
        where = f"{label_path} row {line}"
        key = (entry["subject_id"].strip(), entry["study_id"].strip())
        study_labels[key] = _observation_labels(entry, where)
    wanted = None
    if split is not None:
        if split not in ("train", "validate", "test"):
            raise ValueError(f"split must be 'train', 'validate', 'test' or None, got {split!r}")
        split_path = _mimic_csv(root, "split")
        split_rows = _read_csv(split_path, ["dicom_id", "split"])
        wanted = {r["dicom_id"].strip() for _, r in split_rows if r["split"].strip() == split}
    rows = []
    skipped: Counter = Counter()
    meta = _read_csv(meta_path, ["dicom_id", "subject_id", "study_id", "ViewPosition"])
    for line, entry in meta:
        dicom, subject, study = (entry[c].strip() for c in ("dicom_id", "subject_id", "study_id"))
        if wanted is not None and dicom not in wanted:
            continue
        position = entry["ViewPosition"].strip().upper()
        view = (
            "frontal"
            if position in _FRONTAL_MIMIC
            else "lateral"
            if position in _LATERAL_MIMIC
            else None
        )
        if view is None:
            skipped["other_view"] += 1
            continue
        if views != "all" and view != views:
            continue
        if (subject, study) not in study_labels:
            skipped["unlabelled_study"] += 1
            continue
        if not subject.isdigit() or not study.isdigit():
            raise ValueError(
                f"{meta_path} row {line}: bad subject_id/study_id {subject!r}/{study!r}"
            )
        path = root / "files" / f"p{subject[:2]}" / f"p{subject}" / f"s{study}" / f"{dicom}.jpg"
        rows.append((path, study_labels[(subject, study)], int(subject), view))
    rows = _keep_existing(rows, on_missing, meta_path, skipped)
    return _build(rows, CHEXPERT_LABELS, image_size, skipped)
